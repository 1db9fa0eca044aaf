"""Container healthcheck: exit 0 when a specdec service answers SERVING to the standard gRPC health check.

    python /app/deploy/healthcheck.py 127.0.0.1:50052 [--service NAME] [--timeout 2]

It needs only grpcio and grpcio-health-checking (both project dependencies), so it works in the
service images without downloading a grpc-health-probe binary. Where the container has SPECDEC_TLS_CA
(and SPECDEC_TLS_CERT/KEY), the probe speaks (mutual) TLS with the service's own certificate.
"""

from __future__ import annotations

import argparse
import sys


def _channel(address: str):
    import os

    import grpc

    def read(name: str) -> bytes | None:
        path = os.environ.get(f"SPECDEC_TLS_{name}")
        if not path:
            return None
        with open(path, "rb") as f:
            return f.read()

    ca, cert, key = read("CA"), read("CERT"), read("KEY")
    if not (ca or cert):
        return grpc.insecure_channel(address)
    return grpc.secure_channel(address, grpc.ssl_channel_credentials(ca, key, cert))


def check(address: str, service: str = "", timeout: float = 2.0) -> tuple[bool, str]:
    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    channel = _channel(address)
    try:
        reply = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(service=service),
                                                          timeout=timeout)
    except grpc.RpcError as e:
        return False, f"{address}: {e.code().name}: {e.details()}"
    finally:
        channel.close()
    status = health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)
    return reply.status == health_pb2.HealthCheckResponse.SERVING, f"{address}: {status}"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("address", help="host:port of the service's gRPC listener")
    p.add_argument("--service", default="", help="service name to check ('' = the whole server)")
    p.add_argument("--timeout", type=float, default=2.0)
    args = p.parse_args(argv)
    ok, message = check(args.address, args.service, args.timeout)
    print(message, file=sys.stdout if ok else sys.stderr)
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
