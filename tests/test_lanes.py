"""tests/lanes.py: the recorder of where the suite's CPU goes (``--record-cpu``)."""

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
