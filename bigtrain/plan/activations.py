"""Bytes autograd keeps for backward, tensor by tensor, per token.

Each entry names a tensor the block saves, its bytes per token and how tensor parallelism treats
it (a norm's input, a norm's output, or split over tp). For bigtrain's Llama the list was read off ``SavedActivations`` on the real model in
fp32 and bf16 (tests/test_plan.py re-measures it). With B bytes per element of the compute dtype,
h hidden, k = kv_heads x head_dim, F the SwiGLU size and a heads, one block saves per token:

    attention_norm / ffn_norm (RMSNorm, computed in fp32):
        input in fp32 4h (in fp32 it *is* the block input / residual; in bf16 a copy)
        rsqrt 4, normalized x B h, x * weight B h (the input the next linears save)
    attention: rotated q B h, rotated k B k, v B k (as SDPA saves them), output B h
        (SDPA returns it in (b, s, a, d) memory order, so wo's input is a view of it; q and the
        output are heads x head_dim wide, ``ModelSpec.attention_dim``, h unless a head size is set),
        logsumexp 4 a (fp32); rotary saves only its cos/sin tables (buffers, not counted)
    SwiGLU: w1 x, w3 x, silu(w1 x), and the product w2 multiplies: 4 B F

so per block  s b h (c1 + c2 / t)  with
    c1 = (8h + 8 + 4Bh) / h            (norms: replicated over tp unless Megatron SP)
    c2 = (2Bh + 2Bk + 4a + 4BF) / h    (attention and MLP: split by tp)
fp32 (B=4): c1 = 24 + 8/h; bf16: c1 = 16 + 8/h. For Llama-2 7B in bf16 (k = h, F = 2.6875 h):
c2 = 29.5, so one layer keeps 45.5 s b h bytes (Megatron's GPT-3 figure is 34 s b h + 5 a s^2 b
with dropout and without flash attention).

Layouts (t = tp degree, u = Ulysses degree; every count is per token the rank holds, s b / u):
    tp:            norms whole on every rank (c1), attention and MLP divided (c2 / t)
    Megatron SP:   the norms' inputs are sequence shards (/ t), but each column-parallel linear
                   saves a whole-sequence copy of its gathered input: SP_GATHERED_COPIES x B h
    Ulysses:       as one rank, on s/u tokens, plus B h for attention's output after the
                   all-to-all back (a new tensor, where wo otherwise saves a view of SDPA's output)
    key/value heads fewer than the ranks: a rank keeps whole heads, one copy where there are fewer
                   than tp, and under Ulysses (or cp's all-to-all) the whole sequence of one copy
                   where fewer than u per tp rank (replicate_kv_heads): more than 2Bk/t per token
A checkpointed block keeps only its input (B h, sharded along the sequence under Megatron SP).
After the last block: the final norm (as above), the fp32 log-softmax of the logits 4V
(vocab-parallel under tp: 4V/t), the targets (int64 copy; under tp plus two bool masks) and a
4-byte scalar (not under tp). The first stage keeps the token ids: the sampler's (s+1)-token
window per sample, a copied chunk under Ulysses, shifted ids and a mask (9 bytes) under tp.

Selective recomputation (``memory/selective.py``: the norms and the SwiGLU activation recompute,
the linears keep their inputs) keeps per token: each norm's input B h and output B h, attention as
in a plain block, w1 x, w3 x and their product 3 B F; no fp32 norm internals, no silu output:

    selective: c1 = 4B,  c2 = (2Bh + 2Bk + 4a + 3BF) / h      (fp32: 16 + 8 + 4a/h + 12 F/h)

With ``selective_attention`` (the core recomputed too) the log-sum-exp goes, and attention's
output is kept by wo alone (no extra copy under Ulysses).

int8 compression (``memory/compression.py``) stores a linear's input as 1 byte an element plus a
4-byte scale per token: the norms' outputs (and Megatron SP's gathered copies), w2's input, and
wo's input (an extra copy in a plain block, where SDPA keeps its output anyway). Full
checkpointing keeps no linear input, so int8 changes nothing there. In an MoE block the router
keeps its input exactly (routers are left out) and the routed experts are no linear layers: only
a shared expert's inputs are int8 (``moe_routing_bytes``; measured to the byte, tests/test_plan.py).

The fused loss (``memory/fused_loss.py``) keeps of the head the final norm as above, 4 bytes of
log-sum-exp and the int64 targets per token, instead of the fp32 log-softmax over the vocabulary;
while it runs it holds one chunk's logits and exponentials (``fused_chunk_bytes``). Offload keeps
at most two modules' offloadable tensors on the device (``memory/offload.py``; memory.py).

Compiled blocks (``compile.enabled``, ``Layout.compiled``; bigtrain/parallel/compile.py): the block
is one inductor region, and AOT autograd's min-cut partitioner saves for backward what is cheapest
to keep, recomputing element-wise results from it. Read off ``SavedActivations`` on the compiled
Llama (saved-tensor hooks see what the compiled graph saves: AOT autograd hands it to autograd
through ``save_for_backward``) in fp32 and bf16, and in the generated forward graph's outputs
(``benchmarks/compile_fusions.py``), a compiled block saves per token:

    each norm: its input in the compute dtype B h (the first norm's: the block input; the second's:
        wo's output, the residual x + wo(...) is recomputed from it), rsqrt 4, its output B h as
        the linears after it keep it; no fp32 copy of the input, no normalized x (recomputed)
    attention: as eager (q, k, v, log-sum-exp, SDPA's output)
    SwiGLU: w1 x, w3 x and their product 3 B F; silu(w1 x) is recomputed

    compiled: c1 = (2Bh + 8 + 2Bh) / h = 4B + 8/h,  c2 = (2Bh + 2Bk + 4a + 3BF) / h

so 8h + 2F fewer bytes a token per block in bf16 (fp32: 8h + 4F), 32 KiB for llama-1b (h 2048,
F 8192): 4.0 GiB over its 16 blocks at 4 x 2048 tokens, where the H200 measured 4.2 GiB between
eager and compiled peaks (docs/benchmarks.md). The final norm is a region too (same list), and the
plain loss (no tp, not fused) is compiled as a function: it keeps the logits in the compute dtype
B V and the int64 targets, and recomputes the log-softmax (no fp32 4V, no scalar). With the
activation-memory options (each measured on the trainer at one rank, fp32 and bf16):

    full / every k:   a checkpointed block keeps its input B h, as eager (the block compiles
                      inside its checkpoint, parallel/compile.py; the bytes are the same either way)
    selective:        each norm's input B h, attention as above, w1 x and w3 x 2 B F: the norms'
                      outputs and the SwiGLU product, which selective marks for recomputation, are
                      recomputed too (the compiler recomputes a checkpointed op's output even where
                      a linear after it needs it); with selective_attention: the eager figure
                      (not measured compiled)
    int8:             the block is compiled child by child around its int8 linears
                      (parallel/compile.py), with the same saving: each norm region keeps its input
                      B h and rsqrt, the SwiGLU region w1 x and w3 x; the int8 copies as eager
    int8 + selective: the eager figure (measured: nothing saved beyond the final norm's)
    offload, fused loss: the compiled block's list (offload moves what the graph saves)
    tp, Megatron SP, Ulysses: the same list divided as eager's (the collectives break the graph
                      into pieces; measured over two ranks within 0.15%,
                      benchmarks/measure_compiled_activations.py --parallel)

A model with experts keeps the eager figures: its MoE layers run eagerly inside a block compiled
child by child, not measured compiled. The GPT block below is priced with fused kernels already.

Block-causal attention (``model.attn_mask``, ``ModelSpec.document_mask``) adds, per stage chunk and
micro-batch in flight, the one mask its layers share (:func:`document_mask_bytes`): with sdpa the
additive (samples, 1, s, s) mask in the compute dtype, B s^2 a sample, of the whole sequence s
whatever cuts the tokens (tp, Megatron SP, Ulysses, cp's all-to-all: attention sees the whole
sequence); with FlexAttention its BlockMask, int32 tile indices; under the cp ring the documents'
int64 ids, 8 B s a sample (each pair of chunks masks itself from them while it runs). sdpa saves the
mask for backward once (every layer saves the same tensor: measured, tests/test_document_masking.py); a checkpointed
block keeps it alive as an input of its recomputation. It lives until the chunk's first block has
run its backward, so it is counted with the chunk's largest block too.

GPT-style blocks (not in the runtime; standard fused kernels, flash attention, no dropout):
LayerNorm keeps its input B h, mean and rstd 8 and its output B h; attention as above; the
GELU MLP keeps fc1's output and the GELU's output, 2 B F.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

from bigtrain.plan.layout import BYTES
from bigtrain.plan.memo import cached
from bigtrain.plan.model import ModelSpec, kv_heads_held, local_vocab


# Under Megatron sequence parallelism the runtime all-gathers a norm's output once per sub-block
# (attention, MLP) and the column-parallel linears after it all save that one whole-sequence tensor.
# Megatron keeps only the sharded input and gathers again in backward; if the runtime does that,
# these become 0 (and tests/test_plan.py will say so).
SP_GATHERED_COPIES = {"swiglu": 2, "gelu": 2}


@dataclass(frozen=True)
class BlockActivations:
    """Bytes per token of one block, by how tensor and sequence parallelism divide them."""

    # (tensor, bytes per token, kind: norm_in / norm_out / split, or whole: an MoE block's routing and
    # experts, whole on every tp rank, as the tp ranks route the same hidden states)
    items: tuple[tuple[str, float, str], ...]
    checkpointed: float  # what a checkpointed block keeps per token (its input)
    hidden: int
    nbytes: int
    gathered_copies: int
    gathered_bytes: float = 0.0  # per token of one Megatron-SP gathered copy (B h; h + 4 in int8)
    ulysses_extra: float = 0.0  # per token: wo's own copy of attention's output after the all-to-all
    per_block: float = 0.0  # bytes a block keeps whatever its tokens (averaged over the blocks), unless checkpointed
    kv_heads: int = 0  # the model's key/value heads (0: never replicated, the items' share of them is exact)

    def _sum(self, kind: str) -> float:
        return self._sums.get(kind, 0)

    @functools.cached_property  # a search asks per layout and block; the items are frozen
    def _sums(self) -> dict[str, float]:
        out: dict[str, float] = {}
        for _, nbytes, kind in self.items:
            out[kind] = out.get(kind, 0) + nbytes
        return out

    @property
    def replicated(self) -> float:
        return self._sum("norm_in") + self._sum("norm_out")

    @property
    def split(self) -> float:
        return self._sum("split")

    @property
    def c1(self) -> float:
        return self.replicated / self.hidden

    @property
    def c2(self) -> float:
        return self.split / self.hidden

    def per_token(self, tp: int = 1, tp_sp: bool = False, checkpointed: bool = False, ulysses: int = 1) -> float:
        """Bytes per token this rank holds (tokens: the rank's sequence shard under Ulysses)."""
        if checkpointed:
            return self.checkpointed / (tp if tp_sp else 1)
        if tp_sp:
            out = self._sum("norm_in") / tp + self.gathered_copies * self.gathered_bytes + self.split / tp
        else:
            out = self.replicated + self.split / tp
        if ulysses > 1:  # the all-to-all brings attention's output back as a new tensor, which wo saves
            out += self.ulysses_extra / tp
        return out + self._sum("whole") + self._replicated_kv(tp, ulysses)

    def _replicated_kv(self, tp: int, ulysses: int) -> float:
        """Bytes per token the saved keys and values hold beyond their 1/tp share: a rank keeps whole
        heads, one copy of a head where there are fewer than tp (tensor parallelism replicates it),
        and under Ulysses (or cp's all-to-all) the whole sequence for its kv heads / u, one copy a
        rank where fewer (replicate_kv_heads): u x that many heads per token of its own."""
        if not self.kv_heads:
            return 0.0
        held = kv_heads_held(self.kv_heads, tp, ulysses) * ulysses
        kv = self._key_value_bytes
        return kv * held / self.kv_heads - kv / tp

    @functools.cached_property
    def _key_value_bytes(self) -> float:
        kept = ("attention.k", "attention.v", "attention.k_norm")
        return sum(nbytes for name, nbytes, _ in self.items if name in kept)


@dataclass(frozen=True)
class HeadActivations:
    """What the last stage keeps after the blocks, and what the first keeps of the tokens."""

    norm_in: float  # final norm, per token, without its output
    norm_out: float
    vocab: int  # fp32 softmax / log-softmax: 4 bytes per vocabulary entry (this rank's, under tp)
    nbytes: int
    hidden: int
    seq: int
    fused: bool = False  # model.fused_loss: log-sum-exp and targets instead of the log-softmax
    linear_input: float = 0.0  # per token: the head's saved input (B h; h + 4 in int8)
    compiled: bool = False  # compile.enabled: the plain loss (without tp) is compiled, keeping the logits

    def loss_per_token(self, tp: int = 1) -> float:
        """What the loss keeps per token besides the targets: the compiled plain loss the logits in
        the compute dtype, the eager one its fp32 log-softmax (vocab-parallel under tp: not compiled),
        the fused loss its log-sum-exp."""
        if self.fused:
            return 4
        if self.compiled and tp == 1:
            return self.nbytes * self.vocab
        return 4 * local_vocab(self.vocab, tp)

    def bytes(self, samples: int, tokens_per_sample: int, tp: int = 1, tp_sp: bool = False, ulysses: int = 1,
              last: bool = True, first: bool = True) -> float:
        """``tokens_per_sample`` is the rank's share of the sequence (s / Ulysses degree)."""
        tokens = samples * tokens_per_sample
        out = 0.0
        if last:
            if tp_sp:
                norm = self.norm_in / tp + self.linear_input  # the output layer's gathered input
            else:
                norm = self.norm_in + self.linear_input
            if self.fused:  # log-sum-exp (fp32) and the int64 targets; masks are recomputed
                out += tokens * (norm + 4 + 8)
            elif self.compiled and tp == 1:  # the compiled plain loss: logits and int64 targets, no scalar
                out += tokens * (norm + self.loss_per_token(tp) + 8)
            else:
                # vocab-parallel loss (tensor/loss.py): int64 target indices and two bool masks (the
                # targets in this rank's columns, the counted ones); else int64 targets and a scalar
                targets = tokens * 10 if tp > 1 else tokens * 8 + 4
                out += tokens * (norm + self.loss_per_token(tp)) + targets
        if first:
            if tp > 1:  # vocab-parallel embedding: shifted ids (int64) and a bool mask
                out += tokens * 9
            elif ulysses > 1:  # the rank's chunk of the window, copied
                out += tokens * 8
            else:  # the sampler's (s + 1)-token window, shared by inputs and targets
                out += samples * 8 * (self.seq + 1)
        return out


def _norm_items(model: ModelSpec, nbytes: int, prefix: str, output: float,
                compiled: bool = False) -> list[tuple[str, float, str]]:
    """``output``: bytes per token of the norm's output as the linears after it keep it;
    ``compiled``: the RMSNorm inside a compiled region (its input, rsqrt and output only)."""
    h = model.hidden
    if model.mlp == "swiglu" and compiled:
        return [(f"{prefix}.input", nbytes * h, "norm_in"), (f"{prefix}.rsqrt", 4, "norm_in"),
                (f"{prefix}.output", output, "norm_out")]
    if model.mlp == "swiglu":  # RMSNorm in fp32, then cast back and scaled by the weight
        return [(f"{prefix}.input_fp32", 4 * h, "norm_in"), (f"{prefix}.rsqrt", 4, "norm_in"),
                (f"{prefix}.normalized", nbytes * h, "norm_in"), (f"{prefix}.output", output, "norm_out")]
    return [(f"{prefix}.input", nbytes * h, "norm_in"), (f"{prefix}.mean_rstd", 8, "norm_in"),
            (f"{prefix}.output", output, "norm_out")]


def _int8(elements: int) -> float:
    """Bytes per token of a linear input of ``elements`` per token kept as int8 with a row scale."""
    return elements + 4


def compiles_blocks(model: ModelSpec, compiled: bool, recompute: str = "none", compression: str = "none",
                    selective_attention: bool = False) -> bool:
    """Whether a compiled run's blocks keep the compiled list (module docstring): bigtrain's Llama
    without experts, except where the eager figure is kept (int8 with selective recomputation,
    selective_attention)."""
    if not compiled or model.mlp != "swiglu" or model.experts:
        return False
    return not (recompute == "selective" and (compression == "int8" or selective_attention))


@cached()  # a pure function of frozen values, asked per layout of a search
def block_activations(model: ModelSpec, precision: str, recompute: str = "none",
                      compression: str = "none", selective_attention: bool = False,
                      compiled: bool = False, ep: int = 1, routed_rows: float = 0.0,
                      fp8: str = "none") -> BlockActivations:
    """The itemized saved tensors of one block (see the module docstring); ``compiled``: the run
    compiles its blocks (``Layout.compiled``); ``ep``: the experts' degree (its dispatch saves more);
    ``routed_rows``: the rows an MoE block's experts on this rank take per token of the rank
    (plan/expert_load.py; 0: top_k, an even split); ``fp8``: precision.fp8 (:func:`_float8_items`)."""
    nbytes, h, k = BYTES[precision], model.hidden, model.kv_dim
    rows = routed_rows or model.top_k
    f, f_moe = _ffn_widths(model, rows)
    q = model.attention_dim  # attention's query and output width (h unless a head size is set)
    first_norm, second_norm = ("attention_norm", "ffn_norm") if model.mlp == "swiglu" else ("ln_1", "ln_2")
    int8 = compression == "int8"
    linear_in = _int8(h) if int8 else nbytes * h  # a norm's output, as the linears after it keep it
    selective = recompute == "selective" and model.mlp == "swiglu"
    core_recomputed = selective and selective_attention
    compiled = compiles_blocks(model, compiled, recompute, compression, selective_attention)
    if compiled and selective:  # the compiler recomputes the norms' outputs and the product as well
        attention = [("attention.q", nbytes * q, "split"), ("attention.k", nbytes * k, "split"),
                     ("attention.v", nbytes * k, "split"), ("attention.logsumexp", 4 * model.heads, "split"),
                     ("attention.output", nbytes * q, "split")]
        items = [(f"{first_norm}.input", nbytes * h, "norm_in"), *attention,
                 (f"{second_norm}.input", nbytes * h, "norm_in"),
                 *_ffn("feed_forward.w1_out", nbytes, f, f_moe), *_ffn("feed_forward.w3_out", nbytes, f, f_moe)]
        return BlockActivations(tuple(items), checkpointed=nbytes * h, hidden=h, nbytes=nbytes,
                                gathered_copies=SP_GATHERED_COPIES[model.mlp], gathered_bytes=linear_in,
                                ulysses_extra=nbytes * q, kv_heads=model.kv_heads)
    if selective:
        items = [(f"{first_norm}.input", nbytes * h, "norm_in"), (f"{first_norm}.output", linear_in, "norm_out")]
    else:
        items = _norm_items(model, nbytes, first_norm, linear_in, compiled)
    items += [("attention.q", nbytes * q, "split"), ("attention.k", nbytes * k, "split"),
              ("attention.v", nbytes * k, "split")]
    if model.qk_norm:  # each head's RMSNorm (Qwen3's): its fp32 input, rsqrt a head, normalized x
        items += [("attention.q_norm", (4 + nbytes) * q + 4 * model.heads, "split"),
                  ("attention.k_norm", (4 + nbytes) * k + 4 * model.kv_heads, "split")]
    if core_recomputed:  # no log-sum-exp; wo alone keeps attention's output
        items.append(("attention.output", _int8(q) if int8 else nbytes * q, "split"))
    else:
        items += [("attention.logsumexp", 4 * model.heads, "split"), ("attention.output", nbytes * q, "split")]
        if int8:  # wo's int8 copy; SDPA keeps its output all the same
            items.append(("attention.wo_input", _int8(q), "split"))
    if selective:
        items += [(f"{second_norm}.input", nbytes * h, "norm_in"), (f"{second_norm}.output", linear_in, "norm_out")]
    else:
        items += _norm_items(model, nbytes, second_norm, linear_in, compiled)
    dense = 1 - model.moe_layers / model.layers if model.experts else 1.0  # the blocks with a plain SwiGLU
    product = [("feed_forward.product", dense * _int8(model.ffn_hidden) if int8 else nbytes * f, "split")]
    if f_moe:  # the experts' product (their matmuls are no nn.Linear: int8 leaves them as they are)
        share = model.moe_layers / model.layers
        routed = share * rows * model.expert_ffn
        product.append(("feed_forward.product.moe", nbytes * routed, "whole"))
        if model.shared_expert:  # but the shared expert's w2 is one: int8 keeps its input
            product.append(("feed_forward.product.shared", share * (_int8(model.shared_ffn) if int8 else
                                                                    nbytes * model.shared_ffn), "whole"))
        if model.shared_expert_gate:  # sigmoid(gate) x shared: the product keeps both (the sigmoid its own output)
            product.append(("feed_forward.shared_gate", share * nbytes * (h + 1), "whole"))
    w1_w3 = [*_ffn("feed_forward.w1_out", nbytes, f, f_moe), *_ffn("feed_forward.w3_out", nbytes, f, f_moe)]
    if selective or (model.mlp == "swiglu" and compiled):  # silu(w1 x) recomputed
        items += [*w1_w3, *product]
        if selective and model.experts:  # but the routed experts' (memory/selective.py): the shared expert's only
            routed = rows * model.expert_ffn * model.moe_layers / model.layers
            items.append(("feed_forward.silu_out.moe", nbytes * routed, "whole"))
    elif model.mlp == "swiglu":
        items += [*w1_w3, *_ffn("feed_forward.silu_out", nbytes, f, f_moe), *product]
    else:
        items += [("mlp.fc1_out", nbytes * f, "split"), ("mlp.gelu_out", nbytes * f, "split")]
    per_block = 0.0
    if fp8 != "none" and not int8 and not selective and not model.experts:
        items = _float8_items(model, items, fp8, compiled, (first_norm, second_norm))
        if fp8 == "tensorwise":  # fp32 scales: each linear's input's beside its codes; compiled, the graph
            # keeps those of the 7 weights and of the 4 distinct inputs (wq, wk, wv share one), measured
            per_block = 4 * (11 if compiled else 7 if model.mlp == "swiglu" else 4)
    if model.experts:
        share = model.moe_layers / model.layers
        items.append(("feed_forward.routing", moe_routing_bytes(model, nbytes, ep, compression, rows) * share, "whole"))
        per_block = (4 * model.experts * h if nbytes < 4 else 0) * share  # the router weight's fp32 copy
    return BlockActivations(tuple(items), checkpointed=nbytes * h, hidden=h, nbytes=nbytes,
                            gathered_copies=SP_GATHERED_COPIES[model.mlp], gathered_bytes=linear_in,
                            ulysses_extra=0.0 if int8 or core_recomputed else nbytes * q, per_block=per_block,
                            kv_heads=model.kv_heads)


def _float8_items(model: ModelSpec, items: list, fp8: str, compiled: bool, norms: tuple[str, str]) -> list:
    """A block's saved list with float8 linears (bigtrain/fp8/linear.py), where it differs from the
    compute precision's; read off ``SavedActivations`` on one block (dim 256, 512 tokens, bf16, torch
    2.13 CPU, ``scaled_mm``): bf16 13,848 bytes a token eager and 9,752 compiled; tensorwise 13,336
    and 6,680; rowwise 13,848 and 6,680.

    Compiled (either recipe): the graph keeps no linear's input nor its float8 codes. The norms'
    outputs and the SwiGLU product, which bf16's graph keeps for the linears' weight gradients, are
    recomputed from what the block keeps anyway (the norms' inputs and rsqrt, w1 x and w3 x, and
    each operand's scale), and so are their codes. Eager tensorwise: each linear keeps its own
    float8 input (1 byte an element: one copy per linear, where bf16's linears share their input),
    so a norm's output becomes one code copy per linear reading it, wo keeps a copy of attention's
    output, and w2 a 1-byte product (and each its 4-byte scale, ``per_block``). Eager rowwise keeps the input itself in the compute dtype, as
    bf16 does. Under selective recomputation or int8 compression, and in a model with experts, the
    compute precision's list is kept (not measured with float8)."""
    names = {f"{norms[0]}.output", f"{norms[1]}.output", "feed_forward.product"}
    if compiled:
        return [item for item in items if item[0] not in names]
    if fp8 != "tensorwise":
        return items
    # the linears reading each norm's output: wq, wk, wv and w1, w3 (Llama); the fused qkv and fc1 (GPT)
    readers = (3, 2) if model.mlp == "swiglu" else (1, 1)
    out = []
    for name, nbytes, kind in items:
        if name == f"{norms[0]}.output":
            out.append((name, readers[0] * model.hidden, kind))
        elif name == f"{norms[1]}.output":
            out.append((name, readers[1] * model.hidden, kind))
        elif name == "feed_forward.product":
            out.append((name, model.ffn_hidden, kind))
        else:
            out.append((name, nbytes, kind))
            if name == "attention.output":  # wo's codes beside the output SDPA keeps
                out.append(("attention.wo_input", model.attention_dim, "split"))
    return out


def _ffn_widths(model: ModelSpec, routed_rows: float) -> tuple[float, float]:
    """The SwiGLU width a token's saved activations span, averaged over the blocks: (the dense blocks'
    ffn, split over tp; an MoE block's experts' for ``routed_rows`` rows a token and its shared
    expert's, whole on every tp rank)."""
    if not model.experts:
        return model.ffn_hidden, 0.0
    share = model.moe_layers / model.layers
    return (1 - share) * model.ffn_hidden, share * (routed_rows * model.expert_ffn + model.shared_ffn)


def _ffn(name: str, nbytes: int, split: float, whole: float) -> list[tuple[str, float, str]]:
    return [(name, nbytes * split, "split")] + ([(f"{name}.moe", nbytes * whole, "whole")] if whole else [])


def moe_routing_bytes(model: ModelSpec, nbytes: int, ep: int = 1, compression: str = "none",
                      routed_rows: float = 0.0) -> float:
    """What an MoE block (models/moe.py, the softmax router) saves per token besides its experts'
    SwiGLU activations, read off its saved tensors (h hidden, k top_k, E experts, B compute bytes; r
    the rows this rank's experts take per token, ``routed_rows``, k in an even split: the tensors
    marked r are the experts', the others the routing tokens'):

        router    its fp32 input 4h, exact (int8 compression leaves routers out: memory/
                  activations.py), where the block's list counts the norm's output as the linears
                  after it keep it (B h; h + 4 in int8): below fp32 a copy, and the norm's output
                  itself is kept only by a shared expert (B h, or its int8 copy); in fp32 the same
                  tensor, kept once with a shared expert and no int8 (its int8 copy besides);
                  softmax 4E, top-k indices 8k and values 4k, their sum 4 (the renormalization)
        dispatch  the capacity mask k (bool), the sort order 8k, each routing's token 8k, the
                  gathered rows B r h (the experts' input; under ep, the rows received)
        combine   the experts' rows in fp32 4kh and their weights 4k (the weighted sum), the
                  weighted rows B k h (index_add's source)
        balance   two fp32 E-vectors per sequence (8E / s a token)
        ep > 1    the received rows' permutation to expert order and back, 16r

    Besides, whatever the tokens, below fp32 the router weight's fp32 copy: 4 E h bytes a block
    (``BlockActivations.per_block``)."""
    h, k, e = model.hidden, model.top_k, model.experts
    r = routed_rows or k
    int8 = compression == "int8"
    counted = _int8(h) if int8 else nbytes * h  # the norm's output in the block's list
    by_shared = (_int8(h) if int8 else (nbytes * h if nbytes < 4 else 0)) if model.shared_expert else 0
    router = 4 * h + by_shared - counted + 4 * e + 12 * k + 4
    dispatch = k + 16 * k + nbytes * r * h
    combine = 4 * k * h + 4 * k + nbytes * k * h
    return router + dispatch + combine + 8 * e / model.seq + (16 * r if ep > 1 else 0)


@cached()
def head_activations(model: ModelSpec, precision: str, compression: str = "none",
                     fused_loss: bool = False, compiled: bool = False) -> HeadActivations:
    """``compiled``: the final norm is a compiled region and the plain loss a compiled function."""
    nbytes = BYTES[precision]
    compiled = compiled and model.mlp == "swiglu"  # with experts too: the final norm and the loss are regions
    linear_in = _int8(model.hidden) if compression == "int8" and not fused_loss else nbytes * model.hidden
    items = _norm_items(model, nbytes, "norm", linear_in, compiled)
    return HeadActivations(norm_in=sum(b for _, b, k in items if k == "norm_in"),
                           norm_out=sum(b for _, b, k in items if k == "norm_out"), vocab=model.vocab,
                           nbytes=nbytes, hidden=model.hidden, seq=model.seq, fused=fused_loss,
                           linear_input=linear_in, compiled=compiled)


def document_mask_bytes(model: ModelSpec, samples: int, precision: str, tile: int = 128, ring: bool = False) -> int:
    """What one micro-batch's block-causal mask holds on a stage chunk with blocks (module
    docstring): sdpa's (samples, 1, s, s) additive mask in the compute dtype; FlexAttention's
    BlockMask (:func:`bigtrain.core.documents.document_block_mask`): the partial and the full tiles'
    counts (samples, 1, n) and indices (samples, 1, n, n), int32, for key tiles by query tile and
    their transposes (n = s / 128 tiles), and the padded ids its mask function reads (int64, n x 128
    a sample); ``ring``: the ids of the whole sequence the ring masks its pairs by (int64). 0 under
    causal attention (sdpa's causal kernel takes no mask)."""
    s = model.seq
    if ring and model.document_mask:
        return samples * s * 8
    if model.document_mask == "sdpa":
        return samples * s * s * BYTES[precision]
    if model.document_mask == "flex":
        n = -(-s // tile)
        return samples * (4 * 4 * (n + n * n) + 8 * n * tile)
    return 0


def fused_chunk_bytes(model: ModelSpec, chunk: int, tp: int = 1) -> int:
    """What the fused loss holds while it runs: one chunk's fp32 logits and their exponentials."""
    return 2 * chunk * 4 * local_vocab(model.vocab, tp)


def checkpointed_block_indices(layers: int, recompute: str, every: int) -> set[int]:
    """The runtime's policy (memory/checkpointing.py): none, full, or blocks 0, k, 2k, ..."""
    if recompute == "full":
        return set(range(layers))
    if recompute == "every":
        return set(range(0, layers, every))
    return set()
