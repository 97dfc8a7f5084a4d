"""What :func:`bigtrain.parallel.build.parallelize` returns: this rank's part of the model with its
engine, the placement record, and what reads it (full weights and state by name, sharded
checkpoint chunks)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn

from bigtrain.core.documents import DocumentBoundaries, DocumentIds, document_ids, document_positions
from bigtrain.memory.activations import ActivationMemory
from bigtrain.parallel.compile import Compiled
from bigtrain.distributed.comm import AxisComm
from bigtrain.fp8.linear import Float8Linears
from bigtrain.parallel.pipeline.partition import PipelineStage
from bigtrain.parallel.pipeline.schedules import Schedule
from bigtrain.parallel.context import local_positions, local_sequence
from bigtrain.parallel.chunks import WEIGHT, WEIGHT_IN_USE, SavedChunk, all_finite, chunks, owned_range
from bigtrain.parallel.placement import Placements
from bigtrain.parallel.replicated import ReplicatedEngine
from bigtrain.parallel.ring_attention import chunk_bounds
from bigtrain.parallel.tensor.functional import local_chunk
from bigtrain.parallel.tensor.plan import TensorLayout
from bigtrain.parallel.tied import TiedCopies
from bigtrain.parallel.zero.engine import ZeroEngine

if TYPE_CHECKING:
    from bigtrain.checkpoint.sharded import ChunkReader


def persistent_buffers(model: nn.Module) -> dict[str, torch.Tensor]:
    """The model state that is not a parameter and that checkpoints carry, by name: what
    ``state_dict`` holds besides the parameters (a sigmoid-bias router's bias; the rotary tables
    are not persistent, being derived from the config)."""
    params = {n for n, _ in model.named_parameters(remove_duplicate=False)}
    return {n: t for n, t in model.state_dict(keep_vars=True).items() if n not in params}


def token_loss_sum(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Summed next-token cross-entropy, computed in fp32 whatever the logits' dtype."""
    return F.cross_entropy(logits.float().flatten(0, 1), targets.flatten(), reduction="sum")


def host_copy(t: torch.Tensor) -> torch.Tensor:
    """A copy of ``t`` in host memory: ``checkpoint.async``'s snapshot, held while training goes on
    (on a GPU a second copy of the states it saves would take the device's memory; DCP's async_save
    stages to the host too), priced by the planner (``plan.states.checkpoint_snapshot_bytes``)."""
    return t.detach().to("cpu", copy=True)


@dataclass
class ParallelModel:
    model: nn.Module  # what this rank runs and its engine owns: the model, one pipeline stage, or a group
    engine: ReplicatedEngine | ZeroEngine
    layout: TensorLayout | None
    placements: Placements  # where each of this rank's parameters lives: everyone below reads it
    grad_comm: AxisComm  # the ranks holding replicas of the dense weights (dp, or dp x sp)
    sp: AxisComm
    pp: AxisComm
    checkpointed: list[int]
    stages: dict[int, PipelineStage] = field(default_factory=dict)
    schedule: Schedule | None = None
    tied: TiedCopies | None = None  # copies of tied weights whose twin is on another pipeline rank
    device: torch.device = torch.device("cpu")  # where this rank computes (and its collectives run)
    activations: ActivationMemory | None = None  # recomputation, offload, compression, fused head applied
    float8: Float8Linears | None = None  # the block linears swapped for float8 ones (precision.fp8)
    # What wrapped which module (bigtrain/wrappers.py): {module name: wrapper kinds, outermost first}
    transforms: dict[str, tuple[str, ...]] = field(default_factory=dict)
    compiled: Compiled | None = None  # compile.enabled: the compiled regions and loss
    cp: AxisComm | None = None  # context parallelism: the ranks this rank's sequence chunks are cut over
    cp_mode: str = "ring"  # parallel.cp_mode: how attention runs over them
    # model.attn_mask = 'block_causal': the token ids that delimit documents (None: causal attention)
    documents: DocumentBoundaries | None = None

    @property
    def head_in_loss(self) -> bool:
        """The output head is the loss (``model.fused_loss``): the model ends at its final norm."""
        return self.activations is not None and self.activations.head is not None

    def forward_kwargs(self, start: int | torch.Tensor | None = None) -> dict:
        """What the model (or a pipeline stage) is called with besides its input: ``start_pos`` of
        this rank's sequence chunk (given ``start``), or its tokens' ``positions`` (``start`` a
        tensor: context parallelism's two chunks), and ``with_head=False`` when the head is in the loss."""
        if start is None:
            kwargs = {}
        else:
            kwargs = {"positions": start} if isinstance(start, torch.Tensor) else {"start_pos": start}
        if self.head_in_loss:
            kwargs["with_head"] = False
        return kwargs

    def finish_grad_sync(self) -> None:
        """Complete the gradient reduction (after the last micro-batch), tied copies included."""
        self.engine.finish_grad_sync()
        if self.tied is not None:
            self.tied.sum_grads(self.engine)

    def loss_sum(self, logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        if self.activations is not None and self.activations.head is not None:
            return self.activations.head(logits, targets)  # fused: ``logits`` are the final norm's output
        parallel = self.layout.loss_sum(logits, targets) if self.layout is not None else None
        if parallel is not None:
            return parallel
        if self.compiled is not None and self.compiled.loss_fn is not None:
            return self.compiled.loss_fn(logits, targets)
        return token_loss_sum(logits, targets)

    def sequence_position(self, seq_len: int) -> int | torch.Tensor | None:
        """Where this rank's tokens of a ``seq_len`` sequence sit, for :meth:`forward_kwargs`: their
        global positions under context parallelism, the first one under Ulysses, None when whole."""
        if self.cp is not None and self.cp.size > 1:  # then cut over sp (cp_mode 'hybrid')
            return local_chunk(local_positions(seq_len, self.cp, self.device), self.sp, 0)
        return self.sp.rank * seq_len // self.sp.size if self.sp.size > 1 else None

    def sequence_chunk(self, tokens: torch.Tensor, targets: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor,
                                                                                   int | torch.Tensor | None]:
        """This rank's part of the sequence (all of it without Ulysses or context parallelism) and
        where it sits (:meth:`sequence_position`; None when whole: the model is then called with its
        tokens alone, so a model of one's own need not take ``start_pos``)."""
        if self.cp is not None and self.cp.size > 1:  # each cp rank's two chunks, then Ulysses' part of them
            positions = self.sequence_position(tokens.shape[1]).to(tokens.device)
            tokens, targets = local_sequence(tokens, self.cp), local_sequence(targets, self.cp)
            return local_chunk(tokens, self.sp, 1), local_chunk(targets, self.sp, 1), positions
        if self.sp.size == 1:
            return tokens, targets, None
        start = self.sp.rank * tokens.shape[1] // self.sp.size
        return local_chunk(tokens, self.sp, 1), local_chunk(targets, self.sp, 1), start

    def document_kwargs(self, tokens: torch.Tensor) -> dict:
        """Block-causal attention's inputs for a micro-batch of whole-sequence ``tokens`` (before any
        cut): ``documents``, each token's document over the whole sequence (what attention sees, after
        Megatron SP's gather, Ulysses' or context parallelism's all-to-all), and, with
        ``reset_positions``, ``positions`` restarting at each document, for this rank's tokens (its cp
        chunks, its Ulysses part). Empty when causal.
        Every rank, stage and micro-batch computes them from the same tokens, so they travel as data
        with the micro-batch, never as state on a module."""
        if self.documents is None:
            return {}
        ids = document_ids(tokens, self.documents)
        # The ring (cp_mode 'ring' / 'hybrid') masks each pair of chunks from the ids themselves: a
        # mask of the whole sequence, (seq, seq), is what context parallelism cannot hold.
        if self._attends_in_a_ring():  # each chunk's bounds read once here, not in every layer
            out = {"documents": DocumentIds(ids, chunk_bounds(ids, 2 * self.cp.size))}
        else:
            out = {"documents": ids}
        if self.documents.reset_positions:  # this rank's tokens' positions, cut as its tokens are
            positions = document_positions(tokens, self.documents)
            if self.cp is not None and self.cp.size > 1:
                positions = local_sequence(positions, self.cp)
            out["positions"] = local_chunk(positions, self.sp, 1) if self.sp.size > 1 else positions
        return out

    def _attends_in_a_ring(self) -> bool:
        """Whether the model's attention runs as ring attention (cp_mode 'ring', or 'hybrid': Ulysses
        over sp around the ring)."""
        return self.cp is not None and self.cp.size > 1 and self.cp_mode in ("ring", "hybrid")

    def model_inputs(self, tokens: torch.Tensor, targets: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, dict]:
        """(this rank's tokens, its targets, the keywords the model is called with): the sequence
        chunk, where it sits, the head's place and the documents (per-token ``positions`` take the
        place of ``start_pos`` in the model)."""
        extra = self.document_kwargs(tokens)
        tokens, targets, start = self.sequence_chunk(tokens, targets)
        return tokens, targets, {**self.forward_kwargs(start), **extra}

    def forward_loss(self, tokens: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """This rank's summed loss over its tokens (its sequence chunk under Ulysses)."""
        tokens, targets, kwargs = self.model_inputs(tokens, targets)
        return self.loss_sum(self.model(tokens, **kwargs), targets)

    def gather_named(self, tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """This rank's tensors by parameter name (full over dp already) -> full tensors of the whole
        model, complete on the first rank of the pipeline (empty elsewhere); collective over tp and pp."""
        tensors = self.placements.gather_full(tensors, self.device)
        if self.pp.size == 1:
            return tensors
        parts = self.pp.gather_objects(tensors)
        return {} if parts is None else {k: v for part in parts for k, v in part.items()}

    def full_weights(self) -> dict[str, torch.Tensor]:
        """The whole model's fp32 weights by name (see :meth:`gather_named`)."""
        return self.gather_named(self.engine.full_weights())

    def full_grads(self) -> dict[str, torch.Tensor]:
        """The whole model's reduced, unscaled, unclipped gradients by name (see :meth:`gather_named`)."""
        return self.gather_named(self.engine.full_grads())

    def full_state(self) -> tuple[dict[str, torch.Tensor], dict]:
        """Full (unsharded) weights and optimizer state by name, complete on the first rank of the
        pipeline (its other stages' parts are gathered there); a collective on every rank."""
        weights, optim = self._stage_state()
        if self.pp.size == 1:
            return weights, optim
        spec = self.engine.optim_spec
        parts = self.pp.gather_objects((weights, optim))
        if parts is None:
            return {}, {"optimizer": spec.name, "state": {}}
        return ({k: v for w, _ in parts for k, v in w.items()},
                {"optimizer": spec.name, "state": {k: v for _, o in parts for k, v in o.get("state", {}).items()}})

    def _stage_state(self) -> tuple[dict[str, torch.Tensor], dict]:
        spec = self.engine.optim_spec
        weights, optim = self.engine.full_state()
        state = optim.get("state", {})
        copies = self.placements.copies()  # the first stage saves a tied weight, once
        weights = {n: t for n, t in weights.items() if n not in copies}
        state = {n: t for n, t in state.items() if n not in copies}
        gather = lambda tensors: self.placements.gather_full(tensors, self.device)  # noqa: E731
        weights = gather(weights)
        state = self._by_element_state(state, gather)  # state shaped like a weight is cut like it
        state = self._by_block_state(state, gather=True)
        return weights, {"optimizer": spec.name, "state": state}

    def load_full_state(self, weights: dict[str, torch.Tensor], optim: dict) -> None:
        spec = self.engine.optim_spec
        state = spec.saved_state(optim)  # before resharding: a foreign optimizer's state fails here, by name
        for name, canonical in self.placements.copies().items():  # a copy loads the weight it copies
            if canonical in weights:
                weights = {**weights, name: weights[canonical]}
            if canonical in state:
                state = {**state, name: state[canonical]}
        weights = self.placements.shard_full(weights)
        state = self._by_element_state(state, self.placements.shard_full)
        state = self._by_block_state(state, gather=False)
        self.engine.load_full_state(weights, {"optimizer": spec.name, "state": state})

    # -- sharded checkpoints (torch.distributed.checkpoint) ---------------------------------------
    def _pieces(self):
        engine = self.engine
        if isinstance(engine, ZeroEngine):
            from bigtrain.parallel.zero.state import checkpoint_pieces
            return checkpoint_pieces(engine)
        return engine.checkpoint_pieces()

    def _load_batches(self, with_state: bool):
        engine = self.engine
        if isinstance(engine, ZeroEngine):
            from bigtrain.parallel.zero.state import checkpoint_load_batches
            return checkpoint_load_batches(engine, with_state)
        return engine.checkpoint_load_batches(with_state)

    def _readable_pieces(self, deferred: bool):
        """(batch, None), or with offload's files and ``deferred`` (batch, the context manager that reads
        its unit back in): the save reads each chunk as it writes it (:mod:`bigtrain.checkpoint.sharded`)."""
        engine = self.engine
        if deferred and getattr(engine, "offload", None) is not None and engine.offload.store is not None:
            from bigtrain.parallel.zero.state import checkpoint_units
            return checkpoint_units(engine)
        return ((batch, None) for batch in self._pieces())

    def owned_chunks(self, copy: bool = False, deferred: bool = False) -> list:
        """The chunks of full tensors this rank writes (:class:`SavedChunk`): one entry per parameter
        under its canonical name (a tied weight once) and ``optim/<name>/<state>`` per optimizer
        state tensor. Every element has one owner, as the placement record says: its ZeRO shard's
        rank; among the data-parallel replicas of a range (ZeRO stage 0, the replicated engine) an
        even split of it; of the ranks holding the same values over any other axis (tp for a
        replicated norm, pp_ends for a tied copy) the first. Per-tensor state (a step count) is
        written whole by the owner of the parameter's first element. ``copy``: copies of the data in
        host memory (:func:`host_copy`: a snapshot for a write that overlaps training); else views of
        the live shards. Offload's files
        hold a unit's masters and state in memory only while its pieces are listed: ``deferred``
        (a save that writes at once), their chunks are views read back in by the writer, one unit
        at a time (``SavedChunk.readable``); else copies (the whole rank's states in memory at once)."""

        placements = self.placements
        offload = getattr(self.engine, "offload", None)
        files = offload is not None and offload.store is not None
        copy = copy or (files and not deferred)
        out = []
        for batch, readable in self._readable_pieces(deferred and not copy):
            listed = len(out)
            for piece in batch:
                if not placements.writes_checkpoint(piece.name):
                    continue
                placement = placements[piece.name]
                lo, hi = owned_range(piece)
                shape = placement.full_shape(piece.shape)
                for c in chunks(lo, hi, piece.shape, placement.shards):
                    for key, flat in piece.tensors.items():
                        data = flat[c.start - piece.lo:c.stop - piece.lo].view(c.sizes)
                        fqn = piece.name if key == WEIGHT else f"optim/{piece.name}/{key}"
                        out.append(SavedChunk(fqn, shape, c.offsets, host_copy(data) if copy else data))
                if piece.blocks:
                    out += self._block_chunks(piece, lo, hi, copy)
                if lo == 0 < hi and placements.first_part(piece.name):
                    out += [SavedChunk(f"optim/{piece.name}/{k}", tuple(v.shape), (0,) * v.dim(),
                                       host_copy(v) if copy else v.detach()) for k, v in piece.scalars.items()]
            for chunk in out[listed:] if readable is not None else []:
                chunk.readable = readable
                chunk.finite = bool(all_finite(chunk.data))
        if self._writes_buffers():
            out += [SavedChunk(name, tuple(b.shape), (0,) * b.dim(), host_copy(b) if copy else b.detach())
                    for name, b in persistent_buffers(self.model).items()]
        return out

    def _writes_buffers(self) -> bool:
        """Model state outside the parameters (a router's bias) is whole and equal on every rank
        of a pipeline stage: the first rank over the data-parallel and tp axes writes it."""
        return all(self.placements.comm(axis).rank == 0 for axis in ("dp_sp", "tp"))

    def load_sharded(self, reader: "ChunkReader") -> None:
        """Fill this rank's shards (weights and optimizer state) from a sharded checkpoint (its
        :class:`~bigtrain.checkpoint.sharded.ChunkReader`), whatever layout wrote it: each batch (a
        ZeRO unit, or one parameter) reads only the rectangles this rank's new layout holds. No
        collectives."""
        spec = self.engine.optim_spec
        # Optimizer state, if the saving run had stepped: a delayed update's run saved before its
        # first update landed (the first step skipped on overflow) holds its weights in use alone.
        with_state = any(k.startswith("optim/") and not k.endswith(f"/{WEIGHT_IN_USE}") for k in reader.entries)
        in_use = any(k.endswith(f"/{WEIGHT_IN_USE}") for k in reader.entries)
        for batch in self._load_batches(with_state):
            requests, asked = [], {}
            for piece in batch:
                if not in_use:  # saved without a delayed update: the loader sees it is not filled
                    piece.tensors.pop(WEIGHT_IN_USE, None)
                name, shards = self.placements.saved_name(piece.name), self.placements[piece.name].shards
                for c in chunks(piece.lo, piece.hi, piece.shape, shards):
                    for key, flat in piece.tensors.items():
                        fqn = name if key == WEIGHT else f"optim/{name}/{key}"
                        requests.append((fqn, c.offsets, flat[c.start - piece.lo:c.stop - piece.lo].view(c.sizes)))
                if piece.blocks:
                    requests += self._block_requests(piece, name)
                if with_state:
                    for k in spec.tensor_state:
                        # One request per entry: two pieces of a parameter (or the unit's carrier)
                        # share the tensor read (the reader fills one destination per rectangle).
                        fqn = f"optim/{name}/{k}"
                        if fqn not in asked:
                            asked[fqn] = reader.empty(fqn)
                            requests.append((fqn, (0,) * asked[fqn].dim(), asked[fqn]))
                        piece.scalars[k] = asked[fqn]
            reader.read(requests)
        buffers = persistent_buffers(self.model)
        missing = [n for n in buffers if not reader.has(n)]
        if missing:
            raise ValueError(f"{reader.path} has no {', '.join(missing)} (model state outside the parameters, saved "
                             f"since the sigmoid-bias router's bias became a buffer); resume from a newer checkpoint")
        reader.read([(name, (0,) * b.dim(), b) for name, b in buffers.items()])

    def _block_layout(self, names):
        """(block size, the per-block state's placements) for the parameters ``names``."""
        from bigtrain.parallel.blocks import block_placements

        block = self.engine.block
        shapes = {n: tuple(p.shape) for n, p in self.model.named_parameters() if n in names}
        return block, block_placements(self.placements, shapes, block)

    def _by_block_state(self, state: dict[str, dict], gather: bool) -> dict[str, dict]:
        """Per-block state (flat, one value per block of the local or the whole parameter) gathered
        to the whole parameter's blocks, or cut to this rank's, through the block grid's placements."""
        from bigtrain.parallel.blocks import block_grid

        keys = self.engine.optim_spec.block_state
        if not keys or not state:
            return state
        block, placed = self._block_layout(set(state))
        local = {n: tuple(p.shape) for n, p in self.model.named_parameters() if n in state}
        out = {n: dict(s) for n, s in state.items()}
        for k in keys:
            if gather:
                grids = {n: s[k].reshape(block_grid(local[n], block)) for n, s in state.items()}
                moved = placed.gather_full(grids, self.device)
            else:
                grids = {n: s[k].reshape(block_grid(self.placements[n].full_shape(local[n]), block))
                         for n, s in state.items()}
                moved = placed.shard_full(grids)
            for n in out:
                out[n][k] = moved[n].reshape(-1).contiguous()
        return out

    def _block_rectangles(self, piece, blo: int, bhi: int):
        """(chunks of the whole parameter's block grid covering this rank's blocks [blo, bhi), the
        grid's full shape); piece.lo is a block boundary, so its blocks start at piece.lo / block."""
        from bigtrain.parallel.blocks import block_cuts, block_grid

        placement = self.placements[piece.name]
        cuts = block_cuts(piece.name, placement, piece.shape, piece.block)
        grid = block_grid(piece.shape, piece.block)
        full = block_grid(placement.full_shape(piece.shape), piece.block)
        return chunks(blo, bhi, grid, cuts), full

    def _block_chunks(self, piece, lo: int, hi: int, copy: bool) -> list:

        blo, bhi = piece.block_range(lo, hi)
        first = piece.lo // piece.block
        rects, full = self._block_rectangles(piece, blo, bhi)
        name = self.placements.saved_name(piece.name)
        out = []
        for c in rects:
            for key, flat in piece.blocks.items():
                data = flat[c.start - first:c.stop - first].view(c.sizes)
                out.append(SavedChunk(f"optim/{name}/{key}", full, c.offsets, host_copy(data) if copy else data))
        return out

    def _block_requests(self, piece, name: str) -> list:
        blo, bhi = piece.block_range(piece.lo, piece.hi)
        rects, _ = self._block_rectangles(piece, blo, bhi)
        first = piece.lo // piece.block
        return [(f"optim/{name}/{key}", c.offsets, flat[c.start - first:c.stop - first].view(c.sizes))
                for c in rects for key, flat in piece.blocks.items()]

    def _by_element_state(self, state: dict[str, dict], reshard) -> dict[str, dict]:
        """``reshard`` ({param name: tensor} -> same, as for the weights) applied to each of the
        optimizer's per-element state tensors; per-tensor state (a step count) is kept as it is."""
        names = self.engine.optim_spec.element_state
        moved = {k: reshard({n: s[k] for n, s in state.items()}) for k in names}
        return {n: {**s, **{k: moved[k][n] for k in names}} for n, s in state.items()}
