"""What this host has, as registration reports it, and the labels placement matches on.

Registration carries ``capacity`` (CPUs, memory, each GPU's index, model and memory, the
architecture and OS) for ``lakeshore workers`` and the dashboard; the labels are the operator's
``--label k=v`` over automatic ones: ``arch``, ``os`` and, when known, ``gpu_model``. Each poll
then offers the GPUs free now and these labels (nymph/poller.py; docs/protocol.md "Placement").
"""

from __future__ import annotations

import logging
import os
import platform
from typing import Any

import psutil

from dreamlake.lakeshore.labels import label_problem
from nymph.gpus import capacity as gpu_capacity
from nymph.runner import Offering

log = logging.getLogger(__name__)


def host_capacity(gpu_pool: Any, runner: Any = None) -> dict[str, Any]:
    """This host's capacity, as registration reports it; ``task``: what one task may be given
    here (memory, CPUs), when the runner says (``Capabilities.task_offer``: nymph.runner.Offering)."""
    capacity: dict[str, Any] = {
        "cpus": os.cpu_count() or 1,
        "memory_mb": psutil.virtual_memory().total // 2**20,
        "gpus": gpu_capacity(gpu_pool),
        "arch": platform.machine().lower(),
        "os": platform.system().lower(),
    }
    if runner is not None and runner.capabilities.task_offer and isinstance(runner, Offering):
        capacity["task"] = dict(runner.task_offer())
    return capacity


def auto_labels(capacity: dict[str, Any]) -> dict[str, str]:
    """``arch``, ``os`` and (when the GPUs' model is known, and one) ``gpu_model``, each held to
    the label rule (dreamlake.lakeshore.labels) as an operator's ``--label`` is: a value with a
    space at either end (a driver's padded model name) is stripped, so a selector naming it as
    shown matches; one that still breaks the rule (a control character) is left out, logged,
    rather than offered as a label no selector can name."""
    texts = {"arch": capacity.get("arch"), "os": capacity.get("os")}
    models = {str(g.get("model") or "").strip() for g in capacity.get("gpus") or []} - {"", "unknown"}
    if len(models) == 1:
        texts["gpu_model"] = models.pop()
    labels: dict[str, str] = {}
    for name, raw in texts.items():
        value = str(raw or "").strip()
        if not value:
            continue
        refused = label_problem(name, value, "automatic labels")
        if refused is not None:
            log.warning("nymph: %s; not offered", refused)
            continue
        labels[name] = value
    return labels
