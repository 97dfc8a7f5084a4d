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
