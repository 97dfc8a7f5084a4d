"""Context parallelism (``parallel.cp``) for the Hugging Face family.

bigtrain's Llama gets it around its attention core (bigtrain/parallel/context.py). A transformers
decoder layer has no core: as for Ulysses (bigtrain/families/hf_attention.py), the seam is the
attention function its layers look up by name, ``config._attn_implementation``:

- :func:`context_attention` is registered under :data:`CONTEXT`. It takes q, k, v as transformers
  hands them, (batch, heads, local seq, head_dim) of this rank's two chunks (i and 2cp-1-i of 2 x
  cp, :func:`~bigtrain.parallel.context.chunks_of`), and returns (batch, local seq, heads,
  head_dim), by ``parallel.cp_mode``:

  - ``all-to-all``: :class:`~bigtrain.parallel.context.AllToAllContext`'s two halves (Ulysses over
    cp, then the chunks put in position order), the family's causal sdpa over the whole sequence
    between them (a sliding window holds: it is applied over the whole sequence in position order);
  - ``ring``: :func:`~bigtrain.parallel.ring_attention.ring_attention_heads_first`, the Llama's ring;
  - ``hybrid``: Ulysses over sp (hf_attention's all-to-alls: each sp rank then holds its cp rank's
    two chunks whole, for heads / sp) around the ring over cp.

  The ring computes causal chunk pairs and has no window: a sliding window narrower than the
  sequence is refused before launch (:func:`context_problems`) and again here.
- :func:`attach_context_parallel` (``Family.context_parallel``, called by ``parallelize``) points the
  decoder's config at :data:`CONTEXT` and puts a forward pre-hook on every layer's ``self_attn``
  that passes a :class:`ContextGroup` (the cp AxisComm and the mode) as the keyword :data:`GROUP`
  (the layer hands its keywords on to the attention function). A call without it is an error, so a
  layer the hook missed cannot attend to its own chunks alone.

Positions: each rank's tokens are at ``local_positions(seq, cp)`` (``ParallelModel`` passes them as
``positions``, :class:`~bigtrain.models.hf_causal_lm.CausalLM` as ``position_ids``), so transformers'
rotary tables rotate q and k at their global positions before the attention function. No mask is
built (the name has no mask function; see hf_attention). Every weight's gradient is summed over dp x
cp x sp (the mesh's data axis), as for bigtrain's Llama.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial

import torch
from torch import nn

from bigtrain.config import Config
from bigtrain.core.documents import DocumentIds
from bigtrain.context_checks import divisor_near
from bigtrain.distributed.comm import AxisComm
from bigtrain.families.hf_attention import GROUP as ULYSSES_GROUP
from bigtrain.families.hf_attention import (attend, carried_group, heads_to_shard, layer_window, register_attention,
                                            shard_to_heads)
from bigtrain.parallel.context import AllToAllContext, chunks_of
from bigtrain.models.hf_causal_lm import DOCUMENTS
from bigtrain.parallel.ring_attention import ring_attention_heads_first

CONTEXT = "bigtrain_context"  # the attention implementation's name in transformers' registry
GROUP = "context_group"  # the keyword the ContextGroup travels under, from the hook to the function


@dataclass(frozen=True)
class ContextGroup:
    """What a layer's attention needs of context parallelism: the cp axis and ``parallel.cp_mode``."""

    comm: AxisComm
    mode: str  # 'all-to-all', 'ring' or 'hybrid'

    def __post_init__(self):
        if self.mode not in ("all-to-all", "ring", "hybrid"):
            raise ValueError(f"parallel.cp_mode = {self.mode!r}: must be 'ring', 'all-to-all' or 'hybrid'")


def register_context_attention() -> None:
    """:func:`context_attention` in transformers' registry (idempotent)."""
    from transformers import AttentionInterface  # the family's optional dependency

    register_attention()
    AttentionInterface.register(CONTEXT, context_attention)


def context_attention(module: nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                      attention_mask: torch.Tensor | None, dropout: float = 0.0, scaling: float | None = None,
                      sliding_window: int | None = None, **kwargs) -> tuple[torch.Tensor, None]:
    """transformers' attention-function signature: q (batch, heads, local seq, head_dim), k and v
    (batch, kv heads, local seq, head_dim) of this rank's chunks -> (batch, local seq, heads,
    head_dim) attended over the whole sequence, no attention weights."""
    group = carried_group(CONTEXT, GROUP, ContextGroup, "attach_context_parallel", module, attention_mask, kwargs)
    sliding_window = layer_window(module, sliding_window)
    sp = kwargs.get(ULYSSES_GROUP)
    if (group.mode == "hybrid") != (isinstance(sp, AxisComm) and sp.size > 1):
        raise RuntimeError(f"parallel.cp_mode = '{group.mode}' with {'an sp group' if sp else 'no sp group'}: "
                           f"'hybrid' is Ulysses over sp (> 1) around the ring, the others run without sp")
    if group.mode == "all-to-all":
        hooks = AllToAllContext(group.comm)
        q, k, v = (t.transpose(1, 2) for t in hooks.to_whole_sequence(*(t.transpose(1, 2) for t in (query, key, value))))
        documents = kwargs.get(DOCUMENTS)  # block-causal: the whole sequence's mask, in position order as q, k, v
        extra = () if documents is None else (documents,)
        out = attend(q, k, v, dropout, scaling, sliding_window, *extra)  # (batch, heads / cp, seq, head_dim)
        return hooks.to_local_chunks(out.transpose(1, 2)).contiguous(), None
    documents = kwargs.get(DOCUMENTS)  # block-causal: the ring masks its pairs by the ids (never a whole mask)
    if documents is not None and not isinstance(documents, DocumentIds):
        raise RuntimeError(f"block-causal attention reached the ring (parallel.cp_mode = '{group.mode}') with a mask "
                           f"of the whole sequence, not the document ids it masks each pair of chunks by")
    whole = query.shape[2] * group.comm.size * (sp.size if group.mode == "hybrid" else 1)
    if sliding_window is not None and sliding_window < whole:
        raise RuntimeError(f"parallel.cp_mode = '{group.mode}': the ring attends causally over whole chunks and "
                           f"has no sliding window; this layer's is {sliding_window} tokens of {whole}")
    if dropout:
        raise RuntimeError(f"parallel.cp_mode = '{group.mode}': the ring has no attention dropout ({dropout})")
    ring = partial(ring_attention_heads_first, comm=group.comm, chunks=partial(chunks_of, group.comm.size),
                   scale=scaling, documents=documents)
    if group.mode == "ring":
        return ring(query, key, value).transpose(1, 2), None
    return heads_to_shard(ring(*shard_to_heads(query, key, value, sp)), sp), None  # hybrid


def attach_context_parallel(model: nn.Module, comm: AxisComm, mode: str) -> list[str]:
    """``Family.context_parallel`` of the Hugging Face family: every decoder layer's ``self_attn``
    (of :class:`~bigtrain.models.hf_causal_lm.CausalLM`'s ``model.layers``) attends through
    :func:`context_attention`, its calls carrying the cp group; returns their names."""
    register_context_attention()
    group = ContextGroup(comm, mode)

    def hook(m, args, kwargs):
        return args, {**kwargs, GROUP: group}

    names = [f"model.layers.{i}.self_attn" for i in range(len(model.model.layers))]
    for name in names:
        attention = model.get_submodule(name)
        attention.config._attn_implementation = CONTEXT  # the config the whole decoder shares
        attention.register_forward_pre_hook(hook, with_kwargs=True)
    return names


def attention_window(conf) -> int | None:
    """The sliding window some layer of a transformers config attends within (Mistral's
    ``sliding_window``; Qwen2's and Qwen3's when ``use_sliding_window`` gives a layer one), else None."""
    window = getattr(conf, "sliding_window", None)
    types = getattr(conf, "layer_types", None)
    if window is None or (types is not None and "sliding_attention" not in types):
        return None
    return window


def context_problems(cfg: Config, heads: int, kv_heads: int, where: str, window: int | None) -> list[str]:
    """``parallel.cp > 1`` against the config.json at ``where``: all-to-all gives each cp rank whole
    query heads of its tp rank's (key/value heads split or replicated, as Ulysses); the ring (and
    hybrid) has no sliding window, so a ``window`` narrower than data.seq_len is refused. The rules
    every family shares (chunks, sp, dp_sync): bigtrain/context_checks.py."""
    p, seq = cfg.parallel, cfg.data.seq_len
    if p.cp <= 1 or p.tp <= 0 or heads % p.tp or (kv_heads % p.tp and p.tp % kv_heads):
        return []  # no cp, or a tp the family's own check refuses already
    problems = []
    local_q, local_kv = heads // p.tp, max(1, kv_heads // p.tp)  # fewer than tp: one replicated head a rank
    if p.cp_mode == "all-to-all" and local_q % p.cp:
        problems.append(f"parallel.cp = {p.cp} with cp_mode 'all-to-all' gives each cp rank whole attention heads, "
                        f"and there are {local_q} per tp rank (num_attention_heads = {heads} of {where} / "
                        f"parallel.tp = {p.tp}); use parallel.cp = {divisor_near(local_q, p.cp)} or cp_mode = 'ring'")
    elif p.cp_mode == "all-to-all" and local_kv % p.cp and p.cp % local_kv:
        problems.append(f"parallel.cp = {p.cp} with cp_mode 'all-to-all': the {local_kv} key/value heads per tp "
                        f"rank (num_key_value_heads = {kv_heads} of {where} / parallel.tp = {p.tp}) must divide by "
                        f"cp (split) or divide cp (replicated); use parallel.cp = {divisor_near(local_kv, p.cp)} "
                        f"or cp_mode = 'ring'")
    if p.cp_mode in ("ring", "hybrid") and window is not None and window < seq:
        fix = "parallel.cp_mode = 'all-to-all' (which applies it over the whole sequence)" if p.sp == 1 else \
            "parallel.cp = 1 (Ulysses over sp keeps it)"
        problems.append(f"parallel.cp_mode = '{p.cp_mode}' with the sliding window of {window} tokens of {where} "
                        f"(narrower than data.seq_len = {seq}): the ring attends over whole chunks and has no "
                        f"window; use {fix}")
    return problems
