"""Layout search: enumerate valid layouts, drop those that do not fit, rank by throughput.

The space: every factorization gpus = dp x tp x pp x sp (tp at most a node, sp at most 8 and
dividing the heads), ZeRO 0-3 (only 0 without replicas to shard over), micro-batches 1-8, pipeline
schedules 1f1b / zb-h1 / interleaved with v = 2 or 4 (gpipe and naive hold more and run no faster
than 1f1b, so they are considered only when asked for), recomputation none / every 2nd / full,
and Megatron sequence parallelism on and off when tp > 1 (it should only save memory at the same
traffic, but the runtime's keeps more today: see docs/planner.md, Findings).
Keys the user fixed (``--layout dp=8,zero=1``) are kept; the planner chooses the rest. Memory is
evaluated first and only layouts that fit are timed; a layout whose model states alone exceed the
device is not estimated further (docs/planner.md, Speed of the search).
"""

from __future__ import annotations

import dataclasses
import itertools
from dataclasses import dataclass, field
from typing import Callable, Iterator

from bigtrain.config import ConfigError
from bigtrain.optim import get_optimizer
from bigtrain.plan.cost import StepTime, step_time
from bigtrain.plan.layout import Cluster, Layout, layout_problems
from bigtrain.plan.memory import RankMemory, add_skewed_routing, device_lower_bound, estimate_memory
from bigtrain.plan.model import ModelSpec
from bigtrain.plan.pipeline import PipelineModel

MICRO_BATCHES = (1, 2, 4, 8)
SCHEDULES = (("1f1b", 1), ("zb-h1", 1), ("interleaved", 2), ("interleaved", 4))
RECOMPUTES = ("none", "selective", "every", "full")
SplitRule = Callable[[int, int], "tuple[int, ...] | None"]  # (pp, v) -> where the run cuts (search's split_of)


@dataclass
class Plan:
    model: ModelSpec
    layout: Layout
    cluster: Cluster
    global_batch: int
    memory: RankMemory
    time: StepTime | None = None

    @property
    def fits(self) -> bool:
        return self.memory.fits

    @property
    def tokens_per_s(self) -> float:
        return self.time.tokens_per_s if self.time else 0.0

    def to_dict(self) -> dict:
        out = {"fits": self.fits, "params": self.model.params, "layout": self.layout.to_dict(),
               "layout_text": self.layout.describe(), "memory": self.memory.to_dict()}
        if self.time:
            out.update(step_time_s=self.time.step_time_s, tokens_per_s=self.time.tokens_per_s,
                       mfu=self.time.mfu, hfu=self.time.hfu, time=self.time.to_dict())
        return out


def evaluate(model: ModelSpec, layout: Layout, cluster: Cluster, global_batch: int,
             pipeline: PipelineModel | None = None, with_time: bool = True, optimizer: str = "adamw",
             block: int = 256) -> Plan:
    """Memory and (optionally) step time of one layout; raises ConfigError if it cannot run."""
    problems = layout_problems(layout, model, cluster, global_batch)
    if problems:
        raise ConfigError(problems)
    pipeline = pipeline or PipelineModel()
    memory = estimate_memory(model, layout, cluster.hardware, global_batch, pipeline, optimizer, block)
    add_skewed_routing(memory, model, layout, cluster.hardware, global_batch, pipeline, optimizer, block)
    time = step_time(model, layout, cluster, global_batch, pipeline) if with_time else None
    return Plan(model, layout, cluster, global_batch, memory, time)


def _divisors(n: int) -> list[int]:
    """The divisors of ``n`` in increasing order, in O(sqrt(n))."""
    small = [d for d in range(1, int(n ** 0.5) + 1) if n % d == 0]
    return small + [n // d for d in reversed(small) if d * d != n]


def _options(fixed: dict, key: str, choices) -> list:
    return [fixed[key]] if key in fixed else list(choices)


# Context parallelism is searched for sequences this long and more: below, a ring's hops cost more
# than the attention they split, and every cp choice multiplies the layouts the search prices.
CP_SEARCHED_FROM = 8192


def _cp_choices(model: ModelSpec, fixed: dict, room: int) -> list[int]:
    long = model.seq >= CP_SEARCHED_FROM
    return _options(fixed, "cp", [d for d in _divisors(room) if d == 1 or (long and d <= 8 and model.seq % (2 * d) == 0)])


def _mesh_shapes(model: ModelSpec, cluster: Cluster, fixed: dict) -> Iterator[tuple[int, int, int, int, int]]:
    gpus = cluster.gpus
    for tp in _options(fixed, "tp", [d for d in _divisors(gpus) if d <= cluster.gpus_per_node]):
        for sp in _options(fixed, "sp", [d for d in _divisors(gpus // tp) if d <= 8 and model.heads % d == 0]):
            if gpus % (tp * sp):
                continue
            for cp in _cp_choices(model, fixed, gpus // (tp * sp)):
                if gpus % (tp * sp * cp):
                    continue
                rest = gpus // (tp * sp * cp)
                for pp in _options(fixed, "pp", [d for d in _divisors(rest) if d <= model.layers]):
                    dp = rest // pp if rest % pp == 0 else 0
                    if dp and ("dp" not in fixed or fixed["dp"] == dp):
                        yield dp, tp, pp, sp, cp
    if {"dp", "tp", "pp", "sp"} <= set(fixed):  # a complete but inconsistent mesh: let validation name it
        yield fixed["dp"], fixed["tp"], fixed["pp"], fixed["sp"], fixed.get("cp", 1)


def _schedules(fixed: dict, pp: int) -> list[tuple[str, int]]:
    if "schedule" in fixed or "v" in fixed:
        kind = fixed.get("schedule", "interleaved" if fixed.get("v", 1) > 1 else "1f1b")
        return [(kind, fixed.get("v", 2 if kind == "interleaved" else 1))]
    return [("1f1b", 1)] if pp == 1 else list(SCHEDULES)


def candidate_layouts(model: ModelSpec, cluster: Cluster, fixed: dict, precision: str = "bf16",
                      split_of: SplitRule | None = None) -> Iterator[Layout]:
    """Every layout the search considers, honoring the user's fixed keys (valid or not); with
    ``split_of``, each pipeline cut where the run will make it (and none the run would refuse)."""
    seen = set()
    for dp, tp, pp, sp, cp in _mesh_shapes(model, cluster, fixed):
        # ZeRO shards over dp x cp x sp; on one replica its units still serve offload (stepped one at a time)
        offloading = fixed.get("offload_optimizer", "none") != "none" or fixed.get("offload_params", "none") != "none"
        zeros = _options(fixed, "zero", (0, 1, 2, 3) if dp * sp * cp > 1 or offloading else (0,))
        cp_mode = fixed.get("cp_mode", "hybrid" if sp > 1 else "ring")
        choices = itertools.product(zeros, _options(fixed, "micro_batch", MICRO_BATCHES), _schedules(fixed, pp),
                                    _options(fixed, "recompute", RECOMPUTES),
                                    _options(fixed, "tp_sp", (False, True) if tp > 1 else (False,)))
        for zero, mb, (schedule, v), recompute, tp_sp in choices:
            split = split_of(pp, v) if split_of is not None else ()
            if split is None:
                continue
            for ep, dp_replicate in _data_degrees(model, cluster, fixed, dp, tp, sp * cp, zero):
                layout = Layout(dp=dp, tp=tp, pp=pp, sp=sp, cp=cp, cp_mode=cp_mode if cp > 1 else "ring", zero=zero,
                                micro_batch=mb, schedule=schedule, v=v,
                                recompute=recompute, every=fixed.get("every", 2), tp_sp=tp_sp,
                                precision=fixed.get("precision", precision), offload=fixed.get("offload", False),
                                compression=fixed.get("compression", "none"),
                                fused_loss=fixed.get("fused_loss", False), ep=ep,
                                offload_optimizer=fixed.get("offload_optimizer", "none"),
                                offload_params=fixed.get("offload_params", "none"),
                                offload_masters=fixed.get("offload_masters", "auto"),
                                delayed_update=fixed.get("delayed_update", False), fp8=fixed.get("fp8", "none"),
                                dp_replicate=dp_replicate, compiled=fixed.get("compiled", False),
                                reshard_after_forward=fixed.get("reshard_after_forward", True),
                                prefetch=fixed.get("prefetch", True), split=split,
                                checkpoint_async=fixed.get("checkpoint_async", False),
                                grad_clip=fixed.get("grad_clip", True))
                if layout not in seen:
                    seen.add(layout)
                    yield layout


def _data_degrees(model: ModelSpec, cluster: Cluster, fixed: dict, dp: int, tp: int, sp: int,
                  zero: int) -> list[tuple[int, int]]:
    """(ep, dp_replicate) choices: the expert degrees, with ZeRO over all of dp; and, under ZeRO,
    HSDP with one ZeRO group per node (dp_shard x sp x tp = a node's GPUs), which
    keeps every gather inside the node and sends only the shards' all-reduce across. ``sp``: every
    axis that cuts the sequence (Ulysses x cp), replicas of the weights as dp is."""
    if "dp_replicate" in fixed:  # ep inside one ZeRO group (an ep that is not is refused by the layout's check)
        group = dp // fixed["dp_replicate"] * sp if dp % fixed["dp_replicate"] == 0 else dp * sp
        return [(ep, fixed["dp_replicate"]) for ep in _expert_degrees(model, fixed, group)]
    out = [(ep, 1) for ep in _expert_degrees(model, fixed, dp * sp)]
    per_node = cluster.gpus_per_node // (tp * sp) if cluster.gpus_per_node % (tp * sp) == 0 else 0
    if cluster.engine.hybrid_sharding and zero >= 1 and 1 < per_node < dp and dp % per_node == 0:
        # experts: an ep group inside the node's ZeRO group (its all-to-all stays in the node too)
        out += [(ep, dp // per_node) for ep in _expert_degrees(model, fixed, per_node * sp)]
    return out


def _expert_degrees(model: ModelSpec, fixed: dict, replicas: int) -> list[int]:
    """ep choices: the divisors of the dp x sp ranks that divide the experts (1 for a dense model)."""
    return _options(fixed, "ep", [d for d in _divisors(replicas) if model.experts % d == 0] if model.experts else [1])


def _mesh_problems(fixed: dict, cluster: Cluster) -> list[str]:
    """Why no dp x tp x pp x sp x cp factorization of the GPUs matches the fixed degrees (cp among
    them: a fixed cp that does not divide the GPUs once said "no layout with  fits", naming nothing)."""
    degrees = {k: fixed[k] for k in ("dp", "tp", "pp", "sp", "cp") if k in fixed}
    product = 1
    for value in degrees.values():
        product *= value
    text = " x ".join(f"{k}={v}" for k, v in degrees.items())
    if cluster.gpus % product:
        return [f"--layout: {text} takes {product} GPUs, which does not divide --gpus = {cluster.gpus} (the degrees "
                f"left out fill the rest: dp x tp x pp x sp x cp equals the GPUs); give --gpus a multiple of "
                f"{product} or other degrees"]
    return [f"--layout: no layout{' with ' + text if text else ''} fits the search space on {cluster.gpus} GPUs "
            f"(tp at most {cluster.gpus_per_node}, sp at most 8 and dividing the heads, pp at most the layers); "
            f"give every degree explicitly to use it anyway"]


@dataclass
class SearchResult:
    ranked: list[Plan]  # layouts that fit, fastest first
    closest: Plan | None  # the layout that misses by the least, when none fits
    considered: int
    valid: int
    rejected: dict[str, int] = field(default_factory=dict)  # reason -> count
    # Of the layouts that fit the device but not the host's memory or NVMe: the one that misses by least.
    off_device: Plan | None = None
    optimizer: str = "adamw"  # whose state was counted
    replaces: str = ""  # offload_fit: the optimizer asked for, when ``optimizer`` is its smaller-state substitute

    @property
    def best(self) -> Plan | None:
        return self.ranked[0] if self.ranked else None


def search(model: ModelSpec, cluster: Cluster, global_batch: int, fixed: dict | None = None,
           precision: str = "bf16", pipeline: PipelineModel | None = None, retime: int = 12,
           optimizer: str = "adamw", block: int = 256, prune: bool = True,
           split_of: SplitRule | None = None) -> SearchResult:
    """Rank the layouts that fit; raises ConfigError when no layout is even valid.
    ``split_of(pp, v)``: where the run cuts its pp x v stages (:attr:`Layout.split`; None: it
    would refuse that many), for a run whose parallel.pp_split or pp_balance the search must price;
    without it every cut is even.

    Candidates are timed with the pipeline's closed forms (fast, and equal to the simulator when
    transfers are free); the ``retime`` fastest are then timed again with the simulator.
    ``prune``: a layout whose model states alone cannot fit the device (:func:`device_lower_bound`)
    is neither estimated further nor timed, and when nothing fits it is estimated only if it could
    be the closest; the result is the exhaustive search's (``prune=False``), which
    tests/test_plan_search_speed.py checks."""
    fixed, pipeline = dict(fixed or {}), pipeline or PipelineModel()
    fast = PipelineModel(max_actions=0)
    fitting, considered, valid, rejected, first_problems = [], 0, 0, {}, None
    # The nearest misses: (share of the device or of the host / NVMe, the layout's place, plan); the
    # first of equals wins, as in the order the layouts come.
    closest = off_device = None
    capacity = cluster.hardware.memory_bytes
    skipped: list[tuple[float, int, Layout]] = []  # (the bound's share of the device, place, layout)
    for layout in candidate_layouts(model, cluster, fixed, precision, split_of):
        considered += 1
        problems = layout_problems(layout, model, cluster, global_batch)
        if problems:
            first_problems = first_problems or problems
            rejected[problems[0].split(":")[0]] = rejected.get(problems[0].split(":")[0], 0) + 1
            continue
        valid += 1
        if prune:
            bound = device_lower_bound(model, layout, cluster.hardware, optimizer, block)
            if bound > capacity:
                skipped.append((bound / capacity, valid, layout))
                continue
        memory = estimate_memory(model, layout, cluster.hardware, global_batch, fast, optimizer, block)
        plan = Plan(model, layout, cluster, global_batch, memory)
        if plan.fits:
            plan.time = step_time(model, layout, cluster, global_batch, fast)
            fitting.append(plan)
            continue
        closest, off_device = _nearer(closest, off_device, plan, valid)
    if not valid:
        raise ConfigError(first_problems or _mesh_problems(fixed, cluster))
    if not fitting:  # a skipped layout misses by at least its bound: estimated where that is no more
        for share, place, layout in skipped:
            if closest is None or share <= closest[0]:
                memory = estimate_memory(model, layout, cluster.hardware, global_batch, fast, optimizer, block)
                closest, off_device = _nearer(closest, off_device, Plan(model, layout, cluster, global_batch, memory),
                                              place)
    closest, off_device = (closest[2] if closest else None), (off_device[2] if off_device else None)
    fitting.sort(key=lambda p: (-p.tokens_per_s, p.memory.total))
    for plan in fitting[:retime]:
        plan.time = step_time(model, plan.layout, cluster, global_batch, pipeline)
    fitting[:retime] = sorted(fitting[:retime], key=lambda p: (-p.tokens_per_s, p.memory.total))
    if not fitting and closest is not None:
        closest.time = step_time(model, closest.layout, cluster, global_batch, pipeline)
    shown = fitting[0] if fitting else closest  # the plan a report details
    if shown is not None:
        add_skewed_routing(shown.memory, model, shown.layout, cluster.hardware, global_batch, pipeline, optimizer, block)
    return SearchResult(fitting, None if fitting else closest, considered, valid, rejected,
                        None if fitting else off_device, optimizer)


def _nearer(closest: tuple | None, off_device: tuple | None, plan: Plan, place: int) -> tuple:
    """(closest, off_device) with ``plan``, the ``place``-th valid layout, that does not fit: the
    least share of the device it needs, and of those that fit the device the least share of the
    host's memory or NVMe it misses by, the earlier place first among equals."""
    memory = plan.memory
    ratio = (memory.total / memory.capacity, place)
    if closest is None or ratio < closest[:2]:
        closest = (*ratio, plan)
    if memory.fits_device:
        beyond = (_beyond(memory), place)
        if off_device is None or beyond < off_device[:2]:
            off_device = (*beyond, plan)
    return closest, off_device


def _beyond(memory: RankMemory) -> float:
    """How far a layout misses the host's memory and the NVMe, as shares of them."""
    return max(memory.host / max(1, memory.host_capacity), memory.nvme / max(1, memory.nvme_capacity))


OFFLOAD_STEPS = ({"offload_optimizer": "cpu"}, {"offload_optimizer": "cpu", "delayed_update": True},
                 {"offload_optimizer": "cpu", "offload_params": "cpu", "zero": 3},
                 {"offload_optimizer": "nvme", "offload_masters": "cpu", "zero": 1},
                 {"offload_optimizer": "nvme", "offload_masters": "cpu", "delayed_update": True, "zero": 1},
                 {"offload_optimizer": "nvme", "offload_params": "nvme", "zero": 3})
# Tried when no offload of the asked optimizer fits the host and its NVMe: 8-bit moments (2 bytes a
# parameter of state instead of AdamW's 8). A different optimizer: said so, never chosen silently.
SMALLER_STATE = {"adamw": "adamw8bit"}


def offload_fit(model: ModelSpec, cluster: Cluster, global_batch: int, fixed: dict | None = None,
                precision: str = "bf16", optimizer: str = "adamw", block: int = 256,
                split_of: SplitRule | None = None) -> SearchResult | None:
    """When nothing fits on the device: the first offload that makes something fit the device, the
    host's memory and its NVMe (the optimizer on the host, then with the delayed update, then the
    parameters on the host too at ZeRO-3, then the optimizer's state alone on NVMe with the masters
    on the host at ZeRO-1 (ZeRO-Infinity's split; gradients stay in host memory), with and without
    the delayed update, then optimizer and parameters on NVMe at ZeRO-3), as a
    search with those keys fixed, first with ``optimizer`` and then with its smaller-state
    alternative (``SMALLER_STATE``; the result's ``optimizer`` says which; ``split_of`` as :func:`search`'s). None when the user fixed
    offload keys already; when none fits, the result that missed the host or NVMe by least (its
    ``best`` is None, its ``off_device`` the layout)."""
    fixed = dict(fixed or {})
    if any(k in fixed for k in ("offload_optimizer", "offload_params", "offload_masters", "delayed_update")):
        return None
    missed = None
    for name in (optimizer, SMALLER_STATE.get(optimizer)):
        for tiers in OFFLOAD_STEPS if name else ():
            if "zero" in tiers and fixed.get("zero", tiers["zero"]) != tiers["zero"]:
                continue  # the user fixed a ZeRO stage this offload cannot use
            try:
                result = search(model, cluster, global_batch, {**fixed, **tiers}, precision, optimizer=name,
                                block=block, split_of=split_of)
            except ConfigError:
                continue
            if result.best is not None:
                result.replaces = optimizer if name != optimizer else ""
                return result
            if name == optimizer and result.off_device is not None and (
                    missed is None or _beyond(result.off_device.memory) < _beyond(missed.off_device.memory)):
                missed = result
    return missed


def explain_offload_fit(result: SearchResult, cluster: Cluster) -> list[str]:
    """What the offload that fits moves off the device and what it costs per step (or, when none
    fits, what the closest one would need of the host and its NVMe)."""
    hw = cluster.hardware
    if result.best is None:
        plan = result.off_device
        m = plan.memory
        return [f"Even with offload nothing fits: the closest, {plan.layout.describe()}, fits the device "
                f"({readable_bytes(m.total)} of {readable_bytes(m.capacity)}) but needs "
                f"{readable_bytes(m.host)} of host memory per GPU ({readable_bytes(m.detail.get('host_states', 0))} of "
                f"model states, {readable_bytes(hw.host_reserved_bytes)} for the process) of "
                f"{readable_bytes(m.host_capacity)}, and {readable_bytes(m.nvme)} of NVMe of "
                f"{readable_bytes(m.nvme_capacity)} (the profile's host_memory_bytes and nvme_bytes: set them "
                f"with --hw host_memory_bytes=... --hw nvme_bytes=...)"]
    plan = result.best
    detail, breakdown, m = plan.memory.detail, plan.time.breakdown, plan.memory
    added = sum(v for k, v in breakdown.items() if k.startswith("offload_"))
    lines = [f"With offload it fits: {plan.layout.describe()}"]
    if result.replaces:
        lines.append(f"  with optim.name = '{result.optimizer}' instead of '{result.replaces}' (a different optimizer: "
                     f"no offload of '{result.replaces}'s state fits the host's memory and its NVMe)")
    lines += [f"  device {readable_bytes(m.total)} of {readable_bytes(m.capacity)}; host "
              f"{readable_bytes(m.host)} of {readable_bytes(m.host_capacity)} ({readable_bytes(detail.get('host_states', 0))} "
              f"of model states and offload buffers); NVMe {readable_bytes(detail.get('nvme_states', 0))} of "
              f"{readable_bytes(m.nvme_capacity)} per GPU",
              f"  step {plan.time.step_time_s:.3g} s ({readable_rate(plan.tokens_per_s)} tokens/s, MFU {plan.time.mfu:.0%}), "
              f"of which {added:.3g} s offload (PCIe {hw.host_bandwidth / 1e9:.3g} GB/s, host memory "
              f"{hw.host_memory_bandwidth / 1e9:.3g} GB/s, NVMe {hw.nvme_bandwidth / 1e9:.3g} GB/s per rank: profile "
              f"assumptions)",
              f"  run it with: {' '.join(plan.layout.to_overrides())}"
              + (f" --optim.name={result.optimizer}" if result.replaces else ""),
              "  (on a GPU the host step and the copies to and from it are built but untested on a GPU so far: "
              "docs/offload.md)"]
    return lines


# -- explanations -------------------------------------------------------------------------------------
def readable_bytes(nbytes: float, digits: int = 1) -> str:
    """Bytes in the largest binary unit that keeps the number readable (GiB for accelerators,
    smaller units for toy models)."""
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(nbytes) >= scale:
            return f"{nbytes / scale:.{digits}f} {unit}"
    return f"{nbytes:.0f} B"


def readable_rate(per_s: float) -> str:
    """Tokens (or samples) a second, whole above 100, else three digits: a 1B model in bf16 on the
    cpu profile, 0.19 tokens/s, printed as '0 tokens/s'."""
    return f"{per_s:,.0f}" if per_s >= 100 or per_s == 0 else f"{per_s:.3g}"


def _differences(a: Layout, b: Layout) -> str:
    keys = [f.name for f in dataclasses.fields(Layout)]
    diff = [f"{k} {getattr(a, k)} vs {getattr(b, k)}" for k in keys if getattr(a, k) != getattr(b, k)]
    return ", ".join(diff) or "the same layout"


def explain_ranking(result: SearchResult, top: int = 3) -> list[str]:
    lines = [f"{result.valid} valid layouts of {result.considered} considered, {len(result.ranked)} fit."]
    for i, plan in enumerate(result.ranked[:top], 1):
        t, m = plan.time, plan.memory
        main = sorted((kv for kv in t.breakdown.items() if kv[1] > 0), key=lambda kv: -kv[1])[:3]  # no 'tp_sp_comm 0 s'
        parts = ", ".join(f"{k} {v:.3g} s" for k, v in main)
        lines.append(f"{i}. {plan.layout.describe()}: {readable_rate(t.tokens_per_s)} tokens/s, MFU {t.mfu:.1%}, step "
                     f"{t.step_time_s:.3g} s ({parts}); {readable_bytes(m.total)} of {readable_bytes(m.capacity)} on the worst rank")
    if len(result.ranked) >= 2:
        lines.append(why_best_wins(result.ranked[0], result.ranked[1]))
    return lines


def why_best_wins(best: Plan, runner_up: Plan) -> str:
    a, b = best.time, runner_up.time
    gap = b.step_time_s / a.step_time_s - 1
    # Every part either has: #2's own (selective_recompute, of a layout that recomputes) were left out,
    # and a 3.7 s longer step was said to be the same time, won on memory by the layout that took more.
    parts = list(a.breakdown) + [k for k in b.breakdown if k not in a.breakdown]
    deltas = sorted(((k, b.breakdown.get(k, 0.0) - a.breakdown.get(k, 0.0)) for k in parts),
                    key=lambda kv: -abs(kv[1]))
    reasons = "; ".join(f"{'+' if d > 0 else ''}{d:.3g} s {k}" for k, d in deltas[:2] if abs(d) > 0)
    if not reasons:
        less = best.memory.total < runner_up.memory.total
        reasons = "same time; " + ("#1 needs less memory" if less else "ranked by the search's order")
    longer = f"{gap:.1%}" if gap >= 0.0005 or gap <= 0 else "<0.1%"
    return (f"Why #1 beats #2 ({_differences(best.layout, runner_up.layout)}): #2's step is {longer} longer "
            f"({reasons}).")


def explain_memory(memory: RankMemory, model: ModelSpec, layout: Layout, hardware_name: str) -> list[str]:
    """Where a rank's bytes go, and by how much it misses (or clears) the device."""
    states = memory.model_states
    mixed = layout.precision != "fp32"
    spec = get_optimizer(memory.optimizer_name)
    opt_text = ("fp32 master weights + " if mixed else "") + f"{spec.name}'s state"
    bytes_per_param = states / model.params if layout.zero == 0 and layout.gpus == 1 else None
    lines = [f"worst rank (pipeline rank {memory.pp_rank}): {readable_bytes(memory.total)} needed, "
             f"{readable_bytes(memory.capacity)} on {hardware_name}"
             + (f", {readable_bytes(memory.total - memory.capacity)} short" if not memory.fits else
                f", {readable_bytes(memory.capacity - memory.total)} free"),
             f"  model states {readable_bytes(states)}: parameters {readable_bytes(memory.params)} + gradients {readable_bytes(memory.grads)} "
             f"+ optimizer {readable_bytes(memory.optimizer)} ({opt_text})"
             + (f" = {bytes_per_param:.0f} bytes per parameter x {model.params / 1e9:.2f} B parameters"
                if bytes_per_param else ""),
             f"  activations {readable_bytes(memory.activations)} ({memory.inflight} micro-batch(es) in flight x "
             f"{readable_bytes(memory.activation_per_microbatch)}; per layer s b h (c1 + c2/t) with c1 = "
             f"{memory.detail.get('activation_c1', 0):.1f}, c2 = {memory.detail.get('activation_c2', 0):.1f})",
             f"  buffers {readable_bytes(sum(memory.buffers.values()))}, allocator allowance {readable_bytes(memory.allocator)}"]
    return lines


def explain_no_fit(result: SearchResult, cluster: Cluster) -> list[str]:
    """Nothing fits: what comes closest, what it lacks, and what would make it fit."""
    plan = result.closest
    hw = cluster.hardware
    lines = [f"Nothing fits on {cluster.gpus} x {hw.name} ({result.valid} valid layouts tried)."]
    if plan is None:
        return lines
    lines.append(f"Closest: {plan.layout.describe()}")
    lines += explain_memory(plan.memory, plan.model, plan.layout, hw.name)
    usable = hw.usable_bytes / (1 + hw.fragmentation)
    if plan.memory.model_states > usable:
        # bigtrain's own bytes, as the line above counts them: the ZeRO paper's 16 (2 + 2 + 12) keeps
        # bf16 gradients, bigtrain reduces and keeps them in fp32: 2 + 4 + 12 = 18 mixed, 4 + 4 + 8 in fp32
        # (the paper's 16 was said under a line that counted 18, and undercounted the GPUs needed).
        mixed = plan.layout.precision != "fp32"
        spec = get_optimizer(plan.memory.optimizer_name)
        full = (2 if mixed else 4) + 4 + (4 if mixed else 0) + spec.bytes_per_param
        need = -(-int(full * plan.model.params) // int(usable))
        lines.append(f"  model states alone exceed the device: full training with {spec.name} keeps {full:g} bytes "
                     f"per parameter; sharded over every GPU (ZeRO-3) it needs at least {need} GPUs of this kind, "
                     f"before activations")
    else:
        lines.append("  model states fit: lower the micro-batch, recompute more, or shard activations (tp, pp, sp)")
    return lines
