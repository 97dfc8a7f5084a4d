"""Block-causal attention as the independent references state it (``model.attn_mask =
"block_causal"``): each document of a packed window run through the plain model on its own, as a
sequence of its own, and the pieces put back in the window's order.

Nothing here calls :mod:`bigtrain.core.documents` (the trainer's mask and positions): the documents
are found again by a plain loop over the window's ids, from the rule itself (the token after an end
id begins a document, a start id begins one, and so does the window's first token), and the model
is called without any mask, causal over one document. A wrong mask, a document boundary off by one,
a position not reset, would make the trainer differ from this. With ``reset_positions`` each
document starts at position 0; without, at its offset in the window.
"""

from __future__ import annotations

from typing import Callable

import torch


def document_spans(row: list[int], starts: tuple[int, ...], ends: tuple[int, ...]) -> list[tuple[int, int]]:
    """[first, stop) of each document of one window's ids, in order, covering it."""
    spans, first = [], 0
    for i in range(1, len(row)):
        if row[i] in starts or row[i - 1] in ends:
            spans.append((first, i))
            first = i
    spans.append((first, len(row)))
    return spans


def spans_as_documents(tokens: torch.Tensor, starts: tuple[int, ...], ends: tuple[int, ...]) -> torch.Tensor:
    """(batch, seq) int64: each token's document index in its row, written out from :func:`document_spans`
    (for a reference that must run the packed window whole: MoE blocks with per-sequence capacity or
    balance loss, where a document run alone would route otherwise)."""
    out = torch.empty(tokens.shape, dtype=torch.int64)
    for r, row in enumerate(tokens.tolist()):
        for index, (a, b) in enumerate(document_spans(row, starts, ends)):
            out[r, a:b] = index
    return out.to(tokens.device)


def spans_as_positions(tokens: torch.Tensor, starts: tuple[int, ...], ends: tuple[int, ...]) -> torch.Tensor:
    """(batch, seq) int64: each token's offset from its document's first token, from :func:`document_spans`."""
    out = torch.empty(tokens.shape, dtype=torch.int64)
    for r, row in enumerate(tokens.tolist()):
        for a, b in document_spans(row, starts, ends):
            out[r, a:b] = torch.arange(b - a)
    return out.to(tokens.device)


def join_pieces(outputs: dict[str, list[torch.Tensor]], pieces: int) -> None:
    """Recorded module outputs of one window run as ``pieces`` documents: the last ``pieces``
    entries of each list, (1, length, ...) each, joined along the sequence into one (1, seq, ...)."""
    for name, parts in outputs.items():
        if len(parts) >= pieces:
            parts[-pieces:] = [torch.cat(parts[-pieces:], dim=1)]


def each_document_alone(logits_of: Callable[[torch.Tensor, int], torch.Tensor], tokens: torch.Tensor,
                        starts: tuple[int, ...], ends: tuple[int, ...], reset_positions: bool,
                        after_row: Callable[[int], None] | None = None) -> torch.Tensor:
    """Logits (batch, seq, vocab) of ``tokens`` (batch, seq), each document of each row computed by
    ``logits_of(document ids (1, length), first position)`` alone. ``after_row(pieces)`` runs after
    each row (to join what hooks recorded: :func:`join_pieces`)."""
    rows = []
    for r in range(tokens.shape[0]):
        spans = document_spans(tokens[r].tolist(), starts, ends)
        rows.append(torch.cat([logits_of(tokens[r:r + 1, a:b], 0 if reset_positions else a) for a, b in spans], dim=1))
        if after_row is not None:
            after_row(len(spans))
    return torch.cat(rows)
