"""Test lanes: which tests are slow, and how the suite splits into shards that run side by side.

Both come from ``tests/durations.json`` (each test's recorded seconds, setup + call + teardown, by
node id), as pytest-split does, so that nothing is marked slow by hand and a shard's share follows
what the tests cost:

- a test recorded at ``SLOW_S`` or more gets the ``slow`` marker (besides those marked in code), and
  so does every test of a file that says ``RUNS_IN_ORDER = True`` when one of its tests is slow, so
  ``pytest -m "not slow"`` is the fast lane a developer runs between edits;
- ``--shard=i/n`` keeps the i-th of n shards: whole test files (a file's module fixtures and order
  stay together; tests/test_readme.py relies on its order), given out longest first to the shard
  with the least so far (LPT), each file weighted by its tests' recorded seconds (in the fast lane,
  ``-m "not slow"``, those under ``SLOW_S``; ``DEFAULT_S`` for a file not recorded yet), split
  before any file is imported, so that a shard imports only its own. ``scripts/test.sh`` runs the
  shards at once: many of the long tests wait (launchers, timeouts, a frozen rank) while the other
  shard computes.
- ``--record-durations`` writes this run's seconds into the file (merged under a lock, so that
  shards can record together); run it after adding slow tests: ``scripts/test.sh --record-durations``.
- the **extended lane**: the tests ``tests/extended.txt`` names (node ids or their prefixes, each group
  under the reason it is there) run only with ``--extended`` (``scripts/test.sh --extended``: every
  test). They are proven layouts' further variants: eight ranks on two cores, compiled twins of
  layouts proven eager, a second parametrization along an axis the code treats alike. The suite
  without them is what CI runs in its 15 minutes; the extended lane runs before a session ends, with
  the layout fuzzer's campaign. A test named on the command line (``file::test``) runs whatever
  the list says. Shards weigh only the tests that will run.
- ``--record-cpu PATH`` appends one JSON line a test to PATH: its wall seconds and the CPU seconds and
  minor page faults of the test process and of the children it reaped (forked ranks, fresh
  interpreters, inductor's g++), for finding where the suite's CPU goes (docs/benchmarks.md, "The
  test suite's CPU, by kind"): ``scripts/test.sh --record-cpu /tmp/cpu.jsonl``.
"""

from __future__ import annotations

import fcntl
import json
import resource
import time
from collections import defaultdict
from pathlib import Path

import pytest

DURATIONS = Path(__file__).with_name("durations.json")
SLOW_S = 0.6  # recorded seconds from which a test leaves the fast lane (its 3 minutes on 2 cores)
DEFAULT_S = 0.3  # a test with no record yet (about the suite's median)
EXTENDED = Path(__file__).with_name("extended.txt")


def add_options(parser) -> None:
    parser.addoption("--shard", default="", metavar="I/N",
                     help="run the I-th of N shards of the selected tests (whole files, balanced by tests/durations.json)")
    parser.addoption("--extended", action="store_true",
                     help="run the extended lane too (the tests tests/extended.txt names): the whole suite")
    parser.addoption("--record-durations", action="store_true",
                     help="merge each test's seconds into tests/durations.json")
    parser.addoption("--record-cpu", default="", metavar="PATH",
                     help="append each test's wall and CPU seconds and page faults (its own and its children's) to PATH")


def recorded() -> dict[str, float]:
    try:
        return json.loads(DURATIONS.read_text())
    except (OSError, ValueError):
        return {}


def extended_prefixes(path: Path | None = None) -> list[str]:
    """The node ids (or their prefixes: a test's every parametrization, a whole file) of the extended
    lane, from ``tests/extended.txt`` (``#`` starts a comment)."""
    try:
        lines = (path or EXTENDED).read_text().splitlines()
    except OSError:
        return []
    return [line.split("#", 1)[0].strip() for line in lines if line.split("#", 1)[0].strip()]


def in_extended(nodeid: str, prefixes: list[str]) -> bool:
    """``nodeid`` is named by a prefix: the same id, or the id followed by ``[`` (its
    parametrizations) or ``::`` (a file's or a class's tests)."""
    return any(nodeid == p or nodeid.startswith(p + "[") or nodeid.startswith(p + "::") for p in prefixes)


def register(config) -> None:
    config.pluginmanager.register(ExtendedLane(), "bigtrain-extended-lane")
    config.pluginmanager.register(SlowMarker(), "bigtrain-slow-marker")
    config.pluginmanager.register(Shards(), "bigtrain-shards")
    if config.getoption("--record-durations"):
        config.pluginmanager.register(DurationRecorder(), "bigtrain-durations")
    if config.getoption("--record-cpu"):
        config.pluginmanager.register(CpuRecorder(config.getoption("--record-cpu")), "bigtrain-cpu")


class ExtendedLane:
    """Before ``-m`` selects: a test of the extended lane gets the ``extended`` marker and, without
    ``--extended``, leaves the run, unless its id (``file::test``, with or without parameters) was
    named on the command line."""

    @pytest.hookimpl(tryfirst=True)
    def pytest_collection_modifyitems(self, config, items) -> None:
        prefixes = extended_prefixes()
        named = [relative_path(Path(arg.split("::", 1)[0]).resolve(), config) + "::" + arg.split("::", 1)[1]
                 for arg in config.args if "::" in arg]
        kept, dropped = [], []
        for item in items:
            if not in_extended(item.nodeid, prefixes):
                kept.append(item)
                continue
            item.add_marker(pytest.mark.extended)
            wanted = config.getoption("--extended") or in_extended(item.nodeid, named)
            (kept if wanted else dropped).append(item)
        if config.getoption("--extended"):
            # a file whose tests build on each other (RUNS_IN_ORDER, the README's lines) runs whole
            # under ``-m extended`` too: its extended tests use what its earlier tests made
            in_order = {item.nodeid.split("::")[0] for item in items
                        if "extended" in {m.name for m in item.iter_markers()}
                        and getattr(getattr(item, "module", None), "RUNS_IN_ORDER", False)}
            for item in items:
                if item.nodeid.split("::")[0] in in_order:
                    item.add_marker(pytest.mark.extended)
        if dropped:
            config.hook.pytest_deselected(items=dropped)
            items[:] = kept


class SlowMarker:
    """Before ``-m`` selects: a test recorded as slow gets the marker."""

    @pytest.hookimpl(tryfirst=True)
    def pytest_collection_modifyitems(self, config, items) -> None:
        seconds = recorded()
        slow_files = set()
        for item in items:
            if seconds.get(item.nodeid, 0.0) >= SLOW_S:
                item.add_marker(pytest.mark.slow)
                slow_files.add(item.nodeid.split("::")[0])
        # A file whose tests build on each other (``RUNS_IN_ORDER = True`` in it, as the README's
        # commands do) leaves the fast lane whole when any of its tests is slow.
        for item in items:
            path = item.nodeid.split("::")[0]
            if path in slow_files and getattr(item.module, "RUNS_IN_ORDER", False):
                item.add_marker(pytest.mark.slow)


class Shards:
    """Before collection: import only this shard's test files; after ``-m`` and ``-k`` select: keep
    the tests of those files.

    Files are split from ``tests/durations.json`` alone, before any is imported: a shard that
    collected the whole suite to keep a quarter of it imported and assertion-rewrote every test
    module, 23.5 CPU-s of each shard's start (14.4 with pytest's rewritten modules cached, which a
    clean checkout has not), 4 shards side by side in CI and in the fast lane alike. Every shard
    computes the same split (same file list, same record, same options), so each file runs in
    exactly one shard."""

    def __init__(self):
        self.split: dict[str, int] | None = None

    def shard_files(self, config) -> dict[str, int]:
        if self.split is None:
            seconds = recorded()
            if not config.getoption("--extended"):
                prefixes = extended_prefixes()
                seconds = {k: v for k, v in seconds.items() if not in_extended(k, prefixes)}
            self.split = shard_of_paths(suite_files(config), seconds, parse_shard(config.getoption("--shard"))[1],
                                        fast_lane=config.getoption("markexpr", "").replace(" ", "") == "notslow")
        return self.split

    def pytest_ignore_collect(self, collection_path, config):
        if not config.getoption("--shard") or collection_path.suffix != ".py":
            return None
        path = relative_path(collection_path, config)
        split = self.shard_files(config)
        if path in split and split[path] != parse_shard(config.getoption("--shard"))[0] - 1:
            return True
        return None

    @pytest.hookimpl(trylast=True)
    def pytest_collection_modifyitems(self, config, items) -> None:
        if config.getoption("--shard"):
            keep_shard(config, items, self.shard_files(config))


def relative_path(path, config) -> str:
    try:
        return path.relative_to(config.rootpath).as_posix()
    except ValueError:
        return path.as_posix()


def suite_files(config) -> list[str]:
    """tests/test_*.py, as node ids start: the files a shard may collect."""
    return sorted(relative_path(p, config) for p in Path(__file__).parent.glob("test_*.py"))


def parse_shard(text: str) -> tuple[int, int]:
    try:
        index, count = (int(part) for part in text.split("/"))
    except ValueError:
        raise pytest.UsageError(f"--shard={text!r}: write I/N, e.g. --shard=1/2") from None
    if not 1 <= index <= count:
        raise pytest.UsageError(f"--shard={text}: I must be between 1 and N")
    return index, count


def file_weights(files: list[str], seconds: dict[str, float], fast_lane: bool) -> dict[str, float]:
    """Each file's recorded seconds (``DEFAULT_S`` for a file with none recorded yet); in the fast
    lane (``-m "not slow"``) only its tests under ``SLOW_S``, and none of a file whose tests run in
    order when one of them is slow (as ``SlowMarker`` marks them)."""
    weight = {path: 0.0 for path in files}
    seen, slow = set(), set()
    for nodeid, s in seconds.items():
        path = nodeid.split("::")[0]
        if path not in weight:
            continue
        seen.add(path)
        if fast_lane and s >= SLOW_S:
            slow.add(path)
        else:
            weight[path] += s
    root = Path(__file__).parent.parent
    for path in files:
        if path not in seen:
            weight[path] = DEFAULT_S
        elif path in slow and (root / path).is_file() and "RUNS_IN_ORDER = True" in (root / path).read_text():
            weight[path] = 0.0
    return weight


def shard_of_paths(files: list[str], seconds: dict[str, float], count: int, fast_lane: bool = False) -> dict[str, int]:
    """Each file -> its shard (0-based), longest files first to the lightest shard (LPT)."""
    weight = file_weights(files, seconds, fast_lane)
    loads = [0.0] * count
    out = {}
    for path in sorted(weight, key=lambda p: (-weight[p], p)):
        lightest = loads.index(min(loads))
        out[path] = lightest
        loads[lightest] += weight[path]
    return out


def keep_shard(config, items: list, split: dict[str, int]) -> None:
    """Keep the items of this shard's files (a file outside tests/, named on the command line, runs
    in the first shard)."""
    index, _ = parse_shard(config.getoption("--shard"))

    def mine(item) -> bool:
        return split.get(item.nodeid.split("::")[0], 0) == index - 1

    kept = [item for item in items if mine(item)]
    dropped = [item for item in items if not mine(item)]
    if dropped:
        config.hook.pytest_deselected(items=dropped)
    items[:] = kept


class DurationRecorder:
    """Seconds of each test this run (setup + call + teardown), merged into the file at the end."""

    def __init__(self):
        self.seconds: dict[str, float] = defaultdict(float)

    def pytest_runtest_logreport(self, report) -> None:
        self.seconds[report.nodeid] += report.duration

    def pytest_sessionfinish(self, session) -> None:
        if not self.seconds:
            return
        with open(DURATIONS.with_suffix(".lock"), "w") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            merged = {**recorded(), **{k: round(v, 3) for k, v in self.seconds.items()}}
            DURATIONS.write_text(json.dumps(dict(sorted(merged.items())), indent=0) + "\n")


class CpuRecorder:
    """Each test's wall seconds, CPU seconds and minor page faults (this process, and the children it
    reaped during the test), one JSON line a test appended to ``path`` (shards append side by side)."""

    def __init__(self, path: str):
        self.path = path

    @staticmethod
    def _now() -> dict[str, float]:
        own, kids = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
        return {"wall": time.monotonic(), "self": own.ru_utime + own.ru_stime, "kids": kids.ru_utime + kids.ru_stime,
                "faults_self": own.ru_minflt, "faults_kids": kids.ru_minflt}

    @pytest.hookimpl(hookwrapper=True)
    def pytest_runtest_protocol(self, item, nextitem):
        before = self._now()
        yield
        after = self._now()
        line = {"id": item.nodeid, **{k: round(after[k] - before[k], 3) for k in before}}
        with open(self.path, "a") as out:
            out.write(json.dumps(line) + "\n")
