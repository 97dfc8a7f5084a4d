"""Hugging Face mixture-of-experts decoders in the ``hf`` family: MixtralForCausalLM,
Qwen2MoeForCausalLM and Qwen3MoeForCausalLM from tiny config.json files
(tests/fixtures/hf/{mixtral,qwen2_moe,qwen3_moe}: 2 layers, 4 experts, top-2; Qwen3-MoE's layer 0
dense by decoder_sparse_step = 2, its and Qwen2-MoE's top-k weights not renormalized; Qwen2-MoE's
gated shared expert of 48 beside experts of 32, its q, k and v biased), their sparse blocks bigtrain's MoE block (bigtrain/families/hf_moe.py), each layout
held to transformers' own model (its per-expert loop) trained in one plain process
(bigtrain/families/hf_reference.py), in float64, within fp32's 1e-5 over 4 steps; bf16 within the
bf16 tolerance of ``bigtrain check`` against the reference's bf16 copy.

Why 1e-5 can fail here: a layout differs from the reference by the order of fp32 sums (the dp
average, the expert all-to-all's rows summed in another order, the per-expert loop against the
stacked bank); a wrong name conversion (w1 for w3, w2 not transposed), a router renormalized where
Qwen3-MoE does not, experts cut by tp or a token sent to the wrong rank moves the loss at the first
step by far more (the seam test below shows one such mistake failing).
"""

from __future__ import annotations

import json

import pytest
import torch

from bigtrain.config import ConfigError
from bigtrain.families import hf as hf_family
from bigtrain.families.hf_moe import sparse_blocks
from bigtrain.testing import run_ranks
from tests.helpers import tiny_config, trainer_on_rank, warm_compiler
from tests.test_hf_family import (FIXTURES, STEPS, assert_check_agrees, assert_layout_matches_reference,
                                  assert_matches_reference, hf_config, initial_weights, plan_config_json, reference,
                                  train_and_save, train_layout)

transformers = pytest.importorskip("transformers")


def needs_its_transformers(arch: str) -> None:
    """Qwen2-MoE trains under transformers 5 (4's Qwen2-MoE attention is a class of its own, which
    the family refuses: test_qwen2_moe_under_transformers_4_is_refused_naming_the_fix)."""
    if arch == "qwen2_moe" and int(transformers.__version__.split(".")[0]) < 5:
        pytest.skip("Qwen2-MoE needs transformers >= 5")

EP2 = ["--parallel.dp=2", "--parallel.ep=2"]
LAYOUTS = {  # name -> (architecture, overrides)
    "mixtral-one-process": ("mixtral", []),
    "qwen3_moe-one-process": ("qwen3_moe", []),
    "qwen2_moe-one-process": ("qwen2_moe", []),
    # the gated shared expert whole on every ep rank (its gradient averaged over dp) and tp rank
    "qwen2_moe-dp2-ep2-zero2": ("qwen2_moe", [*EP2, "--parallel.zero=2"]),
    "qwen2_moe-tp2-sp": ("qwen2_moe", ["--parallel.tp=2", "--parallel.sequence_parallel=true"]),
    "mixtral-dp2-zero3": ("mixtral", ["--parallel.dp=2", "--parallel.zero=3"]),
    "mixtral-dp2-ep2": ("mixtral", EP2),  # the headline: experts cut over ep, tokens moved by all-to-all
    "qwen3_moe-dp2-ep2-zero3-recompute-grouped_mm": ("qwen3_moe", [*EP2, "--parallel.zero=3",
                                                                   "--memory.checkpointing=full",
                                                                   "--parallel.moe_grouped_mm=true"]),
    "mixtral-dp2-ep2-pp2": ("mixtral", [*EP2, "--parallel.pp=2", "--train.micro_batch=1"]),
    # experts whole on every tp rank (as bigtrain's Llama's MoE blocks); Qwen3-MoE's dense layer 0 cut
    "qwen3_moe-tp2": ("qwen3_moe", ["--parallel.tp=2"]),
    "mixtral-tp2-sp-grouped_mm": ("mixtral", ["--parallel.tp=2", "--parallel.sequence_parallel=true",
                                              "--parallel.moe_grouped_mm=true"]),
}


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_moe_layout_matches_transformers_reference(corpus_cache, name):
    arch, overrides = LAYOUTS[name]
    needs_its_transformers(arch)
    assert_layout_matches_reference(corpus_cache, arch, overrides, name)


def test_an_expert_parallel_layout_runs_the_all_to_all_dispatch_on_its_half_of_the_experts(corpus_cache, tmp_path):
    """The seam ep rests on: each rank's sparse blocks hold 2 of the 4 experts and dispatch by
    all-to-all (bigtrain/parallel/experts.py found them as MoE blocks)."""
    cfg = hf_config(corpus_cache, "mixtral", *EP2)
    held = run_ranks(_expert_banks, 2, cfg, str(tmp_path))
    block = sparse_blocks(hf_family.hf_config(cfg)).attribute  # block_sparse_moe (transformers 4) or mlp (5)
    for rank_banks in held:
        assert rank_banks == {f"model.layers.{i}.{block}.moe": (2, "AllToAllDispatch") for i in range(2)}


def _expert_banks(rank, world_size, cfg, run_dir):
    from bigtrain.models.moe import moe_blocks

    model = trainer_on_rank(rank, world_size, cfg, run_dir).parallel.model
    return {n: (b.experts.num_experts, type(b.dispatcher).__name__) for n, b in moe_blocks(model)}


def test_a_router_renormalized_where_qwen3_moe_does_not_fails_the_comparison(corpus_cache, monkeypatch):
    """The seam of norm_topk_prob = false: with the top-k weights renormalized (Mixtral's rule) the
    Qwen3-MoE run must not match transformers' model."""
    import dataclasses

    import bigtrain.families.hf as hf

    def renormalized(conf):
        blocks = sparse_blocks(conf)
        return None if blocks is None else dataclasses.replace(blocks, renormalize=True)

    monkeypatch.setattr(hf, "sparse_blocks", renormalized)  # what the family builds the model from
    cfg = hf_config(corpus_cache, "qwen3_moe")
    losses, weights, _ = train_layout(cfg)
    monkeypatch.undo()
    with pytest.raises(AssertionError):
        assert_matches_reference(losses, weights, reference(corpus_cache, "qwen3_moe"), "renormalized qwen3_moe")


# -- compile: the attention and norms compiled, the MoE block eager (parallel/compile.py) ----------------
def _train_compiled(rank, world_size, cfg, run_dir):
    import warnings

    from bigtrain.parallel.compile import CompileFallbackWarning, graphs_compiled

    with warnings.catch_warnings():
        warnings.simplefilter("error", CompileFallbackWarning)  # a region falling back to eager fails
        trainer = trainer_on_rank(rank, world_size, cfg, run_dir)
        losses = [trainer.train_step().loss for _ in range(STEPS)]
    return losses, trainer.parallel.full_weights(), trainer.parallel.transforms, graphs_compiled()


def test_compiled_moe_layers_compile_around_the_eager_moe_block_and_match_the_reference(corpus_cache, tmp_path):
    """A decoder layer holding an MoE block (data-dependent counts per expert, a host sync) is not
    compiled whole: its attention and norms are compiled regions, the sparse block runs eagerly by
    design (no CompileFallbackWarning), and the run matches transformers' model."""
    cfg = hf_config(corpus_cache, "mixtral", "--compile.enabled=true")
    warm_compiler()
    losses, weights, transforms, graphs = _train_compiled(0, 1, cfg, str(tmp_path))
    for i in range(2):
        layer = f"model.layers.{i}"
        for part in ("self_attn", "input_layernorm", "post_attention_layernorm"):
            assert "compile" in transforms.get(f"{layer}.{part}", ()), transforms
        moe = f"{layer}.{sparse_blocks(hf_family.hf_config(cfg)).attribute}"
        assert not any("compile" in t for n, t in transforms.items()
                       if n in (layer, moe) or n.startswith(f"{moe}.")), transforms
    assert graphs > 0
    assert_matches_reference(losses, weights, reference(corpus_cache, "mixtral"), "mixtral compiled")


# -- bigtrain check: step by step, fp32 and bf16 ---------------------------------------------------------
CHECKED = {
    "mixtral-dp2-ep2": ("mixtral", EP2),
    "qwen3_moe-dp2-ep2-bf16": ("qwen3_moe", [*EP2, "--precision.mode=bf16"]),
    "mixtral-tp2-sp-bf16-recompute": ("mixtral", ["--parallel.tp=2", "--parallel.sequence_parallel=true",
                                                   "--precision.mode=bf16", "--memory.checkpointing=full"]),
}


@pytest.mark.parametrize("name", list(CHECKED))
def test_check_compares_the_moe_family_step_by_step(corpus_cache, tmp_path, name):
    assert_check_agrees(corpus_cache, tmp_path, *CHECKED[name])


@pytest.mark.parametrize("layout", [[], ["--parallel.sp=2"], ["--parallel.cp=2", "--parallel.cp_mode=all-to-all"]])
def test_qwen2_moe_s_sliding_window_is_the_one_its_layers_attend_within(corpus_cache, tmp_path, layout):
    """transformers 5's Qwen2-MoE sets sliding_window on its windowed layers (every other one below
    max_window_layers) and does not pass it to the attention function: read from the keyword alone,
    bigtrain's layers attended over the whole sequence, 25% off the reference's first layer."""
    needs_its_transformers("qwen2_moe")
    from bigtrain.check.run import check_on_rank

    windowed = _variant(tmp_path, "qwen2_moe", use_sliding_window=True, sliding_window=8, max_window_layers=2)
    cfg = hf_config(corpus_cache, "qwen2_moe", windowed, *layout)
    report = run_ranks(check_on_rank, cfg.parallel.world_size, cfg, str(tmp_path / "run"), 2)[0]
    assert report.agree and report.worst["forward"] < 1e-5, report.text()


def test_bf16_routes_with_transformers_rounding(corpus_cache, tmp_path, monkeypatch):
    """The seam of router_dtype = 'input' ('input-logits' under transformers 5): in one process in
    bf16 the sparse blocks compute what transformers' do (the router's linear in bf16; the weights
    cast to bf16 before weighting (transformers 4), or the weighted outputs rounded to bf16 (5)),
    so the first step's layer outputs equal the reference's (the same kernels in the same order);
    with bigtrain's fp32 routing they differ (measured: 6e-3 under transformers 4, 1e-3 under 5),
    which the check's bf16 tolerance on the loss (1e-3) would let through. The first step only: transformers
    5 computes each expert's gate and up projections as one GEMM, whose input gradient it rounds
    once where bigtrain's two GEMMs round twice, so later steps differ by bf16 roundings there."""
    import bigtrain.families.hf_moe as hf_moe
    from bigtrain.check.run import check_on_rank
    from bigtrain.models.moe import MoEFeedForward

    cfg = hf_config(corpus_cache, "mixtral", "--precision.mode=bf16")
    report = run_ranks(check_on_rank, 1, cfg, str(tmp_path / "input"), 1)[0]
    assert report.agree and report.worst["forward"] == 0.0, report.text()

    class RoutedInFP32(MoEFeedForward):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **{**kwargs, "router_dtype": "fp32"})

    monkeypatch.setattr(hf_moe, "MoEFeedForward", RoutedInFP32)  # forked ranks inherit it
    report = run_ranks(check_on_rank, 1, cfg, str(tmp_path / "fp32"), 1)[0]
    assert report.worst["forward"] > 0.0, report.text()


# -- the name conversion: init, export, init_from, generate -------------------------------------------
@pytest.mark.parametrize("arch", ["mixtral", "qwen2_moe", "qwen3_moe"])
def test_the_conversion_round_trips_and_the_trainer_starts_from_transformers_initial_values(corpus_cache, tmp_path,
                                                                                           arch):
    from bigtrain.families.hf_moe import file_views, from_transformers_names, sparse_blocks, to_transformers_names
    from bigtrain.families.hf_reference import HFReference

    needs_its_transformers(arch)
    cfg = hf_config(corpus_cache, arch)
    ours = trainer_on_rank(0, 1, cfg, str(tmp_path)).parallel.full_weights()
    ref = HFReference(cfg)
    blocks = sparse_blocks(ref.model.config)
    theirs = file_views(dict(ref.model.named_parameters()), blocks)
    converted = to_transformers_names(ours, blocks)
    assert set(converted) == set(theirs)
    for name, p in theirs.items():
        assert torch.equal(converted[name], p.detach()), name
    back = from_transformers_names(converted, blocks)
    assert set(back) == set(ours) and all(torch.equal(back[n], ours[n]) for n in ours)


def test_transformers_5_s_three_dimensional_experts_are_cut_into_the_file_s_per_expert_matrices():
    """transformers 5 keeps a block's experts as gate_up_proj (E, 2F, h) and down_proj (E, h, F) and
    names Mixtral's block mlp; CI runs transformers 4, so the cut is checked here on tensors of that
    layout: expert e's gate is gate_up_proj[e, :F], its up gate_up_proj[e, F:], its down down_proj[e],
    as views (copying into one sets the 3-D tensor), and they stack into bigtrain's banks."""
    from bigtrain.families.hf_moe import SparseBlocks, file_views, from_transformers_names

    E, F, h = 3, 4, 5
    blocks = SparseBlocks("mlp", "block_sparse_moe", "MixtralSparseMoeBlock", ("w1", "w3", "w2"), (0,), E, 2, F,
                          True, True, "input-logits")
    gate_up, down = torch.randn(E, 2 * F, h), torch.randn(E, h, F)
    router, norm = torch.randn(E, h), torch.randn(h)
    views = file_views({"model.layers.0.mlp.gate.weight": router, "model.layers.0.mlp.experts.gate_up_proj": gate_up,
                        "model.layers.0.mlp.experts.down_proj": down, "model.norm.weight": norm}, blocks)
    f = "model.layers.0.block_sparse_moe"
    assert set(views) == {"model.norm.weight", f"{f}.gate.weight"} | {
        f"{f}.experts.{e}.{w}.weight" for e in range(E) for w in ("w1", "w2", "w3")}
    assert torch.equal(views[f"{f}.experts.1.w3.weight"], gate_up[1, F:])
    views[f"{f}.experts.2.w2.weight"].zero_()
    assert not down[2].any()
    ours = from_transformers_names(views, blocks)
    assert torch.equal(ours["model.layers.0.mlp.moe.router.weight"], router)
    assert torch.equal(ours["model.layers.0.mlp.moe.experts.w1"], gate_up[:, :F].reshape(E * F, h))
    assert torch.equal(ours["model.layers.0.mlp.moe.experts.w3"], gate_up[:, F:].reshape(E * F, h))
    assert torch.equal(ours["model.layers.0.mlp.moe.experts.w2"], down.transpose(1, 2).reshape(E * F, h))


@pytest.mark.parametrize("changed, sparse", [({}, (1, 3)), ({"decoder_sparse_step": 3}, (2,)), ({"num_experts": 0}, ()),
                                             ({"decoder_sparse_step": 1, "mlp_only_layers": [0, 2]}, (1, 3))])
def test_the_sparse_layers_are_the_ones_transformers_builds(corpus_cache, tmp_path, changed, sparse):
    """Qwen3-MoE's rule (decoder_sparse_step, mlp_only_layers, num_experts) read as its decoder
    layer reads it: the swap finds transformers' sparse block in exactly those layers (it raises
    where it finds another) and leaves the dense MLPs of the others."""
    from bigtrain.config import ModelConfig
    from bigtrain.families.hf import build_meta
    from bigtrain.models.hf_moe import SparseMoE

    fields = json.loads((FIXTURES / "qwen3_moe" / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**fields, "num_hidden_layers": 4, **changed}))
    model = build_meta(tiny_config(corpus_cache, "--model.family=hf", f"--model.hf_config={tmp_path}"))
    assert sparse_blocks(model.config).layers == sparse
    assert tuple(i for i, layer in enumerate(model.model.layers) if isinstance(layer.mlp, SparseMoE)) == sparse
    assert all(type(layer.mlp).__name__ == "Qwen3MoeMLP" for i, layer in enumerate(model.model.layers)
               if i not in sparse)


@pytest.mark.parametrize("arch", ["mixtral", "qwen2_moe", "qwen3_moe"])
def test_an_moe_checkpoint_exports_to_a_folder_from_pretrained_loads_with_equal_logits(corpus_cache, tmp_path, arch):
    """The export cuts each bank into transformers' per-expert weights: ``from_pretrained`` loads
    every tensor (none missing, none left over) and its own model's logits equal the trained
    model's; ``bigtrain generate``'s model of the run (built by the family) has them too."""
    from bigtrain.cli import main
    from bigtrain.families.hf_moe import file_views, sparse_blocks, to_transformers_names
    from bigtrain.generate import load_model

    needs_its_transformers(arch)
    tokens = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(1))
    cfg = hf_config(corpus_cache, arch)
    weights, logits = train_and_save(0, 1, cfg, str(tmp_path / "run"), tokens)
    assert main(["export", str(tmp_path / "run"), str(tmp_path / "out"), "--format", "hf"]) == 0
    loaded, info = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "out"), attn_implementation="sdpa",
                                                                     output_loading_info=True)
    assert type(loaded).__name__ == {"mixtral": "MixtralForCausalLM", "qwen2_moe": "Qwen2MoeForCausalLM",
                                   "qwen3_moe": "Qwen3MoeForCausalLM"}[arch]
    assert not info["missing_keys"] and not info["unexpected_keys"], info
    blocks = sparse_blocks(loaded.config)
    theirs = to_transformers_names(weights, blocks)
    for name, p in file_views(loaded.state_dict(), blocks).items():
        assert torch.equal(p, theirs[name]), name
    with torch.no_grad():
        torch.testing.assert_close(loaded.eval()(tokens).logits, logits, rtol=1e-6, atol=1e-6)
        decoder, _ = load_model(tmp_path / "run")
        torch.testing.assert_close(decoder.model(tokens), logits, rtol=0, atol=0)


def test_an_expert_parallel_checkpoint_exports_every_expert(corpus_cache, tmp_path):
    """Saved at dp2 x ep2 (each rank holding half of each bank), exported whole: transformers loads
    all 4 experts of every layer, equal to the run's."""
    from bigtrain.cli import main
    from bigtrain.families.hf_moe import file_views, sparse_blocks, to_transformers_names

    cfg = hf_config(corpus_cache, "mixtral", *EP2)
    weights = run_ranks(train_and_save, 2, cfg, str(tmp_path / "run"), None)[0]
    assert main(["export", str(tmp_path / "run"), str(tmp_path / "out"), "--format", "hf"]) == 0
    loaded = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "out"))
    blocks = sparse_blocks(loaded.config)
    theirs = to_transformers_names(weights, blocks)
    state = file_views(loaded.state_dict(), blocks)
    assert set(state) == set(theirs) and "model.layers.1.block_sparse_moe.experts.3.w2.weight" in state
    for name, p in state.items():
        assert torch.equal(p, theirs[name]), name


def test_init_from_loads_an_exported_moe_folder_into_expert_parallel_ranks(corpus_cache, tmp_path):
    from bigtrain.cli import main

    cfg = hf_config(corpus_cache, "mixtral")
    weights, _ = train_and_save(0, 1, cfg, str(tmp_path / "run"), torch.zeros(1, 4, dtype=torch.long))
    assert main(["export", str(tmp_path / "run"), str(tmp_path / "out"), "--format", "hf"]) == 0
    resumed = hf_config(corpus_cache, "mixtral", f"--model.init_from=hf:{tmp_path / 'out'}", *EP2)
    loaded = run_ranks(initial_weights, 2, resumed, str(tmp_path / "again"))[0]
    assert set(loaded) == set(weights)
    for name, w in weights.items():
        assert torch.equal(loaded[name], w), name


# -- what is refused, by name, before launch -------------------------------------------------------------
def _variant(tmp_path, arch, **changed):
    fields = json.loads((FIXTURES / arch / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**fields, **changed}))
    return f"--model.hf_config={tmp_path}"


@pytest.mark.parametrize("arch, changed, overrides, field", [
    ("mixtral", {"output_router_logits": True}, [], "output_router_logits"),
    ("qwen3_moe", {"output_router_logits": True}, [], "output_router_logits"),
    ("mixtral", {"router_jitter_noise": 0.1}, [], "router_jitter_noise"),
    ("qwen3_moe", {"hidden_act": "gelu"}, [], "hidden_act"),  # the experts are SwiGLU
    ("mixtral", {"num_experts_per_tok": 5}, [], "num_experts_per_tok"),
    ("mixtral", {}, ["--precision.fp8=rowwise", "--precision.fp8_emulate=true"], "precision.fp8"),
    ("qwen3_moe", {}, ["--memory.activation_compression=int8"], "memory.activation_compression"),
    ("mixtral", {}, ["--parallel.cp=2", "--parallel.sp=2", "--parallel.cp_mode=hybrid"],
     "parallel.cp = 2 x parallel.sp"),
    ("mixtral", {"num_local_experts": 3}, EP2, "parallel.ep = 2 does not divide the expert count"),
    ("qwen3_moe", {"num_experts": 0}, EP2, "expert parallelism needs a mixture-of-experts model"),
    ("qwen2_moe", {"shared_expert_intermediate_size": 0}, [], "shared_expert_intermediate_size"),
    ("qwen2_moe", {"hidden_act": "gelu"}, [], "hidden_act"),  # the shared expert's too
])
def test_moe_refusals_name_the_field(corpus_cache, tmp_path, arch, changed, overrides, field):
    needs_its_transformers(arch)
    with pytest.raises(ConfigError) as err:
        tiny_config(corpus_cache, "--model.family=hf", _variant(tmp_path, arch, **changed), *overrides)
    assert any(field in p for p in err.value.problems), err.value.problems


def test_qwen2_moe_under_transformers_4_is_refused_naming_the_fix(corpus_cache):
    if int(transformers.__version__.split(".")[0]) >= 5:
        pytest.skip("transformers 5 trains Qwen2-MoE")
    with pytest.raises(ConfigError) as err:
        tiny_config(corpus_cache, "--model.family=hf", f"--model.hf_config={FIXTURES / 'qwen2_moe'}")
    assert any("pip install 'transformers>=5'" in p for p in err.value.problems), err.value.problems


def test_expert_parallelism_of_a_dense_config_json_is_refused(corpus_cache):
    with pytest.raises(ConfigError) as err:
        tiny_config(corpus_cache, "--model.family=hf", f"--model.hf_config={FIXTURES / 'llama'}", *EP2)
    assert any("expert count of its model.family = 'hf' description = 0" in p for p in err.value.problems)


# -- the planner -----------------------------------------------------------------------------------------
@pytest.mark.parametrize("arch, changed", [("mixtral", {}), ("qwen3_moe", {}),
                                           ("qwen3_moe", {"decoder_sparse_step": 1}),
                                           ("qwen3_moe", {"decoder_sparse_step": 1, "mlp_only_layers": [0, 7]}),
                                           ("qwen2_moe", {}),
                                           ("qwen2_moe", {"qkv_bias": False, "decoder_sparse_step": 2})])
def test_the_planner_counts_the_moe_parameters_transformers_builds(corpus_cache, tmp_path, arch, changed):
    """The planner's bigtrain Llama of the config.json (experts, top-k, expert size, every k-th block
    sparse but mlp_only_layers (7: past the last layer, which transformers ignores), Qwen2-MoE's
    gated shared expert and q/k/v biases, Qwen3's q/k norms) has the parameters transformers builds."""
    from bigtrain.families.hf import parameter_count, planner_config
    from bigtrain.plan.model import ModelSpec

    needs_its_transformers(arch)
    cfg = hf_config(corpus_cache, arch, _variant(tmp_path, arch, **changed))
    priced = planner_config(cfg)
    spec = ModelSpec.from_model_config(priced.model, priced.data.seq_len)
    assert spec.experts == 4 and spec.top_k == 2
    assert spec.params == parameter_count(cfg)


# Mixtral's shape at a quarter of its width and layers: the MoE search over 4 GPUs takes seconds
# (Mixtral-8x7B's own over 16 takes 40 s of this machine).
SMALL_MIXTRAL = {"architectures": ["MixtralForCausalLM"], "model_type": "mixtral", "hidden_size": 1024,
                 "intermediate_size": 3584, "num_hidden_layers": 8, "num_attention_heads": 8,
                 "num_key_value_heads": 2, "num_local_experts": 8, "num_experts_per_tok": 2, "vocab_size": 32000,
                 "max_position_embeddings": 32768, "rms_norm_eps": 1e-5, "rope_theta": 1e6, "sliding_window": None,
                 "tie_word_embeddings": False}


def test_plan_prices_a_mixtral_config_json_with_expert_parallel_layouts(tmp_path, capsys):
    """``bigtrain plan --config`` of a Mixtral config.json: the parameters transformers builds and
    ranked layouts that cut the experts over ep, each one the family runs."""
    from bigtrain.config import load_config
    from bigtrain.families.hf import parameter_count

    report, toml = plan_config_json(tmp_path, capsys, SMALL_MIXTRAL, seq_len=2048, global_batch=64)
    assert report["params"] == parameter_count(load_config(path=toml))
    ranked = [r["layout"] for r in report["ranked"]]
    assert any(layout.get("ep", 1) > 1 for layout in ranked), ranked[:5]
    for layout in ranked:
        assert layout["v"] == 1 and layout["recompute"] != "selective", layout


# -- the layout fuzzer -------------------------------------------------------------------------------------
def test_the_fuzzer_draws_the_moe_architectures_with_expert_parallelism():
    from bigtrain.check.fuzz import draw_sample

    samples = [draw_sample(5, i, 8, dlrm_share=0.0, hf_share=1.0) for i in range(60)]
    specs = [o for s in samples for o in s if o.startswith("--model.hf_config=tiny:")]
    assert any("tiny:mixtral" in s for s in specs), specs
    assert any("tiny:qwen3_moe" in s for s in specs), specs
    assert any("tiny:qwen2_moe" in s for s in specs), specs
    moe = [s for s in samples if any(o.startswith("--model.hf_config=tiny:") and ("_moe" in o or "mixtral" in o)
                                     for o in s)]
    assert any("--parallel.ep=2" in s for s in moe), moe


def test_a_fuzzed_moe_sample_with_expert_parallelism_agrees(corpus_cache):
    from bigtrain.check.fuzz import run_sample

    sample = ["--model.family=hf", "--model.hf_config=tiny:qwen3_moe:3:2:False", "--parallel.dp=2", "--parallel.ep=2",
              "--parallel.zero=2", "--train.micro_batch=2", "--train.global_batch=4", "--optim.grad_clip=1.0",
              "--optim.warmup_steps=2", "--memory.checkpointing=none"]
    outcome = run_sample(sample, corpus_cache, steps=2)
    assert outcome.verdict == "agree", outcome.detail
