"""This machine's GEMM curve and per-kernel overhead, for the shape-aware time model (``gemm.py``).

``bigtrain bench --calibrate`` times a few matmul shapes (best of ``repeats`` each) and fits the two
parameters of ``gemm.gemm_efficiency`` to them: ``gemm_fraction`` (what a large GEMM sustains, as a
share of the measured peak) and ``gemm_half_dim`` (the dimension that halves it), by least squares on
log time over a grid of half dims. ``op_overhead_s`` is the time of a tiny element-wise op (dispatch).
"""

from __future__ import annotations

import contextlib
import math
import statistics
import time

# Square and transformer-like shapes, small to large; (512, 128, 128) and its kin are a small model's
# projections (4 x 128 tokens, hidden 128), where the curve's knee decides a CPU layer's time.
SHAPES = ((64, 64, 64), (512, 128, 128), (128, 512, 128), (512, 384, 128), (512, 128, 512), (256, 256, 256),
          (512, 512, 512), (2048, 256, 256), (1024, 1024, 1024), (4096, 512, 512))
HALF_DIMS = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 192, 256, 384, 512)


@contextlib.contextmanager
def intra_op_threads(threads: int | None):
    """torch's intra-op thread count set to ``threads`` for the block (None: left as it is)."""
    import torch

    before = torch.get_num_threads()
    if threads is not None:
        torch.set_num_threads(threads)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def _median_seconds(fn, repeats: int) -> float:
    """The median time of ``repeats`` calls after a warm-up: on a shared machine the runs the
    planner predicts go at the typical rate, not at the best moment's (a best-of-N peak came out
    1.2-1.4x above what training then sustained here)."""
    fn()  # warm-up
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def measure_gemms(dtype_name: str = "fp32", shapes=SHAPES, repeats: int = 5) -> list[tuple[int, int, int, float]]:
    """(m, n, k, seconds) of each shape on this machine's CPU."""
    import torch

    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[dtype_name]
    out = []
    for m, n, k in shapes:
        a, b = torch.randn(m, k, dtype=dtype), torch.randn(k, n, dtype=dtype)
        out.append((m, n, k, _median_seconds(lambda: torch.mm(a, b), repeats)))
    return out


def measure_op_overhead(repeats: int = 200) -> float:
    """Seconds of one tiny element-wise op: what each kernel costs besides its bytes."""
    import torch

    x = torch.ones(8)
    return _median_seconds(lambda: [x.add(1.0) for _ in range(repeats)], 5) / repeats


def measure_memory_bandwidth(elements: int = 1 << 23, repeats: int = 10) -> float:
    """Bytes/s of an element-wise kernel over fp32 tensors far larger than the caches (32 MiB in,
    32 MiB out by default): the rate the planner's memory-bound terms (element-wise ops, the
    optimizer step) move bytes at. Smaller tensors run faster from cache; the planner does not
    model caches, so it takes the DRAM rate, the conservative one."""
    import torch

    x = torch.ones(elements)
    y = torch.empty_like(x)
    return 2 * x.element_size() * elements / _median_seconds(lambda: torch.mul(x, 2.0, out=y), repeats)


def measure_attention_fraction(peak: float, seq: int = 2048, heads: int = 4, head_dim: int = 32,
                               repeats: int = 5) -> float:
    """``attention_fraction`` on a CPU: the FLOP/s of torch's CPU flash attention kernel (what a
    ring's chunk pairs run on a CPU, parallel/ring_attention.py) over ``peak``. Timed on a pair
    without a mask, 4 s^2 d FLOPs per head (QK^T and AV), as most of a ring's pairs are; the
    default shape is the ``small`` preset's heads (4 x 32) on 2k-token chunks."""
    import torch

    q, k, v = (torch.randn(1, heads, seq, head_dim) for _ in range(3))
    kernel = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
    seconds = _median_seconds(lambda: kernel(q, k, v, 0.0, False, scale=head_dim ** -0.5), repeats)
    return min(1.0, 4 * heads * seq * seq * head_dim / seconds / peak)


def fit_gemm_curve(points: list[tuple[int, int, int, float]], peak: float) -> tuple[float, float]:
    """(gemm_fraction, gemm_half_dim) minimizing the squared log error of predicted vs measured time."""
    best = (math.inf, 1.0, HALF_DIMS[0])
    for d in HALF_DIMS:
        # log t = log(2mnk / peak) - log f - sum log(x / (x + d)): log f is the mean residual.
        logs = [math.log(2 * m * n * k / peak) - sum(math.log(x / (x + d)) for x in (m, n, k)) - math.log(t)
                for m, n, k, t in points]
        log_f = sum(logs) / len(logs)
        error = sum((v - log_f) ** 2 for v in logs)
        if error < best[0]:
            best = (error, math.exp(log_f), d)
    return min(1.0, best[1]), float(best[2])


def _gemm_mix_rate(seconds: float, start=None, results=None) -> float:
    """FLOP/s one thread sustains over ``seconds`` on a mix of small and large fp32 GEMMs (from
    ``SHAPES``), starting when ``start`` (a multiprocessing Event) is set."""
    import torch

    torch.set_num_threads(1)  # a forked child must not use the parent's thread pool
    pairs = [(torch.randn(m, k), torch.randn(k, n)) for m, n, k in SHAPES[1:]]
    for a, b in pairs:
        torch.mm(a, b)
    if start is not None:
        start.wait()
    flops, began = 0, time.perf_counter()
    while time.perf_counter() - began < seconds:
        for a, b in pairs:
            torch.mm(a, b)
            flops += 2 * a.shape[0] * a.shape[1] * b.shape[1]
    rate = flops / (time.perf_counter() - began)
    if results is not None:
        results.put(rate)
    return rate


def measure_shared_rate(ranks: int, seconds: float = 2.0) -> float:
    """What one rank's compute rate becomes when ``ranks`` one-thread ranks run at once on this
    machine, as a share of a lone process's: about 1 while each rank has its own core (less where
    they share caches and memory bandwidth), and less than cores / ranks beyond, where the
    scheduler's time slices and cold caches cost besides (0.3-0.4 measured at 4 ranks on 2 cores
    under load, against the 0.5 of the cores alone). The slowest rank's rate counts: the step waits
    for it."""
    import multiprocessing

    with intra_op_threads(1):
        alone = _gemm_mix_rate(seconds)
    if ranks <= 1:
        return 1.0
    context = multiprocessing.get_context("fork")
    start, results = context.Event(), context.Queue()
    workers = [context.Process(target=_gemm_mix_rate, args=(seconds, start, results)) for _ in range(ranks)]
    for worker in workers:
        worker.start()
    time.sleep(0.2)  # every worker has built its matrices
    start.set()
    rates = [results.get(timeout=60 + 10 * seconds) for _ in workers]
    for worker in workers:
        worker.join()
    return min(1.0, min(rates) / alone)



def measure_recompute_overhead(ops: int = 40, numel: int = 64, repeats: int = 200) -> float:
    """Seconds torch.utils.checkpoint adds per recomputed kernel beyond running it again: a chain
    of ``ops`` tiny multiplications (each saving its input and a weight, as a block's kernels do),
    forward and backward with and without non-reentrant checkpointing, less one forward, over
    ``ops``. The recomputation runs under saved-tensor hooks and rebuilds the graph: a fixed cost
    per kernel (17 us here, stable to 1%) that a small model's blocks feel and a GPU's large
    kernels hide. Tiny tensors keep the kernels' own time out of the difference."""
    import torch
    from torch.utils.checkpoint import checkpoint

    weight = torch.ones(numel, requires_grad=True)
    start = torch.ones(numel, requires_grad=True)

    def chain(x):
        for _ in range(ops):
            x = x * weight
        return x

    def forward():
        with torch.no_grad():
            chain(start)

    with intra_op_threads(1):
        plain = _median_seconds(lambda: chain(start).sum().backward(), repeats)
        checkpointed = _median_seconds(lambda: checkpoint(chain, start, use_reentrant=False).sum().backward(), repeats)
        forward_s = _median_seconds(forward, repeats)
    return max(0.0, (checkpointed - plain - forward_s) / ops)
