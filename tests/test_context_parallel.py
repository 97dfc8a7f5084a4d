"""Context parallelism (parallel.cp, docs/context-parallel.md): the balanced chunk layout, ring
attention against one process's causal SDPA (forward and backward), whole runs against the
independent one-process reference (``bigtrain.check``, fp32: loss and gradient norm within 1e-5
relative, every weight, gradient and module output within 1e-4, over 4 steps), the ring's traffic
against its formula, and the saved activations per rank."""

from functools import partial

import pytest
import torch
import torch.nn.functional as F

from bigtrain.check.run import check_compiled_on_rank, check_on_rank, save_on_rank
from bigtrain.config import ConfigError
from bigtrain.distributed.mesh import Mesh
from bigtrain.parallel.context import chunk_order, chunks_of, local_positions, local_sequence
from bigtrain.parallel.ring_attention import ring_attention
from bigtrain.testing import run_ranks
from bigtrain.validation import validate
from helpers import compiled_once_for_all_ranks, tiny_config, warm_compiler

SMALL_BATCH = ["--train.global_batch=4", "--train.micro_batch=1"]
MOE = ["--model.moe_experts=4", "--model.moe_top_k=2", "--model.moe_capacity_factor=1.0",
       "--model.moe_aux_loss_coef=0.01"]


def test_each_rank_holds_chunks_i_and_2cp_minus_1_minus_i():
    assert [chunks_of(4, r) for r in range(4)] == [(0, 7), (1, 6), (2, 5), (3, 4)]
    assert chunk_order(2) == [0, 3, 1, 2]


def _ring_vs_sdpa(rank, world_size, seq, heads, kv_heads):
    mesh = Mesh({"cp": world_size}, rank)
    cp = mesh.comm("cp")
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(2, seq, heads, 8, generator=gen, dtype=torch.float64)
    k, v = (torch.randn(2, seq, kv_heads, 8, generator=gen, dtype=torch.float64) for _ in range(2))
    dout = torch.randn(2, seq, heads, 8, generator=gen, dtype=torch.float64)
    # One process: causal SDPA over the whole sequence.
    whole = [t.clone().requires_grad_() for t in (q, k, v)]
    ref = F.scaled_dot_product_attention(*(t.transpose(1, 2) for t in whole), is_causal=True,
                                         enable_gqa=heads != kv_heads).transpose(1, 2)
    ref.backward(dout)
    # This rank: its two chunks of each, through the ring.
    mine = [local_sequence(t, cp).requires_grad_() for t in (q, k, v)]
    out = ring_attention(*mine, cp, partial(chunks_of, world_size))
    out.backward(local_sequence(dout, cp))
    errors = [float((out - local_sequence(ref, cp)).abs().max())]
    errors += [float((t.grad - local_sequence(w.grad, cp)).abs().max()) for t, w in zip(mine, whole)]
    return errors, mesh.stats.sent_bytes("cp", "send")


@pytest.mark.parametrize("cp,heads,kv_heads", [(2, 4, 4), (4, 4, 2), (3, 2, 1)])
def test_ring_attention_equals_causal_attention_forward_and_backward(cp, heads, kv_heads):
    """float64, so rounding is far below the bound: a wrong mask, merge or gradient hop is O(1)."""
    for errors, _ in run_ranks(_ring_vs_sdpa, cp, 4 * cp, heads, kv_heads):
        assert max(errors) < 1e-12, errors


def test_local_positions_follow_the_chunks():
    class Comm:
        size, rank = 2, 1
    assert local_positions(8, Comm()).tolist() == [2, 3, 4, 5]
    assert local_sequence(torch.arange(8)[None], Comm()).tolist() == [[2, 3, 4, 5]]


LAYOUTS = {
    "ring-cp2": ["--parallel.cp=2"],
    "ring-cp4": ["--parallel.cp=4"],
    "all-to-all-cp2": ["--parallel.cp=2", "--parallel.cp_mode=all-to-all"],
    "all-to-all-cp4": ["--parallel.cp=4", "--parallel.cp_mode=all-to-all"],
    # Compositions, at 4 ranks (the machine's budget):
    "ring-cp2-tp2-sequence-parallel": ["--parallel.cp=2", "--parallel.tp=2", "--parallel.sequence_parallel=true"],
    "all-to-all-cp2-tp2-sequence-parallel": ["--parallel.cp=2", "--parallel.cp_mode=all-to-all", "--parallel.tp=2",
                                             "--parallel.sequence_parallel=true"],  # 1 kv head per tp rank: replicated
    "ring-cp2-dp2-zero3": ["--parallel.cp=2", "--parallel.dp=2", "--parallel.zero=3"],
    "all-to-all-cp2-dp2-zero3": ["--parallel.cp=2", "--parallel.dp=2", "--parallel.zero=3",
                                 "--parallel.cp_mode=all-to-all"],
    "ring-cp2-pp2": ["--parallel.cp=2", "--parallel.pp=2"],
    "ring-dp2-cp2-tp2-sequence-parallel-zero2-8-ranks": ["--parallel.dp=2", "--parallel.cp=2", "--parallel.tp=2",
                                                         "--parallel.sequence_parallel=true", "--parallel.zero=2"],
    "hybrid-cp2-sp2": ["--parallel.cp=2", "--parallel.sp=2", "--parallel.cp_mode=hybrid"],
    "hybrid-cp4-sp2-8-ranks": ["--parallel.cp=4", "--parallel.sp=2", "--parallel.cp_mode=hybrid"],
    "hybrid-cp2-sp2-kv1": ["--parallel.cp=2", "--parallel.sp=2", "--parallel.cp_mode=hybrid", "--model.n_kv_heads=1"],
    "ring-cp2-selective-recompute-of-attention": ["--parallel.cp=2", "--memory.checkpointing=selective",
                                                  "--memory.selective_attention=true"],
    "ring-cp2-activation-offload": ["--parallel.cp=2", "--memory.checkpointing=full", "--memory.activation_offload=true"],
    "ring-cp2-bf16": ["--parallel.cp=2", "--precision.mode=bf16"],  # against a bf16 reference: 1e-3
    "ring-cp2-full-recompute-fused-loss": ["--parallel.cp=2", "--memory.checkpointing=full", "--model.fused_loss=true"],
    # MoE: capacity 1.0 drops routings, so each token's place in its expert's whole-sequence queue
    # (across the chunk pairs) decides what is kept; the balance loss sums over the cp ranks.
    "ring-cp2-moe-capacity": ["--parallel.cp=2", *MOE],
    "ring-cp4-moe-capacity": ["--parallel.cp=4", *MOE],
    "all-to-all-cp2-moe-ep2": ["--parallel.cp=2", "--parallel.cp_mode=all-to-all", "--parallel.ep=2", *MOE],
    "ring-cp2-tp2-sequence-parallel-moe": ["--parallel.cp=2", "--parallel.tp=2", "--parallel.sequence_parallel=true",
                                           *MOE],
    "ring-cp2-moe-sigmoid-bias-dropless": ["--parallel.cp=2", "--model.moe_experts=4", "--model.moe_top_k=2",
                                           "--model.moe_router=sigmoid-bias", "--model.moe_capacity_factor=0.0"],
    # Masked targets (data.ignore_target: byte 32, the space): each rank's two chunks count different
    # numbers of targets, and the loss is still normalized by the global count.
    "ring-cp2-masked-targets": ["--parallel.cp=2", "--data.ignore_target=32"],
    "all-to-all-cp2-masked-targets": ["--parallel.cp=2", "--parallel.cp_mode=all-to-all", "--data.ignore_target=32"],
    # An odd cp (6 chunks of 6 tokens), and Ulysses over sp = 3 cutting each cp rank's two chunks of 9
    # tokens into parts of 6 that straddle them (6 ranks).
    "ring-cp3": ["--parallel.cp=3", "--data.seq_len=36", "--train.global_batch=3"],
    "hybrid-cp2-sp3-parts-straddle-chunks": ["--parallel.cp=2", "--parallel.sp=3", "--parallel.cp_mode=hybrid",
                                             "--model.n_heads=6", "--model.n_kv_heads=3", "--model.dim=96",
                                             "--data.seq_len=36"],
    # Biases on q, k, v and the output, heads of 6, one key/value head passed round 4 ranks.
    "ring-cp4-biases-head-dim-6-kv1": ["--parallel.cp=4", "--model.attention_bias=true",
                                       "--model.attention_head_dim=6", "--model.n_kv_heads=1"],
}


def _check(corpus_cache, tmp_path, overrides, steps=4):
    cfg = tiny_config(corpus_cache, *SMALL_BATCH, *overrides)
    return run_ranks(check_on_rank, cfg.parallel.world_size, cfg, str(tmp_path), steps, timeout=300)[0]


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_context_parallel_matches_the_reference(name, corpus_cache, tmp_path):
    report = _check(corpus_cache, tmp_path, LAYOUTS[name])
    assert report.agree, report.text()
    assert "forward" in report.worst  # module outputs were put back together and compared


# (overrides on the tiny preset: 4 heads, 2 key/value heads, seq_len 32) -> what the message names
REFUSED = {
    "seq-not-2cp-chunks": (["--parallel.cp=3"], ["data.seq_len = 32", "2 x parallel.cp = 6", "data.seq_len = 30"]),
    "all-to-all-above-query-heads": (["--parallel.cp=8", "--parallel.cp_mode=all-to-all"],
                                     ["parallel.cp = 8", "4 query heads", "cp_mode = 'ring'"]),
    "all-to-all-kv-heads-neither": (["--parallel.cp=2", "--parallel.cp_mode=all-to-all", "--model.n_kv_heads=3",
                                     "--model.n_heads=12", "--model.dim=96"],
                                    ["parallel.cp = 2", "3 key/value heads", "divide by cp"]),
    "unknown-mode": (["--parallel.cp=2", "--parallel.cp_mode=p2p"], ["parallel.cp_mode = 'p2p'", "'ring'"]),
    "hybrid-without-sp": (["--parallel.cp=2", "--parallel.cp_mode=hybrid"],
                          ["parallel.cp_mode = 'hybrid'", "set parallel.sp > 1", "cp_mode = 'ring'"]),
    "ring-with-ulysses": (["--parallel.cp=2", "--parallel.sp=2"], ["parallel.sp = 2", "cp_mode = 'hybrid'"]),
    "hybrid-cp-part-not-cut-by-sp": (["--parallel.cp=2", "--parallel.sp=4", "--parallel.cp_mode=hybrid",
                                      "--data.seq_len=20", "--model.n_kv_heads=4"],
                                     ["data.seq_len / parallel.cp = 10", "parallel.sp = 4", "data.seq_len = 16"]),
    "cp-zero": (["--parallel.cp=0"], ["parallel.cp = 0"]),
    "hybrid-with-moe": (["--parallel.cp=2", "--parallel.sp=2", "--parallel.cp_mode=hybrid", "--model.moe_experts=4"],
                        ["model.moe_experts", "parallel.sp = 1"]),
}


@pytest.mark.parametrize("name", list(REFUSED))
def test_bad_context_parallel_input_is_refused_naming_the_field_and_fix(name, corpus_cache):
    overrides, words = REFUSED[name]
    with pytest.raises(ConfigError) as err:
        tiny_config(corpus_cache, *overrides)
    for word in words:
        assert word in str(err.value), (word, str(err.value))


def test_the_axis_product_must_be_the_world_size(corpus_cache):
    cfg = tiny_config(corpus_cache, "--parallel.cp=2", "--parallel.tp=2")
    with pytest.raises(ConfigError) as err:
        validate(cfg, world_size=2)
    assert "dp x tp x pp x sp x cp = 1 x 2 x 1 x 1 x 2 = 4" in str(err.value) and "launch 4 ranks" in str(err.value), str(err.value)


def test_zero_over_cp_alone_is_not_warned_as_sharding_nothing(corpus_cache):
    """ZeRO's group is dp x cp x sp: at dp = 1 and cp = 4 it shards 4 ways. The preflight warning
    said such a run saved nothing and to set parallel.zero = 0 (4x the states on each rank)."""
    from bigtrain.preflight import layout_warnings

    assert layout_warnings(tiny_config(corpus_cache, "--parallel.cp=4", "--parallel.zero=1")) == []
    assert layout_warnings(tiny_config(corpus_cache, "--parallel.cp=2", "--parallel.sp=2", "--parallel.zero=3",
                                       "--parallel.cp_mode=hybrid")) == []
    assert "nothing is saved" in layout_warnings(tiny_config(corpus_cache, "--parallel.zero=1"))[0]


def test_all_to_all_cp_above_the_kv_heads_replicates_them(corpus_cache):
    """4 query heads, 2 key/value heads, cp = 4: each cp rank gets one query head and a copy of its
    key/value head (as Ulysses does over sp); accepted, and trained in the parity tests' layouts."""
    tiny_config(corpus_cache, "--parallel.cp=4", "--parallel.cp_mode=all-to-all")


def test_the_cli_refuses_bad_context_parallel_input_before_any_rank_starts(tmp_path, capsys, monkeypatch):
    import bigtrain.cli as cli
    import bigtrain.distributed.launch as launch

    started = []
    monkeypatch.setattr(cli, "run_rank", lambda cfg, run_dir, lock=None: started.append("rank") or 0)
    monkeypatch.setattr(launch, "launch_local", lambda nproc, argv, **_: started.append("torchrun") or 0)
    monkeypatch.setattr(launch, "init_distributed", lambda *a, **k: started.append("init"))
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.chdir(tmp_path)
    code = cli.main(["train", "--preset", "tiny", "--parallel.cp=3", "--output-dir", str(tmp_path / "run")])
    err = capsys.readouterr().err
    assert code == 2 and started == [] and not (tmp_path / "run").exists()
    assert "data.seq_len = 32 does not split into 2 x parallel.cp = 6 equal chunks" in err, err


# -- measured: saved activations, the ring's traffic, the causal balance --------------------------
LONG = ["--train.global_batch=1", "--train.micro_batch=1", "--model.max_seq_len=1024", "--data.seq_len=1024"]


def _one_step(rank, world_size, cfg, run_dir):
    from helpers import trainer_on_rank

    result = trainer_on_rank(rank, world_size, cfg, run_dir).train_step(measure=True)
    return result.mem["activations"], result.comm_ops.get("cp", {})


def test_saved_activations_per_rank_at_cp4_are_a_quarter_of_one_process(corpus_cache, tmp_path):
    """Same 1024-token sequence (tiny model, ring mode). Every saved tensor is per token and the ring
    saves what one process's SDPA kernel saves for its share (q, k, v, output, log-sum-exp), so a cp
    rank holds 1/4 of cp = 1's, plus its gathered rotary tables and positions (2 x 256 x 8 fp32 + 256
    int64 = 18,432 bytes, 0.6%): measured 3,245,060 against 12,906,508 / 4 (the issue asks 5%). Fails
    if the ring keeps what arrived (autograd through the sends would keep every block and its
    probabilities) or saves its output in a layout the output projection must copy (measured 4.6%)."""
    one = run_ranks(_one_step, 1, tiny_config(corpus_cache, *LONG), str(tmp_path / "one"))[0][0]
    per_rank = max(m for m, _ in run_ranks(_one_step, 4, tiny_config(corpus_cache, *LONG, "--parallel.cp=4"),
                                           str(tmp_path / "cp4"), timeout=300))
    assert abs(per_rank / (one / 4) - 1) < 0.01, (per_rank, one)


@pytest.mark.parametrize("cp", [2, 4])
def test_ring_bytes_per_layer_equal_the_formula(cp, corpus_cache, tmp_path):
    """KV = 2 x batch x seq/cp x kv heads x head_dim x 4 bytes (fp32) per rank and layer: the forward
    sends (cp - 1) KV, the backward (cp - 1) KV again and cp KV of gradients (ring_grad)."""
    cfg = tiny_config(corpus_cache, *LONG, f"--parallel.cp={cp}")
    m = cfg.model
    kv = 2 * 1 * (cfg.data.seq_len // cp) * m.kv_heads * m.head_dim * 4
    for _, sent in run_ranks(_one_step, cp, cfg, str(tmp_path), timeout=300):
        assert sent["send:ring"] == m.n_layers * 2 * (cp - 1) * kv
        assert sent["send:ring_grad"] == m.n_layers * cp * kv


def test_the_planners_ring_traffic_is_what_a_bf16_run_sends(corpus_cache, tmp_path):
    """In bf16 the keys and values travel in bf16 but their gradients in fp32 (the ring accumulates
    them wide), so the backward sends (cp - 1) KV of 2-byte elements and cp KV of 4-byte ones. The
    planner priced both at the compute dtype: the gradients' half, and 3/8 of the backward's bytes
    at cp = 2, went uncounted. The planner's seconds on a link of one byte a second and no latency
    are its bytes."""
    _planned_ring_bytes_are_sent(corpus_cache, tmp_path, "--parallel.cp=2", "--precision.mode=bf16")


@pytest.mark.parametrize("layout", [["--parallel.cp=2", "--parallel.tp=2"],
                                    ["--parallel.cp=2", "--parallel.sp=2", "--parallel.cp_mode=hybrid"]],
                         ids=["ring-cp2-tp2", "hybrid-cp2-sp2"])
def test_the_planners_ring_traffic_counts_replicated_key_value_heads(layout, corpus_cache, tmp_path):
    """One key/value head, fewer than tp (or than sp under hybrid): each rank holds a copy of it
    (tensor-parallel and Ulysses replication), and the ring passes that whole head, not kv_dim / tp
    (or / sp) of one: the planner counted half the bytes a run sends."""
    _planned_ring_bytes_are_sent(corpus_cache, tmp_path, *layout, "--model.n_kv_heads=1",
                                 "--precision.mode=fp32", seq=64)


@pytest.mark.parametrize("layout", [["--parallel.cp=2", "--parallel.cp_mode=all-to-all"],
                                    ["--parallel.cp=4", "--parallel.cp_mode=all-to-all"],
                                    ["--parallel.sp=4"]],
                         ids=["all-to-all-cp2-heads-split", "all-to-all-cp4-heads-replicated", "ulysses-sp4"])
def test_the_planners_head_exchange_traffic_is_what_a_run_sends(layout, corpus_cache, tmp_path):
    """The all-to-alls that give each rank whole heads (Ulysses over sp, or over cp): 2 key/value
    heads over 4 ranks are replicated first (replicate_kv_heads), so each rank's keys and values
    leave at 4 heads' width, not 2; the planner priced the 2 (3/4 of the bytes sent). Its seconds on
    a link of one byte a second with no latency are its bytes; forward and backward send the same."""
    from dataclasses import replace

    from bigtrain.plan.cost import stage_costs
    from bigtrain.plan.fit import _layout
    from bigtrain.plan.hardware import get_profile
    from bigtrain.plan.layout import Cluster
    from bigtrain.plan.model import ModelSpec

    cfg = tiny_config(corpus_cache, *LONG, "--model.max_seq_len=64", "--data.seq_len=64", "--precision.mode=fp32",
                      *layout)
    hardware = replace(get_profile("cpu"), intra_node_bandwidth=1.0, intra_node_latency_s=0.0)
    planned = stage_costs(ModelSpec.from_model_config(cfg.model, cfg.data.seq_len), _layout(cfg),
                          Cluster.build(cfg.parallel.world_size, hardware, cfg.parallel.world_size))
    axis = "cp" if cfg.parallel.cp > 1 else "sp"

    def exchanged(rank, world_size, cfg, run_dir):
        from helpers import trainer_on_rank

        return trainer_on_rank(rank, world_size, cfg, run_dir).train_step().comm_ops[axis]["all_to_all:ulysses"]

    for sent in run_ranks(exchanged, cfg.parallel.world_size, cfg, str(tmp_path), timeout=300):
        assert (planned.comm_f, planned.comm_b) == (sent / 2, sent / 2), (planned, sent)


def _planned_ring_bytes_are_sent(corpus_cache, tmp_path, *overrides: str, seq: int = 1024) -> None:
    """The planner's ring seconds on a link of one byte a second and no latency are its bytes: the
    forward's equal what a run sends as ``ring`` in the forward (half of it: the backward sends the
    blocks again), the backward's that half plus the gradients (``ring_grad``), on every rank."""
    from bigtrain.plan.cost import ring_seconds
    from bigtrain.plan.fit import _layout
    from bigtrain.plan.links import Link
    from bigtrain.plan.model import ModelSpec

    cfg = tiny_config(corpus_cache, *LONG, f"--model.max_seq_len={seq}", f"--data.seq_len={seq}", *overrides)
    model = ModelSpec.from_model_config(cfg.model, cfg.data.seq_len)
    layout = _layout(cfg)
    forward, backward = ring_seconds(model, layout, Link(bandwidth=1.0, latency=0.0), seq / layout.seq_shards,
                                     cfg.model.n_layers, 0)
    for _, sent in run_ranks(_one_step, cfg.parallel.world_size, cfg, str(tmp_path), timeout=300):
        assert (forward, backward) == (sent["send:ring"] / 2, sent["send:ring"] / 2 + sent["send:ring_grad"]), sent


def _attention_work(cp: int, rank: int, chunks) -> int:
    """Query-key pairs rank ``rank`` computes (chunk size 1: a pair of chunks a >= b is a x b work)."""
    from bigtrain.parallel.ring_attention import _pairs

    return sum(1 for step in range(cp) for _ in _pairs(chunks(cp, rank), chunks(cp, (rank - step) % cp)))


def test_the_balanced_chunks_give_every_rank_the_same_causal_work():
    """Chunk pairs each rank computes (a causal pair on the diagonal counts as one): 2cp + 1 on every
    rank with chunks i and 2cp-1-i; with a contiguous cut (chunks 2i, 2i+1) rank cp-1 does 4cp - 1
    against rank 0's 3, about twice the mean."""
    for cp in (2, 4, 8):
        assert {_attention_work(cp, r, chunks_of) for r in range(cp)} == {2 * cp + 1}
        contiguous = [_attention_work(cp, r, lambda n, i: (2 * i, 2 * i + 1)) for r in range(cp)]
        assert contiguous[0] == 3 and contiguous[-1] == 4 * cp - 1


def _cores(rank, world_size, cfg, run_dir):
    from helpers import trainer_on_rank
    from bigtrain.parallel.context import attention_cores

    trainer = trainer_on_rank(rank, world_size, cfg, run_dir)
    model = trainer.model
    return {name: (type(model.get_submodule(name)).__name__, len(model.get_submodule(name)._forward_pre_hooks),
                   trainer.parallel.transforms.get(name, ())) for name in attention_cores(model)}


@pytest.mark.parametrize("mode,sp,kind,pre_hooks", [("ring", 1, "RingAttention", 0),
                                                    ("all-to-all", 1, "AttentionCore", 1),
                                                    ("hybrid", 2, "RingAttention", 1)])
def test_every_attention_core_gets_its_context_parallel_attention(mode, sp, kind, pre_hooks, corpus_cache, tmp_path):
    """Named, not by a tolerance: each core (found by type) is the ring wrapper, or carries the
    all-to-all hooks; under hybrid the ring wrapper carries the Ulysses hooks over sp."""
    cfg = tiny_config(corpus_cache, "--parallel.cp=2", f"--parallel.sp={sp}", f"--parallel.cp_mode={mode}")
    for cores in run_ranks(_cores, cfg.parallel.world_size, cfg, str(tmp_path)):
        assert len(cores) == cfg.model.n_layers
        for name, (got, hooks, transforms) in cores.items():
            assert (got, hooks) == (kind, pre_hooks), (name, got, hooks)
            assert ("ring_attention" in transforms) == (kind == "RingAttention"), (name, transforms)


@pytest.mark.parametrize("saved,resumed", [(["--parallel.cp=2", "--parallel.dp=2", "--parallel.zero=3"],
                                            ["--parallel.dp=4", "--parallel.zero=3"]),
                                           (["--parallel.dp=2", "--parallel.zero=1"],
                                            ["--parallel.cp=2", "--parallel.dp=2", "--parallel.zero=1"])],
                         ids=["cp2-dp2-zero3-to-dp4-zero3", "dp2-zero1-to-cp2-dp2-zero1"])
def test_a_checkpoint_moves_between_cp_and_plain_layouts(saved, resumed, corpus_cache, tmp_path):
    """2 steps saved in one layout, resumed in the other: what loaded is bitwise what was saved, and
    the next 3 steps match the reference that replayed the first 2."""
    a = tiny_config(corpus_cache, *SMALL_BATCH, *saved)
    state = run_ranks(save_on_rank, a.parallel.world_size, a, str(tmp_path), 2, timeout=300)[0]
    b = tiny_config(corpus_cache, *SMALL_BATCH, *resumed)
    report = run_ranks(check_on_rank, b.parallel.world_size, b, str(tmp_path), 3, state, timeout=300)[0]
    assert report.agree and report.start == 2, report.text()


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["ring"])
def test_compiled_blocks_under_context_parallelism_match_the_reference(mode, corpus_cache, tmp_path):
    """compile.enabled: the ring runs eagerly inside the compiled blocks (a graph break around its
    Python-side traffic), the rest compiled; 3 steps as tests/test_compile.py, and as there a region
    that falls back to eager fails the check (check_compiled_on_rank). The all-to-all mode compiled
    (30 s of a cold compile more, which the suite's 15 minutes no longer hold) is the fuzzer's:
    ``python -m bigtrain.check.fuzz N SEED --cp-share 1 --compile-share 1``."""
    warm_compiler()  # the forked ranks inherit inductor's set-up
    cfg = tiny_config(corpus_cache, *SMALL_BATCH, "--compile.enabled=true", "--parallel.cp=2",
                      f"--parallel.cp_mode={mode}")
    with compiled_once_for_all_ranks(tmp_path / "compiled"):  # both ranks compile the same graphs
        report = run_ranks(check_compiled_on_rank, cfg.parallel.world_size, cfg, str(tmp_path), 3, timeout=300,
                           group_timeout=300)[0]  # a rank waits on its peer compiling from a cold cache
    assert report.agree, report.text()


@pytest.mark.parametrize("causal", [False, True])
def test_the_cpu_flash_pair_equals_the_whole_pair(causal):
    """A chunk pair's forward (output, log-sum-exp) and backward (dq, dk, dv against a merged
    output and log-sum-exp that are not this pair's alone) by the CPU flash kernel the ring uses
    on CPU and by the materialized scores it uses elsewhere, in float64: equal to rounding."""
    from bigtrain.parallel.ring_attention import (_pair_backward, _pair_forward, _whole_pair_backward,
                                                  _whole_pair_forward)

    gen = torch.Generator().manual_seed(0)
    q, k, v, do = (torch.randn(2, 3, 64, 16, dtype=torch.float64, generator=gen) for _ in range(4))
    scale = 16 ** -0.5
    flash, whole = _pair_forward(q, k, v, scale, causal), _whole_pair_forward(q, k, v, scale, causal)
    for a, b in zip(flash, whole):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)
    # as if another pair had been merged in: a larger log-sum-exp and a different output
    out, lse = flash[0] * 0.5 + 0.1, flash[1] + 0.7
    delta = (do * out).sum(-1)
    for a, b in zip(_pair_backward(do, q, k, v, out, lse, delta, scale, causal),
                    _whole_pair_backward(do, q, k, v, lse, delta, scale, causal)):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)


def _hybrid_moe_sequence_view(rank, world_size):
    from bigtrain.config import ModelConfig
    from bigtrain.models.llama import Llama
    from bigtrain.parallel.build import apply_tensor_parallel
    from bigtrain.parallel.context import apply_context_parallel
    from bigtrain.parallel.parallel_plan import TensorParallelPlan

    mesh = Mesh({"cp": 2, "sp": 2}, rank)
    with torch.device("meta"):
        model = Llama(ModelConfig(dim=32, n_layers=1, n_heads=4, n_kv_heads=2, vocab_size=64, max_seq_len=16,
                                  moe_experts=4, moe_top_k=2))
    apply_tensor_parallel(model, mesh, TensorParallelPlan(cp_mode="hybrid"))  # Ulysses: the block's sp parts
    try:
        apply_context_parallel(model, mesh.comm("cp"), "hybrid")
    except ValueError as e:
        return str(e)
    return f"kept: {type(model.layers[0].feed_forward.sequence).__name__}"


def test_parallelize_refuses_an_moe_block_cut_over_both_cp_and_sp():
    """The config refuses cp x sp with experts (context_checks.py); ``parallelize`` called from Python
    did not: cp's chunk pairs silently replaced the block's Ulysses parts, so its capacity and balance
    loss were sized by a sequence sp times too short (a quarter of the tokens seen as a half)."""
    for message in run_ranks(_hybrid_moe_sequence_view, 4, timeout=300):
        assert "layers.0.feed_forward" in message and "parallel.sp = 1" in message, message
