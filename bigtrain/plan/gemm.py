"""Shape-aware compute time: each op of a transformer layer timed from its shapes.

Used by ``cost.stage_costs`` when the hardware profile has ``gemm_fraction > 0`` (otherwise the
planner keeps one ``achievable_fraction`` for everything). Per micro-batch and rank:

* **GEMMs** (m x k times k x n): ``max(2 m n k / (peak x eff), bytes / (hbm x memory_fraction))``
  with ``eff = gemm_fraction x m/(m+d) x n/(n+d) x k/(k+d)``, d = ``gemm_half_dim``: a large GEMM
  sustains ``gemm_fraction`` of the dense peak; a dimension of d halves it (tile and wave
  quantization, too little work per launch). Backward: dX (m, k, n) and dW (n, k, m) per GEMM.
* **Attention**: with a flash kernel (``attention_kernel = "flash"``) its causal FLOPs (half of
  the 4 s^2 h convention) at ``attention_fraction`` of the peak, backward 2.5x (recomputes S);
  unfused (Megatron 2021-22) two batched GEMMs with k = head_dim (or s) plus the softmax /
  mask / dropout passes over the b a s^2 score matrix, memory-bound. Block-causal attention
  (``ModelSpec.document_mask``; :func:`document_attention_share`) scales a fused kernel's work:
  sdpa under the dense mask runs a kernel that takes a mask (memory-efficient, not flash), which
  cannot skip the causal half, so the whole square (twice the causal FLOPs) plus the mask read per
  head in the forward and again in the backward; FlexAttention only the 128 x 128 tiles its
  documents cover (of ``ModelSpec.document_tokens`` tokens on average; unknown: priced as causal).
  A ring (cp_mode 'ring' / 'hybrid') masks its chunk pairs from the documents' ids whatever
  ``model.attention`` says: priced as its causal pairs (an upper bound: it skips the pairs no
  document spans).
* **Element-wise ops** (norms, rotary, activation, residuals, bias-dropout-add, loss) by the bytes
  they read and write at ``hbm_bandwidth x memory_fraction``; backward moves twice the bytes.
  bigtrain's Llama (``mlp = swiglu``) is unfused (RMSNorm in fp32, SwiGLU in three kernels);
  the GPT block (``mlp = gelu``) is Megatron's, with fused LayerNorm, bias-GeLU and bias-dropout-add.
* **Float8 linears** (``layout.fp8``; the attention, dense MLP and shared-expert linears, not the
  routers, experts or head): each GEMM at ``peak_flops_fp8`` on the bf16 curve's efficiency with
  1-byte operands. Where the profile has the GEMM kernels' own share of the peak
  (``gemm_kernel_fraction[_fp8]``, from a profiler), a float8 GEMM is instead the compute
  precision's fitted GEMM time less its kernel time plus the float8 kernel's: ``gemm_fraction`` is
  fitted to whole steps, so it carries time beside the kernels (launch gaps, copies, kernels the
  planner does not list) that faster tensor cores do not shorten. Plus the casts
  (:func:`float8_cast_bytes`): memory-bound kernels at ``hbm_bandwidth x cast_fraction``, their
  bytes counted per operand from bigtrain/fp8 (linear.py, scaling.py): a quantization is an amax
  pass (reads the operand in the compute dtype) and a cast (reads it again, writes 1 byte an
  element); a float8 transpose reads and writes 1 byte an element.

      per element of              x (M K)          W (N K)            dY (M N)
      tensorwise, compiled        q + 2            2q + 2             q + 2
      tensorwise, eager           q + 2            2q + 2             2q + 2
      rowwise                     2q + 2           2q + 2             2q + 2

  with q = 2B + 1 compiled (inductor fuses abs, division, clamp and cast into the two kernels) and
  8B + 1 eager (abs, amax, division, clamp, cast: each a kernel). Tensorwise quantizes x once (its
  codes are saved and transposed for dW), the weight for the forward and again (the same
  operations, in the backward's graph) for dX, and dY once for both backward GEMMs in a compiled
  graph (the same operations, merged by AOT autograd; eager runs them in two autograd nodes).
  Rowwise quantizes every operand once per GEMM it enters, along that GEMM's reduction dimension.
  (The eager table is what one Float8Linear's ATen ops read and write, byte for byte:
  tests/test_plan_fp8.py. Inductor's own count on a CPU block, dim 256, 512 tokens, torch 2.13,
  fused kernels of float8 less those of bf16: tensorwise 30.4 MB against this table's 32.0; rowwise
  28.0 against 46.4, its amax and cast fused into one kernel that reads a row once. On the H200 the
  rowwise casts ran slower than tensorwise's, not faster; until a GPU times the current code,
  ``cast_fraction`` comes from tensorwise's and rowwise is priced by the table.)
  Without float8 matmuls (``peak_flops_fp8 = 0``: emulation) the GEMMs stay at the compute
  precision and each operand is dequantized for both of its GEMMs (reads 1 byte, writes B;
  eager 3B + 1).
* **Compiled blocks** (``layout.compiled``: bigtrain's Llama, each block one inductor region).
  Inductor fuses every element-wise op of the block into 5 forward and 6 backward kernels
  (read off the generated code of a ``small`` block on the CPU, ``benchmarks/compile_fusions.py``;
  the H200's Triton listing fuses the same groups, docs/compile.md), each reading its inputs once
  and writing its outputs once; per token, B bytes of the compute dtype, the reductions in fp32
  registers, rsqrt 4 bytes:

      forward   norm 1 (x -> output, rsqrt)                          2Bh + 4
                rotary (q, k -> rotated, in the layout SDPA takes)   2B(h + k) [+ 8(h + k)]
                norm 2 with the residual (x, wo's output -> output)  3Bh + 4
                silu(w1 x) * w3 x                                     3BF
                the block output x + wo(..) + w2(..)                 4Bh
      backward  SwiGLU (w1 x, w3 x, d product -> their gradients)    5BF
                norm 2 (two input gradients, x, wo's output, the
                block output's gradient, rsqrt -> dh, a row sum)     6Bh + 8
                log-sum-exp to SDPA's layout (the CPU kernel's)      8a
                rotary                                                2B(h + k) [+ 8(h + k)]
                both norms' weight gradients (7 token tensors)       7Bh + 8
                norm 1 (dh, three input gradients, x, rsqrt -> dx)   6Bh + 8

  [In bf16 / fp16 the rotary kernels write the stack of the two rotated halves in fp32 and read
  it back for the cast (4 + 4 bytes an element), and the key gradient's cast is a kernel of its own:
  read so on the CPU; the H200's listing was not kept to say whether Triton does the same.] V is
  a view of its GEMM's output and SDPA's output is in the (b, s, a, d) order wo reads, so nothing
  is copied. Kernels: 5 + 7 GEMMs + attention forward, 6 (bf16: 7) + 14 GEMMs + attention backward
  (eager: OPS_PER_BLOCK, twice in backward). Under tp the norms and residuals are whole unless
  Megatron SP, the rest a tp share, as eager. A model with experts (its MoE layers run eagerly,
  not measured compiled), and the GPT block (Megatron's fused kernels already), keep the eager figures; the head's loss is priced eager (the byte vocabulary's
  log-softmax is a few microseconds).
* **Op overhead**: ``op_overhead_s`` per kernel (the framework's dispatch; 0 on GPUs, where
  launches are asynchronous and hidden behind kernels of this size; measured on CPU), and
  ``recompute_op_overhead_s`` more per kernel of a recomputed (checkpointed) block.
"""

from __future__ import annotations

from dataclasses import astuple, dataclass

from bigtrain.plan.activations import compiles_blocks
from bigtrain.plan.layout import BYTES, Layout
from bigtrain.plan.model import ModelSpec

FLASH_BACKWARD = 2.5  # FlashAttention-2's backward: 5 matmuls of the forward's 2 (S recomputed)
OPS_PER_BLOCK = {"swiglu": 40, "gelu": 16}  # forward kernels of one block (backward: twice)


def compiled_ops_per_block(precision: str) -> tuple[int, int]:
    """A compiled Llama block's (forward, backward) kernels: generated, GEMMs, attention (docstring)."""
    return 5 + 7 + 1, 6 + (BYTES[precision] < 4) + 14 + 1


def gemm_efficiency(hw, m: float, n: float, k: float) -> float:
    d = hw.gemm_half_dim
    return hw.gemm_fraction * (m / (m + d)) * (n / (n + d)) * (k / (k + d))


def gemm_seconds(hw, precision: str, m: float, n: float, k: float, batch: float = 1) -> float:
    if min(m, n, k) <= 0:
        return 0.0
    compute = 2 * m * n * k * batch / (hw.peak_flops(precision) * gemm_efficiency(hw, m, n, k))
    moved = batch * BYTES[precision] * (m * k + k * n + m * n) / (hw.hbm_bandwidth * hw.memory_fraction)
    return max(compute, moved)


def gemm_fwd_bwd(hw, precision: str, m: float, n: float, k: float, batch: float = 1) -> tuple[float, float, float]:
    """(forward, backward, the backward's weight-gradient part) of one GEMM."""
    dw = gemm_seconds(hw, precision, n, k, m, batch)
    return gemm_seconds(hw, precision, m, n, k, batch), gemm_seconds(hw, precision, m, k, n, batch) + dw, dw


# (forward, dX, dW) passes over one element of x, W and dY, in units of a quantization ("q") and
# bytes of float8 transposes ("t"), per recipe and (eager) compiled: the module docstring's table
_CAST_PASSES = {  # (operand: ((q, t) forward, (q, t) dX, (q, t) dW))
    ("tensorwise", True): {"x": ((1, 0), (0, 0), (0, 2)), "w": ((1, 0), (1, 2), (0, 0)), "dy": ((0, 0), (1, 0), (0, 2))},
    ("tensorwise", False): {"x": ((1, 0), (0, 0), (0, 2)), "w": ((1, 0), (1, 2), (0, 0)), "dy": ((0, 0), (1, 0), (1, 2))},
    ("rowwise", True): {"x": ((1, 0), (0, 0), (1, 2)), "w": ((1, 0), (1, 2), (0, 0)), "dy": ((0, 0), (1, 0), (1, 2))},
}
_CAST_PASSES[("rowwise", False)] = _CAST_PASSES[("rowwise", True)]


def quantize_bytes(precision: str, compiled: bool) -> int:
    """Bytes one element costs to quantize: an amax pass and a cast (module docstring)."""
    b = BYTES[precision]
    return 2 * b + 1 if compiled else 8 * b + 1


def float8_cast_bytes(precision: str, recipe: str, compiled: bool, emulated: bool, m: float, n: float, k: float
                      ) -> tuple[float, float, float]:
    """(forward, dX, dW) bytes the casts of one float8 linear move (x: m x k, W: n x k, dY: m x n)."""
    q, b = quantize_bytes(precision, compiled), BYTES[precision]
    passes = _CAST_PASSES[(recipe, compiled)]
    out = [0.0, 0.0, 0.0]
    for operand, elements in (("x", m * k), ("w", n * k), ("dy", m * n)):
        for i, (quantizations, transposed) in enumerate(passes[operand]):
            out[i] += elements * (quantizations * q + transposed)
    if emulated:  # each operand dequantized for each of its two GEMMs
        dequantize = (b + 1) if compiled else (3 * b + 1)
        out[0] += dequantize * (m * k + n * k)
        out[1] += dequantize * (m * n + n * k)
        out[2] += dequantize * (m * n + m * k)
    return out[0], out[1], out[2]


def float8_gemm_seconds(hw, precision: str, m: float, n: float, k: float, batch: float = 1) -> float:
    """One float8 GEMM (m x k times k x n) without its casts (see the module docstring)."""
    if min(m, n, k) <= 0:
        return 0.0
    if hw.peak_flops_fp8 <= 0:  # emulated: the compute precision's GEMM on the dequantized operands
        return gemm_seconds(hw, precision, m, n, k, batch)
    flops = 2 * m * n * k * batch
    moved = batch * (m * k + k * n + BYTES[precision] * m * n) / (hw.hbm_bandwidth * hw.memory_fraction)
    if hw.gemm_kernel_fraction <= 0:
        return max(flops / (hw.peak_flops_fp8 * gemm_efficiency(hw, m, n, k)), moved)
    # The fitted time less the compute precision's kernel plus the float8 kernel: what is not the
    # kernel's in the fitted figure stays (module docstring).
    shape = gemm_efficiency(hw, m, n, k) / hw.gemm_fraction
    fitted = gemm_seconds(hw, precision, m, n, k, batch)
    kernel = flops / (hw.peak_flops(precision) * hw.gemm_kernel_fraction * shape)
    float8 = flops / (hw.peak_flops_fp8 * hw.gemm_kernel_fraction_fp8 * shape)
    return max(0.0, fitted - kernel) + max(float8, moved)


def float8_fwd_bwd(hw, layout: Layout, compiled: bool, m: float, n: float, k: float, batch: float = 1
                   ) -> tuple[float, float, float]:
    """(forward, backward, the backward's weight-gradient part) of one float8 linear, its GEMMs and
    casts; ``compiled``: whether it runs inside an inductor region (:func:`compiles_block`)."""
    p = layout.precision
    casts = float8_cast_bytes(p, layout.fp8, compiled, hw.peak_flops_fp8 <= 0, m, n, k)
    cast_f, cast_dx, cast_dw = (batch * c / (hw.hbm_bandwidth * hw.cast_fraction) for c in casts)
    dw = float8_gemm_seconds(hw, p, n, k, m, batch) + cast_dw  # dY^T x
    dx = float8_gemm_seconds(hw, p, m, k, n, batch) + cast_dx  # dY W
    return float8_gemm_seconds(hw, p, m, n, k, batch) + cast_f, dx + dw, dw


@dataclass(frozen=True)
class BlockTimes:
    forward: float
    backward: float
    weight_grad: float  # the dW GEMMs of the backward (what zb-h1 defers)
    # The forward run again when the block is checkpointed: torch's non-reentrant checkpoint stops
    # at the last tensor the backward needs, the MLP's down projection's input, so a dense block's
    # recomputation skips that GEMM (w2 / fc2; counted on a CPU: every linear of a tiny block runs
    # again but w2); an MoE block's is priced whole.
    recompute: float


def linear_shapes(model: ModelSpec, layout: Layout, tokens: float, moe: bool = False
             ) -> list[tuple[float, float, float, float, bool]]:
    """(m, n, k, how many, whether precision.fp8 makes it float8) of each linear of a block on a tp
    rank (columns or rows divided by t).

    An MoE block's experts are whole on every rank (docs/moe.md): a rank runs its E/ep experts,
    each on ``tokens x top_k x ep / E`` tokens of a balanced routing, which is ``tokens x top_k``
    token-expert products in all, as many FLOPs as top_k dense feed-forwards. The tp ranks of a
    group route the same whole hidden states (parallel/tensor/plan.py), so each does all of it."""
    h, kv, f, t = model.hidden, model.kv_dim, model.ffn_hidden, layout.tp
    if model.mlp == "swiglu":  # wq maps h to the query heads' width a, wo back (a = h unless a head size is set)
        a = model.attention_dim
        attention = [(a / t, h), (kv / t, h), (kv / t, h), (h, a / t)]
        mlp = [(f / t, h), (f / t, h), (h, f / t)]
    else:
        attention, mlp = [((h + 2 * kv) / t, h), (h, h / t)], [(f / t, h), (h, f / t)]
    out = [(tokens, n, k, 1, True) for n, k in attention]
    if not moe:
        return out + [(tokens, n, k, 1, True) for n, k in mlp]
    e = model.expert_ffn
    experts = [(e, h), (e, h), (h, e)] if model.mlp == "swiglu" else [(e, h), (h, e)]
    per_expert = tokens * model.top_k * layout.ep / model.experts
    out += [(per_expert, n, k, model.experts // layout.ep, False) for n, k in experts]
    out.append((tokens, model.experts, h, 1, False))  # the router
    if model.shared_expert:
        f = model.shared_ffn
        out += [(tokens, n, k, 1, True) for n, k in [(f, h), (f, h), (h, f)]]
    if model.shared_expert and model.shared_expert_gate:
        out.append((tokens, 1, h, 1, False))  # its gate
    return out


def _elementwise_bytes(model: ModelSpec, layout: Layout, moe: bool = False) -> float:
    """Bytes one token moves through a block's element-wise kernels in the forward, on one rank
    (an MoE block's activation spans its top_k experts and the shared one)."""
    b, h, kv, t, a = BYTES[layout.precision], model.hidden, model.kv_dim, layout.tp, model.attention_dim
    # the feed-forward width one rank's activation spans: a tp share of the dense one; an MoE
    # block's top_k experts (and the shared one) whole, as every tp rank runs them
    f_rank = model.top_k * model.expert_ffn + model.shared_ffn if moe else model.ffn_hidden / t
    whole = t if layout.tp_sp else 1  # norms and residuals are divided only under sequence parallelism
    if model.mlp == "swiglu":
        norms = 2 * (4 * b + 28) * h  # x.float(), pow, mean, x * rsqrt, .type_as, * weight
        rotary = 6 * b * (a + kv) / t  # q (the query heads' width a) and k
        swiglu = 5 * b * f_rank  # silu(w1 x) and its product with w3 x
        copies = 2 * b * (a + 2 * kv) / t  # q, k, v to heads-first and the output back
        residual = 6 * b * h
        return (norms + residual) / whole + rotary + swiglu + copies
    norms = 2 * 2 * b * h  # fused LayerNorm
    gelu = 2 * b * f_rank  # fused bias-GeLU
    bias_dropout_add = 2 * (3 * b + 1) * h
    return (norms + bias_dropout_add) / whole + gelu


def compiles_block(model: ModelSpec, layout: Layout) -> bool:
    """Whether the blocks are priced compiled (the module docstring): bigtrain's Llama without experts,
    the rule plan/activations.py applies to their memory (its exceptions there are memory's alone),
    compiled whole. A block whose linears save int8 inputs is compiled child by child around them
    (parallel/compile.py: the norms, the attention core and the SwiGLU activation alone; the
    rotary, residual adds and reshapes between them eager): it is priced eager, the nearer bound."""
    return compiles_blocks(model, layout.compiled) and layout.compression != "int8"


def compiled_elementwise_bytes(model: ModelSpec, layout: Layout) -> tuple[float, float]:
    """(forward, backward) bytes one token moves through a compiled Llama block's fused kernels, on
    one rank (the module docstring)."""
    b, h, kv, t, f = BYTES[layout.precision], model.hidden, model.kv_dim, layout.tp, model.ffn_hidden / layout.tp
    whole = t if layout.tp_sp else 1  # norms and residuals are divided only under sequence parallelism
    rotary = (2 * b + (8 if b < 4 else 0)) * (model.attention_dim + kv) / t  # below fp32: the fp32 stack written and read back
    forward = (2 * b * h + 4 + 3 * b * h + 4 + 4 * b * h) / whole + rotary + 3 * b * f
    backward = (6 * b * h + 8 + 7 * b * h + 8 + 6 * b * h + 8) / whole + rotary + 5 * b * f + 8 * model.heads / t
    return forward, backward


def _memory_seconds(hw, nbytes: float) -> float:
    return nbytes / (hw.hbm_bandwidth * hw.memory_fraction)


def block_times(model: ModelSpec, layout: Layout, hw, moe: bool = False) -> BlockTimes:
    """One block (an MoE block if ``moe``), one micro-batch, one rank (tp and Ulysses sp shares)."""
    p, t, u = layout.precision, layout.tp, layout.head_exchange
    tokens = layout.micro_batch * model.seq / layout.seq_shards  # what the linears see (Ulysses, cp)
    fwd = bwd = dw = 0.0
    compiled = compiles_block(model, layout)
    for m, n, k, count, float8 in linear_shapes(model, layout, tokens, moe):
        if float8 and layout.fp8 != "none":
            f, b, w = float8_fwd_bwd(hw, layout, compiled, m, n, k, count)
        else:
            f, b, w = gemm_fwd_bwd(hw, p, m, n, k, count)
        fwd, bwd, dw = fwd + f, bwd + b, dw + w
    not_recomputed = 0.0 if moe else f  # the last linear of a dense block: the MLP's down projection
    heads = model.heads / (t * u)  # the all-to-all (Ulysses): the whole sequence and heads / (t u)
    d, ring = model.head_dim, layout.ring
    # A ring of cp: each rank attends its 2 chunks of s / 2cp queries over the chunks before them,
    # 2cp + 1 chunk pairs, two of them a chunk against itself (causal). A flash kernel (the ring's
    # on a CPU) skips the masked half of those two: 2cp pairs' work; materialized, all 2cp + 1 whole.
    s, pairs = (model.seq, 1) if ring == 1 else (model.seq / (2 * ring), 2 * ring + 1)
    if hw.attention_kernel == "flash":
        # causal: half of QK^T and AV's 4 s^2 d; a ring's 2cp - 1 whole pairs and 2 halves
        flops = (2 if ring == 1 else 4 * (pairs - 1)) * layout.micro_batch * heads * s * s * d
        # A ring with documents masks each pair from the ids: its causal pairs' work at most (pairs
        # before a query chunk's documents are skipped), no kernel over the whole square, no dense mask.
        share = document_attention_share(model) if ring == 1 else 1.0
        attention = flops * share / (hw.peak_flops(p) * hw.attention_fraction)
        fwd, bwd = fwd + attention, bwd + FLASH_BACKWARD * attention
        if model.document_mask == "sdpa" and ring == 1:  # the (b, 1, s, s) mask, read for every head, both ways
            mask_read = _memory_seconds(hw, layout.micro_batch * heads * s * s * BYTES[p])
            fwd, bwd = fwd + mask_read, bwd + mask_read
    else:
        batch = layout.micro_batch * heads * pairs
        for m, n, k in ((s, s, d), (s, d, s)):
            f, b, _ = gemm_fwd_bwd(hw, p, m, n, k, batch)
            fwd, bwd = fwd + f, bwd + b
        scores = batch * s * s
        nbytes = BYTES[p]
        fwd += _memory_seconds(hw, scores * (2 * nbytes + 2 * nbytes + 1))  # scale-mask-softmax, dropout
        bwd += _memory_seconds(hw, scores * (5 * nbytes + 1))
    if compiled:
        moved_forward, moved_backward = compiled_elementwise_bytes(model, layout)
        ops_forward, ops_backward = compiled_ops_per_block(layout.precision)
    else:
        moved_forward = _elementwise_bytes(model, layout, moe)
        moved_backward = 2 * moved_forward
        ops_forward, ops_backward = OPS_PER_BLOCK[model.mlp], 2 * OPS_PER_BLOCK[model.mlp]
    fwd += _memory_seconds(hw, moved_forward * tokens)
    bwd += _memory_seconds(hw, moved_backward * tokens)
    forward = fwd + ops_forward * hw.op_overhead_s
    recompute = forward - (not_recomputed + hw.op_overhead_s if not moe else 0.0)
    return BlockTimes(forward, bwd + ops_backward * hw.op_overhead_s, dw, recompute)


def document_attention_share(model: ModelSpec, tile: int = 128) -> float:
    """Block-causal attention's work over a causal kernel's (module docstring): 2 under sdpa's dense
    mask (the whole square); under FlexAttention the tiles documents of L = ``document_tokens``
    tokens keep, a document spanning n = L / tile + 1 tiles keeping n (n + 1) / 2 of them, s / L
    documents a window, over the causal kernel's s^2 / 2 pairs: n (n + 1) tile^2 / (L s), at most 1
    (1 when L is unknown or spans the window); 1 for causal attention."""
    if model.document_mask == "sdpa":
        return 2.0
    if model.document_mask != "flex" or not model.document_tokens or model.document_tokens >= model.seq:
        return 1.0
    length = model.document_tokens
    spanned = length / tile + 1
    return min(1.0, spanned * (spanned + 1) * tile * tile / (length * model.seq))


def head_times(model: ModelSpec, layout: Layout, hw) -> tuple[float, float, float]:
    """(forward, backward, weight gradient) of the output projection and the loss, one micro-batch."""
    tokens = layout.micro_batch * model.seq / layout.seq_shards
    vocab = model.vocab / layout.tp
    f, b, w = gemm_fwd_bwd(hw, layout.precision, tokens, vocab, model.hidden)
    loss = _memory_seconds(hw, (BYTES[layout.precision] + 8) * vocab * tokens)  # fp32 log-softmax
    return f + loss, b + loss, w


def shape_aware_compute(model: ModelSpec, layout: Layout, hw, layers: float,
                        recomputed: float, in_i: float | None = None) -> tuple[float, float, float]:
    """(forward, backward with recomputation, zb-h1's W) seconds of one micro-batch on a pipeline
    rank holding ``layers`` blocks (``recomputed`` of them checkpointed; ``in_i`` of them with their
    dW in I, not deferred: default the checkpointed ones) and 1/pp of the head (its dW in I too when
    fused). W is
    ``weight_grad_fraction`` of the deferred backward, as the uniform model takes it."""
    block = block_times(model, layout, hw)
    if model.experts:  # the blocks' average, as the layers' FLOPs are averaged (ModelSpec.block_matmul_params)
        share = model.moe_layers / model.layers
        moe = block_times(model, layout, hw, moe=True)
        block = BlockTimes(*((1 - share) * a + share * b for a, b in zip(astuple(block), astuple(moe))))
    head = head_times(model, layout, hw)
    forward = layers * block.forward + head[0] / layout.pp
    ops = compiled_ops_per_block(layout.precision)[0] if compiles_block(model, layout) else OPS_PER_BLOCK[model.mlp]
    dense_share = 1 - (model.moe_layers / model.layers if model.experts else 0)
    # a checkpointed dense block runs its kernels again but the MLP's down projection (BlockTimes.recompute)
    recompute = block.recompute + (ops - dense_share) * hw.recompute_op_overhead_s
    backward = layers * block.backward + head[1] / layout.pp + recomputed * recompute
    # The fused loss head computes its dW in I too (a WholeBackward wrapper: split_backward.py).
    head_deferred = 0.0 if layout.fused_loss else head[1] / layout.pp
    deferred = (layers - (recomputed if in_i is None else in_i)) * block.backward + head_deferred
    return forward, backward, hw.weight_grad_fraction * deferred
