"""Context parallelism: the sequence cut over the ``cp`` ranks, attention over all of it.

The layout (docs/context-parallel.md): the sequence is split into 2 x cp equal chunks and cp rank i
holds chunks i and 2cp-1-i, concatenated. Under causal attention chunk c attends to c + 1 chunks'
keys, so every rank does the same work ((i + 1) + (2cp - i) = 2cp + 1 chunk pairs); a contiguous
cut would give the last rank 2cp - 1 pairs against the first's 1 + 2. Tokens and targets are cut the
same way, the rotary positions are each token's global index, and the loss is each rank's sum over
its own targets, normalized by the global count as under Ulysses (the ranks of cp are replicas of
every weight: gradients are reduced over dp x cp x sp, the mesh's ``dp_sp``).

Attention, per ``parallel.cp_mode``:

- ``ring``: :class:`bigtrain.parallel.ring_attention.RingAttention` takes each attention core's
  place (keys and values passed round the ring, online softmax, a ring backward).
- ``hybrid``: Ulysses over ``sp`` inside (adjacent ranks: the all-to-all gives each sp rank the
  whole of its cp rank's part for a share of the heads) and the ring over ``cp`` across, as USP
  does: the ring wrapper takes the core's place and shares its hooks, so the Ulysses hooks the
  tensor plan put on the core run around the ring. Each cp rank's two chunks are cut over sp.
- ``all-to-all``: Ulysses over the cp ranks (the same all-to-alls as ``parallel.sp``, with the same
  key/value head replication), plus one permutation: after the all-to-all the sequence arrives in
  rank order (chunks 0, 2cp-1, 1, 2cp-2, ...), and is put in position order for the causal core and
  back before the return all-to-all.

The cores are found by type (:class:`bigtrain.models.llama.AttentionCore`), not by name or flag, and
:func:`apply_context_parallel` fails when it finds none. A model family without them (the Hugging
Face decoders) gives its own way to attach (``Family.context_parallel``, carried by
``TensorParallelPlan.context_attention``).
"""

from __future__ import annotations

from functools import partial
from typing import Callable

import torch
from torch import nn

from bigtrain.distributed.comm import AxisComm
from bigtrain.models.llama import AttentionCore
from bigtrain.models.moe import MoEFeedForward, WholeSequences
from bigtrain.parallel.ring_attention import RingAttention
from bigtrain.parallel.sequence_moe import ChunkPairsOverCP
from bigtrain.parallel.tensor.functional import all_to_all
from bigtrain.parallel.tensor.styles import replicate_kv_heads
from bigtrain.wrappers import replace_module, unwrapped


def chunks_of(cp: int, rank: int) -> tuple[int, int]:
    """The global chunk indices (of 2 x cp) that cp rank ``rank`` holds, in its order."""
    return rank, 2 * cp - 1 - rank


def chunk_order(cp: int) -> list[int]:
    """Every chunk index in the order the ranks hold them, rank 0 first (an all-gather's order)."""
    return [c for r in range(cp) for c in chunks_of(cp, r)]


def local_positions(seq_len: int, comm: AxisComm, device=None) -> torch.Tensor:
    """The global positions of this cp rank's tokens (its two chunks), as a LongTensor."""
    size = seq_len // (2 * comm.size)
    return torch.cat([torch.arange(c * size, (c + 1) * size, device=device)
                      for c in chunks_of(comm.size, comm.rank)])


def local_sequence(x: torch.Tensor, comm: AxisComm, dim: int = 1) -> torch.Tensor:
    """This cp rank's part of a whole-sequence tensor (token ids, targets): its two chunks along
    ``dim``, concatenated. No gradient flows (the model's inputs)."""
    pieces = x.chunk(2 * comm.size, dim=dim)
    return torch.cat([pieces[c] for c in chunks_of(comm.size, comm.rank)], dim=dim).contiguous()


def _reorder(x: torch.Tensor, order: list[int], dim: int = 1) -> torch.Tensor:
    """Chunk j of the result is chunk ``order[j]`` of ``x`` (differentiable: an index_select)."""
    size = x.shape[dim] // len(order)
    index = torch.cat([torch.arange(c * size, (c + 1) * size) for c in order]).to(x.device)
    return x.index_select(dim, index)


class AllToAllContext:
    """cp_mode 'all-to-all': Ulysses over the cp ranks with the balanced chunks put in position order
    around the core. :meth:`to_whole_sequence` and :meth:`to_local_chunks` are the two halves, in
    the (batch, seq, heads, dim) layout; :meth:`before` and :meth:`after` run them as forward hooks
    on the Llama's core (its own SDPA runs on the whole sequence), the Hugging Face family's attention
    function calls them directly (bigtrain/families/hf_context.py)."""

    def __init__(self, comm: AxisComm):
        self.comm = comm
        order = chunk_order(comm.size)
        self.to_positions = sorted(range(len(order)), key=order.__getitem__)  # where each chunk is held
        self.to_ranks = order

    def to_whole_sequence(self, q: torch.Tensor, *kv: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """(batch, local seq, heads, dim) q and k, v of this rank's two chunks -> the whole sequence
        in position order and this rank's share of the heads (key/value heads replicated when fewer
        than the ranks, as Ulysses does)."""
        comm = self.comm
        whole = [all_to_all(q, comm, split_dim=2, cat_dim=1),
                 *(all_to_all(replicate_kv_heads(t, comm.size), comm, split_dim=2, cat_dim=1) for t in kv)]
        return tuple(_reorder(t, self.to_positions) for t in whole)

    def to_local_chunks(self, out: torch.Tensor) -> torch.Tensor:
        """The dual of :meth:`to_whole_sequence` for the attention's (batch, seq, heads / cp, dim)
        output: this rank's two chunks, all heads."""
        return all_to_all(_reorder(out, self.to_ranks), self.comm, split_dim=1, cat_dim=2)

    def before(self, module, args):
        # rest: block-causal attention's mask, of the whole sequence in position order as q, k, v become
        q, k, v, *rest = args
        return (*self.to_whole_sequence(q, k, v), *rest)

    def after(self, module, args, out):
        return self.to_local_chunks(out)


def attention_cores(model: nn.Module) -> list[str]:
    """Qualified names of the model's attention cores, found by type (under any wrappers)."""
    return [name for name, m in model.named_modules() if isinstance(unwrapped(m), AttentionCore)]


def attach_to_cores(model: nn.Module, comm: AxisComm, mode: str) -> list[str]:
    """bigtrain's Llama: each :class:`AttentionCore` replaced by the ring (``ring``, ``hybrid``) or
    hooked by the all-to-all; returns the cores' names (none for a model without cores)."""
    names = attention_cores(model)
    for name in names:
        core = model.get_submodule(name)
        if mode in ("ring", "hybrid"):  # hybrid: the core's Ulysses hooks (over sp) run around the ring
            replace_module(model, name, RingAttention(core, comm, partial(chunks_of, comm.size)))
        else:
            hooks = AllToAllContext(comm)
            core.register_forward_pre_hook(hooks.before)
            core.register_forward_hook(hooks.after)
    return names


# (model, the cp axis, parallel.cp_mode) -> the names of the modules that now attend over the cut sequence
Attach = Callable[[nn.Module, AxisComm, str], list[str]]


def apply_context_parallel(model: nn.Module, comm: AxisComm, mode: str, attach: Attach | None = None) -> list[str]:
    """Give ``model``'s attention its context-parallel form over ``comm`` (the cp axis) as ``mode``
    says; returns the names of the modules changed. ``attach``: the model family's way
    (``Family.context_parallel``, e.g. bigtrain/families/hf_context.py); None: bigtrain's Llama's
    attention cores (:func:`attach_to_cores`). Nothing attached is an error: a cp run that attended
    only to its own chunks would train without a word."""
    if comm.size == 1:
        return []
    if mode not in ("ring", "all-to-all", "hybrid"):
        raise ValueError(f"parallel.cp_mode = {mode!r}: must be 'ring', 'all-to-all' or 'hybrid'")
    names = (attach or attach_to_cores)(model, comm, mode)
    if not names:
        raise ValueError(f"context parallelism: nothing in a {type(model).__name__} attends over the cut sequence "
                         f"({'its family' if attach else 'no AttentionCore'}; bigtrain/parallel/context.py)")
    for name, module in model.named_modules():  # MoE blocks: capacity and balance over the whole sequence
        block = unwrapped(module)
        if isinstance(block, MoEFeedForward):
            if type(block.sequence) is not WholeSequences:
                # Ulysses (hybrid) gave it its sp parts: replacing them by cp's chunk pairs would size
                # its capacity and balance loss by a sequence sp times too short, silently (the config
                # refuses the pair: context_checks.py; this guards parallelize called from Python).
                raise ValueError(f"context parallelism: the MoE block {name} already holds a part of each "
                                 f"sequence ({type(block.sequence).__name__}, parallel.sp = "
                                 f"{getattr(getattr(block.sequence, 'comm', None), 'size', '?')}); its capacity "
                                 f"queues do not follow a sequence cut over both cp and sp: use parallel.sp = 1 "
                                 f"(cp alone) or parallel.cp = 1")
            block.sequence = ChunkPairsOverCP(comm)
    return names
