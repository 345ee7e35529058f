"""packaging/keda: the autoscaled nymph pool renders, validates, configures nymph through its own
resolver, and the ScaledObject scales that Deployment on a gauge the control plane really exports."""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml

from dreamlake.lakeshore.server.metrics import Metrics
from dreamlake.lakeshore.store.api import QueueStats
from nymph import config as nymph_config
from tests.conftest import ROOT, require

KEDA = ROOT / "packaging" / "keda"


@pytest.fixture(scope="module")
def docs() -> dict[str, dict[str, Any]]:
    kubectl = shutil.which("kubectl")
    require(kubectl is not None, "kubectl is not installed (it renders packaging/keda offline)")
    assert kubectl is not None
    out = subprocess.run([kubectl, "kustomize", str(KEDA)], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    rendered = [d for d in yaml.safe_load_all(out.stdout) if d]
    return {d["kind"]: d for d in rendered}


def test_the_deployment_validates_and_configures_a_process_nymph(docs: dict[str, dict[str, Any]]) -> None:
    kubernetes_validate = pytest.importorskip("kubernetes_validate")
    deployment = docs["Deployment"]
    kubernetes_validate.validate(deployment, "1.30", strict=True)
    (nymph,) = deployment["spec"]["template"]["spec"]["containers"]
    env = {e["name"]: e.get("value") for e in nymph["env"]}
    env["NYMPH_TOKEN"] = "t"  # from the Secret
    cfg = nymph_config.resolve({}, environ=env)
    assert cfg.runner == "process" and cfg.queues == ("default",) and cfg.concurrency == 4
    assert cfg.workdir == Path("/var/lib/nymph/work")
    mounts = {m["mountPath"] for m in nymph["volumeMounts"]}
    assert {str(cfg.workdir), str(cfg.state_dir)} <= mounts  # writable under a read-only root
    assert nymph["ports"][0]["containerPort"] == cfg.metrics_port
    pod = deployment["spec"]["template"]["spec"]
    assert pod["terminationGracePeriodSeconds"] > cfg.grace_s + cfg.stop_grace_s


def test_the_scaled_object_targets_the_pool_on_an_exported_gauge(docs: dict[str, dict[str, Any]]) -> None:
    scaled = docs["ScaledObject"]
    assert scaled["apiVersion"] == "keda.sh/v1alpha1"
    target = scaled["spec"]["scaleTargetRef"]
    assert (target["kind"], target["name"]) == ("Deployment", docs["Deployment"]["metadata"]["name"])
    assert scaled["metadata"]["namespace"] == docs["Deployment"]["metadata"]["namespace"]
    (trigger,) = scaled["spec"]["triggers"]
    assert trigger["type"] == "prometheus"
    env = {
        e["name"]: e.get("value")
        for e in docs["Deployment"]["spec"]["template"]["spec"]["containers"][0]["env"]
    }
    assert trigger["metadata"]["threshold"] == env["NYMPH_CONCURRENCY"]  # one replica per full pool

    # The query's metric and labels are what /metrics renders.
    query = trigger["metadata"]["query"]
    metric, labels = re.search(r"(lakeshore_\w+)\{([^}]*)\}", query).groups()  # type: ignore[union-attr]
    metrics = Metrics()
    metrics.observe_store([QueueStats("default", {"queued": 3, "running": 1}, 0.0, 1)], workers_live=1)
    text = metrics.render().decode()
    assert f'{metric}{{queue="default",state="queued"}} 3.0' in text
    assert f'{metric}{{queue="default",state="running"}} 1.0' in text
    assert {part.split("=")[0].strip() for part in labels.split(",")} == {"queue", "state"}
