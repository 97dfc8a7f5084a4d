"""benchmarks/bench_offload.py --case gpu on the CPU (``--device cpu``: the GPU path with the host tier
apart, as the tests run it): it trains at the planner's offload fit, and what it prints of memory
(the planner's tiers against the engine's, byte for byte; the RSS) is there."""

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_the_gpu_case_runs_the_planners_fit_on_the_cpu_and_prints_predicted_against_measured(tmp_path,
                                                                                             corpus_cache):
    out = tmp_path / "result.json"
    done = subprocess.run([sys.executable, "benchmarks/bench_offload.py", "--case", "gpu", "--device", "cpu",
                           "--preset", "tiny", "--hardware", "cpu", "--global-batch", "8", "--steps", "2",
                           "--warmup", "1", "--delayed", "--cache-dir", corpus_cache, "--max-bytes", "400000",
                           "--json", str(out)], cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(out.read_text())
    assert "offload_optimizer=cpu" in result["planner_layout"] and "delayed_update" in result["planner_layout"]
    assert result["tiers_equal"], (result["predicted"]["tiers"], result["measured"]["tiers"])
    assert result["measured"]["host_peak_rss_gib"] > 0 and result["predicted"]["host_gib"] > 0
    assert result["bytes_copied"]["down"] > 0 and result["bytes_copied"]["up"] > 0
    assert len(result["losses"]) == 3 and all(loss == loss for loss in result["losses"])
    assert result["offload_hidden_median"] is not None  # the delayed update's host step, reported per step
