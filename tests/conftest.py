
import atexit
import os
import shutil
import tempfile

# Inductor compiles in this process, not in a pool of workers: a test that compiles here and then
# forks ranks (tests/test_compile.py) must not fork while a pool's threads hold a lock (seen: both
# ranks of a compiled tp2 layout waiting on a futex from their first second). Set before torch
# (below, with what it costs).
# And one thread in every process a test starts (fresh shells, `python -m bigtrain`, torchrun's
# ranks): scripts/test.sh runs its shards side by side, and an OpenMP pool of two on two busy cores
# spins at each barrier. Measured beside one busy core: `bigtrain generate` of a `small` run,
# 200 tokens, 29.7 s with two threads against 4.3 s with one.
os.environ.setdefault("OMP_NUM_THREADS", "1")
# Compiled regions call their graphs through inductor's Python wrapper here, not the C++ one a CPU
# run uses (bigtrain/parallel/compile.py): from an empty inductor cache, as in CI, each graph's C++
# wrapper is one more C++ build (the compiled tp2 layout test: 52 s with, 35 s without). The same
# kernels run either way; tests/test_compile.py proves the C++ wrapper's path against the reference.
os.environ.setdefault("TORCHINDUCTOR_CPP_WRAPPER", "0")
# Inductor builds its kernels in this process, not in a pool of worker processes each importing
# torch (its default with more than one core): the compiled Qwen3 tp2 + SP test from an empty cache,
# 64.5 s against 69.2 s (91 s of CPU against 92 s).
os.environ.setdefault("TORCHINDUCTOR_COMPILE_THREADS", "1")
# Each CPU kernel inductor builds here is a shared library of its own, linked against libtorch_cpu
# (434 MB), which GNU ld reads every time: gold links the same object file for less (one kernel's
# link alone 0.79 -> 0.26 CPU-s; the 20 kernel builds of test_fp8.py's compiled tensorwise test
# replayed one by one, 38.4 -> 36.1 CPU-s; two compiled tests' 27 builds in their runs, 73.9 ->
# 66.5). And no line tables (-g1: debug information only). The object code the tests run is the
# same: same source, same -O3 -march flags. gcc looks for `ld` in COMPILER_PATH first, so a
# folder holding `ld` -> ld.gold switches the linker for every g++ the tests start (their torchrun
# ranks and fresh shells too); where there is no gold, GNU ld as before.
os.environ.setdefault("AOT_INDUCTOR_ENABLE_LINE_TABLES", "0")
if "COMPILER_PATH" not in os.environ and shutil.which("ld.gold"):
    _gold = tempfile.mkdtemp(prefix="bigtrain-tests-ld-")
    os.symlink(shutil.which("ld.gold"), os.path.join(_gold, "ld"))
    os.environ["COMPILER_PATH"] = _gold
    # by this process only: ranks forked from it inherit the handler and may exit before it
    atexit.register(lambda pid=os.getpid(): os.getpid() == pid and shutil.rmtree(_gold, True))

import pytest  # noqa: E402
import torch  # noqa: E402
# Dynamo in this process before any test forks ranks: every rank that builds a model imports it (a
# module made under torch.device("meta") initializes through the Python meta kernel of normal_,
# which disables dynamo and so imports it), 1.3 s of CPU a process. Forked ranks inherit it instead
# of each paying it (test_context_parallel.py alone: 289 s of CPU without, 76 s with). Before, a shard
# imported it whenever one of its tests first compiled or built a model in this process: one shard
# of CI forked its ranks for 335 s first (test_activation_parity.py to test_context_parallel.py).
import torch._dynamo  # noqa: E402, F401

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
