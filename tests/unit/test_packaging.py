"""packaging/: the plain manifests render and validate, and the Helm chart says the same thing.

- ``kubectl kustomize packaging/k8s`` renders (kubectl is on the dev box and in CI; skipped without it);
- every rendered object validates with ``kubernetes-validate`` (strict, Kubernetes 1.30), and the
  things the schemas do not check (names are DNS labels, enum values, label syntax) are checked here;
- there is no ``helm`` binary: the chart's templates are kept to a small subset (``.Values`` /
  ``.Release`` / ``.Chart`` fields, ``include``, ``quote``, ``toYaml``, ``nindent``, trim markers),
  rendered by :func:`render_chart` below, which refuses anything else rather than guess; the result
  is validated the same way and compared field by field with the plain manifests;
- the ConfigMap's nymph.toml loads through nymph's own config resolver, and its runner options build
  a :class:`~nymph_kube.KubeRunner`.
"""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml

from nymph import config as nymph_config
from nymph_kube import KubeRunner
from tests.conftest import ROOT, require

K8S = ROOT / "packaging" / "k8s"
CHART = ROOT / "packaging" / "helm" / "nymph"
KUBE_VERSION = "1.30"
RELEASE = {"Name": "nymph", "Namespace": "lakeshore", "Service": "Helm"}

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
    },
}  # fmt: skip
_CAPABILITIES = {"ALL", "CHOWN", "NET_BIND_SERVICE", "DAC_OVERRIDE", "FOWNER", "SETUID", "SETGID", "KILL"}


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


@pytest.fixture(scope="module")
def chart() -> list[dict[str, Any]]:
    return render_chart(CHART, RELEASE)


def _validate(docs: list[dict[str, Any]]) -> None:
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


def _by_kind(docs: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    out = {d["kind"]: d for d in docs}
    assert len(out) == len(docs), "one object of each kind"
    return out


def test_plain_manifests_render_and_validate(plain: list[dict[str, Any]]) -> None:
    assert sorted(d["kind"] for d in plain) == [
        "ConfigMap", "DaemonSet", "Namespace", "Role", "RoleBinding", "ServiceAccount",
    ]  # fmt: skip
    _validate(plain)
    for doc in plain:
        if doc["kind"] != "Namespace":
            assert doc["metadata"]["namespace"] == "lakeshore", doc["kind"]


def test_the_daemonset_runs_nymph_as_the_kube_runner_needs(plain: list[dict[str, Any]]) -> None:
    ds = _by_kind(plain)["DaemonSet"]
    pod = ds["spec"]["template"]["spec"]
    (nymph,) = pod["containers"]
    assert nymph["command"] == ["nymph", "start", "--config", "/etc/nymph/nymph.toml"]
    assert pod["serviceAccountName"] == "nymph"
    env = {e["name"]: e for e in nymph["env"]}
    assert env["NYMPH_TOKEN"]["valueFrom"]["secretKeyRef"] == {"name": "nymph-token", "key": "token"}
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
    toml_text = _by_kind(plain)["ConfigMap"]["data"]["nymph.toml"]
    cfg = _nymph_config(toml_text)
    assert nymph["ports"][0]["containerPort"] == cfg.metrics_port
    assert cfg.workdir == Path("/var/lib/nymph/work") and cfg.runner == "kube"
    # the grace: nymph drains for grace_s, then stops tasks with stop_grace_s; the kubelet must wait
    assert pod["terminationGracePeriodSeconds"] > cfg.grace_s + cfg.stop_grace_s


def test_rbac_grants_pods_in_the_namespace_only(plain: list[dict[str, Any]]) -> None:
    kinds = _by_kind(plain)
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
    cfg = _nymph_config(_by_kind(plain)["ConfigMap"]["data"]["nymph.toml"])
    runner = KubeRunner(**cfg.runner_options)
    assert runner.namespace == "lakeshore" and runner.options.node_name == "n1"
    assert runner.workdir_volume == "hostPath"


# --- the Helm chart, rendered by a deliberately small renderer -----------------------------------


def test_chart_renders_validates_and_agrees_with_the_plain_manifests(
    chart: list[dict[str, Any]], plain: list[dict[str, Any]]
) -> None:
    _validate(chart)
    ours, theirs = _by_kind(chart), _by_kind(plain)
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


def test_the_renderer_refuses_what_it_does_not_know() -> None:
    with pytest.raises(ValueError, match="unsupported"):
        _render("{{ if .Values.x }}a{{ end }}", {}, {"Values": {"x": 1}})


_ACTION = re.compile(r"(\s*)\{\{(-?)\s*(.*?)\s*(-?)\}\}", re.DOTALL)
_DEFINE = re.compile(r'\{\{-?\s*define\s+"([^"]+)"\s*-?\}\}(.*?)\{\{-?\s*end\s*-?\}\}', re.DOTALL)


def render_chart(chart_dir: Path, release: dict[str, str]) -> list[dict[str, Any]]:
    """Render ``chart_dir`` with its default values: only the constructs the chart uses."""
    chart_meta = yaml.safe_load((chart_dir / "Chart.yaml").read_text())
    scope = {
        "Values": yaml.safe_load((chart_dir / "values.yaml").read_text()),
        "Release": release,
        "Chart": {
            "Name": chart_meta["name"],
            "Version": chart_meta["version"],
            "AppVersion": chart_meta["appVersion"],
        },
    }
    defines: dict[str, str] = {}
    for helper in sorted((chart_dir / "templates").glob("_*.tpl")):
        for name, body in _DEFINE.findall(helper.read_text()):
            defines[name] = body
    docs: list[dict[str, Any]] = []
    for template in sorted((chart_dir / "templates").glob("*.yaml")):
        text = _render(template.read_text(), defines, scope)
        docs += [d for d in yaml.safe_load_all(text) if d]
    return docs


def _render(text: str, defines: dict[str, str], scope: dict[str, Any]) -> str:
    out: list[str] = []
    pos = 0
    trim_next = False
    for match in _ACTION.finditer(text):
        literal = text[pos : match.start()]
        if trim_next:
            literal = literal.lstrip()
        lead_ws, left_trim, action, right_trim = match.groups()
        out.append(literal + ("" if left_trim else lead_ws))
        out.append(_evaluate(action, defines, scope))
        trim_next = bool(right_trim)
        pos = match.end()
    tail = text[pos:]
    out.append(tail.lstrip() if trim_next else tail)
    return "".join(out)


def _evaluate(action: str, defines: dict[str, str], scope: dict[str, Any]) -> str:
    if action.startswith("/*"):
        return ""
    stages = [s.strip() for s in action.split("|")]
    value: Any = _command(stages[0], defines, scope)
    for stage in stages[1:]:
        word, *args = stage.split()
        if word == "quote" and not args:
            value = '"' + str(value).replace("\\", "\\\\").replace('"', '\\"') + '"'
        elif word == "nindent" and len(args) == 1:
            pad = " " * int(args[0])
            value = "\n" + "\n".join(
                pad + line if line else line for line in str(value).rstrip("\n").split("\n")
            )
        else:
            raise ValueError(f"unsupported pipeline stage {stage!r}")
    return str(value)


def _command(cmd: str, defines: dict[str, str], scope: dict[str, Any]) -> Any:
    words = cmd.split()
    if len(words) == 1 and words[0].startswith("."):
        return _lookup(words[0], scope)
    if len(words) == 3 and words[0] == "include" and words[2] == ".":
        return _render(defines[words[1].strip('"')], defines, scope).strip()
    if len(words) == 2 and words[0] == "toYaml" and words[1].startswith("."):
        value = _lookup(words[1], scope)
        return (
            yaml.safe_dump(value, default_flow_style=False, sort_keys=True).rstrip("\n")
            if value
            else ("{}" if isinstance(value, dict) else "[]")
        )
    raise ValueError(f"unsupported template action {cmd!r}")


def _lookup(path: str, scope: dict[str, Any]) -> Any:
    value: Any = scope
    for part in path.strip(".").split("."):
        if not isinstance(value, dict) or part not in value:
            raise ValueError(f"unsupported or missing value {path!r}")
        value = value[part]
    return value
