"""The layout search's shortcuts change no answer: the pruned search ranks exactly what the exhaustive
one does (names, step times, memory, the closest miss), a warm search's answers are the ones each
layout gets computed afresh, each cache ignores only layout fields its function does not read, and
the bound the search prunes with never exceeds a layout's memory (docs/planner.md, Speed of the
search)."""

from __future__ import annotations

import dataclasses
import inspect
import random

import pytest

from bigtrain.plan.cost import step_time
from bigtrain.plan.hardware import get_profile
from bigtrain.plan.layout import CP_MODES, FP8, RECOMPUTE, Cluster, Layout, layout_problems
from bigtrain.plan.memo import IGNORED_FIELDS, clear_caches
from bigtrain.plan.memory import add_skewed_routing, device_lower_bound, estimate_memory
from bigtrain.plan.model import ModelSpec
from bigtrain.plan.pipeline import PipelineModel
from bigtrain.plan.search import candidate_layouts, search

MOE = dict(layers=16, hidden=4096, heads=32, kv_heads=8, vocab=32000, seq=4096, ffn_hidden=14336, experts=8,
           top_k=2)  # half a Mixtral 8x7B: 23 B parameters
DENSE = dict(layers=16, hidden=4096, heads=32, vocab=32000, seq=2048)  # 3.5 B
A100_40, A100_80 = get_profile("a100-40g"), get_profile("a100-80g")
CASES = {  # (model, cluster, global batch, fixed keys, whether a layout fits): MoE and dense, fitting or not
    "moe-some-fit": (ModelSpec.build(**MOE), Cluster.build(8, A100_80), 32, {}, True),
    "moe-none-fits-hsdp": (ModelSpec.build(**MOE), Cluster.build(8, A100_40, 4), 32, {"micro_batch": 1}, False),
    "moe-offload-host-too-small": (ModelSpec.build(**MOE),
                                   Cluster.build(4, A100_80.with_values(host_memory_bytes=60 * 10**9)), 32,
                                   {"offload_optimizer": "cpu"}, False),
    "dense-13b-some-fit": (ModelSpec.build(**{**DENSE, "layers": 40, "hidden": 5120, "heads": 40}),
                           Cluster.build(8, A100_40), 32, {}, True),
    "dense-hsdp-most-fit": (ModelSpec.build(**DENSE), Cluster.build(8, A100_40, 4), 32, {"recompute": "none"}, True),
    "dense-none-fits": (ModelSpec.build(**{**DENSE, "layers": 40}), Cluster.build(2, A100_40), 8, {}, False),
}


def _answers(result) -> dict:
    """All a search says: the ranking (layouts, predicted times, memory), the nearest misses, the counts."""
    plan = lambda p: p.to_dict() if p is not None else None  # noqa: E731
    return {"ranked": [plan(p) for p in result.ranked], "closest": plan(result.closest),
            "off_device": plan(result.off_device), "considered": result.considered, "valid": result.valid,
            "rejected": result.rejected, "optimizer": result.optimizer}


@pytest.mark.parametrize("name", list(CASES))
def test_the_pruned_search_answers_as_the_exhaustive_one(name):
    model, cluster, batch, fixed, fits = CASES[name]
    clear_caches()
    exhaustive = _answers(search(model, cluster, batch, fixed, prune=False))
    clear_caches()
    assert _answers(search(model, cluster, batch, fixed)) == exhaustive
    assert bool(exhaustive["ranked"]) == fits  # the cases cover both
    assert (exhaustive["off_device"] is not None) == ("host-too-small" in name)


@pytest.mark.parametrize("name", ["moe-some-fit", "dense-13b-some-fit", "moe-none-fits-hsdp"])
def test_a_warm_search_answers_what_each_layout_gets_afresh(name):
    """A cache keyed on too little would hand one layout another's answer: each layout priced with
    every cache emptied first gets what the search (its caches warm from thousands of others) said."""
    model, cluster, batch, fixed, _ = CASES[name]
    result = search(model, cluster, batch, fixed)
    plans = result.ranked[:12] + result.ranked[12::max(1, len(result.ranked) // 40)]  # retimed, and a sample
    retimed = {id(p) for p in result.ranked[:12]}
    if result.closest is not None:
        plans.append(result.closest)
        retimed.add(id(result.closest))
    assert plans
    for plan in plans:
        clear_caches()
        memory = estimate_memory(model, plan.layout, cluster.hardware, batch, PipelineModel(max_actions=0))
        if "skewed_total" in plan.memory.detail.get("moe_expert_rows", {}):  # the plan a report shows
            add_skewed_routing(memory, model, plan.layout, cluster.hardware, batch, PipelineModel(max_actions=0))
        pipeline = PipelineModel() if id(plan) in retimed else PipelineModel(max_actions=0)
        time = step_time(model, plan.layout, cluster, batch, pipeline)
        assert memory.to_dict() == plan.memory.to_dict(), plan.layout.describe()
        assert time.to_dict() == plan.time.to_dict(), plan.layout.describe()


@pytest.mark.parametrize("name", ["moe-some-fit", "dense-13b-some-fit", "dense-none-fits"])
def test_the_bound_the_search_prunes_with_never_exceeds_the_memory(name):
    model, cluster, batch, fixed, _ = CASES[name]
    fast, pruned = PipelineModel(max_actions=0), 0
    for layout in candidate_layouts(model, cluster, fixed):
        if layout_problems(layout, model, cluster, batch):
            continue
        bound = device_lower_bound(model, layout, cluster.hardware)
        memory = estimate_memory(model, layout, cluster.hardware, batch, fast)
        assert bound <= memory.total, layout.describe()
        pruned += bound > memory.capacity
    assert pruned > 0  # the pruning is exercised


# -- the caches' declarations ---------------------------------------------------------------------
ALTERNATIVES = {"dp": (2, 4), "tp": (1, 2), "pp": (1, 2), "sp": (1, 2), "zero": (0, 1, 2, 3), "micro_batch": (1, 2, 4),
                "schedule": ("1f1b", "zb-h1", "interleaved"), "v": (1, 2), "recompute": RECOMPUTE, "every": (2, 3),
                "tp_sp": (False, True), "precision": ("bf16", "fp32"), "offload": (False, True),
                "compression": ("none", "int8"), "fused_loss": (False, True), "fp8": FP8, "compiled": (False, True),
                "ep": (1, 2), "offload_optimizer": ("none", "cpu", "nvme"), "offload_params": ("none", "cpu", "nvme"),
                "offload_masters": ("auto", "cpu"), "delayed_update": (False, True), "cp": (1, 2), "cp_mode": CP_MODES,
                "dp_replicate": (1, 2)}
SMALL_MOE = ModelSpec.build(layers=4, hidden=512, heads=8, kv_heads=2, vocab=1000, seq=1024, experts=4, top_k=2)
SMALL_DENSE = ModelSpec.build(layers=4, hidden=512, heads=8, vocab=1000, seq=1024)
BASES = [  # (model, layout, cluster): ZeRO 1 and 3, a pipeline, HSDP, cp, groups within and across nodes
    (SMALL_MOE, Layout(dp=4, tp=2, pp=2, zero=1, micro_batch=2, ep=2, recompute="every"), Cluster.build(16, A100_80)),
    (SMALL_MOE, Layout(dp=4, tp=2, pp=2, zero=3, ep=2, dp_replicate=2), Cluster.build(16, A100_40, 4)),
    (SMALL_DENSE, Layout(dp=2, tp=2, pp=2, sp=2, zero=2, schedule="interleaved", v=2, tp_sp=True),
     Cluster.build(16, A100_80)),
    (SMALL_DENSE, Layout(dp=2, tp=2, cp=2, cp_mode="ring", zero=1, offload_optimizer="cpu"), Cluster.build(8, A100_40, 4)),
]


def _fields_that_move(fn, ignored: tuple[str, ...]) -> list[str]:
    """Of the fields ``fn`` is declared not to read, those whose change changes its (uncached) answer:
    each changed alone at every base, then all of them at random together."""
    def rest(cluster):
        given = {"cluster": cluster, "hardware": cluster.hardware, "micro_batches": 4}
        names = list(inspect.signature(fn).parameters)[2:]
        return [given[n] for n in names if n in given]

    moved, rng = set(), random.Random(0)
    for model, base, cluster in BASES:
        expected = fn(model, base, *rest(cluster))
        variants = [(f, {f: value}) for f in ignored for value in ALTERNATIVES[f]]
        variants += [("together", {f: rng.choice(ALTERNATIVES[f]) for f in ignored}) for _ in range(8)]
        for label, change in variants:
            if fn(model, dataclasses.replace(base, **change), *rest(cluster)) != expected:
                moved.add(label)
    return sorted(moved)


def test_every_cache_ignores_only_fields_its_function_does_not_read():
    assert len(IGNORED_FIELDS) >= 4  # stage costs, data-parallel traffic (two), the memory bound
    for fn, ignored in IGNORED_FIELDS.items():
        assert _fields_that_move(fn, ignored) == [], fn.__name__


def test_the_declaration_check_catches_a_field_that_is_read():
    stage_costs = next(fn for fn in IGNORED_FIELDS if fn.__name__ == "stage_costs")
    assert "micro_batch" in _fields_that_move(stage_costs, IGNORED_FIELDS[stage_costs] + ("micro_batch",))
