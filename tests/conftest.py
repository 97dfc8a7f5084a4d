
import os

# Inductor compiles in this process, not in a pool of workers: a test that compiles here and then
# forks ranks (tests/test_compile.py) must not fork while a pool's threads hold a lock (seen: both
# ranks of a compiled tp2 layout waiting on a futex from their first second). Set before torch.
os.environ.setdefault("TORCHINDUCTOR_COMPILE_THREADS", "1")

import pytest  # noqa: E402
import torch  # noqa: E402

# One thread in the test process too: forked ranks inherit a clean pool, and timings do not fight.
torch.set_num_threads(1)


@pytest.fixture(scope="session")
def corpus_cache(tmp_path_factory):
    """A small stdlib byte corpus cached once per session, shared by every test and rank."""
    path = tmp_path_factory.mktemp("corpus")
    return str(path)


# -- lanes: the slow marker and shards from tests/durations.json (tests/lanes.py) ---------------------
import lanes  # noqa: E402


def pytest_addoption(parser):
    lanes.add_options(parser)


def pytest_configure(config):
    lanes.register(config)
