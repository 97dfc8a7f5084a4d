"""Ring attention: causal attention over a sequence cut into chunks across the ``cp`` ranks.

Each rank holds its queries, keys and values for the chunks :func:`bigtrain.parallel.context.chunks_of`
gives it (two of 2 x cp, for causal balance). The keys and values travel round the ring, point to
point: at step j a rank computes its queries against the block that started on rank r - j while it
already sends that block on to r + 1 and receives the next (the transfer overlaps the block's
arithmetic). Blocks are merged by their log-sum-exp (the online softmax of flash attention), so the
result is softmax attention over the whole causal prefix, up to rounding.

Block-causal attention (``model.attn_mask = 'block_causal'``): the ring takes the documents as ids
(:class:`~bigtrain.core.documents.DocumentIds`, the whole sequence's, on every rank: 8 bytes a token)
instead of a (seq, seq) mask, which a sequence long enough for context parallelism could not hold.
Each pair of chunks is then one of three (:class:`_ChunkDocuments`): no query sees any key (the
key chunk's documents all ended before the query chunk's first began) and the pair is skipped; no
document boundary inside the pair, and it runs as without documents (flash attention's kernel on a
CPU, causal on the diagonal); or a boundary inside, and the pair's own (chunk, chunk) mask is built
from the ids and its scores materialized. A query row may see no key of a pair (its log-sum-exp is
-inf there); the merge gives such a part no weight, and every row sees its own key on the diagonal.

Backward is a custom autograd Function that runs the ring again (as flash attention recomputes its
probabilities): it saves only this rank's q, k, v, output and log-sum-exp, the same as one
process's attention kernel saves for its share of the sequence. Autograd through the ring's sends
would instead keep every block that arrived (the whole sequence's keys and values on every rank) and
every block's probabilities, which is what context parallelism exists to avoid. The key/value
gradients travel with their block and arrive home after cp hops.

Traffic per layer and rank, with KV = 2 x batch x local tokens x kv heads x head_dim x element size:
forward (cp - 1) KV (tag ``ring``), backward (cp - 1) KV plus cp KV of fp32 gradients (tag
``ring_grad``) -- measured against this formula in tests/test_context_parallel.py. In backward
both the next block and the current block's gradient so far are in flight while a block is computed.
"""

from __future__ import annotations

import torch
from torch import nn

from bigtrain.core.documents import DocumentIds
from bigtrain.distributed.comm import AxisComm
from bigtrain.parallel.eager import eager_under_compile
from bigtrain.wrappers import ModuleWrapper


def _pass_on(comm: AxisComm, tensor: torch.Tensor, tag: str) -> tuple[torch.Tensor, list]:
    """Send ``tensor`` to the next rank of the ring and receive the previous rank's into a new
    buffer; returns (that buffer, the works to wait for)."""
    incoming = torch.empty_like(tensor)
    after, before = (comm.rank + 1) % comm.size, (comm.rank - 1) % comm.size
    works = comm.batch_isend_irecv([comm.send_op(tensor, after, tag=tag), comm.recv_op(incoming, before)])
    return incoming, works


def _wait(works: list) -> None:
    for work in works:
        work.wait()


def _wide(t: torch.Tensor) -> torch.Tensor:
    """``t`` in the dtype the ring computes in: fp32, or the input's own when wider (float64 tests)."""
    return t.to(torch.promote_types(t.dtype, torch.float32))


def _expand_heads(t: torch.Tensor, heads: int) -> torch.Tensor:
    """(batch, kv heads, seq, dim) -> (batch, heads, seq, dim): each key/value head repeated for its
    group of query heads (grouped-query attention)."""
    return t if t.shape[1] == heads else t.repeat_interleave(heads // t.shape[1], dim=1)


def _fold_heads(t: torch.Tensor, kv_heads: int) -> torch.Tensor:
    """The dual of :func:`_expand_heads` for gradients: each group's copies summed into its head."""
    return t if t.shape[1] == kv_heads else t.unflatten(1, (kv_heads, -1)).sum(2)


def _scores(q: torch.Tensor, k: torch.Tensor, scale: float, causal: bool,
            allowed: torch.Tensor | None = None) -> torch.Tensor:
    s = q @ k.transpose(-1, -2) * scale
    if allowed is not None:  # the pair's documents: (batch, 1, chunk, chunk), causality included
        return s.masked_fill(~allowed, float("-inf"))
    if causal:  # a chunk against itself: position i sees j <= i
        s = s.masked_fill(torch.ones_like(s, dtype=torch.bool).triu(1), float("-inf"))
    return s


def _finite(lse: torch.Tensor) -> torch.Tensor:
    """``lse`` with the -inf of rows that saw no key as 0: subtracted from such a row's scores (all
    -inf) it gives probabilities of 0, not NaN."""
    return torch.where(torch.isinf(lse), torch.zeros_like(lse), lse)


class _ChunkDocuments:
    """Which keys of a pair of chunks each query sees, from the window's document ids (batch, seq)
    in position order, cut into chunks of ``chunk`` tokens. Ids grow along a sequence
    (:func:`~bigtrain.core.documents.document_ids`), so a chunk's first and last ids bound it: read
    to the host once (2 x cp chunks a sample), they sort every pair. ``bounds``: those ids, (2,
    batch, chunks) on the host, where the caller read them once for every layer (on a GPU each read
    waits for the device); else read here."""

    def __init__(self, ids: torch.Tensor, chunk: int, bounds: torch.Tensor | None = None):
        self.ids, self.chunk = ids, chunk
        self.bounds = chunk_bounds(ids, ids.shape[1] // chunk) if bounds is None else bounds
        self.first, self.last = self.bounds.tolist()  # per sample, per chunk

    def pairs(self, mine: tuple[int, ...], theirs: tuple[int, ...]):
        """(query slot, key slot, causal, mask) of the pairs where some query sees some key; mask None
        where no document boundary falls inside (the pair runs as without documents)."""
        rows = range(len(self.first))
        for qi, ki, causal in _pairs(mine, theirs):
            a, b = mine[qi], theirs[ki]
            if causal:
                whole = all(self.first[n][a] == self.last[n][a] for n in rows)
            elif not any(self.last[n][b] == self.first[n][a] for n in rows):
                continue  # every document of the key chunk ended before the query chunk's first began
            else:
                whole = all(self.first[n][b] == self.last[n][a] for n in rows)
            yield qi, ki, causal, None if whole else self._mask(a, b, causal)

    def _mask(self, a: int, b: int, causal: bool) -> torch.Tensor:
        c = self.chunk
        allowed = self.ids[:, a * c:(a + 1) * c, None] == self.ids[:, None, b * c:(b + 1) * c]
        if causal:
            allowed = allowed & torch.ones(c, c, dtype=torch.bool, device=allowed.device).tril()
        return allowed[:, None]  # over the heads


def chunk_bounds(ids: torch.Tensor, chunks: int) -> torch.Tensor:
    """The first and last document id of each of ``chunks`` equal chunks of ``ids`` (batch, seq), as
    (2, batch, chunks) on the host (:class:`_ChunkDocuments`' reading of a window's ids)."""
    chunk = ids.shape[1] // chunks
    return torch.stack((ids[:, ::chunk], ids[:, chunk - 1::chunk])).cpu()


def _attended(documents: _ChunkDocuments | None, mine: tuple[int, ...], theirs: tuple[int, ...]):
    """:meth:`_ChunkDocuments.pairs`, or every causal pair unmasked without documents."""
    if documents is None:
        return ((qi, ki, causal, None) for qi, ki, causal in _pairs(mine, theirs))
    return documents.pairs(mine, theirs)


# One pair of chunks on a CPU: torch's flash attention kernel for the CPU, which tiles the scores
# (a pair of 8k-token chunks would otherwise materialize 8192^2 x heads fp32 scores and as many
# probabilities and score gradients, 1 GiB each at 4 heads) and, for a chunk against itself, skips
# the blocks the causal mask removes. Its forward returns the log-sum-exp the ring merges by; its
# backward, given the ring's merged output and log-sum-exp, computes this pair's share of dq, dk,
# dv (its delta, rowsum(dO * O), is taken from the merged output: the same as the ring's own).
# Elsewhere (CUDA), and for a pair masked by its documents, the pair's scores are materialized whole.
_FLASH_CPU = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
_FLASH_CPU_BACKWARD = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward


def _pair_forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, causal: bool,
                  allowed: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(softmax(q k^T scale) v, its log-sum-exp per query) of one chunk pair, (batch, heads, ...);
    ``allowed``: the pair's document mask (:meth:`_ChunkDocuments.pairs`), None: causal or whole."""
    if q.device.type == "cpu" and allowed is None:
        out, lse = _FLASH_CPU(q, k, v, 0.0, causal, scale=scale)
        return out, lse
    return _whole_pair_forward(q, k, v, scale, causal, allowed)


def _whole_pair_forward(q, k, v, scale: float, causal: bool,
                        allowed: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    s = _scores(q, k, scale, causal, allowed)
    lse = torch.logsumexp(s, dim=-1)  # -inf where a row sees no key of this pair
    return torch.exp(s - _finite(lse)[..., None]) @ v, lse


def _pair_backward(do, q, k, v, out, lse, delta, scale: float, causal: bool, allowed: torch.Tensor | None = None):
    """One pair's (dq, dk, dv) given the ring's merged output ``out``, its log-sum-exp ``lse`` and
    ``delta`` = rowsum(dO * out); ``allowed`` as for :func:`_pair_forward`."""
    if q.device.type == "cpu" and allowed is None:
        return _FLASH_CPU_BACKWARD(do, q, k, v, out, lse, 0.0, causal, scale=scale)
    return _whole_pair_backward(do, q, k, v, lse, delta, scale, causal, allowed)


def _whole_pair_backward(do, q, k, v, lse, delta, scale: float, causal: bool,
                         allowed: torch.Tensor | None = None):
    p = torch.exp(_scores(q, k, scale, causal, allowed) - lse[..., None])  # the merged lse: finite
    ds = p * (do @ v.transpose(-1, -2) - delta[..., None])
    return ds @ k * scale, ds.transpose(-1, -2) @ q * scale, p.transpose(-1, -2) @ do


def _pairs(mine: tuple[int, ...], theirs: tuple[int, ...]):
    """(query chunk slot, key chunk slot, causal) for every pair whose keys a query may see."""
    for qi, a in enumerate(mine):
        for ki, b in enumerate(theirs):
            if b <= a:
                yield qi, ki, b == a


def attend_block(qs: list[torch.Tensor], block: torch.Tensor, mine: tuple[int, ...], theirs: tuple[int, ...],
                 scale: float, out: list, lse: list, documents: _ChunkDocuments | None = None) -> None:
    """One ring step's arithmetic: the queries of chunks ``mine`` (``qs``, one (batch, heads, chunk,
    dim) tensor each) against ``block`` (keys and values stacked, chunks ``theirs``), merged into
    ``out`` and ``lse`` (per query chunk, None before its first block) in place; ``documents``:
    block-causal, each pair masked by them."""
    heads = qs[0].shape[1]
    ks = _expand_heads(_wide(block[0]), heads).chunk(len(theirs), dim=2)
    vs = _expand_heads(_wide(block[1]), heads).chunk(len(theirs), dim=2)
    for qi, ki, causal, allowed in _attended(documents, mine, theirs):
        part, part_lse = _pair_forward(qs[qi], ks[ki], vs[ki], scale, causal, allowed)
        if out[qi] is None:
            out[qi], lse[qi] = part, part_lse
        else:  # merge two softmaxes by their log-sum-exp (a row that saw no key of either: weight 0)
            both = torch.logaddexp(lse[qi], part_lse)
            safe = _finite(both)
            out[qi] = out[qi] * torch.exp(lse[qi] - safe)[..., None] + part * torch.exp(part_lse - safe)[..., None]
            lse[qi] = both


class _RingAttention(torch.autograd.Function):
    """q (batch, heads, local seq, dim), k and v (batch, kv heads, local seq, dim), all this rank's
    chunks concatenated; ``chunks(r)``: the global chunk indices rank r holds, in that order;
    ``documents``: the window's :class:`~bigtrain.core.documents.DocumentIds`, or None (causal)."""

    @staticmethod
    def forward(ctx, q, k, v, comm: AxisComm, chunks, scale: float, documents: DocumentIds | None = None):
        n, r = comm.size, comm.rank
        mine = chunks(r)
        chunked = None if documents is None else _ChunkDocuments(documents.ids, q.shape[2] // len(mine),
                                                                 documents.bounds)
        qs = _wide(q).chunk(len(mine), dim=2)
        out: list[torch.Tensor | None] = [None] * len(mine)
        lse: list[torch.Tensor | None] = [None] * len(mine)
        block = torch.stack((k, v)).contiguous()  # what travels: this rank's keys and values
        for step in range(n):
            source = (r - step) % n
            incoming, works = _pass_on(comm, block, "ring") if step < n - 1 else (None, [])
            attend_block(qs, block, mine, chunks(source), scale, out, lse, chunked)
            _wait(works)
            block = incoming
        # Laid out (batch, seq, heads, dim) in memory, as the output projection reads it: the tensor
        # saved here is then the one it saves (one process's SDPA kernel does the same).
        result = torch.cat(out, dim=2).to(q.dtype).transpose(1, 2).contiguous().transpose(1, 2)
        # the ids too (the same tensor in every layer: held once), for the backward's pairs
        ctx.save_for_backward(q, k, v, result, torch.cat(lse, dim=2), *(() if chunked is None else (chunked.ids,)))
        ctx.comm, ctx.chunks, ctx.scale = comm, chunks, scale
        ctx.bounds = None if chunked is None else chunked.bounds  # on the host: read once
        return result

    @staticmethod
    def backward(ctx, grad_out):
        q, k, v, out, lse, *ids = ctx.saved_tensors
        comm, chunks, scale = ctx.comm, ctx.chunks, ctx.scale
        n, r, heads, kv_heads = comm.size, comm.rank, q.shape[1], k.shape[1]
        mine = chunks(r)
        parts = len(mine)
        documents = _ChunkDocuments(ids[0], q.shape[2] // parts, ctx.bounds) if ids else None
        do, wide_out = _wide(grad_out), _wide(out)
        delta = (do * wide_out).sum(-1)  # rowsum(dO * O): the softmax's backward term
        qs, dos, outs = _wide(q).chunk(parts, dim=2), do.chunk(parts, dim=2), wide_out.chunk(parts, dim=2)
        lses, deltas = lse.chunk(parts, dim=2), delta.chunk(parts, dim=2)
        dq = [torch.zeros_like(x) for x in qs]
        block = torch.stack((k, v)).contiguous()
        # The gradient of a block travels with it, one hop behind: the hop that brings this step's
        # block's gradient so far from the previous rank runs while this rank computes its share.
        arrived, grad_works = None, []
        for step in range(n):
            source = (r - step) % n
            incoming, works = _pass_on(comm, block, "ring") if step < n - 1 else (None, [])
            ks = _expand_heads(_wide(block[0]), heads).chunk(parts, dim=2)
            vs = _expand_heads(_wide(block[1]), heads).chunk(parts, dim=2)
            dk = [torch.zeros_like(x) for x in ks]
            dv = [torch.zeros_like(x) for x in vs]
            for qi, ki, causal, allowed in _attended(documents, mine, chunks(source)):
                dq_pair, dk_pair, dv_pair = _pair_backward(dos[qi], qs[qi], ks[ki], vs[ki], outs[qi], lses[qi],
                                                           deltas[qi], scale, causal, allowed)
                dq[qi] += dq_pair
                dk[ki] += dk_pair
                dv[ki] += dv_pair
            share = torch.stack((_fold_heads(torch.cat(dk, dim=2), kv_heads),
                                 _fold_heads(torch.cat(dv, dim=2), kv_heads)))
            _wait(grad_works)  # the previous hop: what the ranks before computed for this block
            grads = share if arrived is None else arrived + share
            arrived, grad_works = _pass_on(comm, grads, "ring_grad")  # after the last step: home
            _wait(works)
            block = incoming
        _wait(grad_works)
        grads = arrived
        return (torch.cat(dq, dim=2).to(q.dtype), grads[0].to(k.dtype), grads[1].to(v.dtype), None, None, None, None)


@eager_under_compile  # point-to-point traffic in Python: a compiled block breaks around it
def ring_attention_heads_first(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, comm: AxisComm, chunks,
                               scale: float | None = None, documents: DocumentIds | None = None) -> torch.Tensor:
    """The ring itself, in the (batch, heads, seq, dim) layout of sdpa and transformers' attention
    functions: q (batch, heads, local seq, dim), k and v (batch, kv heads, local seq, dim) of the
    chunks ``chunks(comm.rank)`` -> this rank's (batch, heads, local seq, dim), laid out (batch,
    seq, heads, dim) in memory (its ``transpose(1, 2)`` is contiguous). ``scale``: the softmax's,
    head_dim ** -0.5 when None. ``documents``: the window's documents (block-causal attention), None:
    causal."""
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    return _RingAttention.apply(q, k, v, comm, chunks, scale, documents)


def ring_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, comm: AxisComm, chunks,
                   documents: DocumentIds | None = None) -> torch.Tensor:
    """Causal (``documents`` given: block-causal) attention of (batch, local seq, heads, dim) q, k, v
    whose sequence is cut over ``comm``'s ranks as ``chunks(rank)`` says; returns this rank's
    (batch, local seq, heads, dim)."""
    q, k, v = (t.transpose(1, 2) for t in (q, k, v))
    return ring_attention_heads_first(q, k, v, comm, chunks, documents=documents).transpose(1, 2)


class RingAttention(ModuleWrapper):
    """Takes an attention core's place: its causal attention computed by :func:`ring_attention` over
    the cp ranks. The core's own forward (one process's SDPA over the keys it has) is not called:
    this wrapper *is* its computation over a cut sequence, as the vocabulary-parallel lookup is an
    embedding's (the core has no parameters; its hooks still run around this call)."""

    kind = "ring_attention"

    def __init__(self, core: nn.Module, comm: AxisComm, chunks):
        super().__init__(core)
        self.comm, self.chunks = comm, chunks

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                mask: DocumentIds | None = None) -> torch.Tensor:
        if mask is not None and not isinstance(mask, DocumentIds):  # never attend across documents silently
            raise RuntimeError("block-causal attention reached the ring with a mask of the whole sequence, not the "
                               "document ids it masks each pair of chunks by (ParallelModel.document_kwargs gives "
                               "them under parallel.cp_mode = 'ring' / 'hybrid')")
        return ring_attention(q, k, v, self.comm, self.chunks, mask)
