"""Hardware profiles: peak rates, memory, links; custom profiles from files; calibration.

Every number of a preset is a published peak or a stated assumption (see ``source`` of each
preset and docs/planner.md). ``achievable_fraction`` is the share of the peak matmul rate a whole
transformer layer sustains (GEMMs plus norms, softmax and elementwise kernels); it is an
assumption, set once per accelerator and not fitted to the runs docs/planner.md compares with.
Link bandwidths are the bus bandwidth a ring collective reaches per GPU (NCCL's ``busbw``),
about 80-90% of the nominal link rate. ``weight_grad_fraction`` is the share of a backward that
zb-h1's W takes, measured (``weight_grad.py``), not assumed. Profiles with ``gemm_fraction > 0`` time
each op from its shapes instead (``gemm.py``); their GEMM curve is the two parameters fitted to the
published runs (GPU presets) or measured by ``bench --calibrate`` (``calibrate.py``).
"""

from __future__ import annotations

import dataclasses
import json
import math
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from bigtrain.config import ConfigError

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

MIB, GIB = 2**20, 2**30
# W / (I + W) of the split backward on a middle stage of the 5M-parameter Llama (6 blocks, d256,
# seq 128, batch 8, fp32) on the 2-core CI CPU: `bigtrain bench --split-backward` (docs/planner.md
# has the figures). Not measured on GPUs: `bigtrain bench --calibrate` measures the machine it runs on.
WEIGHT_GRAD_FRACTION = 0.42


@dataclass(frozen=True)
class HardwareProfile:
    name: str
    peak_flops_bf16: float  # dense, per accelerator, FLOP/s
    peak_flops_fp32: float  # what an fp32 matmul runs at (no TF32)
    achievable_fraction: float  # share of peak a transformer layer sustains
    memory_bytes: int  # what the device reports as total
    reserved_bytes: int  # never available to tensors: CUDA context, NCCL and cuBLAS workspaces
    fragmentation: float  # caching-allocator allowance, as a fraction of the bytes tensors need
    hbm_bandwidth: float  # bytes/s, for the memory-bound optimizer step
    intra_node_bandwidth: float  # ring bus bandwidth per GPU inside a node (NVLink), bytes/s
    inter_node_bandwidth: float  # ring bus bandwidth per GPU across nodes (one NIC per GPU), bytes/s
    intra_node_latency_s: float  # fixed cost of one collective inside a node
    inter_node_latency_s: float
    gpus_per_node: int = 8
    weight_grad_fraction: float = WEIGHT_GRAD_FRACTION  # W / (I + W) of a split backward, measured
    # device <-> host copies (activation offload), per direction: PCIe Gen4 x16 at ~80% (assumption)
    host_bandwidth: float = 25e9
    # offload.optimizer / offload.params = 'nvme': one rank's share of the local NVMe drives, read or
    # written (assumption: a PCIe Gen4 drive per GPU at ~3 GB/s sustained; ZeRO-Infinity's DGX-2 has
    # ~25 GB/s over 16 GPUs). Calibrate your own: benchmarks/bench_offload.py --case rss.
    nvme_bandwidth: float = 3e9
    # offload.optimizer: bytes per second the host optimizer step streams through host memory (a
    # server's DRAM with a fused multithreaded Adam; assumption). The 2-core CI machine measured ~20e9.
    host_memory_bandwidth: float = 50e9
    # What offload may keep per accelerator off the device (plan/tiers.py counts it byte for byte; no
    # fit exceeds it): host memory and NVMe capacity per GPU. Default: the one-H100 machine bigtrain's
    # first GPU runs used (125 GiB of host memory, a 64 GiB disk; shared/gpu-2026-11-26.md), an
    # assumption; a DGX H100 has 2 TB and 8 x 3.84 TB NVMe for its 8 GPUs (--hw host_memory_bytes=256e9
    # --hw nvme_bytes=3.84e12).
    host_memory_bytes: int = 134_000_000_000
    nvme_bytes: int = 64 * GIB
    # Host memory the training process needs besides what offload keeps there (torch and CUDA
    # libraries, the Python heap, the token corpus): an assumption, counted against host_memory_bytes.
    host_reserved_bytes: int = 2 * GIB
    # Shape-aware compute (plan/gemm.py); gemm_fraction = 0 keeps achievable_fraction for everything.
    gemm_fraction: float = 0.0  # share of the dense peak a large GEMM sustains
    gemm_half_dim: float = 0.0  # a GEMM dimension this small halves that share
    attention_fraction: float = 0.5  # share of the peak a flash attention kernel sustains (forward)
    memory_fraction: float = 0.8  # share of hbm_bandwidth element-wise kernels reach (STREAM-like)
    op_overhead_s: float = 0.0  # dispatch cost per kernel (0 on GPUs: asynchronous launches)
    attention_kernel: str = "flash"  # or "unfused" (softmax over the materialized s x s scores)
    # Collectives (plan/calibrate_comm.py measures them): reduce-scatter's and all-gather's bus
    # bandwidth as a share of all-reduce's (NCCL runs all three at one rate: 1), and the share of a
    # compute window an asynchronous collective hides behind (GPUs: assumption; a CPU measures it).
    reduce_scatter_efficiency: float = 1.0
    all_gather_efficiency: float = 1.0
    comm_overlap: float = 0.9
    # What recomputing a checkpointed kernel costs beyond running it again (torch.utils.checkpoint's
    # saved-tensor hooks and rebuilt graph; calibrate.measure_recompute_overhead; 0 on GPUs, where
    # it hides behind kernels of their size: assumption).
    recompute_op_overhead_s: float = 0.0
    # Dense float8 matmul rate (precision.fp8's GEMMs, plan/gemm.py); 0: no float8 tensor cores, so
    # precision.fp8 runs emulated (the compute precision's GEMMs plus the casts). Its sustained share
    # is taken to follow the bf16 GEMM curve (gemm_fraction, gemm_half_dim): an assumption until a
    # GPU measures it (docs/precision.md).
    peak_flops_fp8: float = 0.0
    # Share of hbm_bandwidth float8's cast kernels reach (amax reductions, scaling and casts, float8
    # transposes: plan/gemm.py counts their bytes); the default is memory_fraction's STREAM-like figure.
    cast_fraction: float = 0.8
    # Share of the dense peak the GEMM kernels themselves sustain, as a profiler times them (bf16 /
    # fp16, and float8 of peak_flops_fp8); 0: gemm_fraction's. gemm_fraction is fitted to whole steps
    # and so carries time beside the kernels that float8's faster kernels do not shorten (plan/gemm.py).
    gemm_kernel_fraction: float = 0.0
    gemm_kernel_fraction_fp8: float = 0.0
    # What the ranks run on: "cuda" or "cpu". compile.enabled = 'auto' compiles on CUDA only
    # (bigtrain/from_config.py ``compiles``), so ``bigtrain plan`` prices a compiled step on a GPU.
    device: str = "cuda"
    source: str = ""

    def peak_flops(self, precision: str) -> float:
        return self.peak_flops_fp32 if precision == "fp32" else self.peak_flops_bf16

    def sustained_flops(self, precision: str) -> float:
        return self.peak_flops(precision) * self.achievable_fraction

    @property
    def usable_bytes(self) -> int:
        return self.memory_bytes - self.reserved_bytes

    def with_values(self, **values: Any) -> "HardwareProfile":
        return dataclasses.replace(self, **_coerce_fields(values, "--hw"))

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


_NVIDIA_RESERVE = dict(reserved_bytes=int(1.5 * GIB), fragmentation=0.05, gpus_per_node=8)
# Shape-aware compute (plan/gemm.py). gemm_fraction and gemm_half_dim were fitted to the published runs
# (scripts/planner-published.py --fit; cuBLAS reaches about 85-90% of the A100's and 70-75% of the
# H100's dense bf16 peak on large GEMMs); attention_fraction from FlashAttention-2's paper (forward
# ~70% of peak on A100, ~50% on H100 without FA3); memory_fraction 0.8: what STREAM-like kernels reach.
_A100_SHAPES = dict(gemm_fraction=0.7, gemm_half_dim=64, attention_fraction=0.7, memory_fraction=0.8)
_H100_SHAPES = dict(gemm_fraction=0.58, gemm_half_dim=64, attention_fraction=0.5, memory_fraction=0.8)
# Hopper's kernels as one H200 timed them (docs/benchmarks.md, "One H200, 2026-11-28 (evening)":
# llama-1b, 4 x 2048 tokens, bf16 compiled; the H100 has the same chip): the step's bf16 GEMM kernels
# took 62.7 ms where gemm_fraction's curve gives 88.0 (0.58 x 88.0 / 62.7 = 0.81 on that curve), its
# float8 GEMM kernels 33.7 ms where the curve at peak_flops_fp8 gives 44.0 (0.76); the float8 casts
# took 32.0 - 8.9 = 23.1 ms of Triton kernels (tensorwise; the float8 step's less the bf16 step's)
# for the 67.4 GB that run's formulation moved (benchmarks/fp8_previous.py: every GEMM operand
# quantized from bf16, 2B + 1 bytes an element, twice each of x, W and dY): 67.4e9 / 23.1e-3 s =
# 2.92 TB/s, 0.61 of 4.8 TB/s. (Its rowwise casts took 33.7 ms for the same bytes, 16.1 of them in
# one reduction over a strided dimension, which the current formulation no longer makes: not a
# bandwidth figure.) plan/gemm.py has the byte counts.
_HOPPER_KERNELS = dict(gemm_kernel_fraction=0.81, gemm_kernel_fraction_fp8=0.76, cast_fraction=0.61)
# One rank's single-threaded fp32 GEMMs on the CI machine (bench --calibrate, 2026-11-23: 94 GFLOP/s at
# 1024^3 = 0.6 of the preset's peak, the curve's half dimension 8) and its dispatch cost per kernel.
_CPU_SHAPES = dict(gemm_fraction=0.6, gemm_half_dim=8, op_overhead_s=2.2e-6)
_A100_LINKS = dict(intra_node_bandwidth=240e9, inter_node_bandwidth=22.5e9,
                   intra_node_latency_s=10e-6, inter_node_latency_s=25e-6)
_H100_LINKS = dict(intra_node_bandwidth=360e9, inter_node_bandwidth=45e9,
                   intra_node_latency_s=10e-6, inter_node_latency_s=25e-6)
_A100_SOURCE = ("A100 datasheet: 312 TFLOP/s dense bf16, 19.5 fp32; DGX A100: NVLink3 300 GB/s per direction "
                "(80% as ring busbw), 8x200 Gb/s HDR (25 GB/s per GPU, 90%). achievable_fraction 0.65: "
                "assumption (large GEMMs ~80% of peak, ~20% of layer time in non-GEMM kernels)")
_H100_SOURCE = ("H100 SXM datasheet: 989 TFLOP/s dense bf16, 1,979 dense fp8 (3,958 with sparsity), 67 fp32, "
                "3.35 TB/s HBM3; DGX H100: NVLink4 450 GB/s "
                "per direction (80% as ring busbw), 8x400 Gb/s NDR (50 GB/s per GPU, 90%). achievable_fraction "
                "0.55: assumption (GEMMs ~70% of peak; non-GEMM kernels did not speed up as much as tensor cores)")

PRESETS: dict[str, HardwareProfile] = {
    "a100-40g": HardwareProfile("a100-40g", 312e12, 19.5e12, 0.65, 40960 * MIB, hbm_bandwidth=1.555e12,
                                source=_A100_SOURCE, **_NVIDIA_RESERVE, **_A100_LINKS, **_A100_SHAPES),
    "a100-80g": HardwareProfile("a100-80g", 312e12, 19.5e12, 0.65, 81920 * MIB, hbm_bandwidth=2.039e12,
                                source=_A100_SOURCE, **_NVIDIA_RESERVE, **_A100_LINKS, **_A100_SHAPES),
    "h100-80g": HardwareProfile("h100-80g", 989e12, 67e12, 0.55, 81559 * MIB, hbm_bandwidth=3.35e12,
                                peak_flops_fp8=1979e12, source=_H100_SOURCE, **_NVIDIA_RESERVE, **_H100_LINKS, **_H100_SHAPES,
                                **_HOPPER_KERNELS),
    "h200-141g": HardwareProfile("h200-141g", 989e12, 67e12, 0.55, 143771 * MIB, hbm_bandwidth=4.8e12,
                                 peak_flops_fp8=1979e12,  # H200 datasheet: 3,958 TFLOP/s fp8 with sparsity
                                 source=_H100_SOURCE.replace("3.35 TB/s HBM3", "4.8 TB/s HBM3e, 141 GB")
                                 .replace("H100 SXM datasheet", "H200 SXM datasheet"),
                                 **_NVIDIA_RESERVE, **_H100_LINKS, **_H100_SHAPES, **_HOPPER_KERNELS),
    # The CI machine of notes-cpu-distributed.md: 2 cores, Gloo over loopback. bf16 matmuls have no
    # fast kernel there (a 1024^3 product takes 2.4 s), hence the low bf16 peak. Calibrate your own.
    "cpu": HardwareProfile("cpu", 2e9, 1.6e11, 0.6, 24 * GIB, reserved_bytes=GIB // 2, fragmentation=0.0, device="cpu",
                           host_memory_bytes=24 * GIB,  # the host is the device: the same 24 GiB
                           hbm_bandwidth=37e9, intra_node_bandwidth=0.85e9, inter_node_bandwidth=0.1e9,
                           intra_node_latency_s=0.7e-3, inter_node_latency_s=1e-3, gpus_per_node=8,
                           reduce_scatter_efficiency=0.25, all_gather_efficiency=0.55, comm_overlap=0.0,
                           recompute_op_overhead_s=17e-6, **_CPU_SHAPES,
                           source="measured on the 2-core CI machine (notes-cpu-distributed.md); "
                                  "fp32 matmul 94-126 GFLOP/s at 1024^3 (one thread; runs differ); Gloo all-reduce 0.85 GB/s at 2 ranks; "
                                  "reduce-scatter / all-gather at 0.25 / 0.55 of its bus bandwidth, "
                                  "no overlap with compute (plan/calibrate_comm.py, 2026-11-23); "
                                  "checkpoint recomputation 17 us per kernel (calibrate.py); shape-aware since 2026-11-23: "
                                  "GEMMs 0.6 of the peak with half dimension 8, 2.2 us dispatch per kernel, "
                                  "37 GB/s memory (bench --calibrate)"),
}

_FIELDS = {f.name: f.type for f in dataclasses.fields(HardwareProfile)}
_RATES = ("peak_flops_bf16", "peak_flops_fp32", "memory_bytes", "hbm_bandwidth", "intra_node_bandwidth",
          "inter_node_bandwidth", "gpus_per_node", "host_bandwidth", "nvme_bandwidth", "host_memory_bandwidth",
          "host_memory_bytes", "nvme_bytes")


def _coerce_fields(values: dict[str, Any], origin: str) -> dict[str, Any]:
    """Check names and types of profile fields, naming the bad one."""
    problems, out = [], {}
    for key, value in values.items():
        if key not in _FIELDS:
            problems.append(f"{origin}: unknown hardware field '{key}'; known: {', '.join(_FIELDS)}")
            continue
        kind = _FIELDS[key]
        try:
            if kind in ("int", int):
                value = int(float(value))
            elif kind in ("float", float):
                value = float(value)
            else:
                value = str(value)
        except (TypeError, ValueError, OverflowError):  # OverflowError: int() of an infinite float
            problems.append(f"{origin}: {key} = {value!r} is not a {'finite ' if kind in ('int', int) else ''}{kind}")
            continue
        if isinstance(value, (int, float)) and not (math.isfinite(value) and value >= 0):
            problems.append(f"{origin}: {key} = {value} must be a finite number >= 0")
        out[key] = value
    for key in _RATES:  # divided by: zero would be a step of infinite time (a ZeroDivisionError)
        if key in out and out[key] < 1:
            problems.append(f"{origin}: {key} = {out[key]}: a rate or size must be >= 1")
    for key in ("attention_fraction", "memory_fraction"):
        if key in out and not 0 < out[key] <= 1:
            problems.append(f"{origin}: {key} = {out[key]} must be in (0, 1]")
    if "gemm_half_dim" in out and out["gemm_half_dim"] > 2**20:  # larger underflows the GEMM curve to 0
        problems.append(f"{origin}: gemm_half_dim = {out['gemm_half_dim']}: at most 2**20 (a GEMM dimension)")
    if "achievable_fraction" in out and not 0 < out["achievable_fraction"] <= 1:
        problems.append(f"{origin}: achievable_fraction = {out['achievable_fraction']} must be in (0, 1]")
    if out.get("attention_kernel", "flash") not in ("flash", "unfused"):
        problems.append(f"{origin}: attention_kernel = {out['attention_kernel']!r} must be 'flash' or 'unfused'")
    if out.get("device", "cuda") not in ("cuda", "cpu"):
        problems.append(f"{origin}: device = {out['device']!r} must be 'cuda' or 'cpu'")
    if "weight_grad_fraction" in out and not 0 < out["weight_grad_fraction"] < 1:
        problems.append(f"{origin}: weight_grad_fraction = {out['weight_grad_fraction']} must be in (0, 1)")
    for key in ("reduce_scatter_efficiency", "all_gather_efficiency"):
        if key in out and not 0 < out[key] <= 1:
            problems.append(f"{origin}: {key} = {out[key]} must be in (0, 1]")
    if "comm_overlap" in out and not 0 <= out["comm_overlap"] <= 1:
        problems.append(f"{origin}: comm_overlap = {out['comm_overlap']} must be in [0, 1]")
    if problems:
        raise ConfigError(problems)
    return out


def sharing_cores(profile: HardwareProfile, share: float) -> HardwareProfile:
    """The profile as one of several CPU ranks on one host sees it, each getting ``share`` of a
    core (cores / ranks, or ``calibrate.measure_shared_rate``): a rank that gets half a core runs
    everything at half speed, its GEMMs, its memory-bound kernels and its per-kernel dispatch alike.
    Profiles hold one rank's rates (``calibrate`` measures them with one thread)."""
    if share >= 1:
        return profile
    return dataclasses.replace(profile, peak_flops_fp32=profile.peak_flops_fp32 * share,
                               peak_flops_bf16=profile.peak_flops_bf16 * share,
                               peak_flops_fp8=profile.peak_flops_fp8 * share,
                               hbm_bandwidth=profile.hbm_bandwidth * share,
                               op_overhead_s=profile.op_overhead_s / share,
                               recompute_op_overhead_s=profile.recompute_op_overhead_s / share)


def usable_cores() -> int:
    """The cores this process may run on (its affinity, which a cgroup or taskset narrows)."""
    import os

    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def host_share(ranks_on_host: int, cores: int | None = None) -> float:
    """The share of a core each of ``ranks_on_host`` single-threaded ranks gets: min(1, cores / ranks)."""
    return min(1.0, (cores or usable_cores()) / max(1, ranks_on_host))


def get_profile(name: str) -> HardwareProfile:
    if name not in PRESETS:
        import difflib

        # 'h100', 'H100-80G', 'a100': the preset of that chip, when one is named so
        lowered = name.lower()
        starts = [p for p in PRESETS if p.startswith(lowered)] if lowered else []
        close = starts or difflib.get_close_matches(lowered, list(PRESETS), n=1, cutoff=0.7)  # not tpu: cpu
        hint = ("did you mean " + " or ".join(f"'{c}'" for c in close) + "? ") if close else ""
        raise ConfigError(f"--hardware = '{name}': unknown; {hint}presets: {', '.join(PRESETS)} "
                          f"(or --hardware-file PATH)")
    return PRESETS[name]


def load_profile(path: str | Path) -> HardwareProfile:
    """A profile from a TOML or JSON file; ``base = "h100-80g"`` fills the fields it leaves out."""
    path = Path(path)
    try:
        text = path.read_bytes()
        data = json.loads(text) if path.suffix == ".json" else tomllib.loads(text.decode())
    except FileNotFoundError:
        raise ConfigError(f"--hardware-file '{path}' does not exist") from None
    except OSError as e:  # a folder, no permission, a device
        raise ConfigError(f"--hardware-file '{path}' cannot be read: {e.strerror or e}") from None
    except (ValueError, UnicodeDecodeError) as e:  # JSONDecodeError and TOMLDecodeError are ValueErrors
        raise ConfigError(f"--hardware-file '{path}' is not valid {path.suffix[1:] or 'TOML'}: {e}") from None
    if not isinstance(data, dict):
        raise ConfigError(f"--hardware-file '{path}' must hold a table of fields")
    data = dict(data.get("hardware", data))
    base = data.pop("base", None)
    values = _coerce_fields(data, f"--hardware-file {path}")
    if base is not None:
        if str(base) not in PRESETS:
            raise ConfigError(f"--hardware-file {path}: base = {base!r} is not a preset; presets: {', '.join(PRESETS)}")
        return dataclasses.replace(get_profile(str(base)), **values)
    missing = [f.name for f in dataclasses.fields(HardwareProfile)
               if f.name not in values and f.default is dataclasses.MISSING]
    if missing:
        raise ConfigError(f"--hardware-file {path}: missing {', '.join(missing)} (or give base = 'h100-80g')")
    return HardwareProfile(**values)


def save_profile(profile: HardwareProfile, path: str | Path) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(profile.to_dict(), indent=1) + "\n")
    return path


# -- calibration -------------------------------------------------------------------------------------
def measure_matmul_flops(size: int, dtype_name: str = "fp32", repeats: int = 3) -> float:
    """FLOP/s of a ``size``^3 matmul on this machine's CPU/GPU (the median of ``repeats``: the
    rate runs sustain on a shared machine, see ``calibrate._median_seconds``)."""
    import torch

    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[dtype_name]
    device = "cuda" if torch.cuda.is_available() else "cpu"
    a = torch.randn(size, size, device=device).to(dtype)
    b = torch.randn(size, size, device=device).to(dtype)
    times = []
    for _ in range(repeats + 1):  # the first call warms up kernels and caches
        if device == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        torch.mm(a, b)
        if device == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    return 2 * size**3 / statistics.median(times[1:])


def calibrate(output: str | Path | None = None, matmul_size: int = 1024, bf16_size: int = 256,
              comm_ranks: int = 2, comm_bytes: int = 16 * MIB, measure_comm: bool = True,
              base: HardwareProfile | None = None, split_stage: dict[str, int] | None = None,
              threads: int | None = 1, comm_trials: int = 3, comm_burst_s: float = 50e-3) -> HardwareProfile:
    """Measure this machine and return (and, with ``output``, write) a profile.

    On a CPU the rates are one rank's, measured with ``threads`` intra-op threads (1: what a rank
    started by torchrun runs, ``OMP_NUM_THREADS=1``; None: torch's current setting). The planner
    gives each rank the profile's rate, so a profile taken with every core would count the cores
    once per rank.

    Peaks are set to the measured rates with ``achievable_fraction = 1``: the measurement already
    is what a matmul achieves here. Memory and anything not measured come from ``base`` (the cpu
    preset unless given). Links inside a node are the measured all-reduce; across nodes keep base's.
    ``weight_grad_fraction`` is measured on a pipeline stage shaped by ``split_stage`` (keyword
    arguments of ``weight_grad.measure_backward_split``; its defaults if None). ``comm_trials``:
    separate measurements of the collectives, their median kept (:func:`measure_collectives`);
    ``comm_burst_s``: the compute between two collectives when their latency after compute is
    measured (``burst_s`` there: a CPU micro-batch's forward; a test shortens it).
    """
    import torch

    from bigtrain.plan.calibrate import (fit_gemm_curve, intra_op_threads, measure_attention_fraction, measure_gemms,
                                         measure_memory_bandwidth, measure_op_overhead, measure_recompute_overhead)
    from bigtrain.plan.calibrate_comm import measure_collectives
    from bigtrain.plan.weight_grad import measure_backward_split

    cpu = not torch.cuda.is_available()
    base = base or PRESETS["cpu"]
    source = [f"bigtrain bench --calibrate on {time.strftime('%Y-%m-%d')}: matmul {matmul_size}^3 fp32, "
              f"{bf16_size}^3 bf16" + (f", {threads} intra-op thread(s) per rank" if cpu and threads else "")]
    with intra_op_threads(threads if cpu else None):
        values: dict[str, Any] = {"name": "calibrated", "achievable_fraction": 1.0, "device": "cpu" if cpu else "cuda",
                                  "peak_flops_fp32": measure_matmul_flops(matmul_size, "fp32", repeats=10),
                                  "peak_flops_bf16": measure_matmul_flops(bf16_size, "bf16", repeats=1)}
        if not cpu:
            values["memory_bytes"] = torch.cuda.get_device_properties(0).total_memory
        if measure_comm and comm_ranks > 1:
            rates = measure_collectives(comm_ranks, comm_bytes, burst_s=comm_burst_s, trials=comm_trials)
            values.update(rates.profile_fields())
            source.append(rates.describe(comm_ranks, comm_bytes))
        points = measure_gemms("fp32", repeats=10)
        fraction, half_dim = fit_gemm_curve(points, values["peak_flops_fp32"])
        values.update(gemm_fraction=fraction, gemm_half_dim=half_dim, op_overhead_s=measure_op_overhead(),
                      recompute_op_overhead_s=measure_recompute_overhead() if cpu else 0.0)
        source.append(f"GEMM curve fitted to {len(points)} fp32 shapes (plan/calibrate.py): gemm_fraction "
                      f"{fraction:.2f}, gemm_half_dim {half_dim:g}; op overhead {values['op_overhead_s'] * 1e6:.1f} us, "
                      f"recomputation overhead {values['recompute_op_overhead_s'] * 1e6:.1f} us per kernel")
        if cpu:  # a GPU's HBM rate is the preset's published figure
            values["hbm_bandwidth"] = measure_memory_bandwidth()
            source.append(f"element-wise memory bandwidth {values['hbm_bandwidth'] / 1e9:.1f} GB/s "
                          f"(32 MiB fp32 tensors)")
            values["attention_fraction"] = measure_attention_fraction(values["peak_flops_fp32"])
            source.append(f"flash attention (CPU kernel, 4 x 2048 x 32) at {values['attention_fraction']:.2f} of the matmul peak")
        split = measure_backward_split(**(split_stage or {}))
    values["weight_grad_fraction"] = split.weight_grad_fraction
    source.append(f"split backward: {split.describe()}")
    values["source"] = "; ".join(source)
    profile = dataclasses.replace(base, **values)
    if output is not None:
        save_profile(profile, output)
    return profile


# The chip in torch.cuda.get_device_name's text -> its presets; the first key found wins (GH200 is an
# H200's HBM beside a Grace CPU: its H100 chip, as the H200's).
_GPU_CHIPS = {"H200": ("h200-141g",), "H100": ("h100-80g",), "A100": ("a100-40g", "a100-80g")}
UNKNOWN_GPU = "h100-80g"  # a chip the presets do not know: the one bigtrain's plans default to


def hardware_of(device_name: str, total_memory: int) -> str:
    """The preset of a CUDA device: its chip's from its name, of the memory nearest ``total_memory``
    (an A100 of 80 GB is "A100-SXM4-80GB" or "A100 80GB PCIe", an H100 NVL has 94 GB: the name's
    form does not say); a chip no preset describes: ``UNKNOWN_GPU``."""
    chip = next((presets for key, presets in _GPU_CHIPS.items() if key in device_name.upper()), (UNKNOWN_GPU,))
    return min(chip, key=lambda name: abs(PRESETS[name].memory_bytes - total_memory))


def local_hardware(without_gpu: str = "cpu") -> str:
    """The preset that matches this machine's accelerator (``without_gpu`` without one)."""
    import torch

    if not torch.cuda.is_available():
        return without_gpu
    return hardware_of(torch.cuda.get_device_name(0), torch.cuda.get_device_properties(0).total_memory)
