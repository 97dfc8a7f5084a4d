"""Documents of a packed window (``model.attn_mask = "block_causal"``): which document each token
belongs to, its position inside it, and the attention mask they make.

A training window is cut from a corpus of documents laid end to end, so it holds the end of one
document, some whole ones and the start of another. Under block-causal attention (torchtitan's
``block_causal``, Megatron's ``reset_attention_mask``) a token attends only to the earlier tokens of
its own document; with ``reset_positions`` (Megatron's ``reset_position_ids``) its rotary position
counts from its document's first token.

Where a document begins, from the window's token ids alone:
- a token right after an end token (``ends``: ``data.document_end``, or the id the tokenizer puts
  after each document) begins one: the end token itself is the last token of the document it ends
  (its target is the next document's first token, predicted from its own document only);
- a start token (``starts``: the id the tokenizer puts before each document, its BOS) begins one;
- the window's first token begins one (the part of a document cut off before the window is not seen).
An end token followed by a start token makes one boundary, not two.

The trainer computes these from each micro-batch's whole-sequence tokens before any layout cuts it,
so every rank, stage and sequence chunk of a window sees the same documents. Plain functions of
tensors, no state: compiled regions receive their outputs as data.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch.nn.attention.flex_attention import BlockMask

ATTN_MASKS = ("causal", "block_causal")


@dataclass(frozen=True)
class DocumentBoundaries:
    """The token ids that delimit documents: ``starts`` begin one (a BOS), the token after one of
    ``ends`` begins one (an EOS, ``data.document_end``). ``reset_positions``: rotary positions count
    from each document's first token."""

    starts: tuple[int, ...] = ()
    ends: tuple[int, ...] = ()
    reset_positions: bool = False

    def __post_init__(self):
        if not self.starts and not self.ends:
            raise ValueError("document boundaries need a start or an end token id (data.document_end, or a "
                             "tokenizer that puts a token before or after each document)")


def _is_any(tokens: torch.Tensor, ids: tuple[int, ...]) -> torch.Tensor:
    if not ids:
        return torch.zeros_like(tokens, dtype=torch.bool)
    return torch.isin(tokens, torch.tensor(ids, dtype=tokens.dtype, device=tokens.device))


def document_starts(tokens: torch.Tensor, boundaries: DocumentBoundaries) -> torch.Tensor:
    """bool (batch, seq): the tokens that begin a document (the first token of the window always)."""
    begins = _is_any(tokens, boundaries.starts)
    begins[:, 1:] |= _is_any(tokens[:, :-1], boundaries.ends)
    begins[:, 0] = True
    return begins


def document_ids(tokens: torch.Tensor, boundaries: DocumentBoundaries) -> torch.Tensor:
    """int64 (batch, seq): each token's document, counted from 0 at the window's first token."""
    return document_starts(tokens, boundaries).long().cumsum(1) - 1


def document_positions(tokens: torch.Tensor, boundaries: DocumentBoundaries) -> torch.Tensor:
    """int64 (batch, seq): each token's position inside its document (0 at the document's first token)."""
    begins = document_starts(tokens, boundaries)
    index = torch.arange(tokens.shape[1], device=tokens.device).expand_as(tokens)
    first = torch.where(begins, index, torch.zeros_like(index)).cummax(1).values  # the latest start so far
    return index - first


def document_mask(documents: torch.Tensor, window: int | None = None) -> torch.Tensor:
    """bool (batch, 1, seq, seq) from ``documents`` (batch, seq; :func:`document_ids`): query i may
    attend to key j when j <= i, both are of one document and, given a sliding ``window``, j > i - window
    (sdpa's boolean ``attn_mask``, broadcast over heads). Every query keeps its own key, so no row is
    empty (an empty row would give NaN)."""
    seq = documents.shape[1]
    i = torch.arange(seq, device=documents.device)
    allowed = i[None, :] <= i[:, None]
    if window is not None and window < seq:
        allowed = allowed & (i[None, :] > i[:, None] - window)
    same = documents[:, :, None] == documents[:, None, :]
    return (same & allowed)[:, None]


def document_bias(documents: torch.Tensor, dtype: torch.dtype, window: int | None = None) -> torch.Tensor:
    """:func:`document_mask` as an additive mask in ``dtype`` (0 where a query may attend, the
    dtype's lowest value where not), (batch, 1, seq, seq): what sdpa adds to its scores. Built once
    per forward and given to every layer: sdpa turns a boolean mask into such a tensor itself, and
    saves it for backward, in each layer (measured on the CPU: one fp32 copy a layer); one tensor
    shared by the layers is saved once (tests/test_document_masking.py)."""
    allowed = document_mask(documents, window)
    return torch.zeros(allowed.shape, dtype=dtype, device=documents.device).masked_fill_(~allowed,
                                                                                          torch.finfo(dtype).min)


def document_block_mask(documents: torch.Tensor, block: int = 128) -> BlockMask:
    """:func:`document_mask` as FlexAttention's BlockMask (``model.attention = 'flex'``), written from
    the documents' ids tile by tile: (batch, 1, tiles, tiles) int32 indices for tiles of ``block``
    tokens, never the (seq, seq) mask (torch's ``create_block_mask`` evaluates the mask at every
    pair, a dense boolean of batch x seq^2 bytes unless it is compiled).

    ``documents`` must grow along a row, as :func:`document_ids` counts them (every caller's ids
    do): a tile's first and last ids are then its least and greatest. A key tile strictly before a
    query tile holds an allowed pair exactly when its last document is the query tile's first (the
    one document both may share), and every pair
    is allowed when that one document covers both tiles (key tile's first id = query tile's last):
    a *full* tile, computed without the mask. A diagonal tile always holds an allowed pair (each
    token its own key) and is never full (causal inside). Every other tile is skipped. A tile that
    is neither is *partial*: the kernel applies the mask function to it, pair by pair, so a partial
    tile that held no allowed pair would cost time, never correctness. The tail tile of a sequence
    that ``block`` does not divide is never full; its padded tokens carry id -1 in the mask
    function, a document of their own that no real token attends to."""
    b, s = documents.shape
    tiles = -(-s // block)
    pad = tiles * block - s
    grown = torch.cat([documents, documents[:, -1:].expand(b, pad)], dim=1).view(b, tiles, block)
    first, last = grown[..., 0], grown[..., -1]  # (batch, tiles): least and greatest id of each tile
    index = torch.arange(tiles, device=documents.device)
    before = index[None, :] < index[:, None]  # (query tile, key tile): the key tile strictly earlier
    shares = (before | (index[None, :] == index[:, None])) & (last[:, None, :] >= first[:, :, None])
    full = before & (first[:, None, :] == last[:, :, None])
    if pad:
        full[:, -1, :] = False
        full[:, :, -1] = False
    partial = shares & ~full
    ids = torch.cat([documents, documents.new_full((b, pad), -1)], dim=1)

    def same_document(batch, head, q, k):
        return (k <= q) & (ids[batch, q] == ids[batch, k])

    def listed(tiles_of: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        # the kept key tiles of each query tile first, in order (a stable sort of "not kept")
        order = torch.sort((~tiles_of).to(torch.int8), dim=-1, stable=True).indices
        return tiles_of.sum(-1, dtype=torch.int32)[:, None], order.to(torch.int32)[:, None]

    return BlockMask.from_kv_blocks(*listed(partial), *listed(full), BLOCK_SIZE=block, mask_mod=same_document,
                                    seq_lengths=(s, s))


@dataclass(frozen=True)
class DocumentIds:
    """The documents of a window as they are, for an attention that masks each block of its own
    from them instead of one mask of the whole sequence: ring attention (context parallelism, whose
    ranks hold chunks of a sequence too long for a (seq, seq) mask). ``ids``: :func:`document_ids`
    of the whole sequence (batch, seq), in position order; ``bounds``: the first and last id of each
    of the ring's chunks, (2, batch, chunks) on the host, read once for every layer
    (:func:`bigtrain.parallel.ring_attention.chunk_bounds`)."""

    ids: torch.Tensor
    bounds: torch.Tensor | None = None


def layer_mask(documents: torch.Tensor | DocumentIds, dtype: torch.dtype,
               kind: str) -> torch.Tensor | BlockMask | DocumentIds:
    """What every layer of one forward attends with (built once, shared): sdpa's additive mask
    (:func:`document_bias`) or, ``kind`` 'flex' (:mod:`bigtrain.core.attention_kind`), the BlockMask
    (:func:`document_block_mask`); documents given as :class:`DocumentIds` (the context-parallel
    ring's) go to the layers as they are."""
    if isinstance(documents, DocumentIds):
        return documents
    return document_block_mask(documents) if kind == "flex" else document_bias(documents, dtype)
