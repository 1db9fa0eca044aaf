"""Secure by default: the compose deployment authenticates everything it exposes, and the services refuse to
listen beyond loopback without authentication unless told --insecure.

Static checks read deploy/docker-compose.yml the way tests/test_deploy.py does (no Docker engine); behaviour
checks start real services, a real redis-server and certificates made by `specdec certs`.
"""

from __future__ import annotations

import os
import pathlib
import subprocess
import sys
import time

import grpc
import pytest

from specdec.core import security
from specdec.core import grpc_util
from specdec import observability as telemetry
from specdec.client import SpecdecClient
from specdec.core.grpc_util import TlsConfig
from tests.harness import DRAFT_EARLY, TARGET, start_stack
from tests.test_deploy import COMPOSE, env_example, load_compose, specdec_commands

ROOT = pathlib.Path(__file__).resolve().parent.parent


# --------------------------------------------------------------------------------------------------
# compose: static checks
# --------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module", params=["defaults", "env-example"])
def compose(request):
    return load_compose(COMPOSE, env={} if request.param == "defaults" else env_example())


def _mounts(svc: dict) -> dict[str, str]:
    """container path -> volume name"""
    out = {}
    for v in svc.get("volumes", []):
        source, target = str(v).split(":")[:2]
        out[target] = source
    return out


def _volume_of(svc: dict, path: str) -> str | None:
    for target, source in _mounts(svc).items():
        if path.startswith(target.rstrip("/") + "/"):
            return source
    return None


def _init(compose) -> tuple[dict, object]:
    svc = compose["services"]["secrets-init"]
    return svc, specdec_commands(compose)["secrets-init"]


def _made_by_init(compose, svc: dict, path: str) -> bool:
    """The file at path (in svc) is written by secrets-init into the same named volume."""
    init_svc, init = _init(compose)
    volume = _volume_of(svc, path)
    if volume is None or volume not in compose["volumes"]:
        return False
    made = {f"{init.out}/ca.pem"} | {f"{init.out}/{s}.{ext}" for s in init.service for ext in ("pem", "key")}
    made |= set(init.secret) | ({init.redis_conf.split(":")[0]} if init.redis_conf else set())
    for f in made:  # same volume, same path below its mount point
        init_volume = _volume_of(init_svc, f)
        if init_volume == volume:
            rel_init = f[len(next(t for t, s in _mounts(init_svc).items() if s == volume)):]
            rel_svc = path[len(next(t for t, s in _mounts(svc).items() if s == volume)):]
            if rel_init == rel_svc:
                return True
    return False


def test_services_talk_mutual_tls_with_certificates_from_the_init_step(compose):
    services = compose["services"]
    _, init = _init(compose)
    for name in ("target", "draft", "orchestrator"):
        svc = services[name]
        env = svc["environment"]
        for var in ("SPECDEC_TLS_CERT", "SPECDEC_TLS_KEY", "SPECDEC_TLS_CA"):
            assert env.get(var), f"{name}: {var} is not set: its gRPC would be plaintext"
            assert _made_by_init(compose, svc, env[var]), f"{name}: {env[var]} is not made by secrets-init"
        assert name in init.service, f"secrets-init makes no certificate for {name}"
        assert svc["depends_on"]["secrets-init"]["condition"] == "service_completed_successfully"
        ns = specdec_commands(compose)[name]
        assert not ns.insecure, f"{name} runs with --insecure"
    # target and draft require client certificates: no flag relaxes their mTLS; the orchestrator's public
    # port relaxes it only in favour of bearer tokens.
    orch = specdec_commands(compose)["orchestrator"]
    assert orch.tls_public_no_client_cert and orch.auth_tokens_file


def test_orchestrator_requires_bearer_tokens_and_has_admin_tokens(compose):
    svc = compose["services"]["orchestrator"]
    ns = specdec_commands(compose)["orchestrator"]
    assert ns.auth_tokens_file and _made_by_init(compose, svc, ns.auth_tokens_file)
    assert ns.admin_tokens_file and _made_by_init(compose, svc, ns.admin_tokens_file)
    assert ns.admin_tokens_file != ns.auth_tokens_file


def test_redis_requires_a_password_from_a_secret(compose):
    services = compose["services"]
    redis = services["redis"]
    cmd = redis["command"]
    conf = cmd[1]
    assert cmd[0] == "redis-server" and conf.endswith(".conf"), "redis must load its requirepass from a file"
    assert _made_by_init(compose, redis, conf)
    _, init = _init(compose)
    conf_file, _, password_file = init.redis_conf.partition(":")
    assert conf_file == conf and password_file in init.secret
    assert not any("requirepass" in str(c) for c in cmd), "the password must not be on the command line"
    assert "REDISCLI_AUTH" in " ".join(redis["healthcheck"]["test"]), "the healthcheck must authenticate"
    orch = specdec_commands(compose)["orchestrator"]
    assert orch.redis_password_file == password_file
    assert _made_by_init(compose, services["orchestrator"], orch.redis_password_file)
    assert "@" not in orch.redis, "the store URL on the command line must carry no password"
    # only Redis and the orchestrator see the secrets volume
    volume = _volume_of(redis, conf)
    holders = {n for n, s in services.items() if volume in _mounts(s).values()}
    assert holders == {"redis", "orchestrator", "secrets-init"}, holders


def test_published_ports_are_on_loopback(compose):
    for name, svc in compose["services"].items():
        for p in svc.get("ports", []):
            parts = str(p).split(":")
            assert len(parts) == 3 and parts[0] == "127.0.0.1", f"{name} publishes {p} beyond loopback"
        env = svc.get("environment") or {}
        assert env.get("SPECDEC_METRICS_HOST", "127.0.0.1") == "127.0.0.1", f"{name}: /metrics beyond loopback"


def test_metrics_bind_loopback_by_default(monkeypatch):
    monkeypatch.delenv("SPECDEC_METRICS_HOST", raising=False)
    assert telemetry.metrics_host() == "127.0.0.1"


# --------------------------------------------------------------------------------------------------
# refusing unauthenticated listeners
# --------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("address, loopback", [("127.0.0.1:1", True), ("localhost:1", True), ("[::1]:1", True),
                                               ("0.0.0.0:1", False), ("[::]:1", False), (":1", False),
                                               ("10.1.2.3:1", False), ("unix:/tmp/x.sock", True)])
def test_is_loopback(address, loopback):
    assert security.is_loopback(address) == loopback


def _serve(*argv: str, timeout: float = 120, ready: bool = False):
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    for var in ("SPECDEC_TLS_CERT", "SPECDEC_TLS_KEY", "SPECDEC_TLS_CA", "SPECDEC_AUTH_TOKENS_FILE",
                "SPECDEC_ADMIN_TOKENS_FILE"):
        env.pop(var, None)
    cmd = [sys.executable, "-m", "launcher.cli", "serve", *argv]
    if not ready:
        return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env)
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    try:
        deadline = time.monotonic() + timeout
        line = ""
        while time.monotonic() < deadline:
            line = proc.stdout.readline()
            if line.startswith("SPECDEC_READY") or not line:
                break
        return proc, line
    except BaseException:
        proc.kill()
        raise


@pytest.mark.parametrize("service, extra", [
    ("target", ["--model", TARGET]),
    ("draft", ["--strategy", "ngram", "--model", TARGET]),
    ("orchestrator", ["--target", "127.0.0.1:1", "--redis", "memory"]),
])
def test_unauthenticated_service_beyond_loopback_refuses_to_start(service, extra):
    out = _serve(service, "--listen", "0.0.0.0:0", *extra)
    assert out.returncode == security.INSECURE_EXIT_CODE, (out.returncode, out.stderr)
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1, out.stderr  # one clear line, no traceback
    assert lines[0].startswith(f"specdec serve {service}: refusing to serve on 0.0.0.0:0 without authentication")
    assert "--insecure" in lines[0]


@pytest.mark.parametrize("service, extra", [
    ("target", ["--model", TARGET]),
    ("draft", ["--strategy", "ngram", "--model", TARGET]),
    ("orchestrator", ["--target", "127.0.0.1:1", "--redis", "memory"]),
])
def test_refusal_comes_before_torch_is_imported(service, extra):
    """The refusal is read from the flags alone (launcher/serve_check.py): no second spent importing torch."""
    code = ("import sys; from launcher.cli import main; rc = main(sys.argv[1:]); "
            "print('torch imported' if 'torch' in sys.modules else 'no torch'); sys.exit(rc)")
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    for var in ("SPECDEC_TLS_CERT", "SPECDEC_TLS_KEY", "SPECDEC_TLS_CA", "SPECDEC_AUTH_TOKENS_FILE",
                "SPECDEC_ADMIN_TOKENS_FILE"):
        env.pop(var, None)
    out = subprocess.run([sys.executable, "-c", code, "serve", service, "--listen", "0.0.0.0:0", *extra],
                         capture_output=True, text=True, timeout=120, env=env)
    assert out.returncode == security.INSECURE_EXIT_CODE, (out.returncode, out.stderr)
    assert out.stdout.strip() == "no torch", out.stdout
    assert out.stderr.startswith(f"specdec serve {service}: refusing to serve on 0.0.0.0:0 without authentication")


def test_early_refusal_leaves_what_it_cannot_judge_to_the_service(tmp_path):
    from launcher.serve_check import refusal

    tokens, empty = tmp_path / "tokens", tmp_path / "empty"
    tokens.write_text("t0k3n\n")
    empty.write_text("# none\n")
    tls = ["--tls-cert", "c.pem", "--tls-key", "k.pem", "--tls-ca", "ca.pem"]
    for service in ("target", "draft", "orchestrator"):
        assert isinstance(refusal([service, "--listen", "0.0.0.0:1"]), security.UnauthenticatedListener)
        assert isinstance(refusal([service, "--listen=0.0.0.0:1", "--threads", "2"]), security.UnauthenticatedListener)
        assert refusal([service, "--listen", "0.0.0.0:1", "--insecure"]) is None
        assert refusal([service, "--listen", "127.0.0.1:1"]) is None
        assert refusal([service, "--listen", "0.0.0.0:1", "--help"]) is None  # help first, as argparse does
        assert refusal([service, "--lis", "0.0.0.0:1"]) is None  # an abbreviation: argparse expands it
        assert refusal([service, "--listen", "0.0.0.0:1", "--tls-c", "x"]) is None
        assert refusal([service, "--listen"]) is None  # no value: the full parser's usage error
    assert refusal(["target", "--listen", "0.0.0.0:1", *tls]) is None  # mutual TLS
    assert refusal(["draft"]) is None and refusal(["orchestrator"]) is None  # loopback defaults
    assert refusal(["orchestrator", "--listen", "0.0.0.0:1", "--http-listen", "", "--auth-tokens-file",
                    str(tokens)]) is None
    assert refusal(["orchestrator", "--listen", "0.0.0.0:1", "--http-listen", "", *tls]) is None
    http = refusal(["orchestrator", "--listen", "0.0.0.0:1", "--http-listen", "0.0.0.0:8000", *tls])
    assert "0.0.0.0:8000" in str(http)  # mutual TLS covers the gRPC port, not the HTTP API
    # An empty tokens file is the service's own error (StartupError), not this refusal.
    assert refusal(["orchestrator", "--listen", "0.0.0.0:1", "--auth-tokens-file", str(empty)]) is None
    assert refusal(["certs"]) is None and refusal([]) is None


def test_insecure_flag_lets_a_service_start_beyond_loopback():
    proc, line = _serve("target", "--listen", "0.0.0.0:0", "--model", TARGET, "--device", "cpu", "--insecure",
                        ready=True)
    try:
        assert line.startswith("SPECDEC_READY 0.0.0.0:"), (line, proc.stderr.read() if proc.poll() is not None else "")
        port = int(line.split()[1].rsplit(":", 1)[1])
        assert grpc_util.check_health(f"127.0.0.1:{port}", timeout=10)
    finally:
        proc.terminate()
        proc.wait(15)


def test_authenticated_configurations_pass_the_check(tmp_path):
    security.require_authentication("0.0.0.0:1", True, False, "")
    security.require_authentication("127.0.0.1:1", False, False, "")  # loopback needs no auth
    security.require_authentication("0.0.0.0:1", False, True, "")  # --insecure
    with pytest.raises(security.UnauthenticatedListener):
        security.require_authentication("0.0.0.0:1", False, False, "")


# --------------------------------------------------------------------------------------------------
# GetOutline: behind auth, addresses for admins only
# --------------------------------------------------------------------------------------------------


def _outline(address: str, token: str | None):
    from specdec.ops.stats_cli import fetch_outline

    return fetch_outline(address, token=token)


def test_get_outline_requires_a_token_and_shows_addresses_to_admins_only(redis_url):
    stack = start_stack(redis_url, draft=DRAFT_EARLY, auth_tokens=["user-token"], admin_tokens=["admin-token"])
    try:
        addr = stack.orchestrator_server.address
        target_addr = stack.target_server.address
        draft_addr = stack.draft_servers[0].address
        store_host = redis_url.split("//")[1].split("/")[0]
        with pytest.raises(grpc.RpcError) as e:
            _outline(addr, None)
        assert e.value.code() == grpc.StatusCode.UNAUTHENTICATED
        with pytest.raises(grpc.RpcError) as e:
            _outline(addr, "wrong")
        assert e.value.code() == grpc.StatusCode.UNAUTHENTICATED

        user = str(_outline(addr, "user-token"))
        for internal in (target_addr, draft_addr, store_host):
            assert internal not in user, f"{internal} shown to a non-admin"
        assert "redacted" in user
        admin = _outline(addr, "admin-token")
        assert admin["components"]["targetService"]["address"] == target_addr
        assert draft_addr in admin["components"]["draftService"]["replicas"]
        assert store_host in admin["components"]["sessionStore"]["url"]
        # an admin token is a working token for generation too
        with SpecdecClient(addr, token="admin-token") as client:
            assert len(client.generate([1, 5, 9], max_new_tokens=4, ignore_eos=True).token_ids) == 4
    finally:
        stack.stop()


# --------------------------------------------------------------------------------------------------
# `specdec certs` and mutual TLS
# --------------------------------------------------------------------------------------------------


def _certs(d: pathlib.Path, *services: str) -> None:
    from launcher.cli import main

    argv = ["certs", "--out", str(d)]
    for s in services:
        argv += ["--service", s]
    assert main(argv) == 0


def test_specdec_certs_are_accepted_by_the_services_and_refuse_strangers(redis_url, tmp_path):
    pki = tmp_path / "pki"
    _certs(pki, "target", "draft", "orchestrator", "client")
    for name in ("ca.key", "target.key"):
        assert (pki / name).stat().st_mode & 0o077 == 0, f"{name} is readable by others"
    before = (pki / "target.pem").read_bytes()
    _certs(pki, "target")  # a rerun keeps what services already trust
    assert (pki / "target.pem").read_bytes() == before

    service = TlsConfig(str(pki / "target.pem"), str(pki / "target.key"), str(pki / "ca.pem"))
    grpc_util.configure_tls(service)
    try:
        stack = start_stack(redis_url, draft=DRAFT_EARLY)
        try:
            addr = stack.orchestrator_server.address
            client_tls = TlsConfig(str(pki / "client.pem"), str(pki / "client.key"), str(pki / "ca.pem"))
            with SpecdecClient(addr, tls=client_tls, timeout_s=30) as client:
                r = client.generate([1, 5, 9], max_new_tokens=8, ignore_eos=True)
            assert len(r.token_ids) == 8 and r.stats["verify_steps"] > 0  # through draft and target, over mTLS

            # no client certificate: every service refuses the handshake
            from grpc_health.v1 import health_pb2, health_pb2_grpc

            for service_addr in (addr, stack.target_server.address, stack.draft_servers[0].address):
                anon = grpc.secure_channel(service_addr, grpc.ssl_channel_credentials((pki / "ca.pem").read_bytes()))
                with pytest.raises(grpc.RpcError) as e:
                    health_pb2_grpc.HealthStub(anon).Check(health_pb2.HealthCheckRequest(), timeout=3)
                anon.close()
                assert e.value.code() == grpc.StatusCode.UNAVAILABLE, service_addr

            # a certificate from another CA: refused too
            other = tmp_path / "other"
            _certs(other, "client")
            stranger = TlsConfig(str(other / "client.pem"), str(other / "client.key"), str(pki / "ca.pem"))
            with SpecdecClient(addr, tls=stranger, timeout_s=3) as c:
                with pytest.raises(grpc.RpcError) as e:
                    c.generate([1, 2], max_new_tokens=2)
                assert e.value.code() == grpc.StatusCode.UNAVAILABLE
        finally:
            stack.stop()
    finally:
        grpc_util.configure_tls(None)


def test_healthcheck_speaks_mutual_tls_from_the_environment(tmp_path, monkeypatch):
    sys.path.insert(0, str(ROOT / "deploy"))
    try:
        import healthcheck
    finally:
        sys.path.pop(0)
    pki = tmp_path / "pki"
    _certs(pki, "target")
    tls = TlsConfig(str(pki / "target.pem"), str(pki / "target.key"), str(pki / "ca.pem"))
    server = grpc_util.ServiceServer("127.0.0.1:0", tls=tls).start()
    try:
        ok, message = healthcheck.check(server.address, timeout=3)
        assert not ok, "a plaintext probe must not pass an mTLS service"
        for var, path in (("CERT", tls.cert), ("KEY", tls.key), ("CA", tls.ca)):
            monkeypatch.setenv(f"SPECDEC_TLS_{var}", path)
        ok, message = healthcheck.check(server.address, timeout=5)
        assert ok, message
    finally:
        server.stop(0)


# --------------------------------------------------------------------------------------------------
# Redis password, secret-free URLs, hashed session ids
# --------------------------------------------------------------------------------------------------


def test_store_url_carries_the_password_without_showing_it(tmp_path):
    from orchestrator.store.session_store import StoreUnavailable, open_store
    from specdec.ops.redis_server import RedisServer

    password = "s3cret/with:odd@chars"
    (tmp_path / "pw").write_text(password + "\n")
    server = RedisServer(data_dir=str(tmp_path / "redis"))
    server.start()
    try:
        import redis

        redis.Redis(port=server.port).config_set("requirepass", password)
        with pytest.raises(StoreUnavailable):
            open_store(server.url).ping()  # no password: refused
        url = security.url_with_password(server.url, security.read_secret(str(tmp_path / "pw"), "pw"))
        store = open_store(url)
        store.ping()
        assert password not in store.url and "***" in store.url
        server.stop()
        with pytest.raises(StoreUnavailable) as e:
            store.ping()
        assert password not in str(e.value)
    finally:
        server.stop()


def test_session_ids_are_hashed_in_spans(redis_url):
    from opentelemetry.sdk.trace.export import SimpleSpanProcessor
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

    exporter = InMemorySpanExporter()
    telemetry.add_span_processor(SimpleSpanProcessor(exporter))
    stack = start_stack(redis_url, draft=DRAFT_EARLY)
    try:
        r = stack.client.generate([1, 5, 9], max_new_tokens=8, ignore_eos=True)
        time.sleep(0.2)
        spans = exporter.get_finished_spans()
        with_session = [s for s in spans if "session_id" in (s.attributes or {})]
        assert with_session, "no span carries a session attribute"
        for s in spans:
            assert r.session_id not in str(dict(s.attributes or {})), f"{s.name} carries the raw session id"
        assert {s.attributes["session_id"] for s in with_session} == {telemetry.session_hash(r.session_id)}
    finally:
        stack.stop()
        exporter.clear()


# --------------------------------------------------------------------------------------------------
# telemetry export: mutual TLS in compose and in the code
# --------------------------------------------------------------------------------------------------


def test_telemetry_export_is_mutual_tls_end_to_end_in_compose(compose):
    """services -> collector -> Jaeger: every hop TLS with a certificate from secrets-init, and the receivers
    require client certificates (nothing on the compose network can inject or read spans in plaintext)."""
    import urllib.parse

    import yaml

    services = compose["services"]
    _, init = _init(compose)
    assert {"otel-collector", "jaeger"} <= set(init.service)
    for name in ("target", "draft", "orchestrator"):
        env = services[name]["environment"]
        url = urllib.parse.urlparse(env["OTEL_EXPORTER_OTLP_ENDPOINT"])
        assert url.scheme == "https", f"{name}: OTLP export must be TLS (https://), not {url.scheme}://"
        assert env.get("SPECDEC_TLS_CA") and env.get("SPECDEC_TLS_CERT"), f"{name}: no identity for the export"
    collector = services["otel-collector"]
    assert collector["depends_on"]["secrets-init"]["condition"] == "service_completed_successfully"
    cfg = yaml.safe_load((ROOT / "deploy" / "otel-collector.yaml").read_text())
    for proto in ("grpc", "http"):
        tls = cfg["receivers"]["otlp"]["protocols"][proto].get("tls") or {}
        for key in ("cert_file", "key_file", "client_ca_file"):  # client_ca_file: client certificates required
            assert tls.get(key) and _made_by_init(compose, collector, tls[key]), f"collector {proto} receiver: {key}"
    to_jaeger = cfg["exporters"]["otlp/jaeger"]["tls"]
    assert not to_jaeger.get("insecure")
    for key in ("ca_file", "cert_file", "key_file"):
        assert to_jaeger.get(key) and _made_by_init(compose, collector, to_jaeger[key]), f"collector -> jaeger: {key}"
    jaeger = services["jaeger"]
    flags = dict(str(a).lstrip("-").split("=", 1) for a in jaeger["command"])
    for proto in ("grpc", "http"):
        assert flags[f"collector.otlp.{proto}.tls.enabled"] == "true"
        for key in ("cert", "key", "client-ca"):
            path = flags[f"collector.otlp.{proto}.tls.{key}"]
            assert _made_by_init(compose, jaeger, path), f"jaeger {proto}: {key} {path} is not made by secrets-init"


_EXPORT_ONE_SPAN = """
from specdec import observability as telemetry
telemetry.setup("specdec-export-test")
with telemetry.span("exported-span", session_id="raw-session-id"):
    pass
telemetry.force_flush(5000)
"""


def test_otlp_export_uses_the_services_certificate(tmp_path):
    """An https:// OTLP endpoint: the service verifies the collector with SPECDEC_TLS_CA and presents its own
    certificate; a collector that requires client certificates gets the span, and refuses an exporter without one."""
    from concurrent import futures

    from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc

    pki = tmp_path / "pki"
    _certs(pki, "otel-collector", "orchestrator")
    received = []

    class Collector(trace_service_pb2_grpc.TraceServiceServicer):
        def Export(self, request, context):
            received.extend(s.name for rs in request.resource_spans for ss in rs.scope_spans for s in ss.spans)
            return trace_service_pb2.ExportTraceServiceResponse()

    server = grpc.server(futures.ThreadPoolExecutor(2))
    trace_service_pb2_grpc.add_TraceServiceServicer_to_server(Collector(), server)
    tls = TlsConfig(str(pki / "otel-collector.pem"), str(pki / "otel-collector.key"), str(pki / "ca.pem"))
    port = server.add_secure_port("127.0.0.1:0", tls.server_credentials())
    server.start()
    try:
        env = {k: v for k, v in os.environ.items() if not k.startswith(("OTEL_", "SPECDEC_TLS_"))}
        env.update(OTEL_EXPORTER_OTLP_ENDPOINT=f"https://localhost:{port}", OTEL_EXPORTER_OTLP_TIMEOUT="3",
                   SPECDEC_TLS_CA=str(pki / "ca.pem"), PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1")
        no_cert = subprocess.run([sys.executable, "-c", _EXPORT_ONE_SPAN], env=env, capture_output=True,
                                 text=True, timeout=120)
        assert no_cert.returncode == 0, no_cert.stderr[-2000:]
        assert received == [], "the collector must refuse an exporter without a client certificate"
        env.update(SPECDEC_TLS_CERT=str(pki / "orchestrator.pem"), SPECDEC_TLS_KEY=str(pki / "orchestrator.key"))
        done = subprocess.run([sys.executable, "-c", _EXPORT_ONE_SPAN], env=env, capture_output=True, text=True,
                              timeout=120)
        assert done.returncode == 0, done.stderr[-2000:]
        assert received == ["exported-span"], done.stderr[-2000:]
    finally:
        server.stop(0)
