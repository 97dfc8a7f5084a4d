"""The planner's profile of this machine's GPU (``bigtrain.plan.hardware.local_hardware``), with torch.cuda
faked: no GPU here. benchmarks/bench_offload.py --case gpu planned for an h100-80g on an H200 (its
default), and preflight's size check priced every GPU as an H100."""

import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from bigtrain.plan import hardware
from bigtrain.plan.hardware import PRESETS

GIB = 2**30


@pytest.mark.parametrize("name,memory,preset", [
    ("NVIDIA H200", 150_754_820_096, "h200-141g"),  # the lent machine's (torch.cuda, 2026-11-27)
    ("NVIDIA GH200 480GB", 101_468_602_368, "h200-141g"),
    ("NVIDIA H100 80GB HBM3", 85_029_158_912, "h100-80g"),
    ("NVIDIA H100 NVL", 100_485_038_080, "h100-80g"),
    ("NVIDIA A100-SXM4-80GB", 85_198_045_184, "a100-80g"),
    ("NVIDIA A100 80GB PCIe", 85_100_000_000, "a100-80g"),  # was a100-40g: only the SXM name was known
    ("NVIDIA A100-SXM4-40GB", 42_505_273_344, "a100-40g"),
    ("NVIDIA B200", 191_000_000_000, hardware.UNKNOWN_GPU),
])
def test_a_gpus_preset_is_its_chips_of_the_nearest_memory(name, memory, preset):
    assert hardware.hardware_of(name, memory) == preset


def _fake_gpu(monkeypatch, name: str, memory: int) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: name)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda device=None: SimpleNamespace(total_memory=memory))


def test_local_hardware_reads_this_gpus_name_and_memory(monkeypatch):
    assert hardware.local_hardware() == "cpu" and hardware.local_hardware(without_gpu="h100-80g") == "h100-80g"
    _fake_gpu(monkeypatch, "NVIDIA H200", 150_754_820_096)
    assert hardware.local_hardware() == "h200-141g"


def test_bench_offload_plans_for_the_gpu_it_runs_on(monkeypatch):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
    import bench_offload

    assert bench_offload.default_hardware("auto") == "cpu" == bench_offload.default_hardware("cpu")
    _fake_gpu(monkeypatch, "NVIDIA H200", 150_754_820_096)
    assert bench_offload.default_hardware("auto") == "h200-141g"  # was h100-80g, whatever the GPU
    assert bench_offload.default_hardware("cpu") == "cpu"  # --device cpu runs the path on this CPU


def test_preflight_prices_a_gpu_run_with_its_gpus_profile(monkeypatch):
    from bigtrain.plan import fit, memory
    from helpers import tiny_config

    seen = []
    estimate = memory.estimate_memory

    def recording(spec, layout, hardware, *args, **kwargs):
        seen.append(hardware.name)
        return estimate(spec, layout, hardware, *args, **kwargs)

    monkeypatch.setattr(memory, "estimate_memory", recording)
    monkeypatch.setattr(fit, "machine_memory", lambda cuda: (80 * GIB, "each GPU of this machine has"))
    cfg = tiny_config("", "--parallel.zero=2")
    fit.size_problems(cfg, cuda=True)  # no GPU: the default GPU's, as before
    _fake_gpu(monkeypatch, "NVIDIA H200", 150_754_820_096)
    fit.size_problems(cfg, cuda=True)
    assert seen == [hardware.UNKNOWN_GPU, "h200-141g"] and PRESETS["h200-141g"].memory_bytes > 140 * GIB
