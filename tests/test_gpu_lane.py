"""The GPU lane's entry points on a machine without a GPU: ``scripts/test-gpu.sh`` and
``benchmarks/bench_gpu.py`` skip with a clear message and exit 0; the benchmark's own code (config,
timing, FLOPs, MFU, report) runs through on the CPU with ``--allow-cpu``."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))
import bench_gpu  # noqa: E402

no_gpu = pytest.mark.skipif(torch.cuda.is_available(), reason="a GPU is present: the lane runs instead of skipping")


def _run(*cmd: str, timeout: float = 180) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHON": sys.executable, "PYTHONPATH": str(ROOT)}
    return subprocess.run(list(cmd), cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)


@no_gpu
def test_the_gpu_script_skips_cleanly_without_a_gpu():
    done = _run("bash", "scripts/test-gpu.sh")
    assert done.returncode == 0, done.stderr
    assert "no CUDA device: skipped" in done.stdout


@no_gpu
def test_the_gpu_benchmark_skips_cleanly_without_a_gpu():
    done = _run(sys.executable, "benchmarks/bench_gpu.py")
    assert done.returncode == 0, done.stderr
    assert "no CUDA device: skipped" in done.stdout


def test_the_gpu_benchmark_runs_through_on_the_cpu(corpus_cache, tmp_path):
    out = tmp_path / "gpu.json"
    assert bench_gpu.main(["--allow-cpu", "--presets", "tiny", "--steps", "1", "--warmup", "0", "--seq", "16",
                           "--peak-tflops", "1", "--cache-dir", corpus_cache, "--json", str(out)]) == 0
    result = json.loads(out.read_text())["results"][0]
    assert result["preset"] == "tiny" and result["tokens_per_step"] == 4 * 16
    assert result["tokens_per_s"] == pytest.approx(64 / result["median_step_s"])
    assert result["mfu"] == pytest.approx(result["tokens_per_s"] * result["flops_per_token"] / 1e12)


def test_mfu_peaks_of_the_lent_gpus():
    assert bench_gpu.detect_peak("NVIDIA H100 80GB HBM3", 0)[0] == 989e12
    assert bench_gpu.detect_peak("NVIDIA H200", 0)[0] == 989e12
    assert bench_gpu.detect_peak("NVIDIA H100 PCIe", 0)[0] == 756e12
    assert bench_gpu.detect_peak("NVIDIA GeForce RTX 4090", 0)[0] is None
    assert bench_gpu.detect_peak("NVIDIA GeForce RTX 4090", 165)[0] == 165e12


def test_the_1b_preset_has_about_a_billion_parameters():
    from bigtrain.config import load_config
    from bigtrain.models.llama import build_model, count_parameters

    assert 0.9e9 < count_parameters(build_model(load_config(preset="llama-1b").model)) < 1.1e9


def test_the_step_profile_sorts_kernels_into_kinds():
    """benchmarks/profile_gpu_step.py (issue 27's fp8 reading): kernel names land in the kind the
    report needs, fp8 GEMMs apart from bf16 ones; the whole script runs through on the CPU."""
    import profile_gpu_step as prof

    assert prof.kind_of("sm90_xmma_gemm_e4m3e4m3_bf16_f32_tn_n_tilesize128x128x64") == "gemm (fp8)"
    assert prof.kind_of("void cutlass::device_kernel<at::cuda::detail::f8f8bf16_rowwise>") == "gemm (fp8)"
    assert prof.kind_of("nvjet_tst_192x192_64x3_2x1_v_bz_coopB_TNN") == "gemm (bf16)"
    assert prof.kind_of("triton_red_fused__to_copy_abs_amax_clamp_0") == "fused"
    # Names from the H200's profile of 2026-11-28, which the first classifier swapped: cuBLAS's
    # float8 GEMMs, and inductor's quantization kernels named after the GEMM they feed.
    assert prof.kind_of("nvjet_sm90_qqtst_256x128_128x4_1x2_h_bz_coopA_TNT") == "gemm (fp8)"
    assert prof.kind_of("nvjet_sm90_qrtst_128x128_128x6_1x1_h_bz_coopA_algo2_ovscale_TNT") == "gemm (fp8)"
    assert prof.kind_of("nvjet_sm90_tst_128x256_64x4_2x1_v_bz_coopA_NTN") == "gemm (bf16)"
    assert prof.kind_of("triton_red_fused__scaled_mm__to_copy_abs_add_amax_clamp_t_view_8") == "fused"
    assert prof.kind_of("cudnn_generated_fort_native_sdpa_sm90_flash_fprop") == "attention"
    assert prof.kind_of("void at::native::(anonymous namespace)::fused_adamw_kernel") == "optimizer"
    assert prof.kind_of("Memcpy HtoD (Pinned -> Device)") == "copy"
    rows = [prof.profile_variant("tiny", "eager", "cpu", warmup=0, steps=1)]
    assert rows[0]["ms_per_step"] > 0 and rows[0]["kinds"].get("gemm (bf16)", 0) > 0
