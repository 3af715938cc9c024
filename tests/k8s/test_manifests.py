"""launch/k8s/ renders with kubectl's kustomize, every object validates offline against
the Kubernetes API schemas (LeaderWorkerSet against its CRD's schema, committed beside
the manifests), and every container's command parses with sgl_pd's, SGLang's and
sglang_router's parsers with the values the kubelet would substitute."""

from __future__ import annotations

import argparse
import json
import re
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml

from sgl_pd.launch_server import _split_args

ROOT = Path(__file__).resolve().parents[2]
K8S = ROOT / "launch/k8s"
OVERLAYS = sorted(p for p in (K8S / "overlays").iterdir() if p.is_dir())
KUSTOMIZATIONS = [K8S / "base", *OVERLAYS, K8S / "monitoring"]
LWS_CRD = K8S / "crds/leaderworkerset.x-k8s.io_leaderworkersets.v0.7.0.yaml"
K8S_VERSION = "1.30.0"  # the oldest release LWS v0.7.0 supports
POD_IP = "10.1.2.3"
# what the LWS controller puts into every container of a group (worker 1 of 4 here)
LWS_ENV = {"LWS_LEADER_ADDRESS": "sgl-pd-decode-0.sgl-pd-decode", "LWS_GROUP_SIZE": "4",
           "LWS_WORKER_INDEX": "1"}  # fmt: skip
SECRET_MODE = 0o600

needs_kubectl = pytest.mark.skipif(
    shutil.which("kubectl") is None,
    reason="kubectl is not installed: launch/install.sh installs it (kubernetes-client)",
)


def _render(path: Path) -> list[dict[str, Any]]:
    out = subprocess.run(
        ["kubectl", "kustomize", str(path)], capture_output=True, text=True, check=True,
        timeout=120,
    ).stdout  # fmt: skip
    return [d for d in yaml.safe_load_all(out) if d]


@pytest.fixture(scope="module")
def rendered() -> dict[str, list[dict[str, Any]]]:
    return {p.name: _render(p) for p in KUSTOMIZATIONS}


def test_there_is_an_overlay_per_cluster_recipe() -> None:
    assert {p.name for p in OVERLAYS} == {
        "deepseek-r1-tp8-1p3d",
        "deepseek-r1-dp-decode",
        "qwen3-coder-480b-tp8-1p3d",
    }
    recipes = {p.stem for p in (ROOT / "launch/recipes").glob("*.sh")}
    assert {p.name for p in OVERLAYS} <= recipes


# -- schemas -----------------------------------------------------------------------------


def _strict(doc: Any, schema: dict[str, Any], where: str) -> list[str]:
    """Fields the CRD's schema does not name (jsonschema lets them through: CRD schemas
    leave additionalProperties open and the API server prunes what they do not name)."""
    if isinstance(doc, dict) and "properties" in schema:
        unknown = [f"{where}.{k}" for k in doc if k not in schema["properties"]]
        return unknown + [
            u
            for k, v in doc.items()
            if k in schema["properties"]
            for u in _strict(v, schema["properties"][k], f"{where}.{k}")
        ]
    if isinstance(doc, list) and "items" in schema:
        return [u for i, v in enumerate(doc) for u in _strict(v, schema["items"], f"{where}[{i}]")]
    return []


def _validate_lws(doc: dict[str, Any]) -> None:
    import jsonschema

    crd = yaml.safe_load(LWS_CRD.read_text())
    group, version = doc["apiVersion"].split("/")
    assert crd["spec"]["group"] == group
    served = {v["name"]: v for v in crd["spec"]["versions"] if v["served"]}
    schema = served[version]["schema"]["openAPIV3Schema"]
    jsonschema.validate(doc, schema)
    metadata_free = {k: v for k, v in doc.items() if k != "metadata"}
    assert _strict(metadata_free, schema, doc["kind"]) == []


@needs_kubectl
def test_every_object_validates_against_the_api_schemas(
    rendered: dict[str, list[dict[str, Any]]],
) -> None:
    kubernetes_validate = pytest.importorskip("kubernetes_validate")
    kinds = set()
    for name, docs in rendered.items():
        assert docs, name
        for doc in docs:
            kinds.add(doc["kind"])
            if doc["apiVersion"].startswith("leaderworkerset.x-k8s.io/"):
                _validate_lws(doc)
            else:
                kubernetes_validate.validate(doc, K8S_VERSION, strict=True)
    assert {"Deployment", "LeaderWorkerSet", "ConfigMap", "Role", "Service"} <= kinds


def test_the_lws_schema_rejects_a_wrong_field() -> None:
    import jsonschema

    bad = {"apiVersion": "leaderworkerset.x-k8s.io/v1", "kind": "LeaderWorkerSet",
           "metadata": {"name": "x"}, "spec": {"replicas": "one"}}  # fmt: skip
    with pytest.raises(jsonschema.ValidationError):
        _validate_lws(bad)
    with pytest.raises(AssertionError):
        spec = {"leaderWorkerTemplate": {"workerTemplate": {"spec": {"containers": []}}}}
        _validate_lws({**bad, "spec": {**spec, "replica": 1}})  # only the strict walk sees it


# -- what the containers run -------------------------------------------------------------


def _pod_templates(docs: list[dict[str, Any]]) -> list[tuple[str, dict[str, Any]]]:
    """(name, pod template) of every workload; a LeaderWorkerSet gives its leader's and
    its workers'."""
    out = []
    for doc in docs:
        if doc["kind"] == "Deployment":
            out.append((doc["metadata"]["name"], doc["spec"]["template"]))
        elif doc["kind"] == "LeaderWorkerSet":
            lwt = doc["spec"]["leaderWorkerTemplate"]
            out.append((doc["metadata"]["name"] + "/leader", lwt["leaderTemplate"]))
            out.append((doc["metadata"]["name"] + "/worker", lwt["workerTemplate"]))
    return out


def _expand(container: dict[str, Any], docs: list[dict[str, Any]], leader: bool) -> list[str]:
    """The container's argv as the kubelet runs it: $(VAR) from its env."""
    maps = {d["metadata"]["name"]: d.get("data", {}) for d in docs if d["kind"] == "ConfigMap"}
    env = {**LWS_ENV, "LWS_WORKER_INDEX": "0" if leader else "1"}
    for var in container.get("env", []):
        if "value" in var:
            env[var["name"]] = var["value"]
        elif "configMapKeyRef" in var["valueFrom"]:
            ref = var["valueFrom"]["configMapKeyRef"]
            env[var["name"]] = maps[ref["name"]][ref["key"]]
        else:
            field = var["valueFrom"]["fieldRef"]["fieldPath"]
            env[var["name"]] = {"status.podIP": POD_IP, "metadata.namespace": "sgl-pd"}[field]
    argv = [*container["command"], *container["args"]]
    return [re.sub(r"\$\((\w+)\)", lambda m: env[m.group(1)], a) for a in argv]


def _secret_volume(template: dict[str, Any], path: str) -> dict[str, Any]:
    container = template["spec"]["containers"][0]
    mount = next(m for m in container["volumeMounts"] if path.startswith(m["mountPath"] + "/"))
    volume = next(v for v in template["spec"]["volumes"] if v["name"] == mount["name"])
    return volume["secret"]


def _labels_match(selector: dict[str, str], labels: dict[str, str]) -> bool:
    return all(labels.get(k) == v for k, v in selector.items())


@needs_kubectl
@pytest.mark.parametrize("overlay", [p.name for p in OVERLAYS])
def test_every_container_command_parses(
    overlay: str,
    rendered: dict[str, list[dict[str, Any]]],
    server_parser: argparse.ArgumentParser,
    tmp_path: Path,
) -> None:
    from sglang_router.launch_router import parse_router_args

    docs = rendered[overlay]
    secret = tmp_path / "pd.secret"
    secret.write_text("0123456789abcdef0123456789abcdef\n")
    secret.chmod(SECRET_MODE)
    servers: dict[str, list[tuple[argparse.Namespace, dict[str, Any]]]] = {}
    router = None
    for name, template in _pod_templates(docs):
        container = template["spec"]["containers"][0]
        python, dash_m, module, *argv = _expand(container, docs, leader=name.endswith("leader"))
        assert (python, dash_m) == ("python3", "-m")
        if module == "sglang_router.launch_router":
            router = (parse_router_args(argv), template)
            continue
        assert module == "sgl_pd.launch_server", name
        path = argv[argv.index("--pd-auth-secret-file") + 1]
        volume = _secret_volume(template, path)  # the Secret, mounted mode 0600
        assert volume["defaultMode"] == SECRET_MODE and volume["secretName"]
        argv[argv.index(path)] = str(secret)
        config, sglang_argv = _split_args(argv)
        assert config.auth_secret() is not None
        args = server_parser.parse_args(sglang_argv)
        assert args.disaggregation_transfer_backend == "sgl_pd"
        assert args.host == POD_IP and args.enable_metrics
        nnodes = args.nnodes
        devices = json.loads(args.disaggregation_ib_device)
        assert sorted(map(int, devices)) == list(range(args.tp_size))  # a NIC per rank
        limits = container["resources"]["limits"]
        assert int(limits["nvidia.com/gpu"]) == args.tp_size // nnodes
        assert int(limits["rdma/rdma_shared_device_a"]) >= 1
        assert "IPC_LOCK" in container["securityContext"]["capabilities"]["add"]
        serves_http = nnodes == 1 or args.node_rank == 0
        if serves_http:
            for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
                assert container[probe]["httpGet"]["path"] == "/health"
                assert container[probe]["timeoutSeconds"] > 20  # SGLang's health timeout
            drain = " ".join(container["lifecycle"]["preStop"]["exec"]["command"])
            timeout = float(re.search(r"--timeout (\d+)", drain).group(1))  # type: ignore[union-attr]
            assert "sgl_pd.drain" in drain
            assert template["spec"]["terminationGracePeriodSeconds"] > timeout
        else:
            assert "readinessProbe" not in container  # workers serve no HTTP
        if args.disaggregation_mode == "prefill":  # announced the way the router reads it
            port = template["metadata"]["annotations"]["sglang.ai/bootstrap-port"]
            assert int(port) == args.disaggregation_bootstrap_port
        if serves_http:
            servers.setdefault(args.disaggregation_mode, []).append((args, template))
        decodes = args.disaggregation_mode == "decode"
        assert args.disaggregation_decode_enable_radix_cache == decodes  # a prefix cache
    assert router is not None
    rargs, rtemplate = router
    assert rargs.pd_disaggregation and rargs.service_discovery
    assert rargs.decode_policy == "cache_aware"
    assert rtemplate["spec"]["serviceAccountName"]
    for role, selector in (("prefill", rargs.prefill_selector), ("decode", rargs.decode_selector)):
        assert servers[role], role
        for args, template in servers[role]:
            labels = dict(template["metadata"]["labels"])
            if "LeaderWorkerSet" in {d["kind"] for d in docs} and role == "decode":
                labels["leaderworkerset.sigs.k8s.io/worker-index"] = "0"  # set by LWS
            assert _labels_match(selector, labels), (role, selector, labels)
            assert args.port == rargs.service_discovery_port
    # the router selects no LWS worker (they serve no HTTP)
    for name, template in _pod_templates(docs):
        if name.endswith("/worker"):
            labels = {**template["metadata"]["labels"],
                      "leaderworkerset.sigs.k8s.io/worker-index": "1"}  # fmt: skip
            assert not _labels_match(rargs.decode_selector, labels)


@needs_kubectl
def test_replicas_follow_the_recipes(rendered: dict[str, list[dict[str, Any]]]) -> None:
    def replicas(overlay: str, kind: str, name: str) -> int:
        doc = next(
            d for d in rendered[overlay] if d["kind"] == kind and d["metadata"]["name"] == name
        )
        return int(doc["spec"]["replicas"])

    for overlay in ("deepseek-r1-tp8-1p3d", "qwen3-coder-480b-tp8-1p3d"):
        assert replicas(overlay, "Deployment", "sgl-pd-prefill") == 1
        assert replicas(overlay, "Deployment", "sgl-pd-decode") == 3
    assert replicas("deepseek-r1-dp-decode", "Deployment", "sgl-pd-prefill") == 11
    lws = next(d for d in rendered["deepseek-r1-dp-decode"] if d["kind"] == "LeaderWorkerSet")
    assert lws["spec"]["leaderWorkerTemplate"]["size"] == 4
    assert not any(
        d["kind"] == "Deployment" and d["metadata"]["name"] == "sgl-pd-decode"
        for d in rendered["deepseek-r1-dp-decode"]
    )
