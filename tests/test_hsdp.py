"""Hybrid sharded data parallel (parallel.dp_replicate x parallel.dp_shard, docs/architecture.md):
ZeRO cuts within a group of dp_shard x cp x sp ranks and all-reduces the reduced shards across
dp_replicate groups. Whole runs against the independent one-process reference (``bigtrain.check``,
fp32: loss and gradient norm within 1e-5 relative, every weight, gradient and module output within
1e-4, over 4 steps), checkpoints moved between HSDP and plain layouts, the traffic of each level
against its formula, the mesh's groups and bad input refused before launch."""

import pytest

from bigtrain.check.run import check_on_rank, save_on_rank
from bigtrain.config import ConfigError
from bigtrain.testing import run_ranks
from bigtrain.validation import validate
from helpers import tiny_config

SMALL_BATCH = ["--train.global_batch=4", "--train.micro_batch=1"]
HSDP_2X2 = ["--parallel.dp=4", "--parallel.dp_replicate=2"]
MOE = ["--model.moe_experts=4", "--model.moe_top_k=2"]

LAYOUTS = {
    "hsdp-2x2-zero1": [*HSDP_2X2, "--parallel.zero=1"],
    "hsdp-2x2-zero2": [*HSDP_2X2, "--parallel.zero=2"],
    "hsdp-2x2-zero3": [*HSDP_2X2, "--parallel.zero=3"],
    # Two micro-batches a step: stage 1 reduces once (both levels), stage 2 every micro-batch.
    "hsdp-2x2-zero1-accumulating": [*HSDP_2X2, "--parallel.zero=1", "--train.global_batch=8"],
    "hsdp-2x2-zero2-accumulating-bf16": [*HSDP_2X2, "--parallel.zero=2", "--train.global_batch=8",
                                         "--precision.mode=bf16"],  # against a bf16 reference: 1e-3
    # Three micro-batches in fp32: each unit's replica all-reduce runs while backward goes on and is
    # waited for at the unit's next micro-batch (its fold) or at the step's end.
    "hsdp-2x2-zero2-accumulating": [*HSDP_2X2, "--parallel.zero=2", "--train.global_batch=12"],
    "hsdp-2x2-zero3-accumulating": [*HSDP_2X2, "--parallel.zero=3", "--train.global_batch=12"],
    # A tied embedding's two copies on the pipeline's ends, summed shard by shard after both levels.
    "hsdp-2x1-pp2-tied-zero3": ["--parallel.dp=2", "--parallel.dp_replicate=2", "--parallel.pp=2", "--parallel.zero=3",
                                "--model.tie_embeddings=true", "--train.global_batch=8"],
    # An optimizer that needs shapes: its row / column statistics summed over the ZeRO group only.
    "hsdp-2x2-zero1-adafactor": [*HSDP_2X2, "--parallel.zero=1", "--optim.name=adafactor"],
    # ZeRO groups of one rank (dp_shard = 1): nothing to reduce-scatter, the replicas all-reduce alone.
    "hsdp-2x1-zero1": ["--parallel.dp=2", "--parallel.dp_replicate=2", "--parallel.zero=1"],
    "hsdp-2x1-zero3": ["--parallel.dp=2", "--parallel.dp_replicate=2", "--parallel.zero=3"],
    # Experts under HSDP: ep = 2 inside each replica group; the experts' ZeRO group is the edp ranks
    # of one replica group (edp_shard: one rank here), their reduced shards all-reduced over
    # dp_replicate, beside the dense weights' two levels.
    "hsdp-2x2-ep2-zero1": [*HSDP_2X2, "--parallel.zero=1", "--parallel.ep=2", *MOE],
    "hsdp-2x2-ep2-zero3-accumulating": [*HSDP_2X2, "--parallel.zero=3", "--parallel.ep=2", *MOE,
                                        "--train.global_batch=8"],
    # 8 ranks, ZeRO groups of 4: the experts' ZeRO group has 2 ranks (edp_shard), so both levels cut them.
    "hsdp-2x4-ep2-zero2-8-ranks": ["--parallel.dp=8", "--parallel.dp_replicate=2", "--parallel.zero=2",
                                   "--parallel.ep=2", *MOE, "--train.global_batch=8"],
    # The sigmoid-bias router (its bias moved by the loads summed over every data rank, both levels),
    # clipping that counts each expert shard once (replicated over dp_replicate) and dropped tokens.
    "hsdp-2x2-ep2-zero2-sigmoid-clip-capacity": [*HSDP_2X2, "--parallel.zero=2", "--parallel.ep=2", *MOE,
                                                 "--model.moe_router=sigmoid-bias", "--optim.grad_clip=0.05",
                                                 "--model.moe_capacity_factor=1.0", "--train.global_batch=8"],
    # ep taken from the sequence axes inside a replica group of one data rank: Ulysses sp, then cp.
    "hsdp-2x1-sp2-ep2-zero1": ["--parallel.dp=2", "--parallel.dp_replicate=2", "--parallel.sp=2", "--parallel.zero=1",
                               "--parallel.ep=2", *MOE],
    "hsdp-2x1-cp2-ep2-zero3": ["--parallel.dp=2", "--parallel.dp_replicate=2", "--parallel.cp=2", "--parallel.zero=3",
                               "--parallel.ep=2", *MOE, "--train.global_batch=8"],
    # ZeRO-Offload: the host step reads the shard both levels reduced (tests/test_offload.py runs the
    # GPU path's stream on the CPU too, against the same HSDP run without offload).
    "hsdp-2x2-zero2-offload-cpu": [*HSDP_2X2, "--parallel.zero=2", "--offload.optimizer=cpu", "--train.global_batch=8"],
    "hsdp-2x2-cp2-zero3-8-ranks": ["--parallel.dp=4", "--parallel.dp_replicate=2", "--parallel.dp_shard=2",
                                   "--parallel.cp=2", "--parallel.zero=3", "--train.global_batch=8"],
    # ZeRO groups of 3 (6 ranks): no unit divides evenly, so every shard's padding is in play.
    "hsdp-2x3-zero3-uneven-shards": ["--parallel.dp=6", "--parallel.dp_replicate=2", "--parallel.zero=3",
                                     "--train.global_batch=6"],
}


def _check(corpus_cache, tmp_path, overrides, steps=4):
    cfg = tiny_config(corpus_cache, *SMALL_BATCH, *overrides)
    return run_ranks(check_on_rank, cfg.parallel.world_size, cfg, str(tmp_path), steps, timeout=600)[0]


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_hybrid_sharding_matches_the_reference(name, corpus_cache, tmp_path):
    report = _check(corpus_cache, tmp_path, LAYOUTS[name])
    assert report.agree, report.text()


# -- checkpoints move between HSDP and plain layouts ------------------------------------------------
@pytest.mark.parametrize("saved,resumed", [
    ([*HSDP_2X2, "--parallel.zero=3"], ["--parallel.dp=4", "--parallel.zero=3"]),
    ([*HSDP_2X2, "--parallel.zero=3"], ["--parallel.cp=2", "--parallel.dp=2", "--parallel.zero=3"]),
    ([*HSDP_2X2, "--parallel.zero=3", "--parallel.ep=2", *MOE], ["--parallel.dp=4", "--parallel.zero=3",
                                                                 "--parallel.ep=4", *MOE]),
    (["--parallel.dp=4", "--parallel.zero=1"], [*HSDP_2X2, "--parallel.zero=2"]),
], ids=["hsdp2x2-zero3-to-dp4-zero3", "hsdp2x2-zero3-to-cp2-dp2-zero3", "hsdp2x2-ep2-zero3-to-dp4-ep4-zero3",
        "dp4-zero1-to-hsdp2x2-zero2"])
def test_a_checkpoint_moves_between_hsdp_and_plain_layouts(saved, resumed, corpus_cache, tmp_path):
    """2 steps saved in one layout, resumed in the other: what loaded is bitwise what was saved
    (each shard written once, by the first replica group), and the next 3 steps match the reference
    that replayed the first 2."""
    a = tiny_config(corpus_cache, *SMALL_BATCH, *saved)
    state = run_ranks(save_on_rank, a.parallel.world_size, a, str(tmp_path), 2, timeout=600)[0]
    b = tiny_config(corpus_cache, *SMALL_BATCH, *resumed)
    report = run_ranks(check_on_rank, b.parallel.world_size, b, str(tmp_path), 3, state, timeout=600)[0]
    assert report.agree and report.start == 2, report.text()


# -- the two levels of traffic, and what each rank holds -----------------------------------------------
def _one_step(rank, world_size, cfg, run_dir):
    from helpers import trainer_on_rank

    trainer = trainer_on_rank(rank, world_size, cfg, run_dir)
    engine = trainer.parallel.engine
    units = [(u.comm.axis, u.comm.size, u.replicas.axis, u.replicas.size, u.padded_numel) for u in engine.units]
    result = trainer.train_step(measure=True)
    params = sum(p.numel() for _, p in trainer.model.named_parameters())
    # What the step held (measured after its update, before its fp32 gradients are freed: lazy_grads.py).
    return result.comm_ops, units, {k: result.mem[k] for k in ("params", "grads", "optimizer")}, params


@pytest.mark.parametrize("zero", [2, 3])
def test_gradients_are_reduce_scattered_in_the_group_and_all_reduced_across_replicas(zero, corpus_cache, tmp_path):
    """fp32, one micro-batch a step, padded flat size F (the units' parameters, each unit padded to a
    multiple of dp_shard = S = 2): each rank sends (S-1)/S x 4F bytes of reduce-scatter over dp_shard
    and 2(R-1)/R x 4F/S of all-reduce over dp_replicate (R = 2), and no gradient crosses any other
    group. Fails if the gradient is reduced over all of dp at once (one level) or not across replicas."""
    from bigtrain.plan.fit import _layout
    from bigtrain.plan.hardware import get_profile
    from bigtrain.plan.memory import estimate_memory
    from bigtrain.plan.model import ModelSpec

    cfg = tiny_config(corpus_cache, *SMALL_BATCH, *HSDP_2X2, f"--parallel.zero={zero}")
    planned = estimate_memory(ModelSpec.from_model_config(cfg.model, cfg.data.seq_len), _layout(cfg),
                              get_profile("cpu"), cfg.train.global_batch)
    S = R = 2
    for ops, units, held, params in run_ranks(_one_step, 4, cfg, str(tmp_path), timeout=600):
        # The planner's parameters and gradients per rank are the engine's, byte for byte (its
        # optimizer state below: the moments exact, the step counts a few scalars).
        assert (held["params"], held["grads"]) == (planned.params, planned.grads), (held, planned)
        assert {(a, n, ra, rn) for a, n, ra, rn, _ in units} == {("dp_shard", S, "dp_replicate", R)}, units
        flat = sum(u[-1] for u in units)
        assert params <= flat < params + S * len(units)  # the padding: under S elements a unit
        assert ops["dp_shard"]["reduce_scatter:grads"] == (S - 1) / S * 4 * flat
        assert ops["dp_replicate"]["all_reduce:grads"] == 2 * (R - 1) / R * 4 * flat / S
        grads = {axis for axis, by_op in ops.items() for op in by_op if op.endswith(":grads")}
        assert grads == {"dp_shard", "dp_replicate"}, ops
        # Sharded only within the group of S: AdamW's two fp32 moments of F / S elements each, and a
        # step count (a scalar) for each of the at most two pieces of a unit.
        for optimizer in (held["optimizer"], planned.optimizer):
            assert 0 <= optimizer - 2 * 4 * flat // S <= 8 * 2 * len(units), (held, planned)


@pytest.mark.parametrize("layout", [
    [*HSDP_2X2, "--parallel.zero=1", "--parallel.ep=2", *MOE],
    ["--parallel.dp=4", "--parallel.zero=2", "--parallel.ep=2", *MOE],
], ids=["hsdp2x2-ep2-zero1", "dp4-ep2-zero2"])
def test_the_size_check_prices_the_expert_shards_the_engine_holds(layout, corpus_cache, tmp_path):
    """The layout the size check, the fit check and the run record price (plan/fit.py _layout) has
    the configured ep: under ZeRO 1-2 each rank holds E / ep experts' weights and fp32 gradients
    whole, and the planner's bytes are the engine's, byte for byte (its optimizer state: the moments
    exact, the step counts a few scalars). Fails on a layout without ep, which prices every expert
    on every rank (1.7x the engine's parameters here)."""
    from bigtrain.plan.fit import _layout
    from bigtrain.plan.hardware import get_profile
    from bigtrain.plan.memory import estimate_memory
    from bigtrain.plan.model import ModelSpec

    cfg = tiny_config(corpus_cache, *SMALL_BATCH, *layout)
    assert _layout(cfg).ep == 2
    planned = estimate_memory(ModelSpec.from_model_config(cfg.model, cfg.data.seq_len), _layout(cfg),
                              get_profile("cpu"), cfg.train.global_batch)
    for _, units, held, _ in run_ranks(_one_step, 4, cfg, str(tmp_path), timeout=600):
        assert (held["params"], held["grads"]) == (planned.params, planned.grads), (held, planned, units)
        assert 0 <= held["optimizer"] - planned.optimizer <= 8 * 2 * len(units), (held, planned)


# -- the replica all-reduce overlaps the backward --------------------------------------------------------
class _RecordingComm:
    """A unit's replica comm that logs each all-reduce it is asked for, then does it."""

    def __init__(self, comm, unit: str, log: list):
        self._comm, self._unit, self._log = comm, unit, log

    def all_reduce(self, tensor, *args, **kwargs):
        self._log.append(("replica_all_reduce", self._unit))
        return self._comm.all_reduce(tensor, *args, **kwargs)

    def __getattr__(self, name):
        return getattr(self._comm, name)


def _replica_order(rank, world_size, cfg, run_dir):
    """One step, micro-batch by micro-batch, logging in order: each micro-batch's start, each
    gradient's arrival in a block unit, each replica all-reduce asked for, finish_grad_sync."""
    from helpers import trainer_on_rank

    trainer = trainer_on_rank(rank, world_size, cfg, run_dir)
    engine, log = trainer.engine, []
    for unit in engine.units:
        unit.replicas = _RecordingComm(unit.replicas, unit.name, log)
    handles = [p.register_post_accumulate_grad_hook(lambda _, name=unit.name: log.append(("grad", name)))
               for unit in engine.units if unit.name != "root" for p in unit.params]
    batches = trainer.sampler.micro_batches(trainer.step, trainer.mesh.coord("dp"), trainer.mesh.size("dp"),
                                            cfg.train.micro_batch)
    for i, (tokens, targets) in enumerate(batches):
        log.append(("micro_batch", i))
        trainer._forward_backward(tokens, targets, sync=i == trainer.accum - 1, tracker=None)
    log.append(("finish_grad_sync", None))
    engine.finish_grad_sync()
    for h in handles:
        h.remove()
    return log, [u.name for u in engine.units]


@pytest.mark.parametrize("zero", [1, 2, 3])
def test_the_replica_all_reduce_is_started_while_backward_goes_on(zero, corpus_cache, tmp_path):
    """HSDP 2x2, 4 blocks, 2 micro-batches: in every micro-batch that reduces (stages 2-3: each;
    stage 1: the last, the first accumulating locally) the replica all-reduce of the last-computed
    block is asked for before backward reaches the first block, and all but the last-reduced unit's
    (the root, whose last gradient is the backward's last) before finish_grad_sync; at the end only
    that one is left. A fact of order, not of timing. Fails on a runtime that all-reduces across
    the replicas only when it folds the results (in finish_grad_sync, or at the unit's next
    micro-batch)."""
    cfg = tiny_config(corpus_cache, *SMALL_BATCH, *HSDP_2X2, f"--parallel.zero={zero}", "--model.n_layers=4",
                      "--train.global_batch=8")
    for log, units in run_ranks(_replica_order, 4, cfg, str(tmp_path), timeout=600):
        assert units == ["root", "unit0", "unit1", "unit2", "unit3"], units
        reducing = [0, 1] if zero >= 2 else [1]
        started = {u: 0 for u in units}  # replica all-reduces asked for so far, per unit
        reduced = 0  # micro-batches that reduced so far
        for event, what in log:
            if event == "micro_batch":
                reduced += what in reducing
                reached_first_block = False
            elif event == "replica_all_reduce":
                started[what] += 1
            elif event == "grad" and what == "unit0" and not reached_first_block:
                reached_first_block = True
                assert started["unit3"] == reduced, (zero, started, reduced, log)
            elif event == "finish_grad_sync":
                assert started == {u: len(reducing) - (u == "root") for u in units}, (zero, started, log)
        assert started == {u: len(reducing) for u in units}, (zero, started, log)
        if zero == 1:  # nothing across the replicas while the first micro-batch accumulates
            first = log[:log.index(("micro_batch", 1))]
            assert not any(event == "replica_all_reduce" for event, _ in first), log


# -- the mesh: declared axes, the data rank -------------------------------------------------------------
def test_the_data_rank_is_replicate_index_times_dp_shard_plus_shard_index():
    from bigtrain.distributed.mesh import Mesh

    for rank in range(8):  # dp_replicate 2 x dp_shard 2 x tp 2: tp innermost
        mesh = Mesh({"dp_replicate": 2, "dp_shard": 2, "tp": 2}, rank, make_groups=False)
        r, s = mesh.coord("dp_replicate"), mesh.coord("dp_shard")
        assert (r, s) == (rank // 4, rank // 2 % 2)
        assert mesh.coord("dp") == r * 2 + s and mesh.size("dp") == 4  # the sampler reads these
        assert mesh.gradient_axes() == ("dp_shard_sp", ("dp_replicate",))
    plain = Mesh({"dp": 4}, make_groups=False)
    assert plain.gradient_axes() == ("dp_sp", ()) and plain.counted_name("dp_shard_sp") == "dp"


def test_a_replicated_engine_refuses_hybrid_placements():
    """The seam, by name: zero = 0 reduces each gradient over one group; given HSDP placements it
    would leave the replica groups apart, so it refuses rather than train them apart."""
    from torch import nn

    from bigtrain.distributed.comm import AxisComm, CommStats
    from bigtrain.parallel.data import DataParallel
    from bigtrain.parallel.placement import Placements

    model = nn.Linear(2, 2)
    one = AxisComm("dp", None, 1, 0, CommStats())
    placements = Placements.of_model(model, lambda axis: one, "dp_shard_sp", replica_axes=("dp_replicate",))
    with pytest.raises(ValueError, match="parallel.dp_replicate > 1"):
        DataParallel(model, one, placements=placements)


# -- bad input, before launch ------------------------------------------------------------------------
REFUSED = {
    "product-not-dp": (["--parallel.dp=2", "--parallel.dp_replicate=2", "--parallel.dp_shard=2"],
                       ["parallel.dp = 2", "dp_replicate x parallel.dp_shard = 2 x 2 = 4", "set parallel.dp = 4"]),
    "replicate-not-dividing-dp": (["--parallel.dp=3", "--parallel.dp_replicate=2", "--train.global_batch=6"],
                                  ["parallel.dp_replicate = 2 does not divide parallel.dp = 3"]),
    "replicate-zero": (["--parallel.dp_replicate=0"], ["parallel.dp_replicate = 0", ">= 1"]),
    "zero-stage-0": ([*HSDP_2X2, "--parallel.zero=0"], ["parallel.zero = 0", "use parallel.zero = 1, 2 or 3"]),
    "ep-across-replica-groups": ([*HSDP_2X2, "--parallel.zero=1", "--parallel.ep=4", *MOE],
                                 ["parallel.ep = 4", "dp_shard x cp x sp = 2 x 1 x 1 = 2", "use parallel.ep = 2"]),
}


@pytest.mark.parametrize("name", list(REFUSED))
def test_bad_hybrid_sharding_input_is_refused_naming_the_field_and_fix(name, corpus_cache):
    overrides, words = REFUSED[name]
    with pytest.raises(ConfigError) as err:
        tiny_config(corpus_cache, *SMALL_BATCH, *overrides)
    for word in words:
        assert word in str(err.value), (word, str(err.value))


def test_another_family_is_refused_with_its_own_reason(corpus_cache, tmp_path):
    """A Hugging Face decoder is refused naming the field and the fix, without the DLRM's reason
    (its tables), which the message once gave every family."""
    from bigtrain.check.fuzz_layouts import tiny_hf_config

    hf = ["--model.family=hf", f"--model.hf_config={tiny_hf_config('llama:2:2:False', tmp_path)}"]
    for family, reason in ((hf, False), (["--model.family=dlrm"], True)):
        with pytest.raises(ConfigError) as err:
            tiny_config(corpus_cache, *SMALL_BATCH, *HSDP_2X2, "--parallel.zero=1", *family)
        text = str(err.value)
        assert "hybrid sharding is built and proved for the Llama family" in text, text
        assert "use parallel.dp_replicate = 1" in text and ("DLRM shards its tables" in text) == reason, text


def test_the_axis_product_must_be_the_world_size(corpus_cache):
    cfg = tiny_config(corpus_cache, *SMALL_BATCH, *HSDP_2X2, "--parallel.zero=1")
    with pytest.raises(ConfigError) as err:
        validate(cfg, world_size=2)
    assert "dp x tp x pp x sp x cp = 4 x 1 x 1 x 1 x 1 = 4" in str(err.value), str(err.value)


def test_dp_shard_given_with_dp_is_accepted(corpus_cache):
    cfg = tiny_config(corpus_cache, *SMALL_BATCH, "--parallel.dp=4", "--parallel.dp_replicate=2",
                      "--parallel.dp_shard=2", "--parallel.zero=3")
    assert cfg.parallel.world_size == 4


def _cli(tmp_path, monkeypatch, *args):
    import bigtrain.cli as cli
    import bigtrain.distributed.launch as launch

    started = []
    monkeypatch.setattr(cli, "run_rank", lambda cfg, run_dir, lock=None: started.append(("rank", cfg)) or 0)
    monkeypatch.setattr(launch, "launch_local", lambda nproc, argv, **_: started.append(("torchrun", nproc)) or 0)
    monkeypatch.setattr(launch, "init_distributed", lambda *a, **k: started.append(("init", None)))
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.chdir(tmp_path)
    code = cli.main(["train", "--preset", "tiny", *args, "--output-dir", str(tmp_path / "run")])
    return code, started


def test_the_cli_launches_dp_replicate_times_dp_shard_ranks(tmp_path, capsys, monkeypatch):
    code, started = _cli(tmp_path, monkeypatch, "--parallel.dp_replicate=2", "--parallel.dp_shard=2",
                         "--parallel.zero=1", "--train.global_batch=16")
    assert code == 0 and started == [("torchrun", 4)], (started, capsys.readouterr().err)


def test_the_cli_refuses_bad_hybrid_sharding_before_any_rank_starts(tmp_path, capsys, monkeypatch):
    code, started = _cli(tmp_path, monkeypatch, "--parallel.dp=2", "--parallel.dp_replicate=2",
                         "--parallel.dp_shard=2", "--parallel.zero=1")
    err = capsys.readouterr().err
    assert code == 2 and started == [] and not (tmp_path / "run").exists()
    assert "parallel.dp = 2 but parallel.dp_replicate x parallel.dp_shard = 2 x 2 = 4" in err, err


# -- the planner and the fuzzer know HSDP ---------------------------------------------------------------
def _planned(dp_replicate: int):
    from bigtrain.plan import Cluster, Layout, ModelSpec, evaluate, get_profile

    model = ModelSpec.build(layers=32, hidden=4096, heads=32, vocab=32000, seq=4096)
    cluster = Cluster.build(16, get_profile("h100-80g"))  # two nodes of 8
    layout = Layout(dp=16, zero=3, micro_batch=1, recompute="full", dp_replicate=dp_replicate)
    return model, layout, cluster, evaluate(model, layout, cluster, global_batch=64)


def test_the_planner_prices_the_two_levels_on_their_own_links():
    """dp 16 on two nodes of 8: ZeRO-3 over all 16 gathers across the nodes; HSDP 2 x 8 gathers and
    reduce-scatters inside a node and sends only each unit's reduced shard across (an all-reduce of
    2 ranks on the inter-node link, every micro-batch at ZeRO-3), and holds twice the optimizer state.
    The runtime starts each unit's all-reduce while backward goes on: per micro-batch it hides
    behind comm_overlap of the backward, except the last unit's (the largest unit priced, as the
    reduce-scatter's tail is), which the step waits for once (an earlier micro-batch's is folded a
    micro-batch later): max(largest, excess) + (m - 1) excess, excess = max(0, sum - window). Here the
    window (0.9 x 0.41 s) hides the whole sum (0.039 s a micro-batch), so the last unit's 1.5 ms is left."""
    from bigtrain.plan.cost import stage_costs
    from bigtrain.plan.dp_cost import _largest_rank_units

    _, _, _, flat = _planned(1)
    model, layout, cluster, hsdp = _planned(2)
    hw, m = cluster.hardware, hsdp.time.micro_batches
    shards = [-(-n // 8) * 2 for n in _largest_rank_units(model, layout)]  # bf16 gradients, cut over 8
    # an all-reduce of 2 ranks: latency x (1 + log2 2), and 2 (2-1)/2 S = S bytes on the link
    across = [hw.inter_node_latency_s * 2 + n / hw.inter_node_bandwidth for n in shards]
    costs = stage_costs(model, layout, cluster)
    window = hw.comm_overlap * (costs.compute_b + costs.comm_b)
    assert sum(across) < window  # what this layout shows: all but the last unit's hidden
    excess = max(0.0, sum(across) - window)
    assert hsdp.time.breakdown["dp_replica_sync"] == pytest.approx(max(max(across), excess) + (m - 1) * excess,
                                                                   rel=1e-9)
    assert hsdp.time.breakdown["dp_replica_sync"] == pytest.approx(max(across), rel=1e-9)
    assert "dp_replica_sync" not in flat.time.breakdown
    assert hsdp.time.breakdown["zero_param_gather"] < flat.time.breakdown["zero_param_gather"] / 5  # NVLink
    assert hsdp.memory.optimizer == pytest.approx(2 * flat.memory.optimizer, rel=1e-3)



def test_the_replica_all_reduces_of_earlier_micro_batches_hide_behind_the_next_one():
    """grad_sync.py: a unit's replica all-reduce is waited for when its shard is folded, which for
    every micro-batch but the last is the unit's reduction in the next micro-batch; the root's and
    block 0's (started as a backward ends) then run during the next micro-batch's forward and
    backward, on the dp_replicate link, which carries nothing else. So where the backward's window
    hides the sum of the all-reduces (as in _planned's layout), the step waits on that link only at
    its end, and 4 micro-batches leave exposed what 1 does. Fails on a planner that charges the
    tail once per micro-batch (4 x the largest unit's all-reduce here). Where the link cannot keep
    up, each micro-batch leaves what its window does not hide (a slow replica link below)."""
    from bigtrain.plan import Cluster, evaluate

    model, layout, cluster, four = _planned(2)
    one = evaluate(model, layout, cluster, global_batch=16)
    assert (four.time.micro_batches, one.time.micro_batches) == (4, 1)
    assert four.time.breakdown["dp_replica_sync"] == pytest.approx(one.time.breakdown["dp_replica_sync"], rel=1e-9)
    slow = Cluster.build(16, cluster.hardware.with_values(inter_node_bandwidth=cluster.hardware.inter_node_bandwidth / 400))
    four, one = (evaluate(model, layout, slow, global_batch=b) for b in (64, 16))
    excess = one.time.breakdown["dp_replica_sync"]  # a sum this slow: the window hides a sliver of it
    assert four.time.breakdown["dp_replica_sync"] == pytest.approx(4 * excess, rel=1e-9)


def test_parallel_auto_searches_dp_replicate_and_writes_it():
    from bigtrain.plan.layout import Layout, layout_problems, parse_layout
    from bigtrain.plan.search import candidate_layouts

    model, _, cluster, _ = _planned(2)
    found = {(l.dp, l.dp_replicate) for l in candidate_layouts(model, cluster, {"tp": 1, "pp": 1, "sp": 1, "zero": 3})}
    assert (16, 2) in found and (16, 1) in found  # a ZeRO group per node, or ZeRO over all 16
    assert "--parallel.dp_replicate=2" in Layout(dp=16, zero=3, dp_replicate=2).to_overrides()
    assert parse_layout("dp=16,dp_replicate=2") == {"dp": 16, "dp_replicate": 2}
    assert any("needs zero >= 1" in p for p in layout_problems(Layout(dp=16, dp_replicate=2), model, cluster, 64))


def test_the_planner_cuts_experts_within_a_replica_group_and_searches_hsdp_with_ep():
    """Experts under HSDP are ZeRO-cut over the edp ranks of one replica group (edp_shard = 8 / 4 = 2
    ranks in a node of 8 with ep 4), not over all of edp (4): their optimizer state is twice that of
    ZeRO over all 16 with the same ep; the search offers HSDP with an ep inside the node's group."""
    from bigtrain.plan import Cluster, Layout, ModelSpec, evaluate, get_profile
    from bigtrain.plan.layout import layout_problems
    from bigtrain.plan.memory import rank_units
    from bigtrain.plan.search import candidate_layouts

    model = ModelSpec.build(layers=4, hidden=1024, heads=16, vocab=32000, seq=2048, experts=16, top_k=2)
    cluster = Cluster.build(16, get_profile("h100-80g"))  # two nodes of 8
    flat, hsdp = (Layout(dp=16, zero=3, micro_batch=1, ep=4, dp_replicate=r) for r in (1, 2))
    assert hsdp.size("edp_shard") == 2 and flat.size("edp") == 4
    assert layout_problems(hsdp, model, cluster, 64) == []
    expert_axes = {u.axis for u in rank_units(model, hsdp, 0)[1]}
    assert expert_axes == {"dp_shard_sp", "edp_shard"}, expert_axes
    assert {u.axis for u in rank_units(model, flat, 0)[1]} == {"dp_sp", "edp"}
    a, b = evaluate(model, flat, cluster, global_batch=64), evaluate(model, hsdp, cluster, global_batch=64)
    assert b.memory.optimizer == pytest.approx(2 * a.memory.optimizer, rel=1e-3)  # dense / 8 vs 16, experts / 2 vs 4
    found = {(l.dp_replicate, l.ep) for l in candidate_layouts(model, cluster, {"tp": 1, "pp": 1, "sp": 1, "zero": 3})}
    assert (2, 4) in found and (2, 8) in found and (1, 16) in found
    assert (2, 16) not in found  # ep 16 would cross the nodes' ZeRO groups
    assert any("must divide dp_shard x cp x sp = 8" in p
               for p in layout_problems(Layout(dp=16, zero=3, ep=16, dp_replicate=2), model, cluster, 64))


def test_the_planner_prices_each_expert_shard_all_reduced_across_replicas_as_edp_shard_cut_it():
    """HSDP with experts, ep 4 in node groups of 8: an expert unit is reduce-scattered over its
    edp_shard (2 ranks), so the shard each rank all-reduces across the replicas is half the unit, not
    an eighth as a dense unit's (grad_sync.py; the engine's units in test_hsdp's 8-rank layouts). The
    second level's time is priced from those shards. Fails on a planner that cuts every unit over the
    dense weights' group of 8 (the experts' inter-node traffic 4x under)."""
    from bigtrain.plan import Cluster, Layout, ModelSpec, evaluate, get_profile
    from bigtrain.plan.cost import stage_costs
    from bigtrain.plan.memory import rank_units

    model = ModelSpec.build(layers=4, hidden=1024, heads=16, vocab=32000, seq=2048, experts=16, top_k=2)
    cluster = Cluster.build(16, get_profile("h100-80g"))  # two nodes of 8
    slow = Cluster.build(16, cluster.hardware.with_values(inter_node_bandwidth=cluster.hardware.inter_node_bandwidth / 400))
    layout = Layout(dp=16, zero=3, micro_batch=1, ep=4, dp_replicate=2)
    root, blocks = rank_units(model, layout, 0)
    cuts = {u.axis: layout.size(u.axis) for u in [root, *blocks]}
    assert cuts == {"dp_shard_sp": 8, "edp_shard": 2}, cuts
    hw, grad_bytes = slow.hardware, slow.engine.grad_reduce_bytes or 2
    shards = [-(-u.numel // cuts[u.axis]) * grad_bytes for u in [root, *blocks]]
    across = [hw.inter_node_latency_s * 2 + n / hw.inter_node_bandwidth for n in shards]
    costs = stage_costs(model, layout, slow)
    excess = max(0.0, sum(across) - hw.comm_overlap * (costs.compute_b + costs.comm_b))
    plan = evaluate(model, layout, slow, global_batch=16)
    m = plan.time.micro_batches
    assert plan.time.breakdown["dp_replica_sync"] == pytest.approx(max(max(across), excess) + (m - 1) * excess,
                                                                   rel=1e-9)


def test_the_layout_fuzzer_draws_dp_replicate_and_validation_accepts_it():
    import random

    from bigtrain.check.fuzz import _valid
    from bigtrain.check.fuzz_layouts import sample_layout

    rng = random.Random(5)
    drawn = [s for s in (sample_layout(rng) for _ in range(200)) if any("dp_replicate" in o for o in s)]
    assert len(drawn) >= 3 and sum(map(_valid, drawn)) >= len(drawn) // 2, drawn


def test_the_fit_check_and_the_run_record_see_the_configured_hsdp(corpus_cache):
    """The layout a run records (run_info) and the fit check estimates is the configured one: its
    ZeRO states cut over the group of dp_shard, twice what ZeRO over all of dp would hold."""
    from bigtrain.plan.fit import _layout
    from bigtrain.plan.memory import estimate_memory
    from bigtrain.plan.model import ModelSpec
    from bigtrain.plan.hardware import get_profile
    from bigtrain.run_info import layout_text

    hsdp = tiny_config(corpus_cache, *SMALL_BATCH, *HSDP_2X2, "--parallel.zero=3")
    plain = tiny_config(corpus_cache, *SMALL_BATCH, "--parallel.dp=4", "--parallel.zero=3")
    assert "dp_replicate=2" in layout_text(hsdp) and "dp_replicate" not in layout_text(plain)
    spec = ModelSpec.from_model_config(hsdp.model, hsdp.data.seq_len)
    held = [estimate_memory(spec, _layout(c), get_profile("cpu"), 4).optimizer for c in (hsdp, plain)]
    assert held[0] == pytest.approx(2 * held[1], rel=1e-2), held


def _hsdp_groups(rank, world_size):
    import torch
    import torch.distributed as dist

    from bigtrain.distributed.mesh import Mesh

    mesh = Mesh({"dp_replicate": 2, "dp_shard": 2, "cp": 2}, rank)
    sums = {}
    for axis in ("dp_replicate", "dp_shard_sp", "dp"):
        value = torch.tensor([float(rank)])
        mesh.comm(axis).all_reduce(value)
        sums[axis] = value.item()
    held = {a: dist.get_process_group_ranks(mesh.groups[a]) for a in ("dp_replicate", "dp_shard_sp", "dp")}
    return sums, held, mesh.groups["dp_shard_sp"] is mesh.groups["dp_shard"], mesh.comm("dp_shard_sp").axis


def test_hsdp_groups_on_gloo_ranks():
    """dp_replicate 2 x dp_shard 2 x cp 2 (8 ranks, cp inner): a ZeRO group is dp_shard x cp (4
    adjacent ranks), the replicas are 4 apart, and the data rank spans both factors."""
    groups = {"dp_replicate": [[0, 4], [1, 5], [2, 6], [3, 7]], "dp_shard_sp": [[0, 1, 2, 3], [4, 5, 6, 7]],
              "dp": [[0, 2, 4, 6], [1, 3, 5, 7]]}
    for rank, (sums, held, shared, name) in enumerate(run_ranks(_hsdp_groups, 8, timeout=300)):
        for axis, expected in groups.items():
            mine = next(g for g in expected if rank in g)
            assert held[axis] == mine and sums[axis] == sum(mine), (rank, axis, held, sums)
        assert not shared and name == "dp_shard_sp"  # dp_shard x cp: a group of its own, counted as itself
