"""Secure defaults: who may listen beyond loopback, the deployment's certificates and secrets, secret-free URLs.

A service bound to an address other than loopback must authenticate its callers (mutual TLS for target and
draft; bearer tokens or mutual TLS for the orchestrator's public port) or be started with ``--insecure``.
``specdec certs`` makes a CA, one certificate per service and random secrets (Redis password, tokens).
"""

from __future__ import annotations

import argparse
import datetime
import hashlib
import ipaddress
import os
import pathlib
import secrets
import socket
import sys
from urllib.parse import quote, urlsplit, urlunsplit

from specdec.core.grpc_util import StartupError

INSECURE_EXIT_CODE = 2  # a configuration the operator must change, like argparse's usage errors


class UnauthenticatedListener(StartupError):
    """A service would accept anyone's calls on a non-loopback address."""

    exit_code = INSECURE_EXIT_CODE


def is_loopback(address: str) -> bool:
    """True when host:port (or a unix: socket) is reachable from this host only."""
    if address.startswith("unix:"):
        return True
    host = address.rpartition(":")[0].strip("[]") if ":" in address else address
    if host in ("", "0.0.0.0", "::", "*"):
        return False
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        pass
    try:  # a name: loopback only if every address it resolves to is
        infos = socket.getaddrinfo(host, None)
    except OSError:
        return False
    return bool(infos) and all(ipaddress.ip_address(i[4][0].split("%")[0]).is_loopback for i in infos)


def principal_of(token: str) -> str:
    """Who a bearer token stands for: its hash (sessions are owned by it; the token itself is never stored)."""
    return hashlib.sha256(token.encode()).hexdigest()[:32]


def require_authentication(listen: str, authenticated: bool, insecure: bool, how: str) -> None:
    """Refuse to serve unauthenticated beyond loopback unless --insecure says the network is trusted."""
    if authenticated or insecure or is_loopback(listen):
        return
    raise UnauthenticatedListener(
        f"refusing to serve on {listen} without authentication: {how}, listen on 127.0.0.1, "
        "or pass --insecure on a trusted network")


MTLS_HINT = "give --tls-cert, --tls-key and --tls-ca (mutual TLS; `specdec certs` makes them)"


def require_mtls(args) -> None:
    """Target and draft: beyond loopback, only callers with a certificate from --tls-ca."""
    authenticated = bool(args.tls_cert and args.tls_key and args.tls_ca)
    require_authentication(args.listen, authenticated, args.insecure, MTLS_HINT)


def require_public_auth(args) -> tuple[list[str], list[str]]:
    """The orchestrator: its public port and HTTP API beyond loopback need bearer tokens (or mutual TLS on the
    gRPC port). Returns the (user, admin) bearer tokens read from their files."""
    tokens, admin_tokens = read_tokens(args.auth_tokens_file), read_tokens(args.admin_tokens_file)
    if (args.auth_tokens_file or args.admin_tokens_file) and not (tokens or admin_tokens):
        raise StartupError(f"no bearer tokens in {args.auth_tokens_file or args.admin_tokens_file}")
    mtls_public = bool(args.tls_cert and args.tls_key and args.tls_ca) and not args.tls_public_no_client_cert
    require_authentication(args.listen, bool(tokens or admin_tokens) or mtls_public, args.insecure,
                           "give --auth-tokens-file (bearer tokens) or mutual TLS on the public port")
    if args.http_listen:  # the HTTP API authenticates by bearer token only
        require_authentication(args.http_listen, bool(tokens or admin_tokens), args.insecure,
                               "give --auth-tokens-file (bearer tokens) for the HTTP API")
    return tokens, admin_tokens


# --------------------------------------------------------------------------------------------------
# URLs that carry a password
# --------------------------------------------------------------------------------------------------


def redact_url(url: str) -> str:
    """The URL with its password (if any) replaced by ***: safe for logs and error messages."""
    try:
        parts = urlsplit(url)
        password = parts.password
    except ValueError:
        return "<unparseable>"
    if not password:
        return url
    user = f"{parts.username}:***@" if parts.username else ":***@"
    return urlunsplit(parts._replace(netloc=user + parts.netloc.rpartition("@")[2]))


def url_with_password(url: str, password: str) -> str:
    """The store URL with the password in its userinfo (redis-py reads it from there); the URL's own
    username, if any, is kept."""
    parts = urlsplit(url)
    user = quote(parts.username, safe="") if parts.username else ""
    host = parts.netloc.rpartition("@")[2]
    return urlunsplit(parts._replace(netloc=f"{user}:{quote(password, safe='')}@{host}"))


def read_secret(path: str, what: str) -> str:
    """The first line of a secret file; a clear StartupError when it is missing or empty."""
    try:
        value = pathlib.Path(path).read_text().strip().splitlines()
    except OSError as e:
        raise StartupError(f"cannot read {what} from {path}: {e.strerror or e}") from None
    if not value or not value[0].strip():
        raise StartupError(f"{what} file {path} is empty")
    return value[0].strip()


def read_tokens(path: str | None) -> list[str]:
    """Bearer tokens, one per line (blank lines and # comments skipped)."""
    if not path:
        return []
    try:
        with open(path) as f:
            return [line.strip() for line in f if line.strip() and not line.lstrip().startswith("#")]
    except OSError as e:
        raise StartupError(f"cannot read tokens from {path}: {e.strerror or e}") from None


# --------------------------------------------------------------------------------------------------
# `specdec certs`: a CA, service certificates, secrets
# --------------------------------------------------------------------------------------------------

REPLICA_NAMES = 16  # compose container names <project>-<service>-1..16 (a scaled service's replicas)


def _write(path: pathlib.Path, data: bytes, mode: int) -> None:
    tmp = path.with_name(path.name + ".tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, mode)
    with os.fdopen(fd, "wb") as f:
        f.write(data)
    os.chmod(tmp, mode)
    os.replace(tmp, path)


def _names(service: str, project: str, hosts: list[str]) -> list[str]:
    replicas = [f"{project}-{service}-{i}" for i in range(1, REPLICA_NAMES + 1)] if project else []
    return list(dict.fromkeys([service, *replicas, "localhost", "127.0.0.1", "::1", *hosts]))


def make_certs(out: str | os.PathLike, services: list[str], hosts: list[str] = (), project: str = "",
               days: int = 825) -> dict[str, pathlib.Path]:
    """A CA (out/ca.pem, out/ca.key) and for each service out/NAME.pem + out/NAME.key, valid as server and as
    client (a service calls the others with its own certificate). Files already there are kept: a rerun of the
    init step does not rotate what running services trust."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

    out = pathlib.Path(out)
    out.mkdir(parents=True, exist_ok=True)
    now = datetime.datetime.now(datetime.timezone.utc) - datetime.timedelta(minutes=5)

    def key_pem(key) -> bytes:
        return key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                 serialization.NoEncryption())

    ca_pem, ca_key_path = out / "ca.pem", out / "ca.key"
    if ca_pem.exists() and ca_key_path.exists():
        ca_cert = x509.load_pem_x509_certificate(ca_pem.read_bytes())
        ca_key = serialization.load_pem_private_key(ca_key_path.read_bytes(), password=None)
    else:
        ca_key = ec.generate_private_key(ec.SECP256R1())
        name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "specdec CA")])
        ca_cert = (x509.CertificateBuilder().subject_name(name).issuer_name(name).public_key(ca_key.public_key())
                   .serial_number(x509.random_serial_number()).not_valid_before(now)
                   .not_valid_after(now + datetime.timedelta(days=3650))
                   .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
                   .add_extension(x509.KeyUsage(digital_signature=False, content_commitment=False,
                                                key_encipherment=False, data_encipherment=False, key_agreement=False,
                                                key_cert_sign=True, crl_sign=True, encipher_only=False,
                                                decipher_only=False), critical=True)
                   .sign(ca_key, hashes.SHA256()))
        _write(ca_key_path, key_pem(ca_key), 0o600)
        _write(ca_pem, ca_cert.public_bytes(serialization.Encoding.PEM), 0o644)
    written = {"ca": ca_pem}
    for service in services:
        cert_path, key_path = out / f"{service}.pem", out / f"{service}.key"
        written[service] = cert_path
        if cert_path.exists() and key_path.exists():
            continue
        key = ec.generate_private_key(ec.SECP256R1())
        sans = []
        for n in _names(service, project, list(hosts)):
            try:
                sans.append(x509.IPAddress(ipaddress.ip_address(n)))
            except ValueError:
                sans.append(x509.DNSName(n))
        cert = (x509.CertificateBuilder()
                .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, service)]))
                .issuer_name(ca_cert.subject).public_key(key.public_key())
                .serial_number(x509.random_serial_number()).not_valid_before(now)
                .not_valid_after(now + datetime.timedelta(days=days))
                .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
                .add_extension(x509.SubjectAlternativeName(sans), critical=False)
                .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH,
                                                      ExtendedKeyUsageOID.CLIENT_AUTH]), critical=False)
                .sign(ca_key, hashes.SHA256()))
        _write(key_path, key_pem(key), 0o600)
        _write(cert_path, cert.public_bytes(serialization.Encoding.PEM), 0o644)
    return written


def make_secret(path: str | os.PathLike, mode: int = 0o600) -> pathlib.Path:
    """A random 32-byte URL-safe token in path, unless one is there already."""
    path = pathlib.Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    if not path.exists() or not path.read_text().strip():
        _write(path, (secrets.token_urlsafe(32) + "\n").encode(), mode)
    return path


def make_redis_conf(path: str | os.PathLike, password_file: str | os.PathLike) -> pathlib.Path:
    """A redis.conf with `requirepass`, so the password never appears on redis-server's command line. Readable
    by the Redis container's own user (it is not this image's); keep it in a volume only Redis and the
    orchestrator mount."""
    path = pathlib.Path(path)
    password = read_secret(str(password_file), "the Redis password")
    _write(path, f"requirepass {password}\n".encode(), 0o644)
    return path


def add_certs_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--out", required=True, help="directory for ca.pem/ca.key and NAME.pem/NAME.key")
    p.add_argument("--service", action="append", default=[], metavar="NAME",
                   help="a service to make a certificate for (its DNS name; repeat for each)")
    p.add_argument("--host", action="append", default=[], metavar="NAME_OR_IP",
                   help="another name or address every certificate is valid for (repeatable)")
    p.add_argument("--project", default="",
                   help="compose project name: certificates also name its replicas PROJECT-NAME-1..16")
    p.add_argument("--days", type=int, default=825, help="validity of the service certificates")
    p.add_argument("--secret", action="append", default=[], metavar="FILE",
                   help="also write a random token to FILE (relative to --out) unless it exists (repeatable)")
    p.add_argument("--redis-conf", metavar="FILE:PASSWORD_FILE",
                   help="also write a redis.conf (requirepass) at FILE from PASSWORD_FILE (both relative to --out)")


def run_certs(args) -> int:
    if args.days <= 0:
        print(f"specdec certs: --days must be positive, got {args.days}", file=sys.stderr)
        return 2
    out = pathlib.Path(args.out)
    try:
        written = make_certs(out, args.service, args.host, args.project, args.days)
        for name in args.secret:
            make_secret(out / name)
        if args.redis_conf:
            conf, _, password = args.redis_conf.partition(":")
            if not password:
                print("specdec certs: --redis-conf needs FILE:PASSWORD_FILE", file=sys.stderr)
                return 2
            make_redis_conf(out / conf, out / password)
    except (OSError, StartupError) as e:
        print(f"specdec certs: {e}", file=sys.stderr)
        return 1
    for name, path in written.items():
        print(f"{name}: {path}")
    return 0
