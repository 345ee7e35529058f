"""Sizes in run_config.resources read one way by every runner (nymph.resources)."""

from __future__ import annotations

import pytest

from nymph.resources import parse_size
from nymph.runner import RunnerError


@pytest.mark.parametrize(
    ("value", "expected"),
    [
        (1024, 1024),
        ("1024", 1024),
        ("512m", 512 * 2**20),
        ("1g", 2**30),
        ("2GiB", 2 * 2**30),
        ("512Mi", 512 * 2**20),
    ],
)
def test_sizes(value: object, expected: int) -> None:
    assert parse_size(value, "resources.memory") == expected


@pytest.mark.parametrize("value", [0, -1, True, "0.5", 0.5, "lots", "", None, "1x"])
def test_bad_sizes_name_the_field_and_the_value(value: object) -> None:
    # "0.5" / 0.5 used to parse as 0 bytes, which docker reads as "no limit"
    with pytest.raises(RunnerError, match=r"resources\.memory: expected a positive size .* got"):
        parse_size(value, "resources.memory")


def test_the_runners_share_it() -> None:
    from nymph_docker import policy
    from nymph_kube import podspec
    from nymph_slurm import jobs

    assert policy.parse_size is podspec.parse_size is jobs.parse_size is parse_size
    with pytest.raises(RunnerError, match=r"resources\.cpus"):
        policy.limits({"cpus": True}, cpus=None, memory=None, pids=None, shm=None)
