"""Block-causal attention on one GPU: sdpa under the dense additive mask against FlexAttention over
the documents' BlockMask (``model.attention``, docs/ecosystem.md "Document masking").

One attention call's forward and backward, as a layer runs it (q, k, v of (batch, heads, seq,
head_dim), grouped-query heads), on a window packed with documents of random lengths (mean
``--doc-mean`` tokens): the median time over ``--steps``, the peak memory the call adds
(``max_memory_allocated`` above what was held before it, the mask's construction included) and the
largest difference of the two outputs (relative to the output's largest magnitude).

    python benchmarks/bench_document_attention.py --json runs/doc_attention.json
    python benchmarks/bench_document_attention.py --allow-cpu --seq 256 --steps 2   # smoke: forward only

On a CPU torch has no FlexAttention backward: ``--allow-cpu`` times the forward alone (a test of
this script; its figures mean nothing).
"""

from __future__ import annotations

import argparse
import statistics
import time

import common  # noqa: F401 - puts this checkout first on the path
import torch
import torch.nn.functional as F

from bigtrain.core.documents import document_bias, document_block_mask
from bigtrain.models.flex import flex_attend


def packed_documents(batch: int, seq: int, mean: int, gen: torch.Generator) -> torch.Tensor:
    starts = torch.rand(batch, seq, generator=gen) < 1 / mean
    starts[:, 0] = True
    return starts.long().cumsum(1) - 1


def attend(kind: str, q, k, v, documents):
    if kind == "sdpa":
        mask = document_bias(documents, q.dtype)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=q.shape[1] != k.shape[1])
    return flex_attend(q, k, v, document_block_mask(documents))


def run(kind: str, q, k, v, documents, steps: int, backward: bool) -> dict:
    cuda = q.device.type == "cuda"
    times, out = [], None
    for step in range(steps + 1):  # the first: warm-up (flex compiles its kernel there)
        if cuda:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            before = torch.cuda.memory_allocated()
        t0 = time.perf_counter()
        with torch.set_grad_enabled(backward):
            out = attend(kind, q, k, v, documents)
            if backward:
                out.backward(torch.ones_like(out))
        if cuda:
            torch.cuda.synchronize()
        if step:
            times.append(time.perf_counter() - t0)
    peak = torch.cuda.max_memory_allocated() - before if cuda else 0
    return {"median_ms": 1e3 * statistics.median(times), "peak_added_mib": peak / 2**20, "out": out.detach()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--seq", type=int, default=8192)
    ap.add_argument("--batch", type=int, default=2)
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--kv-heads", type=int, default=8)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--doc-mean", type=int, default=1024)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--allow-cpu", action="store_true")
    ap.add_argument("--json", default="")
    a = ap.parse_args()
    cuda = torch.cuda.is_available()
    if not cuda and not a.allow_cpu:
        raise SystemExit("no CUDA device (--allow-cpu: a forward-only smoke run)")
    device, dtype = ("cuda", torch.bfloat16) if cuda else ("cpu", torch.float32)
    gen = torch.Generator().manual_seed(0)
    documents = packed_documents(a.batch, a.seq, a.doc_mean, gen).to(device)
    q, k, v = (torch.randn(a.batch, h, a.seq, a.head_dim, generator=gen).to(device, dtype).requires_grad_(cuda)
               for h in (a.heads, a.kv_heads, a.kv_heads))
    rows = {kind: run(kind, q, k, v, documents, a.steps, backward=cuda) for kind in ("sdpa", "flex")}
    same = documents[:, :, None] == documents[:, None, :]
    allowed = int(torch.tril(same).sum())  # pairs a document attends: what flex computes, up to tiles
    diff = float((rows["flex"]["out"].float() - rows["sdpa"]["out"].float()).abs().max()
                 / rows["sdpa"]["out"].float().abs().max())
    result = {"device": torch.cuda.get_device_name(0) if cuda else "cpu", "torch": torch.__version__,
              "dtype": str(dtype), "backward": cuda, **{k: getattr(a, k.replace("-", "_")) for k in
                                                       ("seq", "batch", "heads", "kv_heads", "head_dim", "doc_mean")},
              "documents_per_row": float(documents[:, -1].float().mean() + 1),
              "allowed_over_causal": allowed / (a.batch * a.seq * (a.seq + 1) / 2),
              "max_relative_difference": diff,
              **{f"{kind}_{key}": value for kind, row in rows.items() for key, value in row.items() if key != "out"}}
    result["flex_speedup"] = result["sdpa_median_ms"] / result["flex_median_ms"]
    for key, value in result.items():
        print(f"{key}: {value:.4g}" if isinstance(value, float) else f"{key}: {value}")
    if a.json:
        import json
        import os

        os.makedirs(os.path.dirname(a.json) or ".", exist_ok=True)
        with open(a.json, "w") as f:
            json.dump({**result, **common.checkout()}, f, indent=1)


if __name__ == "__main__":
    main()
