"""Shared builders for the tests: tiny configs and single-process references."""

from __future__ import annotations

import contextlib
from pathlib import Path

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from bigtrain.config import Config, load_config
from bigtrain.distributed.mesh import Mesh
from bigtrain.train import Trainer
from bigtrain.validation import validate

CORPUS_BYTES = 400_000


def stdlib_texts(count: int) -> list[str]:
    """The first ``count`` standard-library modules' text: the same on every run of this machine's Python."""
    import sysconfig

    files = sorted(Path(sysconfig.get_paths()["stdlib"]).glob("*.py"))[:count]
    return [f.read_bytes().decode("utf-8", errors="replace") for f in files]


def byte_level_bpe(vocab: int, special: list[str], texts: list[str]):
    """A ``tokenizers`` byte-level BPE of ``vocab`` ids with ``special`` tokens, trained on ``texts``."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  special_tokens=special, show_progress=False)
    tok.train_from_iterator(texts, trainer)
    return tok


def tiny_config(cache_dir: str, *overrides: str) -> Config:
    """The tiny preset on a small stdlib corpus, no progress bar, logging off."""
    base = ["--logging.progress=false", "--logging.report=false", f"--data.cache_dir={cache_dir}",
            f"--data.max_bytes={CORPUS_BYTES}", "--checkpoint.save_final=false"]
    cfg = load_config(preset="tiny", overrides=base + list(overrides))
    validate(cfg)
    return cfg


def warm_compiler() -> None:
    """Compile one small function in this process before forking ranks that compile: they inherit
    inductor's imports and its once-a-process set-up (its key of torch's sources, the CPU's vector
    instruction set, the check of the precompiled header) instead of each paying it again."""
    from bigtrain.parallel.compile import compiled_function

    x = torch.ones(8, requires_grad=True)
    compiled_function(lambda t: (t * 2).sin())(x).sum().backward()


def trainer_on_rank(rank: int, world_size: int, cfg: Config, run_dir: str) -> Trainer:
    mesh = Mesh.from_config(cfg.parallel, rank, world_size)
    return Trainer(cfg, Path(run_dir), mesh)


def save_after_steps(rank: int, world_size: int, cfg: Config, run_dir: str, steps: int) -> None:
    """On one rank (``run_ranks``): train ``steps`` steps, then save a checkpoint."""
    trainer = trainer_on_rank(rank, world_size, cfg, run_dir)
    for _ in range(steps):
        trainer.train_step()
    trainer.save()


def run_steps(trainer: Trainer, steps: int) -> list[float]:
    return [trainer.train_step().loss for _ in range(steps)]


def params_of(trainer: Trainer) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in trainer.model.named_parameters()}


def assert_rel_close(actual: torch.Tensor, expected: torch.Tensor, rtol: float, what: str = "") -> None:
    """||actual - expected|| <= rtol ||expected||: relative error of the whole tensor, so an element
    that Adam moved to within 1e-7 of zero does not make the comparison meaningless."""
    actual, expected = actual.detach(), expected.detach()  # outputs of a module under test carry autograd
    err = float(torch.linalg.vector_norm((actual - expected).double()))
    scale = float(torch.linalg.vector_norm(expected.double()))
    assert err <= rtol * scale, f"{what}: relative error {err / max(scale, 1e-30):.3e} > {rtol:.0e}"


def lose_one_ranks_gradients(unit_name: str, rank: int):
    """A ``ZeroEngine._reduce`` with a fault in one unit's gradient reduction: ``rank``'s gradients
    of that unit never arrive (monkeypatch it in; forked ranks inherit it)."""
    from bigtrain.parallel.zero.engine import ZeroEngine

    original = ZeroEngine._reduce

    def faulty(self, unit):
        if unit.name == unit_name and self.comm.rank == rank:
            for p in unit.params:
                if p.grad is not None:
                    p.grad.zero_()
        return original(self, unit)

    return faulty


def descendant_pids(pid: int) -> list[int]:
    """Every process below ``pid`` (children, their children, ...), read from /proc."""
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
            except OSError:
                continue
            children.setdefault(int(fields[1]), []).append(int(entry.name))
    found, todo = [], [pid]
    while todo:
        kids = children.get(todo.pop(), [])
        found += kids
        todo += kids
    return found


@contextlib.contextmanager
def compiled_once_for_all_ranks(marker_dir: str | Path, timeout_s: float = 120.0):
    """While open, ranks forked by ``run_ranks`` whose compiled graphs are the same, in the same
    order (data, tensor, sequence, expert and context parallel ranks; not pipeline stages), build
    each graph once: every rank but the first waits until rank 0 has compiled its n-th graph, then
    reads it from inductor's FX graph and AOT autograd caches (as a real run's torchrun ranks share
    them) instead of lowering it again. From an empty cache, as CI starts, the ranks lowered every
    graph side by side; only the kernels' g++ builds were shared (inductor's file lock). g++ is
    most of a cold compile, the lowering the rest (the warm-up test of test_compile.py: 56.5 s of
    CPU cold, 19.7 s with every kernel built but no FX graph or AOT entry cached, 13.5 s with all
    cached). The five compiled two-rank tests that use it: 220 -> 198 s of CPU. Every rank
    still runs compiled graphs and is checked as before; a rank's graph that differs from rank 0's
    has another cache key and compiles itself. A rank that finds no marker within ``timeout_s``
    compiles on its own (slower, never wrong)."""
    import itertools
    import time

    import torch._inductor.compile_fx as compile_fx_module
    import torch.distributed as dist

    marker_dir = Path(marker_dir)
    marker_dir.mkdir(parents=True, exist_ok=True)
    original = compile_fx_module.compile_fx
    graphs = itertools.count()
    inside = []  # compile_fx calls itself (with its config patches applied): one graph, one marker

    def compile_fx(*args, **kwargs):
        if inside:
            return original(*args, **kwargs)
        n = next(graphs)
        rank = dist.get_rank() if dist.is_available() and dist.is_initialized() else 0
        marker = marker_dir / f"graph-{n}"
        if rank > 0:
            deadline = time.monotonic() + timeout_s
            while not marker.exists() and time.monotonic() < deadline:
                time.sleep(0.05)
        inside.append(n)
        try:
            return original(*args, **kwargs)
        finally:
            inside.pop()
            if rank == 0:
                marker.touch()

    compile_fx_module.compile_fx = compile_fx
    try:
        yield
    finally:
        compile_fx_module.compile_fx = original


class GemmFlops(TorchDispatchMode):
    """While active, counts the FLOPs of the matrix multiplies dispatched (mm, addmm, bmm: 2 m n k
    each) in ``flops``: what the planner's time model prices, counted from what runs."""

    GEMMS = {torch.ops.aten.mm.default, torch.ops.aten.addmm.default, torch.ops.aten.bmm.default}

    def __init__(self):
        super().__init__()
        self.flops = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func in self.GEMMS:
            a, b = args[-2], args[-1]
            self.flops += 2 * a.numel() * b.shape[-1]
        return func(*args, **(kwargs or {}))

