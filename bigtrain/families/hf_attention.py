"""Ulysses sequence parallelism (``parallel.sp``) for the Hugging Face family.

bigtrain's Llama applies Ulysses as hooks around its attention core
(:class:`~bigtrain.parallel.tensor.styles.UlyssesAttention`). A transformers decoder layer has no
such module: its attention projects q, k, v, applies the rotary tables and then calls a function
looked up by name, ``config._attn_implementation``, in transformers' ``ALL_ATTENTION_FUNCTIONS``.
That function is the seam:

- :func:`ulysses_attention` is registered there once under :data:`ULYSSES`. It is a plain function
  of its arguments: q, k, v of this rank's sequence shard and all its heads
  (batch, heads, seq / sp, head_dim) -> all-to-all -> the whole sequence and heads / sp -> causal
  attention -> all-to-all back. Key/value heads follow UlyssesAttention's rule: split when they
  divide by sp, else (when they divide sp) each rank is sent a copy of the one its query heads use.
- :class:`UlyssesAttentionGroup`, a plan style on every ``self_attn``, sets the model's config to
  :data:`ULYSSES` and passes the sp :class:`AxisComm` explicitly, as the keyword :data:`GROUP`,
  to each call (a forward pre-hook; the layer hands its keywords on to the attention function).
  A call without it is an error, so a layer the plan skipped cannot silently attend to its shard.

The mask: for an implementation name it has no mask function for, transformers' masking utils
return no mask (``_preprocess_mask_arguments``), so the decoder builds none (it would be the
causal mask of the local shard, wrong after the all-to-all). Each rank then attends over the whole
sequence, causal by ``is_causal`` (a sliding window, Mistral's or Qwen's, by an explicit mask of the
whole sequence); a mask that does arrive is refused. Rotary tables need no change: each rank's
positions start at ``sp.rank * seq / sp`` (``ParallelModel.sequence_position``), and q and k are
rotated before the all-to-all. Qwen3's per-head q/k norms also run before it, on the local
sequence and all heads. Every weight sees its sequence shard only; its gradient is summed over the
data axis, which counts dp x sp (as for bigtrain's Llama), so no partial-gradient entry is needed.

Block-causal attention (``model.attn_mask``): each token's document over the whole sequence
reaches both functions as the keyword :data:`~bigtrain.models.hf_causal_lm.DOCUMENTS` (the adapter
passes it to the decoder, transformers hands a layer's keywords on to its attention function), and
:func:`attend` adds the layer's window to the documents' mask (built once a forward by the adapter). Under Ulysses the
documents are the whole sequence's, as q, k and v are after the all-to-all.

Without Ulysses the family's layers attend through :func:`causal_attention` (:data:`CAUSAL`, the
name the family builds its models with): the same sdpa call on the sequence the layer holds, so that
transformers builds no (batch, 1, seq, seq) mask (see the function) and a sliding window holds in
pipeline stages too, which call their layers with no mask.

Also here, the family's check of Ulysses: :func:`ulysses_problems` (head and sequence shapes sp
must divide).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from bigtrain.config import Config
from bigtrain.context_checks import divisor_near
from bigtrain.distributed.comm import AxisComm
from bigtrain.models.hf_causal_lm import DOCUMENTS
from bigtrain.parallel.tensor.functional import all_to_all
from bigtrain.parallel.tensor.styles import Style, TPContext, replicate_kv_heads

CAUSAL = "bigtrain_causal"  # the family's attention: causal sdpa over the sequence the layer holds
ULYSSES = "bigtrain_ulysses"  # the attention implementation's name in transformers' registry
GROUP = "ulysses_group"  # the keyword the sp AxisComm travels under, from the hook to the function


def register_attention() -> None:
    """Both functions in transformers' registry (idempotent: plain functions under fixed names)."""
    from transformers import AttentionInterface  # the family's optional dependency

    AttentionInterface.register(CAUSAL, causal_attention)
    AttentionInterface.register(ULYSSES, ulysses_attention)


def causal_attention(module: nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                     attention_mask: torch.Tensor | None, dropout: float = 0.0, scaling: float | None = None,
                     sliding_window: int | None = None, **kwargs) -> tuple[torch.Tensor, None]:
    """The decoder's attention without transformers' mask: q (batch, heads, seq, head_dim), k and v
    (batch, kv heads, seq, head_dim) -> (batch, seq, heads, head_dim), no attention weights.

    transformers builds no mask for a name it has no mask function for, and with ``use_cache =
    False`` (training) it would otherwise build a whole (batch, 1, seq, seq) one for every step
    (its packed-sequence check of the position ids), which keeps sdpa off its flash kernel and off
    native grouped-query attention: measured on the CPU in bf16, the key/value gradients then summed
    over their query heads in bf16 and 3e-3 off the reference's. Here attention is causal by
    ``is_causal`` (a sliding window, Mistral's or Qwen's, by an explicit mask), as transformers' own
    sdpa path runs it when it can skip the mask."""
    if attention_mask is not None:
        raise RuntimeError(f"attention implementation '{CAUSAL}' was given a mask of shape "
                           f"{tuple(attention_mask.shape)}: bigtrain's decoders attend causally over whole sequences")
    window = layer_window(module, sliding_window)
    documents = kwargs.get(DOCUMENTS)
    extra = () if documents is None else (documents,)  # a causal call stays the six-argument one
    out = attend(query, key, value, dropout, scaling, window, *extra)
    return out.transpose(1, 2).contiguous(), None


def layer_window(module: nn.Module, sliding_window: int | None) -> int | None:
    """The sliding window the attention ``module`` attends within: the keyword its forward passes
    (Mistral's, Mixtral's, Qwen2's, Qwen3's), else the layer's own ``sliding_window``, which
    transformers 5's Qwen2-MoE sets on its windowed layers without passing it (its window reaches
    transformers' sdpa and eager paths only through their mask; read from the keyword alone, such a
    layer attended over the whole sequence here: 25% off the reference's first layer)."""
    return sliding_window if sliding_window is not None else getattr(module, "sliding_window", None)


def carried_group(name: str, key: str, kind: type, prepared_by: str, module: nn.Module,
                  attention_mask: torch.Tensor | None, kwargs: dict):
    """What a call of the registered attention function ``name`` carries under the keyword ``key``
    (its group, put there by a forward pre-hook of ``prepared_by``). Raises when it is missing (a
    layer the plan missed would attend to its own part of the sequence alone) or when a mask
    arrived (transformers builds none for these names; one of the local part would be wrong)."""
    group = kwargs.get(key)
    if not isinstance(group, kind):
        raise RuntimeError(f"attention implementation '{name}' called without its group ('{key}'): the layer "
                           f"{type(module).__name__} was not prepared by {prepared_by}")
    if attention_mask is not None:
        raise RuntimeError(f"attention implementation '{name}' was given a mask of shape "
                           f"{tuple(attention_mask.shape)}: a mask of the local part cannot hold over the whole sequence")
    return group


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, dropout: float, scaling: float | None,
           window: int | None, documents: torch.Tensor | None = None) -> torch.Tensor:
    """Causal sdpa of (batch, heads, seq, head_dim) q over k and v of as many or fewer heads; given
    ``documents`` (the additive (batch, 1, seq, seq) mask of the documents the decoder passes its
    layers as :data:`DOCUMENTS`), block-causal, within the window too (one explicit mask of both;
    a windowed layer makes its own copy). With a mask the key/value heads are repeated for their
    query heads first, as transformers' sdpa path does whenever it passes a mask (sdpa's grouped
    path with a mask is its math kernel anyway): the same call, so a windowed layer rounds as the reference's (in bf16, one process's
    first gradients were 3.5e-3 off it with the grouped call, bit-equal with this one)."""
    if documents is not None:
        mask = documents.to(q.dtype)
        windowed = sliding_window_mask(q.shape[2], window, q.device)
        if windowed is not None:
            mask = mask.masked_fill(~windowed, torch.finfo(mask.dtype).min)
    else:
        mask = sliding_window_mask(q.shape[2], window, q.device)
    if mask is not None and k.shape[1] != q.shape[1]:
        k, v = (t.repeat_interleave(q.shape[1] // t.shape[1], dim=1) for t in (k, v))
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=dropout, is_causal=mask is None,
                                          scale=scaling, enable_gqa=k.shape[1] != q.shape[1])


def ulysses_attention(module: nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                      attention_mask: torch.Tensor | None, dropout: float = 0.0, scaling: float | None = None,
                      sliding_window: int | None = None, **kwargs) -> tuple[torch.Tensor, None]:
    """transformers' attention-function signature: q (batch, heads, seq / sp, head_dim), k and v
    (batch, kv heads, seq / sp, head_dim) of this rank's shard -> (batch, seq / sp, heads,
    head_dim), no attention weights."""
    sp = carried_group(ULYSSES, GROUP, AxisComm, "UlyssesAttentionGroup", module, attention_mask, kwargs)
    # The documents are the whole sequence's, as q, k and v are after the all-to-all.
    documents = kwargs.get(DOCUMENTS)
    extra = () if documents is None else (documents,)
    out = attend(*shard_to_heads(query, key, value, sp), dropout, scaling, layer_window(module, sliding_window), *extra)
    return heads_to_shard(out, sp), None


def shard_to_heads(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                   sp: AxisComm) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Ulysses' first all-to-all: (batch, heads, seq / sp, head_dim) of this rank's shard -> the
    whole sequence (all the sp ranks' shards, in rank order) and this rank's heads / sp (key/value
    heads split, or replicated when fewer than the ranks)."""
    q = all_to_all(query, sp, split_dim=1, cat_dim=2)
    k, v = (all_to_all(replicate_kv_heads(t.transpose(1, 2), sp.size).transpose(1, 2), sp, split_dim=1, cat_dim=2)
            for t in (key, value))
    return q, k, v


def heads_to_shard(out: torch.Tensor, sp: AxisComm) -> torch.Tensor:
    """Ulysses' return all-to-all: (batch, heads / sp, seq, head_dim) -> (batch, seq, heads / sp,
    head_dim) -> this rank's shard, all heads, (batch, seq / sp, heads, head_dim)."""
    return all_to_all(out.transpose(1, 2), sp, split_dim=1, cat_dim=2).contiguous()


def sliding_window_mask(seq: int, window: int | None, device: torch.device) -> torch.Tensor | None:
    """Where query i may attend to key j within a sliding window, as transformers' masking utils
    say (causal, and ``j > i - window``); None when the window covers the whole sequence (causal)."""
    if window is None or window >= seq:
        return None
    i = torch.arange(seq, device=device)
    return (i[None, :] <= i[:, None]) & (i[None, :] > i[:, None] - window)


class UlyssesAttentionGroup(Style):
    """On a decoder layer's ``self_attn``: its attention runs as :func:`ulysses_attention` (the
    model's config names it) and each call carries the sp group (a forward pre-hook's keyword)."""

    def apply(self, module: nn.Module, ctx: TPContext) -> None:
        if ctx.sp is None or ctx.sp.size == 1:
            return
        register_attention()
        module.config._attn_implementation = ULYSSES  # the config the whole decoder shares
        sp = ctx.sp

        def hook(m, args, kwargs):
            return args, {**kwargs, GROUP: sp}

        module.register_forward_pre_hook(hook, with_kwargs=True)


def with_ulysses(plan: dict) -> dict:
    """``plan`` (a tensor-parallel plan, or empty) with Ulysses on every decoder layer's attention."""
    key = "model.layers.*.self_attn"
    styles = plan.get(key, [])
    return {**plan, key: [*(styles if isinstance(styles, list) else [styles]), UlyssesAttentionGroup()]}


def ulysses_problems(cfg: Config, heads: int, kv_heads: int, where: str) -> list[str]:
    """``parallel.sp > 1`` against the config.json at ``where`` (its query and key/value head
    counts) and the sequence: each sp rank takes whole query heads of its tp rank's, key/value heads
    divide by sp (split) or divide it (replicated), and the sequence cuts evenly over sp (and then
    over tp under sequence parallelism)."""
    p, seq = cfg.parallel, cfg.data.seq_len
    if p.sp <= 1 or p.tp <= 0 or heads % p.tp or (kv_heads % p.tp and p.tp % kv_heads):
        return []  # no Ulysses, or a tp the family's own check refuses already
    problems = []
    local_q, local_kv = heads // p.tp, max(1, kv_heads // p.tp)  # fewer than tp: one replicated head a rank
    if local_q % p.sp:
        problems.append(f"parallel.sp = {p.sp} (Ulysses) gives each sp rank whole attention heads, and there are "
                        f"{local_q} per tp rank (num_attention_heads = {heads} of {where} / parallel.tp = {p.tp}); "
                        f"use parallel.sp = {divisor_near(local_q, p.sp)}")
    elif local_kv % p.sp and p.sp % local_kv:
        problems.append(f"parallel.sp = {p.sp} (Ulysses): the {local_kv} key/value heads per tp rank "
                        f"(num_key_value_heads = {kv_heads} of {where} / parallel.tp = {p.tp}) must divide by sp "
                        f"(split) or divide sp (replicated); use parallel.sp = {divisor_near(local_kv, p.sp)}")
    if seq % p.sp:
        problems.append(f"data.seq_len = {seq} does not divide by parallel.sp = {p.sp} (Ulysses cuts the sequence "
                        f"evenly); use data.seq_len = {p.sp * max(1, seq // p.sp)}")
    elif p.sequence_parallel and p.tp > 1 and (seq // p.sp) % p.tp:
        problems.append(f"parallel.sequence_parallel: data.seq_len / parallel.sp = {seq // p.sp} does not divide by "
                        f"parallel.tp = {p.tp}; use data.seq_len = {p.sp * p.tp * max(1, seq // (p.sp * p.tp))} or "
                        f"turn sequence_parallel off")
    return problems
