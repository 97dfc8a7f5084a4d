"""Will this run fit this machine? The planner's memory model, asked before launch.

``bigtrain train`` builds the model and allocates on every rank only after the launch; a model
of 10^9 layers or a micro-batch of 10^9 sequences would end in the kernel's OOM killer (no
message on CPU) or a long stall instead of an error. :func:`size_problems` asks the planner
(``memory.py``: model states byte for byte, saved activations, buffers, the allocator allowance)
for the worst rank's bytes, adds the two host-side allocations the planner leaves out because they
are negligible in sane configs (the rotary tables of ``model.max_seq_len`` positions and the
sampler's per-step arrays of ``train.global_batch`` entries), and compares with this machine: on
CPU every local rank shares the host's memory, on CUDA each rank has its device.

A run the estimate puts above the memory is rejected (the model states are exact; activations are
the measured saved tensors, so a larger true peak only makes it worse); above 80% it is a warning.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass, field
from pathlib import Path

from bigtrain.config import Config

WARN_FRACTION = 0.8
# Above this many blocks the per-block estimate would build lists as long as the model: the
# closed-form model states decide alone (a model this deep is rejected by them on any machine).
EXACT_LAYERS_MAX = 100_000


def _size(nbytes: float) -> str:
    for unit, scale in (("EiB", 2**60), ("PiB", 2**50), ("TiB", 2**40), ("GiB", 2**30), ("MiB", 2**20),
                        ("KiB", 2**10)):
        if nbytes >= scale:
            value = nbytes / scale
            return f"{value:.3g} {unit}" if value < 1e4 else f"{value:.2e} {unit}"
    return f"{nbytes:.0f} B"


def host_memory() -> int:
    """This machine's memory as this process may use it (the cgroup limit when lower)."""
    total = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    for path in ("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory/memory.limit_in_bytes"):
        try:
            text = Path(path).read_text().strip()
        except OSError:
            continue
        if text.isdigit():
            total = min(total, int(text))
    return total


def machine_memory(cuda: bool) -> tuple[int, str]:
    if cuda:
        import torch

        return torch.cuda.get_device_properties(0).total_memory, "each GPU of this machine has"
    return host_memory(), "this machine has"


def _model_fields(cfg: Config) -> str:
    m = cfg.model
    ffn = f"model.ffn_hidden = {m.ffn_hidden}" + (f" (-> {m.ffn_dim})" if not m.ffn_hidden else "")
    return f"model.n_layers = {m.n_layers}, model.dim = {m.dim}, {ffn}, model.vocab_size = {m.vocab_size}"


def _offload_tiers(cfg: Config, cuda: bool) -> tuple[str, str]:
    """(offload.optimizer, offload.params) as the planner prices them on this machine's device. On a
    CPU device the host is the device: only the files (``nvme``) take bytes off it, and host
    memory is the run without offload, except for the delayed update, which keeps what a host step
    apart needs there too (a separate fp32 master and a second gradient, a third more optimizer
    state and as much again in gradients): its tiers price that (``tiers.tier_detail``, the host
    as the device)."""
    o = cfg.offload
    host_step_apart = o.delayed_update and o.optimizer == "cpu"
    return tuple(tier if cuda or tier == "nvme" or (host_step_apart and kind == "optimizer") else "none"
                 for kind, tier in (("optimizer", o.optimizer), ("params", o.params)))


def _off_device(tier: str, cuda: bool) -> bool:
    """Whether an offload tier takes bytes off this machine's device (on a CPU only the files do)."""
    return tier == "nvme" or (cuda and tier != "none")


def _layout(cfg: Config, cuda: bool = False):
    """The planner's layout of ``cfg`` on a CUDA device (``cuda``) or a CPU: offload's tiers as far as
    they leave this device, compile.enabled resolved as the runtime resolves it for that device."""
    from bigtrain.plan.layout import Layout

    p = cfg.parallel
    optimizer, params = _offload_tiers(cfg, cuda)
    return Layout(dp=p.dp, tp=p.tp, pp=p.pp, sp=p.sp, cp=p.cp, cp_mode=p.cp_mode, zero=p.zero, ep=p.ep,
                  micro_batch=cfg.train.micro_batch,
                  schedule=p.pp_schedule, v=p.pp_virtual, recompute=cfg.memory.checkpointing,
                  every=cfg.memory.checkpoint_every, tp_sp=p.sequence_parallel, precision=cfg.precision.mode,
                  offload=cfg.memory.activation_offload, compression=cfg.memory.activation_compression,
                  fused_loss=cfg.model.fused_loss, offload_optimizer=optimizer, offload_params=params,
                  fp8=cfg.precision.fp8, offload_masters=cfg.offload.masters if optimizer == "nvme" else "auto",
                  delayed_update=cfg.offload.delayed_update and optimizer != "none", dp_replicate=p.dp_replicate,
                  reshard_after_forward=p.reshard_after_forward, prefetch=p.prefetch, split=pipeline_split(cfg),
                  checkpoint_async=getattr(cfg.checkpoint, "async"), grad_clip=cfg.optim.grad_clip > 0,
                  compiled=runtime_compiles(cfg, "cuda" if cuda else "cpu"))


def pipeline_split(cfg: Config) -> tuple[int, ...]:
    """Where the run's pipeline stages start (the first block of stages 1..), as the runtime cuts
    them (parallel/pipeline/partition.py): parallel.pp_split, or for bigtrain's Llama with
    parallel.pp_balance = 'params' the cut balancing the plain model's parameters (the embedding on
    the first stage, the final norm and the output layer on the last); () for the even cut."""
    p = cfg.parallel
    stages = p.pp * p.pp_virtual
    if stages <= 1:
        return ()
    if p.split_points is not None:
        return tuple(p.split_points)
    return balanced_split(cfg, stages)


def stage_split(cfg: Config, pp: int, v: int) -> tuple[int, ...] | None:
    """:func:`pipeline_split` of ``cfg`` run with ``pp`` x ``v`` stages (what ``--parallel auto``
    prices for each layout it weighs); None where the run would refuse that many: a
    parallel.pp_split names the stages' starts, so it fixes their count."""
    p = cfg.parallel
    if p.split_points is not None:
        return tuple(p.split_points) if len(p.split_points) == pp * v - 1 else None
    try:
        return balanced_split(cfg, pp * v) if pp * v > 1 else ()
    except ValueError:  # more stages than blocks: the run refuses them too (the search's check names it)
        return ()


def balanced_split(cfg: Config, stages: int) -> tuple[int, ...]:
    """Without parallel.pp_split: the cut parallel.pp_balance makes of ``stages`` stages (() when even)."""
    if cfg.parallel.pp_balance != "params" or cfg.model.family != "llama":
        return ()
    from bigtrain.parallel.pipeline.partition import balanced_split_points, even_split_points
    from bigtrain.plan.model import ModelSpec

    spec = ModelSpec.from_model_config(cfg.model, cfg.data.seq_len)
    dense = sum(t.numel for t in spec.block_tensors())
    moe = sum(t.numel for t in spec.moe_block_tensors() + spec.expert_tensors()) if spec.experts else dense
    costs = [moe if spec.is_moe_block(i) else dense for i in range(spec.layers)]
    head = spec.hidden + spec.vocab * spec.hidden  # the final norm and the output (a tied one counted again)
    points = balanced_split_points(costs, stages, spec.vocab * spec.hidden, head)
    return () if points == even_split_points(spec.layers, stages) else tuple(points)


def runtime_compiles(cfg: Config, device_type: str) -> bool:
    """compile.enabled resolved as the runtime resolves it on a device of this type, for cfg's family."""
    from bigtrain.families.registry import family_of
    from bigtrain.from_config import compile_enabled

    return compile_enabled(cfg, device_type, family_of(cfg).compiles)


@dataclass
class SizeProblem:
    text: str
    layout_helps: bool  # another layout of the same model may fit (not the rotary tables, nor the sampler)


@dataclass
class SizeCheck:
    """What :func:`size_check` found, with the memory it compared against (``refit.py`` proposes a
    layout that fits the same ``capacity`` shared by ``sharing`` ranks)."""

    problems: list[SizeProblem] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)
    capacity: int = 0
    sharing: int = 1


def size_problems(cfg: Config, local_ranks: int = 1, cuda: bool = False,
                  nvme_dir: str | None = None) -> tuple[list[str], list[str]]:
    """(problems, warnings) comparing the planner's estimate of the run with this machine's memory
    (and, with offload, its host memory and the disk under ``nvme_dir``). ``refit.py``'s
    ``size_problems_and_fixes`` adds to a problem a layout that would fit."""
    check = size_check(cfg, local_ranks, cuda, nvme_dir)
    return [p.text for p in check.problems], check.warnings


def size_check(cfg: Config, local_ranks: int = 1, cuda: bool = False, nvme_dir: str | None = None) -> SizeCheck:
    """:func:`size_problems`, each problem saying whether another layout may solve it."""
    from bigtrain.plan.hardware import UNKNOWN_GPU, get_profile, local_hardware
    from bigtrain.plan.memory import estimate_memory
    from bigtrain.plan.states import zero_formula_bytes
    from bigtrain.plan.model import ModelSpec

    m, p, t, d = cfg.model, cfg.parallel, cfg.train, cfg.data
    capacity, has = machine_memory(cuda)
    sharing = 1 if cuda else max(1, local_ranks)
    found = SizeCheck(capacity=capacity, sharing=sharing)
    on_machine = f" x {sharing} ranks on this machine" if sharing > 1 else ""
    spec = ModelSpec.from_model_config(m, d.seq_len, device="cuda" if cuda else "cpu")
    optimizer = cfg.optim.name
    zero_group = p.dp // max(1, p.dp_replicate) * p.cp * p.sp  # HSDP: ZeRO cuts within one dp_shard x cp x sp group
    formula = zero_formula_bytes(spec.params / (p.tp * p.pp), p.zero, zero_group, cfg.precision.mode, optimizer)
    off_optimizer, off_params = (_off_device(tier, cuda) for tier in _offload_tiers(cfg, cuda))
    states = sum(v for k, v in formula.items()
                 if not (k == "optimizer" and off_optimizer) and not (k == "params" and off_params))
    if states * sharing > capacity:
        text = (f"{_model_fields(cfg)} make {spec.params:.3g} parameters: their weights, gradients and "
                f"optimizer state alone take {_size(states)} per rank (the planner's ZeRO formula at "
                f"parallel.zero = {p.zero}, {cfg.precision.mode}, {optimizer}){on_machine}, and {has} {_size(capacity)}; "
                f"make the model smaller, shard it (parallel.zero, parallel.tp, parallel.pp) or use more machines")
        # A model this deep: the per-block search would build lists as long as the model.
        found.problems.append(SizeProblem(text, layout_helps=m.n_layers <= EXACT_LAYERS_MAX))
        return found
    if m.n_layers > EXACT_LAYERS_MAX:
        return found
    try:
        # this GPU's profile (an H200's, not an H100's); a CUDA run planned on a machine without one: the default GPU's
        hardware = get_profile(local_hardware(without_gpu=UNKNOWN_GPU) if cuda else "cpu")
        mem = estimate_memory(spec, _layout(cfg, cuda), hardware, t.global_batch, optimizer=optimizer)
    except Exception:  # noqa: BLE001 - a layout the planner does not model is no reason to refuse a run
        return found
    tiers = offload_problems(cfg, mem, local_ranks, cuda, nvme_dir)
    if tiers:
        found.problems += [SizeProblem(text, layout_helps=False) for text in tiers]
        return found
    in_memory = memory_filesystem(nvme_dir) if mem.nvme and nvme_dir else None
    if in_memory:
        found.warnings.append(files_in_memory_warning(cfg, mem, nvme_dir, in_memory, sharing))
    parts = {
        "states": (mem.model_states, f"{_model_fields(cfg)} ({spec.params:.3g} parameters): weights, gradients "
                                     f"and optimizer state"),
        "activations": (mem.activations + sum(mem.buffers.values()),
                        f"train.micro_batch = {t.micro_batch} x data.seq_len = {d.seq_len} (with model.dim = {m.dim}, "
                        f"model.n_layers = {m.n_layers}, model.vocab_size = {m.vocab_size}, memory.checkpointing = "
                        f"'{cfg.memory.checkpointing}'): saved activations and buffers"),
        "allocator": (mem.allocator, "the per-process allowance of the planner's profile"),
        "rotary": (4 * m.max_seq_len * max(1, m.head_dim), f"model.max_seq_len = {m.max_seq_len}: the rotary "
                                                          f"tables (lower it to what data.seq_len needs)"),
        "sampler": (8 * t.global_batch * (1 + (3 * (d.seq_len + 1) if d.ignore_target >= 0 else 0)),
                    f"train.global_batch = {t.global_batch}: the sampler's per-step arrays"),
    }
    if not cuda and mem.detail.get("host_states"):  # the host is the device: offload's host tier is here too
        parts["states"] = (mem.model_states + mem.detail["host_states"], parts["states"][1])
    if not cuda and in_memory:  # and so are the files on a filesystem in memory
        parts["states"] = (parts["states"][0] + mem.nvme, parts["states"][1] + f" (with offload's files on "
                                                                                 f"offload.nvme_dir, a {in_memory})")
    extra = mem.detail.get("checkpoint_copies", 0) - parts["activations"][0]
    if not cuda and extra > 0:  # a save (between steps, no activation held) holds more than a step
        parts["checkpoint"] = (extra, "a checkpoint save's copies (the delayed update's weights in use, a chunk "
                                      "out of the files) beyond the activations of a step")
    per_rank = sum(nbytes for nbytes, _ in parts.values())
    need = per_rank * sharing
    if need <= WARN_FRACTION * capacity:
        return found
    big, (big_bytes, what) = max(parts.items(), key=lambda kv: kv[1][0])
    detail = ", ".join(f"{k} {_size(v)}" for k, (v, _) in parts.items())
    text = (f"{what} take {_size(big_bytes)} of the {_size(per_rank)} the planner estimates per rank ({detail})"
            f"{on_machine}, and {has} {_size(capacity)}")
    if need > capacity:
        fix = {"states": "make the model smaller or shard it (parallel.zero, parallel.tp, parallel.pp)",
               "activations": "lower train.micro_batch or data.seq_len, or set memory.checkpointing = 'full'",
               "allocator": "start fewer ranks (parallel.dp, parallel.tp, parallel.pp, parallel.sp)",
               "rotary": "lower model.max_seq_len", "sampler": "lower train.global_batch",
               "checkpoint": "set offload.delayed_update = false, or shard over more ranks (parallel.zero)"}[big]
        layout_helps = big in ("states", "activations", "allocator")  # not the rotary tables, nor the sampler
        found.problems.append(SizeProblem(f"{text}; {fix}", layout_helps))
        return found
    found.warnings.append(f"{text}: close to the limit ({need / capacity:.0%})")
    return found


def disk_free(path: str) -> int:
    """Free bytes on the file system that ``path`` (or its nearest existing parent) is on."""
    import shutil

    where = Path(path).absolute()
    while not where.exists() and where != where.parent:
        where = where.parent
    return shutil.disk_usage(where).free


MEMORY_FILESYSTEMS = ("tmpfs", "ramfs")  # their files are pages of the machine's memory


def _mounts() -> list[tuple[str, str]]:
    """(mount point, filesystem type) of this process's mounts (none where /proc is not Linux's)."""
    try:
        lines = Path("/proc/self/mounts").read_text().splitlines()
    except OSError:
        return []
    # A space in a mount point is written \040 (and a tab, newline, backslash alike).
    unescape = lambda field: re.sub(r"\\([0-7]{3})", lambda m: chr(int(m.group(1), 8)), field)  # noqa: E731
    return [(unescape(f[1]), f[2]) for f in (line.split() for line in lines) if len(f) >= 3]


def memory_filesystem(path: str) -> str | None:
    """The type of the filesystem ``path`` (or its nearest existing parent) is on, if it keeps its
    files in memory (tmpfs, ramfs: /dev/shm, often /tmp or /run); else None."""
    where = Path(path).absolute()
    while not where.exists() and where != where.parent:
        where = where.parent
    where = where.resolve()
    on = [(mount, kind) for mount, kind in _mounts() if where == Path(mount) or Path(mount) in where.parents]
    if not on:
        return None
    kind = max(on, key=lambda m: len(Path(m[0]).parts))[1]  # the innermost mount holds it
    return kind if kind in MEMORY_FILESYSTEMS else None


def files_in_memory_warning(cfg: Config, mem, nvme_dir: str, kind: str, ranks: int) -> str:
    on_machine = f" x {ranks} ranks on this machine" if ranks > 1 else ""
    return (f"offload.nvme_dir = '{nvme_dir}' is on a {kind} (a filesystem in memory): the {_size(mem.nvme)} of "
            f"offload's files per rank{on_machine} take host memory, not disk, and the size check counts them as "
            f"host memory; set offload.nvme_dir to a directory on a disk (an NVMe) to free that memory, or "
            f"offload.optimizer = 'cpu' (offload.params = 'cpu') to keep the states in memory without the files' "
            f"copies")


def offload_problems(cfg: Config, mem, local_ranks: int, cuda: bool, nvme_dir: str | None) -> list[str]:
    """Offload's tiers against this machine: on a GPU what every local rank keeps in host memory
    (the planner's host tier, byte for byte, and each process's ``host_reserved_bytes``) against
    the host's memory, and the files of every local rank against the disk under ``nvme_dir``."""
    o = cfg.offload
    if o.optimizer == "none" and o.params == "none":
        return []
    ranks = max(1, local_ranks)
    on_machine = f" x {ranks} ranks on this machine" if ranks > 1 else ""
    tiers = f"offload.optimizer = '{o.optimizer}', offload.params = '{o.params}'"
    problems = []
    held = mem.detail.get("tiers", {})
    # Files on a filesystem in memory (/dev/shm) are host memory too.
    in_memory = memory_filesystem(nvme_dir) if mem.nvme and nvme_dir else None
    files_in_memory = mem.nvme if in_memory else 0
    if cuda:
        need, have = (mem.host + files_in_memory) * ranks, host_memory()
        if need > have:
            what = ", ".join(f"{k} {_size(v)}" for k, v in held.get("host", {}).items() if v)
            files = (f", and its files on offload.nvme_dir = '{nvme_dir}' ({in_memory}, in memory) "
                     f"{_size(files_in_memory)}" if files_in_memory else "")
            problems.append(
                f"{tiers} keep {_size(mem.detail.get('host_states', 0))} per rank in host memory ({what}), plus "
                f"{_size(mem.host - mem.detail.get('host_states', 0))} for the process and offloaded activations"
                f"{files}{on_machine}: {_size(need)} of host memory needed, and this machine has {_size(have)}; put the "
                f"optimizer's state in files (offload.optimizer = 'nvme'), use smaller state (optim.name = "
                f"'adamw8bit'), or shard over more ranks on more machines (parallel.dp with parallel.zero >= 1)")
    if mem.nvme and nvme_dir:
        need, have = mem.nvme * ranks, disk_free(nvme_dir)
        if need > have:
            what = ", ".join(f"{k} {_size(v)}" for k, v in held.get("nvme", {}).items() if v)
            problems.append(f"{tiers} keep {_size(mem.nvme)} per rank in files ({what}){on_machine}: {_size(need)} "
                            f"needed under offload.nvme_dir = '{nvme_dir}', and its disk has {_size(have)} free; "
                            f"set offload.nvme_dir to a larger disk, or keep less in files (offload.optimizer = "
                            f"'cpu', offload.params = 'none')")
    return problems
