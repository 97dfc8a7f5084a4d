"""config.json fields of a Hugging Face decoder that some layouts cannot honour, refused before
launch by the family's check (bigtrain/families/hf.py). Each rule names the field, why the layout
would train something else than one process running transformers would, and the fix.

- ``attention_dropout`` > 0: transformers applies it in training mode; each rank would draw its
  masks from its own (unseeded, so identical) generator, which neither one process nor the
  reference (bigtrain/families/hf_reference.py) reproduces, so no layout can be checked. Measured:
  a Llama at 0.1 differed from its reference by 8e-4 in the first loss.
- ``rope_scaling`` of type 'longrope': transformers' rotary embedding picks its long or short
  factors from the largest position id of each call (``longrope_frequency_update``: long past
  ``original_max_position_embeddings``). Under Ulysses (``parallel.sp``) or context parallelism
  (``parallel.cp``) a rank's call sees its own tokens' positions only, so a rank whose tokens all
  sit at or below that length would rotate with the short factors while the whole sequence uses
  the long ones. Measured: Llama, sp 2, 32 tokens, original 16: the first loss 1e-2 off the
  reference's, no error. Refused exactly when some rank would choose differently.
"""

from __future__ import annotations

import torch

from bigtrain.config import Config
from bigtrain.parallel.context import chunks_of


def dropout_problems(conf, where: str) -> list[str]:
    rate = float(getattr(conf, "attention_dropout", 0.0) or 0.0)
    if rate > 0:
        return [f"attention_dropout = {rate:g} in {where}: bigtrain trains these decoders without dropout (each "
                f"rank would draw its own masks, which one process and the reference do not); set "
                f"\"attention_dropout\": 0.0 in {where}"]
    return []


def positions_reached(seq: int, cp: int, sp: int) -> list[int]:
    """Each rank's largest token position + 1 (what transformers' rotary update reads from its
    call): the cp rank's two chunks of 2 x cp (bigtrain/parallel/context.py), then Ulysses' equal
    part of them (``ParallelModel.sequence_position``)."""
    size = seq // (2 * cp) if cp > 1 else seq
    held = [torch.cat([torch.arange(c * size, (c + 1) * size) for c in chunks_of(cp, r)]) for r in range(cp)] \
        if cp > 1 else [torch.arange(seq)]
    return [int(part.max()) + 1 for positions in held for part in positions.chunk(sp) if part.numel()]


def rotary_problems(cfg: Config, conf, where: str) -> list[str]:
    """'longrope' under sp or cp where a rank's positions and the whole sequence pick different factors."""
    scaling = getattr(conf, "rope_scaling", None) or {}
    kind = scaling.get("rope_type", scaling.get("type"))
    p, seq = cfg.parallel, cfg.data.seq_len
    if kind != "longrope" or (p.sp <= 1 and p.cp <= 1) or seq % max(1, 2 * p.cp * p.sp):
        return []  # the sequence shapes are the layout checks' to refuse
    # as transformers reads it: the config's attribute if it has one, else max_position_embeddings
    original = conf.original_max_position_embeddings if hasattr(conf, "original_max_position_embeddings") \
        else conf.max_position_embeddings
    reached = min(positions_reached(seq, max(1, p.cp), max(1, p.sp)))
    if seq <= original or reached > original:
        return []
    return [f"rope_scaling 'longrope' of {where} takes its long factors past original_max_position_embeddings = "
            f"{original}, as data.seq_len = {seq} is, but with parallel.sp = {p.sp} and parallel.cp = {p.cp} a "
            f"rank's tokens reach only position {reached} and transformers would rotate them with the short "
            f"factors; use a data.seq_len of at most {original}, or fewer sp/cp ranks (every rank's tokens must "
            f"reach past {original}: Ulysses' first rank holds data.seq_len / parallel.sp of them)"]
