"""tests/lanes.py: the shards, the extended lane and the recorder of where the suite's CPU goes."""

import json
import subprocess
import sys
from types import SimpleNamespace

import pytest

from lanes import CpuRecorder


def test_the_cpu_recorder_counts_the_children_a_test_reaps(tmp_path):
    """A test's line holds its own CPU and that of the processes it started and waited for (forked
    ranks, fresh interpreters, g++), which ``RUSAGE_SELF`` alone would miss."""
    path = tmp_path / "cpu.jsonl"
    protocol = CpuRecorder(str(path)).pytest_runtest_protocol(SimpleNamespace(nodeid="tests/x.py::t"), None)
    next(protocol)  # the test runs here
    subprocess.run([sys.executable, "-c", "sum(i * i for i in range(3_000_000))"], check=True)
    with pytest.raises(StopIteration):
        next(protocol)
    (line,) = [json.loads(text) for text in path.read_text().splitlines()]
    assert line["id"] == "tests/x.py::t"
    assert set(line) == {"id", "wall", "self", "kids", "faults_self", "faults_kids"}
    assert line["kids"] > 0.05 and line["faults_kids"] > 0  # the child's own seconds and pages
    assert line["wall"] >= line["kids"]  # one child at a time: its CPU fits in the test's wall time


def test_the_shards_split_every_test_file_once_from_the_record_alone():
    """``--shard`` splits files before importing them (tests/lanes.py, ``Shards``): from the record
    and the file list only, each file in exactly one shard, longest first to the lightest; a file
    with nothing recorded weighs DEFAULT_S; the fast lane weighs only the tests under SLOW_S, and
    nothing of a file that runs in order once one of its tests is slow."""
    from lanes import DEFAULT_S, file_weights, shard_of_paths

    files = ["tests/test_a.py", "tests/test_b.py", "tests/test_c.py", "tests/test_readme.py"]
    seconds = {"tests/test_a.py::t1": 9.0, "tests/test_a.py::t2": 0.5, "tests/test_b.py::t": 4.0,
               "tests/test_readme.py::slow": 5.0, "tests/test_readme.py::fast": 0.2, "tests/test_gone.py::t": 99.0}
    assert file_weights(files, seconds, fast_lane=False) == {
        "tests/test_a.py": 9.5, "tests/test_b.py": 4.0, "tests/test_c.py": DEFAULT_S, "tests/test_readme.py": 5.2}
    assert file_weights(files, seconds, fast_lane=True) == {  # test_readme.py: RUNS_IN_ORDER = True
        "tests/test_a.py": 0.5, "tests/test_b.py": 0.0, "tests/test_c.py": DEFAULT_S, "tests/test_readme.py": 0.0}
    split = shard_of_paths(files, seconds, 2)
    assert set(split) == set(files) and split["tests/test_a.py"] != split["tests/test_readme.py"]
    assert split["tests/test_b.py"] == split["tests/test_readme.py"]  # 9.5 | 5.2 + 4.0 (+ 0.3 to the lighter)
    assert shard_of_paths(files, seconds, 2) == split  # every shard computes the same split


def test_every_entry_of_the_extended_lane_names_a_recorded_test():
    """An entry that names nothing (a test renamed, a parametrization dropped) would leave its
    replacement in the suite unnoticed: each names at least one test of tests/durations.json."""
    from lanes import extended_prefixes, in_extended, recorded

    seconds = recorded()
    prefixes = extended_prefixes()
    assert prefixes
    stale = [p for p in prefixes if not any(in_extended(nodeid, [p]) for nodeid in seconds)]
    assert not stale, f"tests/extended.txt names no recorded test: {stale}"


def test_the_extended_lane_leaves_the_run_unless_asked_or_named(tmp_path, monkeypatch):
    """A prefix names a test, its parametrizations or a file's tests, not a test whose name merely
    starts alike; its tests leave a plain run (reported as deselected), stay with --extended, and
    stay when named on the command line; the shards weigh only the tests that run."""
    import lanes

    listing = tmp_path / "extended.txt"
    listing.write_text("# why\ntests/test_a.py::t  # a test's every parametrization\ntests/test_b.py\n")
    monkeypatch.setattr(lanes, "EXTENDED", listing)
    assert lanes.in_extended("tests/test_a.py::t[x]", lanes.extended_prefixes())
    assert lanes.in_extended("tests/test_b.py::u", lanes.extended_prefixes())
    assert not lanes.in_extended("tests/test_a.py::t_other", lanes.extended_prefixes())

    class Item(SimpleNamespace):
        def add_marker(self, mark):
            self.marks.append(mark.name)

        def iter_markers(self):
            return [SimpleNamespace(name=name) for name in self.marks]

    in_order = SimpleNamespace(RUNS_IN_ORDER=True)  # test_a.py's tests build on each other

    def run(extended: bool, args: list[str], marked: dict | None = None) -> tuple[list[str], list[str]]:
        items = [Item(nodeid=n, marks=[], module=in_order if "test_a" in n else None)
                 for n in ("tests/test_a.py::t[x]", "tests/test_a.py::t_other", "tests/test_b.py::u",
                           "tests/test_c.py::v")]
        deselected = []
        config = SimpleNamespace(getoption=lambda name: extended, args=args, rootpath=tmp_path.parent.parent,
                                 hook=SimpleNamespace(pytest_deselected=lambda items: deselected.extend(items)))
        lanes.ExtendedLane().pytest_collection_modifyitems(config, items)
        if marked is not None:
            marked.update({i.nodeid: "extended" in i.marks for i in items})
        return [i.nodeid for i in items], [i.nodeid for i in deselected]

    kept, dropped = run(False, ["tests"])
    assert kept == ["tests/test_a.py::t_other", "tests/test_c.py::v"]
    assert dropped == ["tests/test_a.py::t[x]", "tests/test_b.py::u"]
    marked = {}
    assert run(True, ["tests"], marked)[1] == []
    # with --extended, a file that runs in order is marked whole (``-m extended`` keeps its order)
    assert marked == {"tests/test_a.py::t[x]": True, "tests/test_a.py::t_other": True,
                      "tests/test_b.py::u": True, "tests/test_c.py::v": False}
    monkeypatch.chdir(tmp_path.parent.parent)
    kept, dropped = run(False, [f"{tmp_path.parent.parent}/tests/test_a.py::t"])
    assert "tests/test_a.py::t[x]" in kept and dropped == ["tests/test_b.py::u"]
