"""A Llama-style decoder as plain single-device PyTorch.

RMSNorm, rotary position embeddings, grouped-query attention and a SwiGLU MLP. The model knows
nothing of ranks: parallel layouts are applied afterwards by ``bigtrain.parallel``. Build it on the
meta device (``with torch.device("meta")``) and call :meth:`Llama.init_weights` after
``to_empty``: weights are drawn per parameter from a generator seeded by the parameter's name, so
every layout that owns a parameter (or a shard of it) initializes it to the same values.
"""

from __future__ import annotations

import zlib

import torch
import torch.nn.functional as F
from torch import nn

from bigtrain.config import ModelConfig
from bigtrain.core.attention_kind import attention_kind
from bigtrain.core.documents import DocumentIds, layer_mask
from bigtrain.models.feed_forward import FeedForward
from bigtrain.models.flex import BlockMask, flex_attend
from bigtrain.models.moe import MoEFeedForward, init_router_biases
from bigtrain.models.rope import rotary_tables_for
from bigtrain.models.widen import at_least_fp32


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.empty(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Normalize in fp32 whatever the compute dtype: the mean of squares underflows in bf16.
        x32 = at_least_fp32(x)
        normed = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return normed.type_as(x) * self.weight


def rotary_tables(head_dim: int, max_seq_len: int, theta: float, device=None) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin of shape (max_seq_len, head_dim / 2), unscaled (a model's own tables, with its
    ``rope_scaling``, come from :func:`bigtrain.models.rope.rotary_tables_for`)."""
    inv_freq = 1.0 / theta ** (torch.arange(0, head_dim, 2, device=device, dtype=torch.float32) / head_dim)
    angles = torch.outer(torch.arange(max_seq_len, device=device, dtype=torch.float32), inv_freq)
    return angles.cos(), angles.sin()


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate pairs (x[..., 2i], x[..., 2i+1]) of x (batch, seq, heads, head_dim) by position: cos
    and sin (seq, head_dim / 2), or (batch, seq, head_dim / 2) when each row has positions of its own
    (``model.reset_positions``: they restart at each document)."""
    x1, x2 = at_least_fp32(x).unflatten(-1, (-1, 2)).unbind(-1)
    cos, sin = (cos[None, :, None, :], sin[None, :, None, :]) if cos.dim() == 2 else (cos[:, :, None], sin[:, :, None])
    rotated = torch.stack((x1 * cos - x2 * sin, x1 * sin + x2 * cos), dim=-1).flatten(-2)
    return rotated.type_as(x)


class AttentionCore(nn.Module):
    """Causal softmax attention on (batch, seq, heads, head_dim) tensors; given ``mask``,
    block-causal: a token attends to the earlier tokens of its own document only. The mask is data,
    built once a forward (:func:`bigtrain.core.documents.layer_mask`), and its type says the kernel:
    an additive (batch, 1, seq, seq) tensor goes to sdpa, a BlockMask to FlexAttention
    (``model.attention``; :mod:`bigtrain.models.flex`).

    A module of its own so a parallel plan can wrap it (Ulysses re-shards q, k, v around it; the
    mask is always the whole sequence's, which attention sees after the all-to-all)."""

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                mask: torch.Tensor | None = None) -> torch.Tensor:
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))
        gqa = q.shape[1] != k.shape[1]
        if mask is None:
            out = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=gqa)
        elif isinstance(mask, BlockMask):
            out = flex_attend(q, k, v, mask)
        elif isinstance(mask, DocumentIds):  # the ring's (RingAttention takes this core's place)
            raise RuntimeError("document ids reached attention over a whole sequence: only ring attention "
                               "(parallel.cp_mode = 'ring' / 'hybrid') masks its blocks from them")
        else:
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask.to(q.dtype), enable_gqa=gqa)
        return out.transpose(1, 2)


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.n_heads, self.n_kv_heads, self.head_dim = cfg.n_heads, cfg.kv_heads, cfg.head_dim
        self.wq = nn.Linear(cfg.dim, self.n_heads * self.head_dim, bias=cfg.q_bias)
        self.wk = nn.Linear(cfg.dim, self.n_kv_heads * self.head_dim, bias=cfg.q_bias)
        self.wv = nn.Linear(cfg.dim, self.n_kv_heads * self.head_dim, bias=cfg.q_bias)
        self.wo = nn.Linear(self.n_heads * self.head_dim, cfg.dim, bias=cfg.attention_bias)
        self.core = AttentionCore()

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                mask: torch.Tensor | None = None) -> torch.Tensor:
        b, s, _ = x.shape
        # Head counts come from the weights so a tensor-parallel shard (fewer heads) runs unchanged.
        q = self.wq(x).view(b, s, -1, self.head_dim)
        k = self.wk(x).view(b, s, -1, self.head_dim)
        v = self.wv(x).view(b, s, -1, self.head_dim)
        if cos.dim() == 2:  # a table from the first position on (per-row tables are one per token already)
            cos, sin = cos[:s], sin[:s]
        q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
        out = self.core(q, k, v) if mask is None else self.core(q, k, v, mask)
        return self.wo(out.reshape(b, s, -1))


class TransformerBlock(nn.Module):
    def __init__(self, cfg: ModelConfig, index: int = 0):
        super().__init__()
        self.attention_norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.attention = Attention(cfg)
        self.ffn_norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.feed_forward = (moe_feed_forward(cfg) if cfg.is_moe_block(index)
                             else FeedForward(cfg.dim, cfg.ffn_dim, cfg.mlp_bias))

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                mask: torch.Tensor | None = None) -> torch.Tensor:
        """``mask``: block-causal attention's additive mask of the whole sequence (None: causal)."""
        h = x + self.attention(self.attention_norm(x), cos, sin, mask)
        return h + self.feed_forward(self.ffn_norm(h))


class Llama(nn.Module):
    """Tokens (batch, seq) -> logits (batch, seq, vocab); or the final norm's output with
    ``with_head=False`` (a loss that applies the head itself, the fused loss, then calls it)."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.cfg = cfg
        self.tok_embeddings = nn.Embedding(cfg.vocab_size, cfg.dim)
        self.layers = nn.ModuleList(TransformerBlock(cfg, i) for i in range(cfg.n_layers))
        self.norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.output = nn.Linear(cfg.dim, cfg.vocab_size, bias=False)
        if cfg.tie_embeddings:
            self.output.weight = self.tok_embeddings.weight
        # Not persistent: derived from the config, so checkpoints need not carry them.
        self.register_buffer("rope_cos", torch.empty(cfg.max_seq_len, cfg.head_dim // 2), persistent=False)
        self.register_buffer("rope_sin", torch.empty(cfg.max_seq_len, cfg.head_dim // 2), persistent=False)

    def to_empty(self, *, device: torch.device | str | None, recurse: bool = True) -> "Llama":
        # nn.Module.to_empty gives each registration of a meta parameter a tensor of its own: without
        # tying the head again, a tied model would silently train two weights.
        super().to_empty(device=device, recurse=recurse)
        if self.cfg.tie_embeddings:
            self.output.weight = self.tok_embeddings.weight
        return self

    def forward(self, tokens: torch.Tensor, start_pos: int = 0, with_head: bool = True,
                positions: torch.Tensor | None = None, documents: torch.Tensor | None = None) -> torch.Tensor:
        """``start_pos``: position of the first token (a sequence-parallel rank holds a later chunk);
        ``with_head``: False ends at the final norm (its output goes to a fused loss head);
        ``positions``: each token's position instead, (seq,) (a context-parallel rank holds two
        chunks) or (batch, seq) (positions restarting at each document); ``documents``: each token's
        document (batch, whole seq), for block-causal attention (None: causal)."""
        s = tokens.shape[1]
        if positions is not None:
            cos, sin = self.rope_cos[positions], self.rope_sin[positions]
        else:
            cos, sin = self.rope_cos[start_pos:start_pos + s], self.rope_sin[start_pos:start_pos + s]
        h = self.tok_embeddings(tokens)
        mask = None if documents is None else documents_mask(self.cfg, documents, h.dtype)  # one for every layer
        for layer in self.layers:
            h = layer(h, cos, sin) if mask is None else layer(h, cos, sin, mask)
        h = self.norm(h)
        return self.output(h) if with_head else h

    @torch.no_grad()
    def init_buffers(self, device: torch.device | str | None = None) -> None:
        """(Re)create the rotary tables and zero the routers' biases, on ``device`` (default: where
        they are), in fp32."""
        device = self.rope_cos.device if device is None else torch.device(device)
        self.rope_cos, self.rope_sin = rotary_tables_for(self.cfg, device)
        init_router_biases(self, device)

    def initial_value(self, name: str, shape: tuple[int, ...], seed: int) -> torch.Tensor:
        """Parameter ``name``'s full initial value (what ``parallelize`` cuts each rank's part from)."""
        return init_value(name, shape, seed, self.cfg)

    @torch.no_grad()
    def init_weights(self, seed: int) -> None:
        """Fill every parameter and buffer; the values depend on (seed, parameter name) only."""
        self.init_buffers()
        for name, param in self.named_parameters():
            param.copy_(init_value(name, tuple(param.shape), seed, self.cfg))


def documents_mask(cfg: ModelConfig, documents: torch.Tensor, dtype: torch.dtype):
    """The mask every layer of one forward (or pipeline stage) attends with, for ``documents``
    (batch, seq): sdpa's additive one in ``dtype`` or FlexAttention's BlockMask, as
    ``model.attention`` resolves on the device the documents are on
    (:func:`bigtrain.core.attention_kind.attention_kind`); :class:`~bigtrain.core.documents.DocumentIds`
    (the context-parallel ring's) as they are."""
    if isinstance(documents, DocumentIds):
        return documents
    return layer_mask(documents, dtype, attention_kind(cfg.attention, "block_causal", documents.device.type))


def init_value(name: str, shape: tuple[int, ...], seed: int, cfg: ModelConfig) -> torch.Tensor:
    """The initial value of parameter ``name`` (full, unsharded), on the CPU in fp32."""
    if name.endswith("norm.weight"):
        return torch.ones(shape, device="cpu")
    if name.endswith(".bias"):  # as Hugging Face initializes linear biases
        return torch.zeros(shape, device="cpu")
    gen = torch.Generator().manual_seed(seed * 1_000_003 + zlib.crc32(name.encode()))
    std = cfg.init_std
    if name.endswith(("wo.weight", "w2.weight", "experts.w2")):
        # GPT-2's scaled init for projections into the residual stream keeps its variance flat in depth.
        std = std / (2 * cfg.n_layers) ** 0.5
    return torch.randn(shape, generator=gen, device="cpu") * std


def moe_feed_forward(cfg: ModelConfig) -> MoEFeedForward:
    return MoEFeedForward(cfg.dim, cfg.moe_ffn_dim, cfg.moe_experts, cfg.moe_top_k, cfg.moe_capacity_factor,
                          cfg.moe_aux_loss_coef, cfg.moe_router, cfg.moe_shared_expert,
                          shared_hidden=cfg.moe_shared_ffn_dim, shared_gate=cfg.moe_shared_expert_gate)


def build_model(cfg: ModelConfig, device: str | torch.device = "meta") -> Llama:
    """The reference model, on the meta device by default (no memory until materialized)."""
    with torch.device(device):
        return Llama(cfg)


def count_parameters(model: nn.Module) -> int:
    return sum(p.numel() for p in {id(p): p for p in model.parameters()}.values())
