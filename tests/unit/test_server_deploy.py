"""The control plane's deployment files (docs/deploy.md): the systemd unit and its env example, and
the Helm chart, linted (strict) and rendered by real Helm (``helm-python-sdk``) and validated as
Kubernetes 1.30 objects, as tests/unit/test_packaging.py does for nymph's chart.
"""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.conftest import ROOT
from tests.unit.deploy_kit import KUBE_VERSION, by_kind, helm, parse_unit, seconds, validate

__all__ = ["helm"]  # the fixture (deploy_kit)

CHART = ROOT / "packaging" / "helm" / "lakeshore-server"
UNIT = ROOT / "systemd" / "lakeshore-server.service"
ENV = ROOT / "systemd" / "lakeshore-server.env.example"
NAMESPACE = "lakeshore"
_LINT_WARNING = 2


# --- systemd --------------------------------------------------------------------------------------


def test_the_unit_runs_the_server_unprivileged_on_its_state_directory() -> None:
    service = parse_unit(UNIT.read_text())["Service"]
    assert service["ExecStart"] == ["/usr/local/bin/lakeshore server"]
    assert service["DynamicUser"] == ["yes"] and service["StateDirectory"] == ["lakeshore"]
    assert "LAKESHORE_DATA_DIR=%S/lakeshore" in service["Environment"]
    assert service["StateDirectoryMode"] == ["0700"] and service["NoNewPrivileges"] == ["yes"]
    assert service["EnvironmentFile"] == ["-/etc/lakeshore/server.env"]
    # room for uvicorn's graceful shutdown (5 s) and the group commit's last batch
    assert seconds(service["TimeoutStopSec"][0]) >= 10


def test_the_env_example_names_only_settings_the_server_reads() -> None:
    names = re.findall(r"^#?(LAKESHORE_[A-Z0-9_]+)=", ENV.read_text(), re.M)
    assert names
    source = "\n".join(p.read_text() for p in (ROOT / "dreamlake" / "lakeshore").rglob("*.py"))
    for name in names:
        assert f'"{name}"' in source, f"{name} is not read by lakeshore"


def test_systemd_analyze_verify(tmp_path: Path) -> None:
    analyze = shutil.which("systemd-analyze")
    if analyze is None:
        pytest.skip("systemd-analyze is not installed")
    fake = tmp_path / "lakeshore"
    fake.write_text("#!/bin/sh\nexit 0\n")
    fake.chmod(0o755)
    unit = tmp_path / "lakeshore-server.service"
    unit.write_text(UNIT.read_text().replace("/usr/local/bin/lakeshore", str(fake)))
    proc = subprocess.run([analyze, "verify", str(unit)], capture_output=True, text=True, timeout=60)
    complaints = [ln for ln in (proc.stdout + proc.stderr).splitlines() if "lakeshore-server.service" in ln]
    assert proc.returncode == 0 and not complaints, proc.stdout + proc.stderr


# --- the Helm chart -------------------------------------------------------------------------------


def _render(helm: Any, values: dict[str, Any] | None = None) -> list[dict[str, Any]]:
    with helm.Chart.load(CHART) as loaded:
        manifests = loaded.render(values, name="lakeshore", namespace=NAMESPACE, is_install=True)
    return [
        doc
        for path, text in sorted(manifests.items())
        if path.endswith(".yaml")
        for doc in yaml.safe_load_all(text)
        if doc
    ]


def _env(docs: list[dict[str, Any]]) -> dict[str, Any]:
    (container,) = by_kind(docs)["Deployment"]["spec"]["template"]["spec"]["containers"]
    return {e["name"]: e.get("value", e.get("valueFrom")) for e in container["env"]}


def test_helm_lint_strict_passes(helm: Any) -> None:
    report = helm.lint(CHART, strict=True, namespace=NAMESPACE, kube_version=f"v{KUBE_VERSION}.0")
    assert report["errors"] == [], report
    assert [m for m in report["messages"] if m["severity"] >= _LINT_WARNING] == [], report


def test_defaults_render_a_postgresql_server_with_a_blob_volume(helm: Any) -> None:
    docs = _render(helm)
    validate(docs)
    kinds = by_kind(docs)
    assert set(kinds) == {"Deployment", "Service", "PersistentVolumeClaim"}
    env = _env(docs)
    assert env["LAKESHORE_DB"] == {"secretKeyRef": {"name": "lakeshore-db", "key": "url"}}  # never a value
    assert env["LAKESHORE_BLOBS_DIR"] == "/var/lib/lakeshore/blobs"
    pod = kinds["Deployment"]["spec"]["template"]["spec"]
    assert pod["securityContext"]["runAsNonRoot"] is True
    assert pod["containers"][0]["readinessProbe"]["httpGet"]["path"] == "/healthz"
    assert pod["volumes"][0]["persistentVolumeClaim"]["claimName"] == "lakeshore-blobs"


def test_ingress_terminates_tls_and_several_processes_need_redis(helm: Any) -> None:
    values = {
        "ingress": {"enabled": True, "host": "ls.example.org", "tls": {"secretName": "ls-tls"}},
        "blobs": {
            "bucket": "payloads",
            "s3Endpoint": "https://s3.example.org",
            "persistence": {"size": "1Gi"},
        },
        "replicas": 2,
        "redis": {"url": "redis://redis:6379/0"},
    }
    docs = _render(helm, values)
    validate(docs)
    kinds = by_kind(docs)
    assert "PersistentVolumeClaim" not in kinds  # a bucket: no blob volume
    ingress = kinds["Ingress"]["spec"]
    assert ingress["tls"] == [{"hosts": ["ls.example.org"], "secretName": "ls-tls"}]
    env = _env(docs)
    assert (
        env["LAKESHORE_REDIS_URL"] == "redis://redis:6379/0" and env["LAKESHORE_BLOBS_BUCKET"] == "payloads"
    )
    with pytest.raises(Exception, match=r"needs redis\.url"):
        _render(helm, {"workers": 4})
    with pytest.raises(helm.HelmValuesError, match="/retention"):
        _render(helm, {"retention": "a week"})
