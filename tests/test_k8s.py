"""deploy/k8s: every manifest validates strictly against the Kubernetes schemas (kubernetes-validate, offline),
the overlays render, and what they deploy matches the code: the services' real flags and ports, DNS discovery of
the drafts, Redis persistence, non-root read-only pods, network policies, the GPU overlay, Chaos Mesh recipes.

The overlays are rendered by a small renderer of the kustomize features deploy/k8s uses (resources, namespace,
labels, images, JSON 6902 patches); where `kubectl` is installed its `kubectl kustomize` output must be the same,
and the secure component (secret generators) is rendered with it."""

from __future__ import annotations

import copy
import pathlib
import re
import shutil
import subprocess

import pytest
import yaml

from tests.test_deploy import parse_specdec

ROOT = pathlib.Path(__file__).resolve().parent.parent
K8S = ROOT / "deploy" / "k8s"
OVERLAYS = ["cpu", "gpu"]
KUBERNETES_VERSION = "1.37.0"
CLUSTER_SCOPED = {"Namespace"}
WORKLOADS = {"Deployment", "StatefulSet"}
KUBECTL = shutil.which("kubectl")


# --- a renderer of the kustomize features deploy/k8s uses -------------------------------------------------------


def _json_pointer(path: str) -> list[str]:
    return [p.replace("~1", "/").replace("~0", "~") for p in path.lstrip("/").split("/")]


def _apply_op(doc: dict, op: dict) -> None:
    *parents, last = _json_pointer(op["path"])
    node = doc
    for key in parents:
        node = node[int(key)] if isinstance(node, list) else node[key]
    if op["op"] == "remove":
        del node[int(last) if isinstance(node, list) else last]
    elif op["op"] in ("add", "replace"):
        value = copy.deepcopy(op["value"])
        if isinstance(node, list):
            if last == "-":
                node.append(value)
            elif op["op"] == "add":
                node.insert(int(last), value)
            else:
                node[int(last)] = value
        else:
            if op["op"] == "replace":
                assert last in node, f"replace of a missing {op['path']}"
            node[last] = value
    else:
        raise NotImplementedError(f"JSON patch op {op['op']!r}")


def _containers(doc: dict) -> list[dict]:
    spec = doc.get("spec", {}).get("template", {}).get("spec", {})
    return spec.get("initContainers", []) + spec.get("containers", [])


def render(directory: pathlib.Path) -> list[dict]:
    k = yaml.safe_load((directory / "kustomization.yaml").read_text())
    unsupported = set(k) - {"apiVersion", "kind", "namespace", "labels", "resources", "images", "patches"}
    if unsupported:
        raise NotImplementedError(f"{directory}: kustomize fields {sorted(unsupported)}")
    docs: list[dict] = []
    for entry in k.get("resources", []):
        path = directory / entry
        docs += render(path) if path.is_dir() else [d for d in yaml.safe_load_all(path.read_text()) if d]
    for patch in k.get("patches", []):
        ops = yaml.safe_load((directory / patch["path"]).read_text())
        assert isinstance(ops, list), "only JSON 6902 patches are rendered here"
        target = patch["target"]
        hits = [d for d in docs if d["kind"] == target["kind"]
                and re.fullmatch(target["name"], d["metadata"]["name"])]
        assert hits, f"patch {patch['path']} matches nothing"
        for doc in hits:
            for op in ops:
                _apply_op(doc, op)
    for doc in docs:
        if "namespace" in k:
            if doc["kind"] == "Namespace":
                doc["metadata"]["name"] = k["namespace"]
            elif doc["kind"] not in CLUSTER_SCOPED:
                doc["metadata"]["namespace"] = k["namespace"]
        for labels in k.get("labels", []):
            assert labels.get("includeSelectors") is False and not labels.get("includeTemplates")
            doc["metadata"].setdefault("labels", {}).update(labels["pairs"])
        for image in k.get("images", []):
            for c in _containers(doc):
                name, _, tag = c["image"].partition(":")
                if name == image["name"]:
                    c["image"] = image.get("newName", name) + ":" + image.get("newTag", tag)
    return docs


def kubectl_kustomize(directory: pathlib.Path) -> list[dict]:
    out = subprocess.run([KUBECTL, "kustomize", str(directory)], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    return [d for d in yaml.safe_load_all(out.stdout) if d]


def by_key(docs: list[dict]) -> dict:
    keyed = {(d["kind"], d["metadata"]["name"]): d for d in docs}
    assert len(keyed) == len(docs), "two objects of one kind share a name"
    return keyed


@pytest.fixture(scope="module", params=OVERLAYS)
def overlay(request) -> tuple[str, dict]:
    return request.param, by_key(render(K8S / "overlays" / request.param))


def _validate(doc: dict) -> None:
    import kubernetes_validate

    kubernetes_validate.validate(doc, KUBERNETES_VERSION, strict=True)


# --- schemas and rendering -------------------------------------------------------------------------------------


def test_every_manifest_validates_strictly_against_the_kubernetes_schemas(overlay):
    name, docs = overlay
    assert len(docs) >= 15
    for (kind, obj), doc in docs.items():
        try:
            _validate(doc)
        except Exception as e:  # noqa: BLE001 - name the object that failed
            pytest.fail(f"{name}: {kind}/{obj}: {e}")


def test_the_validator_is_strict_and_offline():
    """A misspelled field fails (strict schemas); the schemas ship with the package (no network needed)."""
    import kubernetes_validate

    docs = by_key(render(K8S / "overlays" / "cpu"))
    bad = copy.deepcopy(docs[("Deployment", "draft")])
    bad["spec"]["template"]["spec"]["containers"][0]["readOnlyRootFileSystem"] = True  # wrong capitalisation
    with pytest.raises(kubernetes_validate.ValidationError):
        _validate(bad)
    schemas = pathlib.Path(kubernetes_validate.__file__).parent / "kubernetes-json-schema"
    assert (schemas / f"v{KUBERNETES_VERSION}-local-strict").is_dir()


@pytest.mark.skipif(KUBECTL is None, reason="kubectl is not installed: the renderer above is checked without it")
@pytest.mark.parametrize("name", OVERLAYS + ["../chaos"])
def test_the_renderer_renders_what_kubectl_kustomize_renders(name):
    directory = (K8S / "overlays" / name).resolve()
    ours = by_key(render(directory))
    theirs = by_key(kubectl_kustomize(directory))
    assert ours.keys() == theirs.keys()
    for key in ours:
        assert ours[key] == theirs[key], key


@pytest.mark.skipif(KUBECTL is None, reason="the secure component's secret generators need kubectl kustomize")
def test_the_secure_component_renders_and_validates_with_operator_files(tmp_path):
    tree = tmp_path / "k8s"
    shutil.copytree(K8S, tree)
    for name in ("tokens.txt", "ca.pem", "tls.crt", "tls.key"):
        (tree / "components/secure/secrets" / name).write_text(f"placeholder {name}\n")
    (tree / "overlays/secure").mkdir()
    (tree / "overlays/secure/kustomization.yaml").write_text(
        "apiVersion: kustomize.config.k8s.io/v1beta1\nkind: Kustomization\nresources: [../cpu]\n"
        "components: [../../components/secure]\n")
    docs = by_key(kubectl_kustomize(tree / "overlays/secure"))
    for doc in docs.values():
        _validate(doc)
    secrets = [name for kind, name in docs if kind == "Secret"]
    assert len(secrets) == 2 and all(re.fullmatch(r"specdec-(auth-tokens|tls)-\w+", s) for s in secrets)
    for service in ("orchestrator", "draft", "target"):
        spec = docs[("Deployment", service)]["spec"]["template"]["spec"]
        env = {e["name"]: e["value"] for e in spec["containers"][0]["env"]}
        args = parse_specdec(spec["containers"][0]["args"])
        assert args.tls_cert is None  # the flags' defaults come from these variables
        assert env["SPECDEC_TLS_CERT"] == "/etc/specdec/tls/tls.crt" and env["SPECDEC_TLS_CA"].startswith("/etc/")
        volumes = {v["name"]: v for v in spec["volumes"]}
        assert volumes["tls"]["secret"]["secretName"] in secrets  # the generated name, hash included
        assert all("grpc" not in spec["containers"][0][p] for p in ("startupProbe", "readinessProbe", "livenessProbe"))
    orch = docs[("Deployment", "orchestrator")]["spec"]["template"]["spec"]["containers"][0]
    assert {"name": "SPECDEC_AUTH_TOKENS_FILE", "value": "/etc/specdec/tokens/tokens"} in orch["env"]


def test_no_secret_values_are_committed():
    tracked = subprocess.run(["git", "ls-files", "deploy/k8s"], cwd=ROOT, capture_output=True, text=True,
                             check=True).stdout.split()
    secret_files = [f for f in tracked if f.startswith("deploy/k8s/components/secure/secrets/")]
    assert sorted(secret_files) == ["deploy/k8s/components/secure/secrets/.gitignore",
                                    "deploy/k8s/components/secure/secrets/README.md"]
    for f in tracked:
        assert "BEGIN" not in (ROOT / f).read_text() or f.endswith(".md")  # no PEM blocks


# --- what is deployed matches the code -------------------------------------------------------------------------


def _pod(doc: dict) -> dict:
    return doc["spec"]["template"]["spec"]


def _specdec_args(docs: dict) -> dict:
    return {name: parse_specdec(_pod(docs[("Deployment", name)])["containers"][0]["args"])
            for name in ("target", "draft", "orchestrator")}


def _port(address: str) -> int:
    return int(address.rpartition(":")[2])


def test_the_services_run_with_flags_they_have_and_find_each_other(overlay):
    _, docs = overlay
    args = _specdec_args(docs)
    for name, ns in args.items():
        assert ns.service == name
        container = _pod(docs[("Deployment", name)])["containers"][0]
        port = _port(ns.listen)
        assert ns.listen.startswith("0.0.0.0:")
        assert [p["containerPort"] for p in container["ports"]] == [port]
        for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
            assert container[probe]["grpc"]["port"] == port  # native gRPC probes: grpc.health.v1
        env = {e["name"]: e["value"] for e in container["env"]}
        if hasattr(ns, "threads"):
            assert env["OMP_NUM_THREADS"] == str(ns.threads)
    orch = args["orchestrator"]
    assert orch.draft == "dns:///draft-headless:50051"  # every draft pod a replica, re-resolved while running
    assert orch.resolve_interval_s > 0
    assert orch.target == "dns:///target-headless:50052"  # every target pod a replica of the orchestrator's pool
    for address, name in ((orch.draft.removeprefix("dns:///"), "draft"), (orch.target.removeprefix("dns:///"), "target")):
        host = address.rpartition(":")[0]
        service = docs[("Service", host)]
        assert service["spec"]["clusterIP"] == "None"  # headless: one DNS record per ready pod
        assert service["spec"]["selector"] == _pod_labels(docs[("Deployment", name)])
        assert [p["port"] for p in service["spec"]["ports"]] == [_port(address)] == [_port(args[name].listen)]
    redis_host = re.fullmatch(r"redis://([^:/]+):(\d+)/\d+", orch.redis)
    assert redis_host and ("Service", redis_host.group(1)) in docs
    assert docs[("Deployment", "orchestrator")]["spec"]["replicas"] == 2
    public = docs[("Service", "orchestrator")]["spec"]
    assert public["ports"][0]["port"] == _port(orch.listen) and public["selector"] == _pod_labels(
        docs[("Deployment", "orchestrator")])


def _pod_labels(doc: dict) -> dict:
    return doc["spec"]["template"]["metadata"]["labels"]


def test_redis_keeps_its_append_only_file_on_a_volume_and_never_evicts(overlay):
    _, docs = overlay
    sts = docs[("StatefulSet", "redis")]
    container = _pod(sts)["containers"][0]
    argv = container["args"]
    flag = {argv[i]: argv[i + 1] for i in range(1, len(argv) - 1) if argv[i].startswith("--")}
    assert flag["--appendonly"] == "yes" and flag["--maxmemory-policy"] == "noeviction"
    claim = sts["spec"]["volumeClaimTemplates"][0]["metadata"]["name"]
    assert {"name": claim, "mountPath": flag["--dir"]} in container["volumeMounts"]
    maxmemory_mb = int(flag["--maxmemory"].removesuffix("mb"))
    assert int(container["resources"]["limits"]["memory"].removesuffix("Mi")) > maxmemory_mb
    assert sts["spec"]["serviceName"] == "redis"


def test_pods_run_as_non_root_with_read_only_root_filesystems_and_limits(overlay):
    _, docs = overlay
    workloads = [d for (kind, _), d in docs.items() if kind in WORKLOADS]
    assert len(workloads) == 4
    for doc in workloads:
        pod = _pod(doc)
        assert pod["securityContext"]["runAsNonRoot"] and pod["securityContext"]["runAsUser"] > 0
        assert pod["automountServiceAccountToken"] is False
        mounts_by_volume = {v["name"]: v for v in pod.get("volumes", [])}
        for c in pod.get("initContainers", []) + pod["containers"]:
            sc = c["securityContext"]
            assert sc["readOnlyRootFilesystem"] and sc["allowPrivilegeEscalation"] is False
            assert sc["capabilities"]["drop"] == ["ALL"]
            assert {"cpu", "memory"} <= c["resources"]["requests"].keys() <= c["resources"]["limits"].keys()
            if c["image"].startswith("specdec"):
                # Everything a specdec process writes lies on a writable volume: the model cache, /tmp, ~/.cache.
                env = {e["name"]: e["value"] for e in c["env"]}
                mounted = {m["mountPath"]: m["name"] for m in c["volumeMounts"]}
                for path in (env["SPECDEC_CACHE_DIR"], "/tmp", "/home/specdec/.cache"):
                    assert "emptyDir" in mounts_by_volume[mounted[path]], path
    # The image's user, whose home the ~/.cache mount is in.
    dockerfile = (ROOT / "deploy" / "Dockerfile").read_text()
    assert "--uid 10001" in dockerfile and "--home-dir /home/specdec" in dockerfile
    for doc in workloads:
        if _pod(doc)["containers"][0]["image"].startswith("specdec"):
            assert _pod(doc)["securityContext"]["runAsUser"] == 10001


def test_the_gpu_overlay_puts_the_target_on_a_gpu_and_the_drafts_on_cheaper_nodes(overlay):
    name, docs = overlay
    target, draft = _pod(docs[("Deployment", "target")]), _pod(docs[("Deployment", "draft")])
    limits = target["containers"][0]["resources"]["limits"]
    args = _specdec_args(docs)
    if name == "cpu":
        assert "nvidia.com/gpu" not in limits and args["target"].device == "cpu"
        assert "nodeSelector" not in draft
        return
    assert limits["nvidia.com/gpu"] == 1 and target["containers"][0]["resources"]["requests"]["nvidia.com/gpu"] == 1
    assert args["target"].device == "cuda" and target["containers"][0]["image"] == "specdec:cuda"
    assert any(t["key"] == "nvidia.com/gpu" for t in target["tolerations"])
    assert draft["nodeSelector"] and draft["tolerations"]
    assert "nvidia.com/gpu" not in draft["containers"][0]["resources"]["limits"]


def test_disruption_budgets_and_the_draft_autoscaler_point_at_real_pods(overlay):
    _, docs = overlay
    for name in ("orchestrator", "draft"):
        pdb = docs[("PodDisruptionBudget", name)]
        deployment = docs[("Deployment", name)]
        assert pdb["spec"]["selector"]["matchLabels"] == _pod_labels(deployment)
        assert pdb["spec"]["minAvailable"] < deployment["spec"]["replicas"]  # a node can still be drained
    hpa = docs[("HorizontalPodAutoscaler", "draft")]["spec"]
    assert hpa["scaleTargetRef"] == {"apiVersion": "apps/v1", "kind": "Deployment", "name": "draft"}
    assert hpa["minReplicas"] <= docs[("Deployment", "draft")]["spec"]["replicas"] < hpa["maxReplicas"]


def _selects(selector: dict, labels: dict) -> bool:
    return all(labels.get(k) == v for k, v in selector.get("matchLabels", {}).items())


def test_network_policies_allow_only_client_orchestrator_and_orchestrator_backends(overlay):
    _, docs = overlay
    policies = [d["spec"] for (kind, _), d in docs.items() if kind == "NetworkPolicy"]
    pods = {name: _pod_labels(docs[(kind, name)]) for kind, name in docs if kind in WORKLOADS}
    ports = {"orchestrator": 50050, "draft": 50051, "target": 50052, "redis": 6379}

    def allowed(direction: str, pod: str) -> list[dict]:
        rules = []
        for p in policies:
            if _selects(p["podSelector"], pods[pod]) and direction.capitalize() in p["policyTypes"]:
                rules += p.get(direction, [])
        return rules

    for pod in pods:  # everything is denied unless a policy allows it
        assert any(p["podSelector"] == {} and set(p["policyTypes"]) == {"Ingress", "Egress"} and
                   not p.get("ingress") and not p.get("egress") for p in policies)
    for pod, port in ports.items():
        rules = allowed("ingress", pod)
        assert [q["port"] for r in rules for q in r["ports"]] == [port]
        if pod != "orchestrator":  # only the orchestrator reaches the backends
            peers = [peer for r in rules for peer in r["from"]]
            assert peers and all(_selects(peer["podSelector"], pods["orchestrator"]) for peer in peers)
    egress = allowed("egress", "orchestrator")
    reachable = {pod for r in egress for peer in r["to"] for pod in pods
                 if "podSelector" in peer and "namespaceSelector" not in peer and _selects(peer["podSelector"], pods[pod])}
    assert reachable == {"draft", "target", "redis"}
    for pod in pods:  # DNS (the drafts' re-resolution needs it) and nothing else outside
        dns = [r for r in allowed("egress", pod) if "namespaceSelector" in r["to"][0]]
        assert {q["port"] for r in dns for q in r["ports"]} == {53}
        if pod != "orchestrator":
            assert allowed("egress", pod) == dns


# --- Chaos Mesh recipes ----------------------------------------------------------------------------------------

CHAOS_SPEC_KEYS = {
    "PodChaos": {"action", "mode", "selector"},
    "NetworkChaos": {"action", "mode", "selector", "delay"},
}


def test_chaos_recipes_are_well_formed_chaos_mesh_objects_aimed_at_the_drafts():
    """Chaos Mesh's CRDs are not in the Kubernetes schemas: their structure is checked here."""
    k = yaml.safe_load((K8S / "chaos" / "kustomization.yaml").read_text())
    docs = [d for f in k["resources"] for d in yaml.safe_load_all((K8S / "chaos" / f).read_text()) if d]
    draft_labels = _pod_labels(by_key(render(K8S / "overlays" / "cpu"))[("Deployment", "draft")])
    kinds = set()
    for doc in docs:
        assert doc["apiVersion"] == "chaos-mesh.org/v1alpha1"
        assert set(doc) == {"apiVersion", "kind", "metadata", "spec"} and doc["metadata"]["name"]
        spec = doc["spec"]
        if doc["kind"] == "Schedule":
            assert {"schedule", "type"} <= spec.keys()
            kind, spec = spec["type"], spec[spec["type"][0].lower() + spec["type"][1:]]
        else:
            kind = doc["kind"]
        kinds.add(kind)
        assert CHAOS_SPEC_KEYS[kind] <= spec.keys()
        assert spec["selector"]["namespaces"] == [k["namespace"]]
        assert spec["selector"]["labelSelectors"] == draft_labels
        if kind == "PodChaos":
            assert spec["action"] == "pod-kill"
        else:
            assert spec["action"] == "delay" and re.fullmatch(r"\d+ms", spec["delay"]["latency"])
    assert kinds == {"PodChaos", "NetworkChaos"}
