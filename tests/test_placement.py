"""The placement record is the seam: a parameter placed somewhere new is reduced, clipped and
initialized right by every engine with no code of its own.

An expert-like parameter: a bank of E experts sharded over ``ep`` (each rank holds E/ep of them and
sends its own tokens through them), replicated over ``edp``, so its gradient is a sum over the
ranks sharing its ep coordinate (edp) only, while the dense weights beside it are reduced over
every data-parallel rank. Against a plain single-process computation of the same loss: the reduced
gradients, the clipped global norm and the weights after two clipped SGD steps, under the
replicated engine and ZeRO 1-3 (where the expert and dense weights of one block become two units,
cut over different groups). A wrong placement (the experts treated as dense) must fail the same
comparison, so the comparison can fail. Checkpoints read the same record: a run saved under one
engine resumes under another and continues like one process.
"""

from __future__ import annotations

import zlib

import pytest
import torch
from torch import nn
from torch.func import functional_call

import sgd_momentum  # noqa: F401 - registers "sgd_momentum" through the optimizer seam
from pathlib import Path

from bigtrain.checkpoint.sharded import ChunkReader, save_chunks
from bigtrain.config import OptimConfig
from bigtrain.distributed.mesh import Mesh
from bigtrain.parallel.parallel_model import ParallelModel
from bigtrain.parallel.placement import Placement, Placements, ShardSpec, dense
from bigtrain.parallel.replicated import ReplicatedEngine
from bigtrain.parallel.zero import ZeroEngine
from bigtrain.precision import Precision
from bigtrain.testing import run_ranks
from helpers import assert_rel_close

DIM, EXPERTS, EP, WORLD, BATCH, STEPS = 8, 4, 2, 4, 6, 2
LR, MAX_NORM = 0.05, 0.05  # the norm is ~0.3 at step 0: clipping acts
OPTIM = OptimConfig(name="sgd_momentum", lr=LR, weight_decay=0.0, beta1=0.9)


class Block(nn.Module):
    def __init__(self, experts: int):
        super().__init__()
        self.dense = nn.Linear(DIM, DIM, bias=False)
        self.experts = nn.Parameter(torch.empty(experts, DIM * DIM))  # 2-D: checkpoint chunks are 1-D or 2-D

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.dense(x))
        chosen = self.experts[torch.arange(len(x)) % len(self.experts)]  # token i -> local expert i mod n
        return x + torch.einsum("bd,bde->be", h, chosen.view(-1, DIM, DIM))


class ToyMoE(nn.Module):
    def __init__(self, experts: int):
        super().__init__()
        self.blocks = nn.ModuleList(Block(experts) for _ in range(2))
        self.head = nn.Linear(DIM, 1, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return self.head(x).squeeze(-1)


def full_init(name: str, shape: tuple) -> torch.Tensor:
    gen = torch.Generator().manual_seed(zlib.crc32(name.encode()))
    return torch.randn(shape, generator=gen) * 0.4


def batch(step: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(1000 * step + rank)
    return torch.randn(BATCH, DIM, generator=gen), torch.randn(BATCH, generator=gen)


def loss_of(model: nn.Module, step: int, rank: int, params=None) -> torch.Tensor:
    """Rank ``rank``'s summed squared error, normalized by the global count (gradients are summed)."""
    x, y = batch(step, rank)
    out = model(x) if params is None else functional_call(model, params, (x,))
    return (out - y).pow(2).sum() / (BATCH * WORLD)


def ep_slice(rank: int) -> slice:
    """The experts rank ``rank`` holds: ep is the inner factor of dp, so ranks 0 and 1 form an ep
    group (each holding half the experts), as do 2 and 3; 0 and 2 hold the same half (edp)."""
    local = EXPERTS // EP
    coord = rank % EP
    return slice(coord * local, (coord + 1) * local)


def reference() -> list[dict]:
    """One process: every rank's tokens through the experts that rank holds; torch's clipping and SGD."""
    model = ToyMoE(EXPERTS)
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(full_init(name, tuple(p.shape)))
    optimizer = torch.optim.SGD(model.parameters(), lr=LR, momentum=OPTIM.beta1)
    out = []
    for step in range(STEPS):
        optimizer.zero_grad()
        for rank in range(WORLD):
            full = dict(model.named_parameters())
            params = {n: p[ep_slice(rank)] if n.endswith("experts") else p for n, p in full.items()}
            loss_of(model, step, rank, params).backward()
        grads = {n: p.grad.clone() for n, p in model.named_parameters()}
        norm = float(torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM))
        optimizer.step()
        out.append({"grads": grads, "norm": norm, "weights": {n: p.detach().clone() for n, p in model.named_parameters()}})
    return out


def expert_placements(model: nn.Module, mesh: Mesh, right: bool) -> Placements:
    """Dense weights replicated over dp; experts sharded over ep and replicated over edp (or, when
    not ``right``, wrongly left dense)."""
    placements = Placements.of_model(model, mesh.comm, model_axes=())
    spec = ShardSpec(dim=0, index=mesh.coord("ep"), parts=EP, full_size=EXPERTS, padded_size=EXPERTS, axis="ep")
    for name in placements:
        if name.endswith("experts"):
            placed = Placement(shards=(spec,), replicate=("edp",), partial=("edp",)) if right else \
                dense().with_shard(spec)
            placements.update(name, placed)
    return placements


def _engine(mesh: Mesh, zero: int | None, right: bool):
    with torch.device("meta"):
        model = ToyMoE(EXPERTS // EP)
    placements = expert_placements(model, mesh, right)
    init = placements.local_init(full_init)
    comm = mesh.comm("dp_sp")
    if zero is None:
        model.to_empty(device="cpu")
        with torch.no_grad():
            for name, p in model.named_parameters():
                p.copy_(init(name, tuple(p.shape)))
        return ReplicatedEngine(model, comm, OPTIM, bucket_mb=1e-4, placements=placements)  # several buckets
    return ZeroEngine(model, comm, zero, Precision(torch.float32, torch.float32), OPTIM, init_fn=init,
                      unit_modules=list(model.blocks), placements=placements)


def _train(rank, world_size, cases):
    mesh = Mesh({"dp": world_size, "ep": EP}, rank)
    assert mesh.coord("ep") == rank % EP  # the layout ep_slice assumes
    results = {}
    for zero, right in cases:
        engine = _engine(mesh, zero, right)
        steps = []
        for step in range(STEPS):
            engine.backward(loss_of(engine.model, step, rank))
            engine.finish_grad_sync()
            grads = engine.full_grads()
            norm, _ = engine.step(LR, MAX_NORM)
            engine.zero_grad()
            steps.append({"grads": grads, "norm": norm, "weights": engine.full_weights()})
        results[zero, right] = steps
    return results


def _local(name: str, full: torch.Tensor, rank: int) -> torch.Tensor:
    return full[ep_slice(rank)] if name.endswith("experts") else full


def _compare(steps: list[dict], expected: list[dict], rank: int) -> None:
    for step, (mine, ref) in enumerate(zip(steps, expected)):
        assert mine["norm"] == pytest.approx(ref["norm"], rel=1e-5), f"step {step} rank {rank}: gradient norm"
        for kind in ("grads", "weights"):
            assert set(mine[kind]) == set(ref[kind])
            for name, value in mine[kind].items():
                assert_rel_close(value, _local(name, ref[kind][name], rank), 1e-5, f"step {step} rank {rank} {kind} {name}")


def test_experts_over_ep_are_reduced_over_edp_and_clipped_like_one_process():
    cases = [(None, True), (1, True), (2, True), (3, True), (None, False)]
    expected = reference()
    per_rank = run_ranks(_train, WORLD, cases, timeout=180)
    for rank, results in enumerate(per_rank):
        for zero, right in cases[:-1]:
            _compare(results[zero, right], expected, rank)
        with pytest.raises(AssertionError):  # experts reduced over every dp rank: another model's gradients
            _compare(results[None, False], expected, rank)


def _one_step(engine, step: int, rank: int) -> None:
    engine.backward(loss_of(engine.model, step, rank))
    engine.finish_grad_sync()
    engine.step(LR, MAX_NORM)
    engine.zero_grad()


def _parallel_model(engine, mesh: Mesh) -> ParallelModel:
    return ParallelModel(engine.model, engine, None, engine.placements, mesh.comm("dp_sp"), mesh.comm("sp"),
                         mesh.comm("pp"), [])


def _resume_elsewhere(rank, world_size, pairs, root):
    """Step 0 under one engine, a sharded checkpoint, step 1 under another: the weights after it."""
    mesh = Mesh({"dp": world_size, "ep": EP}, rank)
    out = {}
    for saved_by, loaded_by in pairs:
        path = Path(root) / f"{saved_by}-{loaded_by}"
        before = _engine(mesh, saved_by, right=True)
        _one_step(before, 0, rank)
        save_chunks(path, _parallel_model(before, mesh).owned_chunks())  # DCP checks: no overlap, full cover
        after = _engine(mesh, loaded_by, right=True)
        _parallel_model(after, mesh).load_sharded(ChunkReader(path))
        _one_step(after, 1, rank)
        out[saved_by, loaded_by] = after.full_weights()
    return out


def test_a_checkpoint_of_experts_resumes_under_another_engine(tmp_path):
    """Each expert element is written once (by its edp group's owner) at its place in the full bank,
    and read back into any engine's shards, momentum included: step 1 after the resume equals one
    process."""
    pairs = [(None, 3), (3, None), (1, 2)]
    expected = reference()[1]["weights"]
    for rank, results in enumerate(run_ranks(_resume_elsewhere, WORLD, pairs, str(tmp_path), timeout=180)):
        for pair in pairs:
            for name, value in results[pair].items():
                assert_rel_close(value, _local(name, expected[name], rank), 1e-5, f"{pair} rank {rank} {name}")


def test_placement_records_the_steps_of_parallelize():
    """What the steps record: a cut removes replication there; ZeRO cuts over the gradient axis."""
    p = dense()
    assert (p.replicate, p.partial, p.grad_axis) == (("dp_sp", "tp"), ("dp_sp",), "dp_sp")
    column = p.with_shard(ShardSpec(dim=0, index=1, parts=2, full_size=10, padded_size=16))
    assert column.replicate == ("dp_sp",) and column.full_shape((8, 3)) == (10, 3)
    assert column.sharded_flat().flat == "dp_sp" and column.sharded_flat().replicate == ()
    norm_under_sp = p.with_partial("tp")
    assert norm_under_sp.partial == ("dp_sp", "tp") and norm_under_sp.grad_axis == "dp_sp"
    head_copy = p.with_copy("pp_ends", "tok_embeddings.weight")
    assert "pp_ends" in head_copy.replicate and "pp_ends" in head_copy.partial
    with pytest.raises(ValueError, match="ZeRO cuts a unit over the axis"):
        Placement(flat="tp", partial=("dp_sp",))


def test_the_norm_counts_each_replica_once():
    """On every rank of a 2 x 2 x 2 (pp, dp, tp) mesh: the first replica counts, shards always do."""
    for rank in range(8):
        mesh = Mesh({"pp": 2, "dp": 2, "tp": 2}, rank, make_groups=False)
        replicated, column = dense(), dense().with_shard(ShardSpec(0, mesh.coord("tp"), 2, 4, 4))
        tied = dense().with_copy("pp_ends", None)
        placements = Placements({"norm": replicated, "wq": column, "emb": tied}, mesh.comm)
        first_tp, first_dp = mesh.coord("tp") == 0, mesh.coord("dp") == 0
        assert placements.counted_in_norm("norm") == (first_tp and first_dp)
        assert placements.counted_in_norm("wq") == first_dp
        assert placements.counted_in_norm("emb") == (first_tp and first_dp and mesh.coord("pp") == 0)
        # Checkpoints split the data-parallel replicas' range among them; other replicas: the first writes.
        assert placements.writes_checkpoint("norm") == first_tp and placements.writes_checkpoint("wq")
