"""Mutual TLS between services, TLS on the public API; plaintext and certificate-less peers are refused."""

import shutil
import subprocess

import grpc
import pytest

from specdec.core import grpc_util
from specdec.client import SpecdecClient
from specdec.core.grpc_util import TlsConfig
from tests.harness import DRAFT_EARLY, start_stack


def make_pki(d, san: str = "IP:127.0.0.1,DNS:localhost"):
    """A CA and one leaf certificate for the names in san (127.0.0.1/localhost), with the openssl CLI."""
    openssl = shutil.which("openssl")
    assert openssl, "openssl CLI is needed to make test certificates"

    def run(*args):
        subprocess.run([openssl, *args], check=True, capture_output=True, cwd=d)

    run("req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", "ca.key", "-out", "ca.pem", "-days", "1",
        "-subj", "/CN=specdec-test-ca")
    (d / "san.cnf").write_text(f"subjectAltName={san}\n")
    run("req", "-newkey", "rsa:2048", "-nodes", "-keyout", "svc.key", "-out", "svc.csr", "-subj", "/CN=localhost")
    run("x509", "-req", "-in", "svc.csr", "-CA", "ca.pem", "-CAkey", "ca.key", "-CAcreateserial", "-out", "svc.pem",
        "-days", "1", "-extfile", "san.cnf")
    return TlsConfig(cert=str(d / "svc.pem"), key=str(d / "svc.key"), ca=str(d / "ca.pem"))


@pytest.fixture
def tls(tmp_path):
    cfg = make_pki(tmp_path)
    grpc_util.configure_tls(cfg)
    yield cfg
    grpc_util.configure_tls(None)


def test_mutual_tls_end_to_end(redis_url, tls):
    stack = start_stack(redis_url, draft=DRAFT_EARLY)
    try:
        r = stack.client.generate([1, 5, 9], max_new_tokens=12, ignore_eos=True)
        assert len(r.token_ids) == 12 and r.stats["verify_steps"] > 0  # orchestrator reached draft and target

        plain = grpc.insecure_channel(stack.target_server.address)
        with pytest.raises(grpc.FutureTimeoutError):
            grpc.channel_ready_future(plain).result(timeout=1.5)
        plain.close()

        # TLS without a client certificate: the service refuses the handshake.
        with SpecdecClient(stack.orchestrator_server.address, tls=TlsConfig(ca=tls.ca), timeout_s=3) as anon:
            with pytest.raises(grpc.RpcError) as e:
                anon.generate([1, 2], max_new_tokens=2)
            assert e.value.code() == grpc.StatusCode.UNAVAILABLE
    finally:
        stack.stop()
