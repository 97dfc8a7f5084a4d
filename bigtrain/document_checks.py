"""``model.attn_mask`` and ``model.reset_positions`` against the rest of a config, before any process
starts (docs/ecosystem.md, "Document masking"). Imports no torch (as :mod:`bigtrain.validation`).

Block-causal attention is refused where it would be silently wrong or meaningless:
- a model family whose model takes no documents (``Family.document_mask``): it would attend causally;
- ``parallel.cp > 1`` with ``cp_mode`` 'ring' or 'hybrid' in a family whose ring takes no documents
  (``Family.ring_documents``: bigtrain's Llama and the Hugging Face family mask each pair of chunks
  by the documents' ids; a family of one's own may not). 'all-to-all' gathers the whole sequence around
  attention, where the mask holds as without cp;
- a corpus with no token that marks where documents meet (:func:`bigtrain.data.boundaries.boundary_ids`).

``model.attention = 'flex'`` (:mod:`bigtrain.core.attention_kind`) is refused where FlexAttention
cannot run: causal attention (no documents to make a BlockMask of; sdpa's causal kernel needs no
mask), a family whose attention does not take a BlockMask (``Family.flex_attention``), and, given
the device (:func:`check_attention_device`), a CPU, where torch has no FlexAttention backward.
"""

from __future__ import annotations

from bigtrain.config import Config
from bigtrain.core.attention_kind import ATTENTIONS
from bigtrain.data.boundaries import boundary_ids
from bigtrain.data.tokenizer import TokenizerError
from bigtrain.families import registered_family

ATTN_MASKS = ("causal", "block_causal")  # bigtrain.core.documents.ATTN_MASKS (this module imports no torch)


def check_documents(cfg: Config) -> list[str]:
    m, p = cfg.model, cfg.parallel
    if m.attn_mask not in ATTN_MASKS:
        return [f"model.attn_mask = {m.attn_mask!r}: must be one of {', '.join(repr(x) for x in ATTN_MASKS)}"]
    if m.attention not in ATTENTIONS:
        return [f"model.attention = {m.attention!r}: must be one of {', '.join(repr(x) for x in ATTENTIONS)}"]
    if m.attn_mask == "causal":
        if m.attention == "flex":
            return ["model.attention = 'flex' computes block-causal attention only (causal attention runs sdpa's "
                    "causal kernel, which needs no mask); set model.attn_mask = 'block_causal' or "
                    "model.attention = 'auto'"]
        if m.reset_positions:
            return ["model.reset_positions = true needs model.attn_mask = 'block_causal' (positions restart at "
                    "each document only when attention stays inside it); set model.attn_mask = 'block_causal' or "
                    "model.reset_positions = false"]
        return []
    family = registered_family(m.family)
    if family is None:
        return []  # check_model names an unknown family
    if not family.document_mask:
        return [f"model.attn_mask = 'block_causal': model.family = '{m.family}' has no document mask (its model "
                f"takes no documents); use model.attn_mask = 'causal'"]
    problems = []
    if m.attention == "flex" and not family.flex_attention:
        problems.append(f"model.attention = 'flex': model.family = '{m.family}' has no FlexAttention path (its "
                        f"attention takes sdpa's dense mask only); set model.attention = 'sdpa' or 'auto'")
    if p.cp > 1 and p.cp_mode != "all-to-all" and not family.ring_documents:
        problems.append(f"model.attn_mask = 'block_causal' with parallel.cp = {p.cp} and parallel.cp_mode = "
                        f"'{p.cp_mode}': model.family = '{m.family}' has no document mask in its ring attention; "
                        f"set parallel.cp_mode = 'all-to-all' (the whole sequence is gathered around attention, "
                        f"and the mask holds there) or parallel.cp = 1")
    try:
        boundary_ids(cfg.data)
    except TokenizerError as e:
        if "model.attn_mask" in str(e):  # an unreadable tokenizer is data.tokenizer's own problem, named there
            problems.append(str(e))
    return problems


def check_attention_device(cfg: Config, cuda_available: bool | None) -> list[str]:
    """``model.attention = 'flex'`` on a CPU (``train.device = 'cpu'``, or no CUDA device): torch has
    FlexAttention's forward there, no backward (NotImplementedError at the first step, eager or
    compiled, torch 2.13). ``cuda_available`` None: unknown (only train.device is read)."""
    m = cfg.model
    if m.attention != "flex" or m.attn_mask != "block_causal":
        return []
    if cfg.train.device != "cpu" and cuda_available is not False:
        return []
    where = "train.device = 'cpu'" if cfg.train.device == "cpu" else "no CUDA device is available"
    return [f"model.attention = 'flex' with {where}: torch has no FlexAttention backward on a CPU; set "
            f"model.attention = 'auto' (sdpa on a CPU, flex on CUDA) or 'sdpa', or train on a CUDA device"]
