"""Device placement: every tensor handed to a collective and every bookkeeping tensor (gradient-norm
sums and the overflow flag, loss sums, memory figures, the save barrier, check's verdict, pipeline
shape messages, layout checks) lives on the model's device. NCCL accepts device tensors only, and
Gloo accepts anything, so on CPU nothing would notice a slip: ``DeviceWatch`` (tests/device_watch.py)
also flags tensors that bigtrain creates without naming a device and host copies (``.cpu()``)
handed to a collective, which is what such a slip looks like on a CPU.

Multi-rank layouts run on Gloo with the expected device "cpu". The single-rank tests take a
``torch.device``: "cpu" always, "cuda" when a GPU is present (marked ``gpu``; scripts/test-gpu.sh
runs them), where the same watch checks "cuda" and the run is compared with the independent
reference on the same device.
"""

from pathlib import Path

import pytest
import torch

from bigtrain.check.compare import TOLERANCES
from bigtrain.check.run import check_layout
from bigtrain.distributed.mesh import Mesh
from bigtrain.testing import run_ranks
from bigtrain.train import Trainer
from device_watch import BIGTRAIN_DIR, DeviceWatch
from helpers import tiny_config

DEVICES = [pytest.param("cpu", id="cpu"),
           pytest.param("cuda", id="cuda", marks=[pytest.mark.gpu, pytest.mark.skipif(
               not torch.cuda.is_available(), reason="no CUDA device")])]

# compile.enabled = 'auto' compiles on CUDA: the cuda cases would each compile the model (one
# inductor compile per precision and stage, its Triton kernels built one at a time in this process:
# tests/conftest.py), within scripts/gpu-check.sh's 150 s for the lane (on the H200, 2026-11-27, the
# lane needed a rerun with a longer limit, the two fp8 cases 38 s each), and run DeviceWatch's
# function mode under dynamo. They test placement, parity, resume and freeing in eager mode, as on
# the CPU; the cases named "compiled" test compiling on the device.
EAGER = ["--compile.enabled=false"]
SMALL = ["--train.global_batch=4", "--train.micro_batch=2", *EAGER]
LAYOUTS = {
    "dp2-zero0-fp32": ["--parallel.dp=2"],  # bucketed DataParallel + ReplicatedEngine
    "dp2-zero0-bf16": ["--parallel.dp=2", "--precision.mode=bf16"],
    "dp2-zero1-bf16": ["--parallel.dp=2", "--parallel.zero=1", "--precision.mode=bf16"],
    "dp2-zero2-fp16": ["--parallel.dp=2", "--parallel.zero=2", "--precision.mode=fp16"],  # loss scaler
    "dp2-zero3-bf16": ["--parallel.dp=2", "--parallel.zero=3", "--precision.mode=bf16"],
    "tp2": ["--parallel.tp=2", "--parallel.sequence_parallel=true"],
    "pp2-tied": ["--parallel.pp=2", "--model.tie_embeddings=true", "--train.micro_batch=1"],
}


def _exercise(trainer: Trainer, steps: int) -> list:
    """The paths that hand tensors to collectives: steps with memory figures, and a checkpoint save
    (full state gathered over dp / tp / pp, then the barrier)."""
    results = [trainer.train_step(measure=True) for _ in range(steps)]
    trainer.save()
    return results


def _watched(rank, world_size, cfg, run_dir, device, check_steps):
    with DeviceWatch(device) as watch:
        mesh = Mesh.from_config(cfg.parallel, rank, world_size)
        _exercise(Trainer(cfg, Path(run_dir) / "train", mesh, device), steps=2)
        report = check_layout(cfg, mesh, Path(run_dir) / "check", check_steps, device) if check_steps else None
    return watch.problems, watch.checked, report


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_collectives_and_bookkeeping_stay_on_the_device(layout, corpus_cache, tmp_path):
    cfg = tiny_config(corpus_cache, *SMALL, *LAYOUTS[layout])
    check_steps = 1 if layout in ("dp2-zero3-bf16", "tp2") else 0  # check's verdict and gathers too
    results = run_ranks(_watched, cfg.parallel.world_size, cfg, str(tmp_path), "cpu", check_steps, timeout=240)
    for rank, (problems, checked, _) in enumerate(results):
        assert checked > 0, f"rank {rank}: the watch saw no collective"
        assert not problems, f"rank {rank}:\n" + "\n".join(dict.fromkeys(problems))
    if check_steps:
        assert results[0][2].agree, results[0][2].text()


def test_the_watch_catches_a_host_tensor_and_a_host_copy():
    """The mutations the watch exists for: a flag made without a device, and a ``.cpu()`` copy, each
    handed to a collective (a group of one rank: the call is checked, nothing is sent)."""
    comm = Mesh({}).comm("dp")
    with DeviceWatch("cpu") as watch:
        comm.all_reduce(torch.zeros(1, device="cpu"), tag="fine")
    assert watch.problems == [] and watch.checked == 1
    # A bookkeeping tensor made without a device, as if by a line of bigtrain (the factory check
    # looks only at bigtrain's own code).
    barrier = compile("comm.all_reduce(torch.zeros(1), tag='barrier')", BIGTRAIN_DIR + "mutation.py", "exec")
    with DeviceWatch("cpu") as watch:
        exec(barrier, {"comm": comm, "torch": torch})
        comm.all_reduce(torch.ones(3, device="cpu").cpu() * 2, tag="host copy")
        comm.all_reduce(torch.ones(3, device="cpu").cpu().to("cpu"), tag="placed again")
    assert len(watch.problems) == 2, watch.problems
    assert "torch.zeros without a device" in watch.problems[0] and "host copy" in watch.problems[1]
    if torch.cuda.is_available():
        with DeviceWatch("cuda") as watch:
            comm.all_reduce(torch.zeros(1, device="cpu"))
        assert "expected cuda" in watch.problems[0]


# -- one device, one rank ------------------------------------------------------------------------
STAGES = {"zero0-fp32": ["--parallel.zero=0"], "zero0-bf16": ["--precision.mode=bf16"],
          "zero1-bf16": ["--parallel.zero=1", "--precision.mode=bf16"],
          "zero2-fp16": ["--parallel.zero=2", "--precision.mode=fp16"],
          "zero3-bf16": ["--parallel.zero=3", "--precision.mode=bf16"]}


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("stage", list(STAGES))
def test_one_rank_steps_keep_everything_on_the_device(stage, device, corpus_cache, tmp_path):
    cfg = tiny_config(corpus_cache, *SMALL, *STAGES[stage])
    with DeviceWatch(device) as watch:
        trainer = Trainer(cfg, tmp_path, Mesh({}), device)
        results = _exercise(trainer, steps=2)
    assert watch.checked > 0
    assert not watch.problems, "\n".join(dict.fromkeys(watch.problems))
    assert all(p.device.type == torch.device(device).type for p in trainer.model.parameters())
    assert all(r.loss > 0 and r.grad_norm > 0 and not r.skipped for r in results)


PARITY = {"fp32": [], "bf16-zero0": ["--precision.mode=bf16"],
          "bf16-zero3": ["--precision.mode=bf16", "--parallel.zero=3"],
          "bf16-compiled": ["--precision.mode=bf16", "--compile.enabled=true"]}


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("recipe", list(PARITY))
def test_one_device_run_matches_the_reference_on_that_device(recipe, device, corpus_cache, tmp_path):
    """The trainer on one device against the independent reference on the same device, in the same
    precision: same kernels on both sides, so the precision's tolerance (bf16: loss within 1e-3 and
    every weight within 1e-2 relative at every step) measures the trainer, not the hardware.
    ``bf16-compiled``: the blocks compiled on the device (compile.enabled's default there), against the
    eager reference at the same bf16 bounds a compiled layout is held to on the CPU: inductor's fused
    kernels round bf16 in other places, as another layout's reduction order does; a region falling
    back to eager fails the case."""
    import warnings

    from bigtrain.parallel.compile import CompileFallbackWarning

    if recipe.endswith("compiled") and device == "cpu":
        pytest.skip("compiling on the CPU is tests/test_compile.py's: the GPU's case")
    cfg = tiny_config(corpus_cache, *SMALL, *PARITY[recipe])
    with warnings.catch_warnings():
        warnings.simplefilter("error", CompileFallbackWarning)  # run eagerly, it would prove nothing
        report = check_layout(cfg, Mesh({}), tmp_path, steps=4, device=device)
    assert report.agree, report.text()
    assert report.tolerance == TOLERANCES[cfg.precision.mode]


RESUME = {"zero1-fp32": ["--parallel.zero=1"], "zero3-bf16": ["--parallel.zero=3", "--precision.mode=bf16"]}


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("recipe", list(RESUME))
def test_a_one_device_run_resumes_where_it_stopped(recipe, device, corpus_cache, tmp_path):
    """A checkpoint saved on the device (gathered to host copies) loads back onto it: the optimizer
    state, the step count and the weights continue the same loss curve (exactly on the CPU; within
    the precision's tolerance on a GPU, whose attention backward may add in any order)."""
    cfg = tiny_config(corpus_cache, *SMALL, *RESUME[recipe])
    straight = Trainer(cfg, tmp_path / "straight", Mesh({}), device)
    expected = [straight.train_step().loss for _ in range(4)]
    first = Trainer(cfg, tmp_path / "resumed", Mesh({}), device)
    for _ in range(2):
        first.train_step()
    first.save()
    again = Trainer(cfg, tmp_path / "resumed", Mesh({}), device)
    assert again.resume("auto") and again.step == 2
    resumed = [again.train_step().loss for _ in range(2)]
    rtol = 1e-6 if device == "cpu" else TOLERANCES[cfg.precision.mode].loss
    torch.testing.assert_close(torch.tensor(resumed), torch.tensor(expected[2:]), rtol=rtol, atol=0)


FREED = {"zero0-bf16": ["--precision.mode=bf16"],
         "zero0-bf16-compiled": ["--precision.mode=bf16", "--compile.enabled=true"],
         "zero3-bf16": ["--parallel.zero=3", "--precision.mode=bf16"],
         "zero1-offload": ["--parallel.zero=1", "--offload.optimizer=cpu"],
         "fp8-emulated": ["--precision.mode=bf16", "--precision.fp8=rowwise", "--precision.fp8_emulate=true"]}
FREED_RANKS = {"dp2-zero0": ["--parallel.dp=2"], "dp2-zero3-bf16": ["--parallel.dp=2", "--parallel.zero=3"],
               "tp2": ["--parallel.tp=2", "--parallel.sequence_parallel=true"],
               "pp2": ["--parallel.pp=2", "--train.micro_batch=1"]}
WORKSPACE_SLACK = 64 * 2**20  # cuBLAS / cuDNN workspaces the caching allocator keeps for the stream


def test_the_cuda_cases_compile_only_where_their_name_says(corpus_cache):
    """compile.enabled = 'auto' compiles on CUDA: every single-device case pins it, so that on a GPU
    only the cases named "compiled" compile (see EAGER)."""
    from bigtrain.from_config import compile_enabled

    for cases in (STAGES, PARITY, RESUME, FREED):
        for name, flags in cases.items():
            cfg = tiny_config(corpus_cache, *SMALL, *flags)
            assert compile_enabled(cfg, "cuda", family_compiles=True) == name.endswith("compiled"), name


def _holders(obj, depth: int = 3) -> list[str]:
    """Who keeps ``obj`` alive, ``depth`` levels up: the failure message of a leak."""
    import gc

    lines, frontier, seen = [], [(obj, 0)], {id(obj)}
    while frontier:
        o, level = frontier.pop()
        for r in gc.get_referrers(o):
            if id(r) in seen or level >= depth or type(r).__name__ == "frame":
                continue
            seen.add(id(r))
            lines.append("  " * level + f"{type(r).__module__}.{type(r).__qualname__}: {str(r)[:120]!r}")
            frontier.append((r, level + 1))
    return lines[:60]


def _still_alive(make_trainer) -> str:
    """Build a trainer, take two steps, delete it: '' when nothing of it stays alive, else who
    holds it (the trainer or its first weight)."""
    import gc
    import weakref

    trainer = make_trainer()
    for _ in range(2):
        trainer.train_step()
    refs = {"the trainer": weakref.ref(trainer), "its first weight": weakref.ref(next(trainer.model.parameters()))}
    del trainer
    gc.collect()
    for what, ref in refs.items():
        if ref() is not None:
            return f"{what} is still referenced after the trainer was deleted:\n" + "\n".join(_holders(ref()))
    return ""


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("recipe", list(FREED))
def test_a_deleted_trainer_frees_its_memory(recipe, device, corpus_cache, tmp_path):
    """A library runs several trainers in one process (a notebook, a benchmark of variants, a test
    suite): once a trainer is deleted, nothing of it stays alive, and on a GPU the memory it
    allocated is free again. A deleted llama-1b trainer left 16.4 GiB allocated on an H200
    (benchmarks/bench_gpu.py, 2026-11-27): the engine's gradient hooks, held by the parameters,
    referenced the engine (bigtrain/parallel/grad_hooks.py)."""
    import gc

    if recipe.endswith("compiled") and device == "cpu":
        pytest.skip("compiling on the CPU costs the lane more than this case adds: the GPU's case")
    cfg = tiny_config(corpus_cache, *SMALL, *FREED[recipe])
    gc.collect()
    base = torch.cuda.memory_allocated() if device == "cuda" else 0
    problem = _still_alive(lambda: Trainer(cfg, tmp_path, Mesh({}), device))
    assert not problem, problem
    if device == "cuda":
        left = torch.cuda.memory_allocated() - base
        assert left <= WORKSPACE_SLACK, f"{left / 2**20:.1f} MiB still allocated after the trainer was deleted"


def _freed_on_rank(rank: int, world_size: int, cfg, run_dir: str) -> str:
    mesh = Mesh.from_config(cfg.parallel, rank, world_size)
    return _still_alive(lambda: Trainer(cfg, Path(run_dir), mesh, "cpu"))


@pytest.mark.parametrize("layout", list(FREED_RANKS))
def test_a_deleted_trainer_frees_its_memory_on_every_rank(layout, corpus_cache, tmp_path):
    """The same on two Gloo ranks: the data-parallel buckets' hooks, ZeRO-3's gathers, tp's and
    the pipeline's stages."""
    cfg = tiny_config(corpus_cache, *SMALL, *FREED_RANKS[layout])
    for rank, problem in enumerate(run_ranks(_freed_on_rank, cfg.parallel.world_size, cfg, str(tmp_path), timeout=240)):
        assert not problem, f"rank {rank}: {problem}"
