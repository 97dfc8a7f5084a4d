"""Transforms are wrappers or hooks: no module's ``forward`` is replaced on an instance, no module
carries an attribute another package set for it, and parameter and state-dict names are those of
the plain model (a checkpoint written before the wrappers loads after them)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch
from torch import nn

from bigtrain.config import ModelConfig, OptimConfig
from bigtrain.distributed.mesh import Mesh
from bigtrain.memory.activations import apply_activation_memory
from bigtrain.memory.checkpointing import Checkpointed
from bigtrain.models.llama import build_model
from bigtrain.parallel.build import apply_expert_parallel, apply_tensor_parallel, parallelize
from bigtrain.parallel.compile import CompiledRegion, apply_compile
from bigtrain.parallel.parallel_plan import (ActivationPlan, CompilePlan, EnginePlan, ExpertPlan, ParallelPlan,
                                             TensorParallelPlan)
from bigtrain.parallel.pipeline.split_backward import split_parameters
from bigtrain.precision import Precision
from bigtrain.testing import run_fake_rank
from bigtrain.wrappers import SHARED_STATE, ModuleWrapper, transforms_of, unwrapped

BIGTRAIN = Path(__file__).resolve().parent.parent / "bigtrain"
# ``x.forward = ...`` or ``setattr(x, "forward", ...)``: a forward replaced on an instance.
FORWARD_ASSIGNED = re.compile(r"\.forward\s*=(?!=)|setattr\([^)]*[\"']forward[\"']")


def test_no_module_forward_is_replaced_on_an_instance_in_bigtrain():
    found = [f"{path.relative_to(BIGTRAIN.parent)}:{i}: {line.strip()}"
             for path in sorted(BIGTRAIN.rglob("*.py"))
             for i, line in enumerate(path.read_text().splitlines(), 1) if FORWARD_ASSIGNED.search(line)]
    assert not found, "a module's forward replaced on an instance (use a wrapper or a hook):\n" + "\n".join(found)


def test_the_grep_finds_what_it_looks_for():
    assert FORWARD_ASSIGNED.search("    module.forward = forward")
    assert FORWARD_ASSIGNED.search("setattr(head, 'forward', fn)")
    assert not FORWARD_ASSIGNED.search("if block.forward == other.forward:")


CFG = ModelConfig(dim=32, n_layers=4, n_heads=4, n_kv_heads=2, vocab_size=61, max_seq_len=16,
                  moe_experts=4, moe_every=2, moe_shared_expert=True)


def _attributes(module: nn.Module) -> dict:
    """What a module holds besides the registries a wrapper shares (and its train/eval mode)."""
    return {k: v for k, v in vars(module).items() if k not in SHARED_STATE and k != "training"}


def _snapshot(model: nn.Module) -> dict[int, tuple[nn.Module, dict]]:
    return {id(m): (m, dict(_attributes(m))) for m in model.modules()}


def _changed(before: dict[int, tuple[nn.Module, dict]]) -> list[str]:
    """Attributes added to, or replaced on, the plain model's modules since ``before``."""
    out = []
    for module, attrs in before.values():
        now = _attributes(module)
        for key in sorted(set(now) | set(attrs)):
            if key not in attrs or key not in now or now[key] is not attrs[key]:
                out.append(f"{type(module).__name__}.{key}")
    return out


def _structure_on_a_fake_rank(rank, world_size, policy):
    """tp with Megatron sequence parallelism, experts over ep with grouped GEMM, every
    activation-memory wrapper and regional compilation, on the meta model of one rank of four (a
    fake process group: structure and shapes only)."""
    model = build_model(CFG)
    before = _snapshot(model)
    mesh = Mesh({"dp": 2, "tp": 2, "ep": 2}, rank)
    layout = apply_tensor_parallel(model, mesh, TensorParallelPlan(sequence_parallel=True))
    apply_expert_parallel(model, mesh, ExpertPlan(grouped_mm=True))
    apply_activation_memory(model, ActivationPlan(policy=policy, compression="int8", offload=True, fused_loss=True,
                                                  selective_attention=True), layout)
    apply_compile(model)
    return _changed(before), transforms_of(model)


@pytest.mark.parametrize("policy", ["full", "selective"])
def test_no_transform_leaves_an_attribute_on_a_module(policy):
    """Every transform, composed: the plain modules hold exactly the attributes they were built with
    (what changed is structure: registered parameters, children, hooks), and the record of what
    was applied lives on the model's structure (``transforms_of``), not in flags."""
    changed, transforms = run_fake_rank(_structure_on_a_fake_rank, 4, policy, rank=1)
    assert changed == [], f"attributes set on modules by another package: {changed}"
    assert transforms["tok_embeddings"] == ("vocab_parallel",)
    assert transforms["output"] == ("fused_loss",)  # the fused head: int8 does not apply to it
    assert transforms["layers.0.attention.wq"][-1] == "int8_saved_input"
    if policy == "full":
        assert transforms["layers.0"] == ("checkpoint",)  # a dense block holding int8 linears: not compiled whole
        assert "compile" in transforms["layers.0.attention.core"]
    else:
        # the recomputed attention core runs eagerly under compile (memory/selective.py): no region of its own
        assert transforms["layers.0.attention.core"] == ("recompute",)
        assert transforms["layers.1.attention_norm"] == ("compile", "recompute")


def _cut_sequence_on_a_fake_rank(rank, world_size, axis):
    """Ulysses (sp) or context parallelism (cp, ring) on the MoE model of one rank of two: the MoE
    blocks' view of the sequence is swapped (bigtrain/parallel/sequence_moe.py), a child module in
    place of the model's own, as the dispatcher is; no plain attribute set on the block."""
    from bigtrain.parallel.context import apply_context_parallel

    model = build_model(CFG)
    before = _snapshot(model)
    mesh = Mesh({axis: 2}, rank)
    if axis == "sp":
        apply_tensor_parallel(model, mesh, TensorParallelPlan())
    else:
        apply_context_parallel(model, mesh.comm("cp"), "ring")
    views = {type(m.sequence).__name__ for m in model.modules() if hasattr(m, "dispatcher")}
    return _changed(before), views


@pytest.mark.parametrize("axis, view", [("sp", "SequenceParts"), ("cp", "ChunkPairsOverCP")])
def test_cutting_the_sequence_leaves_no_attribute_on_an_moe_block(axis, view):
    changed, views = run_fake_rank(_cut_sequence_on_a_fake_rank, 2, axis, rank=1)
    assert changed == [], f"attributes set on modules by another package: {changed}"
    assert views == {view}


def _parallel(plan_kwargs: dict) -> tuple[nn.Module, object]:
    plain = build_model(CFG, "cpu")
    plain.init_weights(0)
    plan = ParallelPlan(optim=OptimConfig(), **plan_kwargs)
    return plain, parallelize(build_model(CFG), Mesh({}), plan, "cpu")


WRAPPED = {"engine": EnginePlan(zero=2, precision=Precision(torch.bfloat16, torch.float32))}


@pytest.mark.parametrize("policy", ["full", "every", "selective"])
def test_names_and_state_dicts_are_the_plain_models(policy):
    """Wrapped, compiled and under ZeRO-2 in bf16, the model's parameter and state-dict names are the plain
    model's, and the plain model's state dict loads into it (a checkpoint of an earlier run)."""
    plain, parallel = _parallel({**WRAPPED, "activations": ActivationPlan(policy=policy, fused_loss=True, offload=True),
                                 "compile": CompilePlan(True)})
    model = parallel.model
    assert [n for n, _ in model.named_parameters()] == [n for n, _ in plain.named_parameters()]
    assert list(model.state_dict()) == list(plain.state_dict())
    assert any(isinstance(m, ModuleWrapper) for m in model.modules())
    model.load_state_dict(plain.state_dict())  # strict: every name found, none left over


def test_a_wrapper_shares_the_wrapped_modules_parameters_hooks_and_attributes():
    model = build_model(CFG, "cpu")
    model.init_weights(0)
    block, calls = model.layers[0], []
    block.register_forward_pre_hook(lambda m, args: calls.append("before"))
    wrapper = Checkpointed(block)
    assert wrapper.attention is block.attention and wrapper.attention_norm.eps == CFG.norm_eps
    wrapper.register_forward_hook(lambda m, args, out: calls.append("after"))
    x = torch.randn(2, 8, CFG.dim, requires_grad=True)
    cos, sin = torch.ones(16, CFG.dim // CFG.n_heads // 2), torch.zeros(16, CFG.dim // CFG.n_heads // 2)
    torch.testing.assert_close(wrapper(x, cos, sin), block.forward(x, cos, sin), rtol=0, atol=0)
    assert calls == ["before", "after"]  # hooks of either run once, around the wrapper's call
    assert unwrapped(wrapper) is block and "forward" not in vars(block)
    wrapper.eval()
    assert not block.training


def test_the_split_backward_finds_checkpointed_and_compiled_blocks_by_their_wrapper():
    model = build_model(ModelConfig(dim=16, n_layers=3, n_heads=2, vocab_size=32, max_seq_len=8), "cpu")
    model.layers[0] = Checkpointed(model.layers[0])
    model.layers[2] = CompiledRegion(model.layers[2])
    deferred, eager = split_parameters(model)
    eager_ids = {id(p) for p in eager}
    assert eager_ids == {id(p) for i in (0, 2) for p in model.layers[i].parameters()}
    assert {id(p) for p in deferred} == {id(p) for p in model.parameters()} - eager_ids
