"""Bytes autograd keeps for backward, tensor by tensor, per token.

Each entry names a tensor the block saves, its bytes per token and whether tensor parallelism
splits it. For bigtrain's Llama the list was read off ``SavedActivations`` on the real model in
fp32 and bf16 (tests/test_plan.py re-measures it). With B bytes per element of the compute dtype,
h hidden, k = kv_heads x head_dim, F the SwiGLU size and a heads, one block saves per token:

    attention_norm / ffn_norm (RMSNorm, computed in fp32):
        input in fp32 4h (in fp32 it *is* the block input / residual; in bf16 a copy)
        rsqrt 4, normalized x B h, x * weight B h (the input the next linears save)
    attention: rotated q B h, rotated k B k, v B k (as SDPA saves them), output B h
        (SDPA returns it in (b, s, a, d) memory order, so wo's input is a view of it),
        logsumexp 4 a (fp32); rotary saves only its cos/sin tables (buffers, not counted)
    SwiGLU: w1 x, w3 x, silu(w1 x), and the product w2 multiplies: 4 B F

so per block  s b h (c1 + c2 / t)  with
    c1 = (8h + 8 + 4Bh) / h            (norms: replicated over tp unless Megatron SP)
    c2 = (2Bh + 2Bk + 4a + 4BF) / h    (attention and MLP: split by tp)
fp32 (B=4): c1 = 24 + 8/h; bf16: c1 = 16 + 8/h. For Llama-2 7B in bf16 (k = h, F = 2.6875 h):
c2 = 29.5, so one layer keeps 45.5 s b h bytes (Megatron's GPT-3 figure is 34 s b h + 5 a s^2 b
with dropout and without flash attention).

A checkpointed block keeps only its input (B h, sharded along the sequence under Megatron SP).
After the last block: the final norm (as above), the fp32 log-softmax of the logits 4V
(vocab-parallel under tp), the targets (int64, flattened copy) and the micro-batch's token
window (int64, b (s+1) values shared by inputs and targets) plus a 4-byte scalar of the loss.

GPT-style blocks (not in the runtime; standard fused kernels, flash attention, no dropout):
LayerNorm keeps its input B h, mean and rstd 8 and its output B h; attention as above; the
GELU MLP keeps fc1's output and the GELU's output, 2 B F.
"""

from __future__ import annotations

from dataclasses import dataclass

from bigtrain.plan.layout import BYTES
from bigtrain.plan.model import ModelSpec


@dataclass(frozen=True)
class BlockActivations:
    """Bytes per token of one block, by how tensor parallelism divides them."""

    items: tuple[tuple[str, float, bool], ...]  # (tensor, bytes per token, split by tp)
    checkpointed: float  # what a checkpointed block keeps per token (its input)
    hidden: int

    @property
    def replicated(self) -> float:
        return sum(b for _, b, split in self.items if not split)

    @property
    def split(self) -> float:
        return sum(b for _, b, split in self.items if split)

    @property
    def c1(self) -> float:
        return self.replicated / self.hidden

    @property
    def c2(self) -> float:
        return self.split / self.hidden

    def per_token(self, tp: int = 1, tp_sp: bool = False, checkpointed: bool = False) -> float:
        """Bytes per token of the sequence (before Ulysses splits it) on one tp rank."""
        if checkpointed:
            return self.checkpointed / (tp if tp_sp else 1)
        return self.replicated / (tp if tp_sp else 1) + self.split / tp


@dataclass(frozen=True)
class HeadActivations:
    """What the last stage keeps after the blocks, and the first stage's token window."""

    norm: float  # final norm, per token (replicated over tp unless Megatron SP)
    logits: float  # fp32 log-softmax, per token (vocab-parallel: divided by tp)
    targets: float  # int64 per token
    tokens_per_sample: int  # int64 window of s + 1 tokens per sample
    scalar: int = 4  # the loss's saved scalar, once per micro-batch

    def bytes(self, samples: int, seq: int, tp: int = 1, tp_sp: bool = False, last: bool = True,
              first: bool = True) -> float:
        tokens = samples * seq
        out = 0.0
        if last:
            out += tokens * (self.norm / (tp if tp_sp else 1) + self.logits / tp + self.targets) + self.scalar
        if first:
            out += samples * self.tokens_per_sample
        return out


def _norm_items(model: ModelSpec, nbytes: int, prefix: str) -> list[tuple[str, float, bool]]:
    h = model.hidden
    if model.mlp == "swiglu":  # RMSNorm in fp32, then cast back and scaled by the weight
        return [(f"{prefix}.input_fp32", 4 * h, False), (f"{prefix}.rsqrt", 4, False),
                (f"{prefix}.normalized", nbytes * h, False), (f"{prefix}.output", nbytes * h, False)]
    return [(f"{prefix}.input", nbytes * h, False), (f"{prefix}.mean_rstd", 8, False),
            (f"{prefix}.output", nbytes * h, False)]


def block_activations(model: ModelSpec, precision: str) -> BlockActivations:
    """The itemized saved tensors of one block (see the module docstring)."""
    nbytes, h, k, f = BYTES[precision], model.hidden, model.kv_dim, model.ffn_hidden
    first_norm, second_norm = ("attention_norm", "ffn_norm") if model.mlp == "swiglu" else ("ln_1", "ln_2")
    items = _norm_items(model, nbytes, first_norm)
    items += [("attention.q", nbytes * h, True), ("attention.k", nbytes * k, True), ("attention.v", nbytes * k, True),
              ("attention.logsumexp", 4 * model.heads, True), ("attention.output", nbytes * h, True)]
    items += _norm_items(model, nbytes, second_norm)
    if model.mlp == "swiglu":
        items += [("feed_forward.w1_out", nbytes * f, True), ("feed_forward.w3_out", nbytes * f, True),
                  ("feed_forward.silu_out", nbytes * f, True), ("feed_forward.product", nbytes * f, True)]
    else:
        items += [("mlp.fc1_out", nbytes * f, True), ("mlp.gelu_out", nbytes * f, True)]
    return BlockActivations(tuple(items), checkpointed=nbytes * h, hidden=h)


def head_activations(model: ModelSpec, precision: str) -> HeadActivations:
    norm = sum(b for _, b, _ in _norm_items(model, BYTES[precision], "norm"))
    return HeadActivations(norm=norm, logits=4 * model.vocab, targets=8, tokens_per_sample=8 * (model.seq + 1))


def checkpointed_block_indices(layers: int, recompute: str, every: int) -> set[int]:
    """The runtime's policy (memory/checkpointing.py): none, full, or blocks 0, k, 2k, ..."""
    if recompute == "full":
        return set(range(layers))
    if recompute == "every":
        return set(range(0, layers, every))
    return set()
