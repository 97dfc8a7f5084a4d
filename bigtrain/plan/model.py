"""The planner's description of a model: shapes, parameter inventory and FLOPs per token.

Two families. ``mlp="swiglu"`` is bigtrain's own Llama (``bigtrain/models/llama.py``): RMSNorm
without bias, rotary positions, bias-free projections wq/wk/wv/wo and a SwiGLU MLP w1/w3/w2,
an input embedding and an (untied by default) output projection. ``mlp="gelu"`` is the classic
GPT / Megatron block: LayerNorm with bias, learned position embeddings, biased projections,
a 4h GELU MLP and an output projection tied to the input embedding.

The inventories list every parameter tensor with its element count and whether it gets weight
decay (matrices do, vectors do not), in the order the runtime's ZeRO units need: one unit per
transformer block and one root unit for everything else.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

from bigtrain.config import ConfigError, ModelConfig
from bigtrain.core.attention_kind import attention_kind
from bigtrain.parallel.placement import Placement, dense, even_shard, vocab_pad_to

MLP_KINDS = ("swiglu", "gelu")


@dataclass(frozen=True)
class Tensor:
    """One parameter tensor: its name, shape, whether AdamW decays it, and how tensor parallelism
    splits it ('col': output rows; 'row': input columns; 'vocab': vocabulary rows, padded as the
    runtime pads them; 'rep': replicated). What a rank holds of it is read from the same placement
    record the runtime keeps (:mod:`bigtrain.parallel.placement`)."""

    name: str
    shape: tuple[int, ...]
    decays: bool
    split: str
    # 'col' over this many key/value heads (wk, wv): tp ranks beyond them hold the whole projection
    # (the runtime's ReplicatedKVHeads, tp a multiple of the heads); 0: not a key/value projection
    heads: int = 0

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    def placement(self, tp: int, index: int = 0) -> Placement:
        """Where tensor-parallel rank ``index`` of ``tp`` holds it (a dense weight over dp x sp)."""
        placed = dense()
        if self.split == "rep" or tp == 1 or (self.heads and self.heads % tp):
            return placed
        dim = 1 if self.split == "row" else 0
        pad_to = vocab_pad_to(self.shape[0], tp) if self.split == "vocab" else 1
        return placed.with_shard(even_shard(self.shape[dim], tp, index, dim, pad_to))

    def local_numel(self, tp: int) -> int:
        """Elements one of ``tp`` tensor-parallel ranks holds."""
        return math.prod(self.placement(tp).local_shape(self.shape))


def local_vocab(vocab: int, tp: int) -> int:
    """Vocabulary rows per tensor-parallel rank, padding included (the runtime's rule)."""
    return even_shard(vocab, tp, 0, 0, vocab_pad_to(vocab, tp)).local_size


def kv_heads_held(kv_heads: int, tp: int, ulysses: int = 1) -> int:
    """Key/value heads one rank holds (the runtime's replicate_kv_heads rule): its share of them per
    tp rank, one replicated copy where there are fewer than tp; then per Ulysses (or cp all-to-all)
    rank, its share of those, one copy where there are fewer than ``ulysses``."""
    return max(1, max(1, kv_heads // tp) // ulysses)


# The spec is frozen: its inventory's sums are computed once per spec (a layout search asks for them
# per layout), in a cache beside it rather than in its __dict__, which reports print.
_per_spec = functools.lru_cache(maxsize=64)


@dataclass(frozen=True)
class ModelSpec:
    layers: int
    hidden: int
    heads: int
    kv_heads: int
    vocab: int
    seq: int
    ffn_hidden: int
    mlp: str = "swiglu"
    tie_embeddings: bool = False
    name: str = ""
    # Mixture of experts (bigtrain/models/moe.py), swiglu only: experts per MoE block (0: dense),
    # each token's experts, every k-th block MoE, each expert's SwiGLU size (0: ffn_hidden).
    experts: int = 0
    top_k: int = 2
    moe_every: int = 1
    expert_hidden: int = 0
    shared_expert: bool = False
    shared_expert_hidden: int = 0  # the shared expert's SwiGLU size (0: expert_ffn)
    shared_expert_gate: bool = False  # its output scaled by sigmoid(w x) per token (Qwen2-MoE's)
    dense_blocks: tuple[int, ...] = ()  # blocks kept dense whatever moe_every says (model.moe_dense_layers)
    # model.moe_capacity_factor (0: dropless): what bounds the rows a rank's experts take under a
    # skewed router (plan/expert_load.py)
    capacity_factor: float = 0.0
    # The router the planner prices when dropless: False, an even split of the routings over the ep
    # ranks; True, a fully skewed one (the worst case the report shows beside it: expert_load.py).
    skewed_routing: bool = False
    # Attention shapes beyond hidden / heads (model.attention_head_dim, a Hugging Face head_dim such
    # as Qwen3's 128 at hidden 1024 and 16 heads: 0 means hidden / heads) and the projections'
    # biases (model.qkv_bias or attention_bias on q, k, v; attention_bias on the output too).
    head_size: int = 0
    qkv_bias: bool = False
    out_bias: bool = False
    qk_norm: bool = False  # an RMSNorm over each query and key head (Qwen3's q_norm, k_norm)
    # model.mlp_bias: biases on a dense block's w1, w3 (cut over tp) and w2 (whole, added after the
    # tp sum); not on the experts (models/moe.py). Left out, a pipeline's cut by parameters
    # (pp_balance = 'params') could differ from the runtime's by a block.
    mlp_bias: bool = False
    # Block-causal attention (model.attn_mask, model.attention, resolved for the device planned:
    # bigtrain.core.attention_kind): '' causal (no mask), 'sdpa' the dense additive mask, 'flex' a
    # BlockMask. Each stage chunk builds one a micro-batch, kept until its backward (plan/activations.py).
    document_mask: str = ""
    # The corpus's mean tokens a document, for FlexAttention's time (plan/gemm.py,
    # document_attention_share): 0, unknown, prices block-causal attention as causal (an upper bound).
    document_tokens: float = 0.0

    # -- construction ----------------------------------------------------------------------------
    @classmethod
    def from_model_config(cls, cfg: ModelConfig, seq: int, name: str = "", device: str = "cuda") -> "ModelSpec":
        """The spec of the runtime's Llama built from ``cfg`` and trained on ``seq``-token samples on a
        ``device`` ('cuda', 'cpu': what model.attention = 'auto' chooses by)."""
        mask = attention_kind(cfg.attention, cfg.attn_mask, device) if cfg.attn_mask == "block_causal" else ""
        # document_tokens stays 0 (unknown): no config field states a document's length (data.document_end
        # only delimits documents; their lengths are the corpus's, known once it is tokenized), so
        # FlexAttention's block-causal time is priced as causal attention's, an upper bound (gemm.py).
        return cls(layers=cfg.n_layers, hidden=cfg.dim, heads=cfg.n_heads, kv_heads=cfg.kv_heads,
                   vocab=cfg.vocab_size, seq=seq, ffn_hidden=cfg.ffn_dim, mlp="swiglu",
                   tie_embeddings=cfg.tie_embeddings, name=name, head_size=cfg.attention_head_dim,
                   qkv_bias=cfg.q_bias, out_bias=cfg.attention_bias, qk_norm=cfg.qk_norm, mlp_bias=cfg.mlp_bias,
                   document_mask=mask, **moe_fields(cfg))

    @classmethod
    def build(cls, layers: int, hidden: int, heads: int, vocab: int, seq: int, kv_heads: int = 0,
              ffn_hidden: int = 0, mlp: str = "swiglu", tie_embeddings: bool | None = None,
              name: str = "", **moe) -> "ModelSpec":
        """A spec from dimensions, with the family's defaults for the unset ones; raises ConfigError."""
        problems = _dimension_problems(layers, hidden, heads, kv_heads, vocab, seq, ffn_hidden, mlp)
        if problems:
            raise ConfigError(problems)
        if not ffn_hidden:
            ffn_hidden = ModelConfig(dim=hidden).ffn_dim if mlp == "swiglu" else 4 * hidden
        if tie_embeddings is None:
            tie_embeddings = mlp == "gelu"  # GPT-2/3 and Megatron tie; Llama does not
        return cls(layers, hidden, heads, kv_heads or heads, vocab, seq, ffn_hidden, mlp, tie_embeddings, name, **moe)

    # -- shapes ----------------------------------------------------------------------------------
    @property
    def head_dim(self) -> int:
        return self.head_size or self.hidden // self.heads

    @property
    def kv_dim(self) -> int:
        return self.kv_heads * self.head_dim

    @property
    def attention_dim(self) -> int:
        """The query heads' width, heads x head_dim: what QK^T and AV contract over and wq / wo map
        to and from. It is ``hidden`` unless a head size is set (Qwen3-0.6B: 16 x 128 = 2048 at
        hidden 1024)."""
        return self.heads * self.head_dim

    # -- parameter inventory -------------------------------------------------------------------
    def block_tensors(self) -> list[Tensor]:
        """One transformer block's parameters."""
        h, kv, f = self.hidden, self.kv_dim, self.ffn_hidden
        if self.mlp == "swiglu":
            q = self.attention_dim
            kvh = self.kv_heads
            biases = [Tensor(f"attention.{w}.bias", (n,), False, "col", heads) for w, n, heads
                      in (("wq", q, 0), ("wk", kv, kvh), ("wv", kv, kvh)) if self.qkv_bias]
            biases += [Tensor("attention.wo.bias", (h,), False, "rep")] if self.out_bias else []
            biases += [Tensor(f"attention.{n}", (self.head_dim,), False, "rep") for n in ("q_norm", "k_norm")
                       if self.qk_norm]
            if self.mlp_bias:
                biases += [Tensor("feed_forward.w1.bias", (f,), False, "col"),
                           Tensor("feed_forward.w3.bias", (f,), False, "col"),
                           Tensor("feed_forward.w2.bias", (h,), False, "rep")]
            return [Tensor("attention.wq", (q, h), True, "col"), Tensor("attention.wk", (kv, h), True, "col", kvh),
                    Tensor("attention.wv", (kv, h), True, "col", kvh), Tensor("attention.wo", (h, q), True, "row"),
                    *biases,
                    Tensor("feed_forward.w1", (f, h), True, "col"), Tensor("feed_forward.w3", (f, h), True, "col"),
                    Tensor("feed_forward.w2", (h, f), True, "row"), Tensor("attention_norm", (h,), False, "rep"),
                    Tensor("ffn_norm", (h,), False, "rep")]
        qkv = h + 2 * kv
        return [Tensor("attn.qkv.weight", (qkv, h), True, "col"), Tensor("attn.qkv.bias", (qkv,), False, "col"),
                Tensor("attn.proj.weight", (h, h), True, "row"), Tensor("attn.proj.bias", (h,), False, "rep"),
                Tensor("mlp.fc1.weight", (f, h), True, "col"), Tensor("mlp.fc1.bias", (f,), False, "col"),
                Tensor("mlp.fc2.weight", (h, f), True, "row"), Tensor("mlp.fc2.bias", (h,), False, "rep"),
                Tensor("ln_1", (2, h), False, "rep"), Tensor("ln_2", (2, h), False, "rep")]

    def embedding_tensors(self) -> list[Tensor]:
        """What the first pipeline stage holds besides blocks."""
        out = [Tensor("tok_embeddings", (self.vocab, self.hidden), True, "vocab")]
        if self.mlp == "gelu":
            out.append(Tensor("pos_embeddings", (self.seq, self.hidden), True, "rep"))
        return out

    def head_tensors(self, separate_copy: bool = False) -> list[Tensor]:
        """What the last pipeline stage holds besides blocks: the final norm and the output
        projection (a tied one only when it lives on another stage than the embedding)."""
        norm = Tensor("norm", (self.hidden,) if self.mlp == "swiglu" else (2, self.hidden), False, "rep")
        out = [norm]
        if not self.tie_embeddings or separate_copy:
            out.append(Tensor("output", (self.vocab, self.hidden), True, "vocab"))
        return out

    # -- mixture of experts ----------------------------------------------------------------------
    def is_moe_block(self, index: int) -> bool:
        """Whether block ``index`` (from 0) has experts (the runtime's rule, ModelConfig.is_moe_block)."""
        return self.experts > 0 and (index + 1) % max(1, self.moe_every) == 0 and index not in self.dense_blocks

    @property
    @_per_spec
    def moe_layers(self) -> int:
        return sum(self.is_moe_block(i) for i in range(self.layers))

    @property
    def expert_ffn(self) -> int:
        return self.expert_hidden or self.ffn_hidden

    @property
    def shared_ffn(self) -> int:
        """The shared expert's SwiGLU size; 0 without one."""
        return (self.shared_expert_hidden or self.expert_ffn) if self.shared_expert else 0

    def moe_block_tensors(self) -> list[Tensor]:
        """An MoE block's parameters outside its experts: attention and norms as a dense block's,
        the router, and the shared expert (whole on every tp rank, like the experts: docs/moe.md)."""
        h, f = self.hidden, self.shared_ffn
        out = [t for t in self.block_tensors() if not t.name.startswith("feed_forward.")]
        out.append(Tensor("feed_forward.router.weight", (self.experts, h), True, "rep"))
        if self.shared_expert:
            out += [Tensor(f"feed_forward.shared.{w}", (f, h) if w != "w2" else (h, f), True, "rep")
                    for w in ("w1", "w3", "w2")]
        if self.shared_expert and self.shared_expert_gate:
            out.append(Tensor("feed_forward.shared_gate.weight", (1, h), True, "rep"))
        return out

    def expert_tensors(self, ep: int = 1) -> list[Tensor]:
        """An MoE block's experts as one of ``ep`` expert-parallel ranks holds them: E/ep experts,
        stored as (E/ep x F, h) matrices w1, w3, w2 (models/moe.py), whole over tp."""
        rows = self.experts // ep * self.expert_ffn
        return [Tensor(f"feed_forward.experts.{w}", (rows, self.hidden), True, "rep") for w in ("w1", "w3", "w2")]

    def block_tensors_at(self, index: int) -> list[Tensor]:
        """Block ``index``'s parameters, experts whole."""
        if self.is_moe_block(index):
            return self.moe_block_tensors() + self.expert_tensors()
        return self.block_tensors()

    def _active_block_params(self, index: int) -> int:
        """Weights a token multiplies in block ``index``: of an MoE block top_k of the E experts."""
        dense = sum(t.numel for t in (self.moe_block_tensors() if self.is_moe_block(index) else self.block_tensors())
                    if t.decays)
        return dense + (self.top_k * 3 * self.expert_ffn * self.hidden if self.is_moe_block(index) else 0)

    @property
    @_per_spec
    def activation_ffn(self) -> float:
        """The SwiGLU width a token's saved activations span, averaged over the blocks: the dense
        ffn; of an MoE block top_k experts' (and the shared expert's)."""
        if not self.experts:
            return self.ffn_hidden
        moe = self.top_k * self.expert_ffn + self.shared_ffn
        return (self.moe_layers * moe + (self.layers - self.moe_layers) * self.ffn_hidden) / self.layers

    @property
    @_per_spec
    def block_params(self) -> int:
        return sum(t.numel for t in self.block_tensors())

    @property
    @_per_spec
    def params(self) -> int:
        """Distinct parameters (a tied embedding counted once; every expert)."""
        root = self.embedding_tensors() + self.head_tensors()
        if self.experts:
            return sum(t.numel for i in range(self.layers) for t in self.block_tensors_at(i)) + \
                sum(t.numel for t in root)
        return self.layers * self.block_params + sum(t.numel for t in root)

    # -- FLOPs ---------------------------------------------------------------------------------
    @property
    @_per_spec
    def block_matmul_params(self) -> float:
        """Weights a token multiplies in one block (biases and norms cost O(h), left out); with
        experts, the active ones (top_k of E), averaged over the blocks."""
        if self.experts:
            return sum(self._active_block_params(i) for i in range(self.layers)) / self.layers
        return sum(t.numel for t in self.block_tensors() if t.decays)

    @property
    @_per_spec
    def matmul_params(self) -> int:
        """N of the 6N convention: every weight a token is multiplied by (all block matrices and
        the output projection; of an MoE block's experts the top_k active ones); the input
        embedding is a lookup and costs nothing."""
        return round(self.layers * self.block_matmul_params) + self.vocab * self.hidden

    def block_forward_flops_per_token(self) -> int:
        """2 per multiply-add over the block's weights, plus attention's QK^T and AV: 4 a s with
        a = heads x head_dim (:attr:`attention_dim`; h when heads x head_dim = h), the full-matrix
        convention of PaLM and Megatron (a causal kernel does about half)."""
        return 2 * self.block_matmul_params + 4 * self.attention_dim * self.seq

    def model_flops_per_token(self) -> int:
        """Model FLOPs per trained token: 6N + 12 L a s (forward 2N + 4Las, backward twice that).

        The convention chosen is the peers': attention's score and value products count the query
        heads' width a = heads x head_dim, not the model's hidden size, as Megatron-LM's
        ``num_floating_point_operations`` (kv_channels x num_attention_heads) and torchtitan's
        ``12 * l * h * q * t`` (heads x head_dim) do, so an MFU figure from a model whose heads x
        head_dim differs from hidden (Qwen3) compares with theirs; the products really contract over
        a, so it is also the work done. Over the whole s x s matrix, as they count it."""
        return 6 * self.matmul_params + 12 * self.layers * self.attention_dim * self.seq

    def block_recompute_flops_per_token(self) -> float:
        """What a checkpointed block runs again in the backward: its forward up to the last tensor the
        backward needs (torch's non-reentrant checkpoint stops there), the MLP's down projection's
        input, so all but that GEMM (2 F h: w2, or fc2) in a dense block; an MoE block's whole
        forward (its experts' last GEMM is not the block's last op). Averaged over the blocks."""
        dense = self.layers - (self.moe_layers if self.experts else 0)
        return self.block_forward_flops_per_token() - 2 * self.ffn_hidden * self.hidden * dense / self.layers

    def recompute_flops_per_token(self, checkpointed_blocks: float) -> float:
        """Extra hardware FLOPs of recomputing the forward of ``checkpointed_blocks`` blocks."""
        return checkpointed_blocks * self.block_recompute_flops_per_token()

    def describe(self) -> str:
        kind = "Llama-style (SwiGLU, RMSNorm, rotary)" if self.mlp == "swiglu" else "GPT-style (GELU, LayerNorm, learned positions)"
        gqa = f", {self.kv_heads} kv heads" if self.kv_heads != self.heads else ""
        moe = ""
        if self.experts:
            where = "every block" if self.moe_every == 1 else f"every {self.moe_every}th block"
            if self.dense_blocks:
                where += f" but {', '.join(map(str, sorted(self.dense_blocks)))}"
            shared = (f" and a{' gated' if self.shared_expert_gate else ''} shared expert of {self.shared_ffn}"
                      if self.shared_expert else "")
            capacity = f", capacity {self.capacity_factor:g}" if self.capacity_factor > 0 else ""
            moe = (f", {self.experts} experts of {self.expert_ffn} top-{self.top_k}{shared} in {where}{capacity} "
                   f"({_count(self.matmul_params)} active)")
        return (f"{self.name + ': ' if self.name else ''}{kind}, {self.layers} layers, hidden {self.hidden}, "
                f"{self.heads} heads{gqa}, ffn {self.ffn_hidden}, vocab {self.vocab}, seq {self.seq}, "
                f"{_count(self.params)} parameters{moe}")


def moe_fields(cfg: ModelConfig) -> dict:
    """The ModelSpec fields of ``cfg``'s mixture of experts (none for a dense model)."""
    if cfg.moe_experts <= 0:
        return {}
    return dict(experts=cfg.moe_experts, top_k=cfg.moe_top_k, moe_every=cfg.moe_every,
                expert_hidden=cfg.moe_ffn_hidden, shared_expert=cfg.moe_shared_expert,
                shared_expert_hidden=cfg.moe_shared_expert_hidden, shared_expert_gate=cfg.moe_shared_expert_gate,
                dense_blocks=cfg.moe_dense_blocks, capacity_factor=cfg.moe_capacity_factor)


def _count(n: int) -> str:
    for unit, scale in (("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if n >= scale:
            return f"{n / scale:.2f} {unit}"
    return str(n)


def _dimension_problems(layers, hidden, heads, kv_heads, vocab, seq, ffn_hidden, mlp) -> list[str]:
    """Every problem with a model's dimensions, each naming the command-line flag."""
    problems = []
    for flag, value in (("--layers", layers), ("--hidden", hidden), ("--heads", heads), ("--vocab", vocab),
                        ("--seq", seq)):
        if not isinstance(value, int) or value <= 0:
            problems.append(f"{flag} = {value}: must be a positive integer")
    for flag, value in (("--kv-heads", kv_heads), ("--ffn-hidden", ffn_hidden)):
        if not isinstance(value, int) or value < 0:
            problems.append(f"{flag} = {value}: must be >= 0 (0 picks the default)")
    if mlp not in MLP_KINDS:
        problems.append(f"--mlp = '{mlp}': must be one of {', '.join(MLP_KINDS)}")
    if problems:
        return problems
    if hidden % heads:
        problems.append(f"--hidden = {hidden} is not divisible by --heads = {heads}; pick heads that divide it")
    elif mlp == "swiglu" and (hidden // heads) % 2:
        problems.append(f"--hidden / --heads = {hidden // heads} must be even for rotary embeddings")
    if kv_heads and heads % kv_heads:
        problems.append(f"--kv-heads = {kv_heads} must divide --heads = {heads}")
    return problems
