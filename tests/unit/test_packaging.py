"""packaging/: the plain manifests render and validate, and the Helm chart says the same thing.

- ``kubectl kustomize packaging/k8s`` renders (kubectl is on the dev box and in CI; skipped without it);
- every rendered object validates with ``kubernetes-validate`` (strict, Kubernetes 1.30), and the
  things the schemas do not check (names are DNS labels, enum values, label syntax) are checked here;
- the Helm chart is linted (``strict``) and rendered by real Helm, through ``helm-python-sdk``
  (Helm v4's Go SDK as a shared library: no ``helm`` binary); the result is validated the same way
  and compared field by field with the plain manifests, and the values schema (a string
  ``image.tag``, no unknown keys) and the templates' optional parts are exercised;
- the ConfigMap's nymph.toml loads through nymph's own config resolver, and its runner options build
  a :class:`~nymph_kube.KubeRunner`.
"""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml

from nymph import config as nymph_config
from nymph_kube import KubeRunner
from tests.conftest import ROOT, require
from tests.unit.deploy_kit import KUBE_VERSION, by_kind, helm, validate

__all__ = ["helm"]  # the fixture (deploy_kit)

K8S = ROOT / "packaging" / "k8s"
CHART = ROOT / "packaging" / "helm" / "nymph"
RELEASE, NAMESPACE = "nymph", "lakeshore"
_LINT_WARNING = 2  # helm lint severities: 1 info, 2 warning, 3 error


# --- the plain manifests --------------------------------------------------------------------------


@pytest.fixture(scope="module")
def plain() -> list[dict[str, Any]]:
    kubectl = shutil.which("kubectl")
    require(
        kubectl is not None, "kubectl is not installed (it renders packaging/k8s offline: kubectl kustomize)"
    )
    assert kubectl is not None
    out = subprocess.run([kubectl, "kustomize", str(K8S)], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    return [d for d in yaml.safe_load_all(out.stdout) if d]


def _render(helm: Any, values: dict[str, Any] | None = None) -> list[dict[str, Any]]:
    """The chart's objects as ``helm template nymph packaging/helm/nymph -n lakeshore`` prints them."""
    with helm.Chart.load(CHART) as loaded:
        manifests = loaded.render(values, name=RELEASE, namespace=NAMESPACE, is_install=True)
    return [
        doc
        for path, text in sorted(manifests.items())
        if path.endswith(".yaml")  # not NOTES.txt
        for doc in yaml.safe_load_all(text)
        if doc
    ]


@pytest.fixture(scope="module")
def chart(helm: Any) -> list[dict[str, Any]]:
    return _render(helm)


def test_plain_manifests_render_and_validate(plain: list[dict[str, Any]]) -> None:
    assert sorted(d["kind"] for d in plain) == [
        "ConfigMap", "DaemonSet", "Namespace", "Role", "RoleBinding", "ServiceAccount",
    ]  # fmt: skip
    validate(plain)
    for doc in plain:
        if doc["kind"] != "Namespace":
            assert doc["metadata"]["namespace"] == "lakeshore", doc["kind"]


def test_the_daemonset_runs_nymph_as_the_kube_runner_needs(plain: list[dict[str, Any]]) -> None:
    ds = by_kind(plain)["DaemonSet"]
    pod = ds["spec"]["template"]["spec"]
    (nymph,) = pod["containers"]
    assert nymph["command"] == ["nymph", "start", "--config", "/etc/nymph/nymph.toml"]
    assert pod["serviceAccountName"] == "nymph"
    env = {e["name"]: e for e in nymph["env"]}
    # the token: the Secret mounted as a file nymph reads (never a command line, not the environment)
    assert "NYMPH_TOKEN" not in env
    token_file = Path(env["NYMPH_TOKEN_FILE"]["value"])
    token_mount = next(m for m in nymph["volumeMounts"] if m["name"] == "token")
    assert token_mount["mountPath"] == str(token_file.parent) and token_mount["readOnly"] is True
    token_volume = next(v for v in pod["volumes"] if v["name"] == "token")["secret"]
    assert token_volume["secretName"] == "nymph-token"
    assert token_volume["items"] == [{"key": "token", "path": token_file.name}]
    assert token_volume["defaultMode"] & 0o007 == 0  # not readable by others: nymph refuses that
    assert pod["securityContext"]["fsGroup"] == pod["securityContext"]["runAsUser"]
    assert env["NYMPH_RUNNER_OPT_NODE_NAME"]["valueFrom"]["fieldRef"]["fieldPath"] == "spec.nodeName"
    volumes = {v["name"]: v for v in pod["volumes"]}
    assert volumes["workdir"]["hostPath"]["path"] == "/var/lib/nymph/work"
    assert volumes["state"]["hostPath"]["path"] == "/var/lib/nymph/state"
    mounts = {m["name"]: m["mountPath"] for m in nymph["volumeMounts"]}
    assert mounts["workdir"] == "/var/lib/nymph/work"  # the same path on the node: pods mount it as is
    assert nymph["readinessProbe"]["httpGet"] == {"path": "/healthz", "port": "metrics"}
    assert nymph["livenessProbe"]["httpGet"]["port"] == "metrics"
    assert nymph["securityContext"]["allowPrivilegeEscalation"] is False
    assert nymph["securityContext"]["capabilities"] == {"drop": ["ALL"]}
    assert pod["securityContext"]["runAsNonRoot"] is True and pod["securityContext"]["runAsUser"] != 0
    toml_text = by_kind(plain)["ConfigMap"]["data"]["nymph.toml"]
    cfg = _nymph_config(toml_text)
    assert nymph["ports"][0]["containerPort"] == cfg.metrics_port
    assert cfg.workdir == Path("/var/lib/nymph/work") and cfg.runner == "kube"
    # the grace: nymph drains for grace_s, then stops tasks with stop_grace_s; the kubelet must wait
    assert pod["terminationGracePeriodSeconds"] > cfg.grace_s + cfg.stop_grace_s


def test_rbac_grants_pods_in_the_namespace_only(plain: list[dict[str, Any]]) -> None:
    kinds = by_kind(plain)
    rules = kinds["Role"]["rules"]
    assert {
        "apiGroups": [""],
        "resources": ["pods"],
        "verbs": ["create", "get", "list", "watch", "delete"],
    } in rules
    assert {"apiGroups": [""], "resources": ["pods/log"], "verbs": ["get"]} in rules
    assert "ClusterRole" not in kinds
    binding = kinds["RoleBinding"]
    assert binding["subjects"] == [{"kind": "ServiceAccount", "name": "nymph", "namespace": "lakeshore"}]


def _nymph_config(toml_text: str) -> nymph_config.NymphConfig:
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "nymph.toml"
        path.write_text(toml_text)
        environ = {
            "NYMPH_TOKEN": "t",
            "NYMPH_RUNNER_OPT_NODE_NAME": "n1",
            "NYMPH_RUNNER_OPT_NAMESPACE": "lakeshore",
        }
        return nymph_config.resolve({}, environ=environ, config_file=path)


def test_the_config_builds_a_kube_runner(plain: list[dict[str, Any]]) -> None:
    cfg = _nymph_config(by_kind(plain)["ConfigMap"]["data"]["nymph.toml"])
    runner = KubeRunner(**cfg.runner_options)
    assert runner.namespace == "lakeshore" and runner.options.node_name == "n1"
    assert runner.workdir_volume == "hostPath"


# --- the Helm chart, linted and rendered by real Helm ---------------------------------------------


def test_helm_lint_strict_passes(helm: Any) -> None:
    report = helm.lint(CHART, strict=True, namespace=NAMESPACE, kube_version=f"v{KUBE_VERSION}.0")
    assert report["errors"] == [], report
    assert [m for m in report["messages"] if m["severity"] >= _LINT_WARNING] == [], report


def test_chart_renders_validates_and_agrees_with_the_plain_manifests(
    chart: list[dict[str, Any]], plain: list[dict[str, Any]]
) -> None:
    validate(chart)
    ours, theirs = by_kind(chart), by_kind(plain)
    assert set(ours) == set(theirs) - {"Namespace"}  # helm install --create-namespace makes that one
    for kind in ours:
        assert ours[kind]["metadata"]["name"] == theirs[kind]["metadata"]["name"], kind
        assert ours[kind]["metadata"]["namespace"] == "lakeshore", kind
    assert ours["Role"]["rules"] == theirs["Role"]["rules"]
    assert ours["RoleBinding"]["subjects"] == theirs["RoleBinding"]["subjects"]
    assert ours["ConfigMap"]["data"] == theirs["ConfigMap"]["data"]
    mine, plain_pod = (
        ours["DaemonSet"]["spec"]["template"]["spec"],
        theirs["DaemonSet"]["spec"]["template"]["spec"],
    )
    for field in ("containers", "initContainers", "volumes", "securityContext", "terminationGracePeriodSeconds",
                  "serviceAccountName"):  # fmt: skip
        assert mine[field] == plain_pod[field], field
    assert ours["DaemonSet"]["spec"]["selector"] == theirs["DaemonSet"]["spec"]["selector"]
    assert "nodeSelector" not in mine and "tolerations" not in mine  # empty values leave them out


def _images(docs: list[dict[str, Any]]) -> set[str]:
    pod = by_kind(docs)["DaemonSet"]["spec"]["template"]["spec"]
    return {c["image"] for c in pod["containers"] + pod["initContainers"]}


def test_the_image_tag_is_a_string_defaulting_to_the_app_version(helm: Any) -> None:
    app_version = yaml.safe_load((CHART / "Chart.yaml").read_text())["appVersion"]
    assert _images(_render(helm)) == {f"ghcr.io/dreamlake/nymph:{app_version}"}
    assert _images(_render(helm, {"image": {"tag": "1.0"}})) == {"ghcr.io/dreamlake/nymph:1.0"}
    assert _images(_render(helm, {"image": {"tag": "2"}})) == {"ghcr.io/dreamlake/nymph:2"}
    # YAML reads an unquoted 1.0 as a number, which would render as ":1": refused, naming the value
    numeric = helm.values_from_yaml("image:\n  tag: 1.0\n")
    with pytest.raises(helm.HelmValuesError, match=r"/image/tag.*want string"):
        _render(helm, numeric)
    assert helm.lint(CHART, numeric, strict=True)["errors"], "lint refuses it too"


def test_values_are_typed_by_the_schema(helm: Any) -> None:
    with pytest.raises(helm.HelmValuesError, match="'imag' not allowed"):  # a typo is not ignored
        _render(helm, {"imag": {"tag": "1.0"}})
    with pytest.raises(helm.HelmValuesError, match="/metricsPort"):
        _render(helm, {"metricsPort": "9464"})


def test_optional_values_reach_the_pod_and_a_config_change_rolls_it(helm: Any) -> None:
    placed = _render(
        helm,
        {
            "nodeSelector": {"nvidia.com/gpu.present": "true"},
            "tolerations": [{"key": "gpu", "operator": "Exists", "effect": "NoSchedule"}],
        },
    )
    validate(placed)
    pod = by_kind(placed)["DaemonSet"]["spec"]["template"]
    assert pod["spec"]["nodeSelector"] == {"nvidia.com/gpu.present": "true"}
    assert pod["spec"]["tolerations"] == [{"key": "gpu", "operator": "Exists", "effect": "NoSchedule"}]

    unlimited = by_kind(_render(helm, {"resources": None}))["DaemonSet"]  # null drops the default
    (bare,) = unlimited["spec"]["template"]["spec"]["containers"]
    assert "resources" not in bare

    def checksum(docs: list[dict[str, Any]]) -> str:
        annotations = by_kind(docs)["DaemonSet"]["spec"]["template"]["metadata"]["annotations"]
        return str(annotations["checksum/config"])

    default_config = yaml.safe_load((CHART / "values.yaml").read_text())["config"]
    assert checksum(placed) == checksum(_render(helm))  # scheduling is not config
    assert checksum(_render(helm, {"config": default_config + "concurrency = 8\n"})) != checksum(placed)
