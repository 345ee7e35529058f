"""What the deployment tests share: the Helm chart rendered and validated, a systemd unit parsed."""

from __future__ import annotations

import re
from typing import Any

import pytest

from tests.conftest import require

KUBE_VERSION = "1.30"


_DNS_LABEL = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$")


_LABEL_VALUE = re.compile(r"^(([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9])?$")


_ENUMS = {
    "imagePullPolicy": {"Always", "IfNotPresent", "Never"},
    "protocol": {"TCP", "UDP", "SCTP"},
    "restartPolicy": {"Always", "OnFailure", "Never"},
    "type": {
        # hostPath types, update strategies, seccomp profile types
        "", "DirectoryOrCreate", "Directory", "FileOrCreate", "File", "Socket", "CharDevice", "BlockDevice",
        "RollingUpdate", "OnDelete", "RuntimeDefault", "Localhost", "Unconfined",
        # Service types and the Deployment's Recreate strategy (the control plane's chart)
        "ClusterIP", "NodePort", "LoadBalancer", "Recreate",
    },
    "pathType": {"Prefix", "Exact", "ImplementationSpecific"},
}  # fmt: skip


_CAPABILITIES = {"ALL", "CHOWN", "NET_BIND_SERVICE", "DAC_OVERRIDE", "FOWNER", "SETUID", "SETGID", "KILL"}


@pytest.fixture(scope="module")
def helm() -> Any:
    """helm-python-sdk: Helm v4 itself (its Go SDK as a shared library), no helm binary needed."""
    try:
        import helm_python
    except ImportError:
        require(False, "helm-python-sdk is not installed (pip install -e '.[test]' brings it)")
    return helm_python


def validate(docs: list[dict[str, Any]]) -> None:
    kubernetes_validate = pytest.importorskip("kubernetes_validate")
    for doc in docs:
        kubernetes_validate.validate(doc, KUBE_VERSION, strict=True)
        _check_names_and_enums(doc, f"{doc['kind']}/{doc['metadata']['name']}")


def _check_names_and_enums(node: Any, where: str, key: str = "") -> None:
    """What the JSON schemas leave out: DNS-1123 names, enum values, label syntax, capabilities."""
    if isinstance(node, dict):
        for k, v in node.items():
            if k in ("name", "namespace", "serviceAccountName") and isinstance(v, str) and key != "env":
                assert len(v) <= 63 and _DNS_LABEL.match(v), f"{where}: {k} {v!r} is not a DNS label"
            elif k in _ENUMS and isinstance(v, str):
                assert v in _ENUMS[k], f"{where}: {k} {v!r} is not one of {sorted(_ENUMS[k])}"
            elif k in ("labels", "matchLabels") and isinstance(v, dict):
                for lk, lv in v.items():
                    assert _LABEL_VALUE.match(str(lv)) and len(str(lv)) <= 63, f"{where}: label {lk}={lv!r}"
            elif k in ("add", "drop") and key == "capabilities":
                assert set(v) <= _CAPABILITIES, f"{where}: capabilities {v}"
            _check_names_and_enums(v, where, k)
    elif isinstance(node, list):
        for item in node:
            _check_names_and_enums(item, where, key)


def by_kind(docs: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    out = {d["kind"]: d for d in docs}
    assert len(out) == len(docs), "one object of each kind"
    return out


Unit = dict[str, dict[str, list[str]]]


def parse_unit(text: str) -> Unit:
    """Sections -> key -> every value (systemd keys may repeat), with continuation lines joined."""
    unit: Unit = {}
    section: dict[str, list[str]] | None = None
    pending = ""
    for raw in text.splitlines():
        line = pending + raw.strip()
        pending = ""
        if line.endswith("\\"):
            pending = line[:-1] + " "
            continue
        if not line or line[0] in "#;":
            continue
        if line.startswith("[") and line.endswith("]"):
            section = unit.setdefault(line[1:-1], {})
            continue
        assert section is not None, f"assignment outside a section: {line!r}"
        key, sep, value = line.partition("=")
        assert sep, f"not an assignment: {line!r}"
        section.setdefault(key.strip(), []).append(value.strip())
    return unit


def seconds(value: str) -> float:
    """A systemd time span ("30", "30s", "1min 30s", "2m") in seconds."""
    units = {"": 1, "s": 1, "sec": 1, "m": 60, "min": 60, "h": 3600, "ms": 0.001}
    total = 0.0
    for number, unit in re.findall(r"(\d+(?:\.\d+)?)\s*([a-z]*)", value):
        total += float(number) * units[unit]
    return total
