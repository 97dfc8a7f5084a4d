"""What inductor fuses in one compiled transformer block: the fused-kernels reading of issue 27.

Compiles one block of a preset's Llama (fp32 on the CPU, bf16 autocast on a GPU), runs forward and
backward once, and lists the kernels inductor generated: each generated kernel's name is the ops it
fused (``cpp_fused_add_mean_mul_pow_rsqrt_...`` on a CPU, ``triton_..._fused_...`` on a GPU), so the
list says whether RMSNorm, rotary and SwiGLU each became one memory pass, and which matmuls stay
library calls (``extern_kernels.mm`` / ``bmm``, and the attention op). A memory-bound op that stays
unfused (several kernels for one RMSNorm, say) is what would earn a hand-written kernel.

    python benchmarks/compile_fusions.py                  # small preset, this machine's device
    python benchmarks/compile_fusions.py --preset llama-1b --json runs/bench/fusions.json
"""

from __future__ import annotations

import argparse
import json
import re
import sys

import common  # noqa: F401 - puts this checkout first on the path

import torch
from torch._inductor.utils import run_and_get_code

from bigtrain.config import load_config
from bigtrain.models.llama import build_model

KERNEL = re.compile(r"\b(cpp_fused_\w+|triton_\w+_fused_\w+|triton_\w+)\s*=\s*async_compile")
LIBRARY = re.compile(r"\b(extern_kernels\.\w+|aten\.\w+\.\w+|torch\.ops\.aten\.\w+(?:\.\w+)?)\(")
# Which source op each fused kernel's name shows (inductor names a kernel after the aten ops it holds).
SIGNS = {"RMSNorm forward (mean of squares, rsqrt, scale)": ("mean", "rsqrt"),
         "RMSNorm backward": ("div", "pow", "sum"),
         "SwiGLU (silu x gate), forward and backward": ("silu",),
         "rotary (halves mixed by cos and sin, restacked), forward and backward": ("stack",)}


def _kernels(codes: list[str]) -> tuple[list[str], dict[str, int]]:
    kernels, library = [], {}
    for code in codes:
        kernels += sorted(set(KERNEL.findall(code)))
        for call in LIBRARY.findall(code):
            library[call] = library.get(call, 0) + 1
    return kernels, library


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--preset", default="small")
    p.add_argument("--batch", type=int, default=2)
    p.add_argument("--fp8", default="none", help="tensorwise or rowwise: the block's linears in float8 "
                   "(bigtrain/fp8; on a CPU emulated), in bf16: what fp8 adds to the block's kernels")
    p.add_argument("--json", default="")
    args = p.parse_args(argv)
    cfg = load_config(preset=args.preset)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    torch.manual_seed(0)
    model = build_model(cfg.model, device=device)
    model.to_empty(device=device)
    model.init_weights(seed=0)
    block = model.layers[0]
    if args.fp8 != "none":  # the trainer's fp8 path: bf16 weights, float8 GEMMs, quantization compiled in
        from bigtrain.fp8.linear import convert_to_float8, float8_matmuls_on
        from bigtrain.fp8.scaling import Float8Recipe

        backend = "scaled_mm" if device == "cuda" and float8_matmuls_on(device) else "emulated"
        convert_to_float8(model, Float8Recipe(args.fp8), backend)
        block = model.layers[0].to(torch.bfloat16)
    seq = min(cfg.data.seq_len, 2048)
    cos, sin = model.rope_cos[:seq], model.rope_sin[:seq]
    dtype = torch.bfloat16 if args.fp8 != "none" else torch.float32
    x = torch.randn(args.batch, seq, cfg.model.dim, device=device, dtype=dtype, requires_grad=True)
    cos, sin = cos.to(dtype), sin.to(dtype)
    compiled = torch.compile(block, dynamic=False)

    def step():
        with torch.autocast(device, dtype=torch.bfloat16, enabled=device == "cuda" and args.fp8 == "none"):
            out = compiled(x, cos, sin)
        out.float().square().mean().backward()

    _, codes = run_and_get_code(step)
    kernels, library = _kernels(codes)
    fused = {what: [k for k in kernels if all(s in k for s in signs)] for what, signs in SIGNS.items()}
    what = f" with {args.fp8} float8 linears" if args.fp8 != "none" else ""
    print(f"{args.preset} block{what} on {device}: {len(codes)} graphs (forward, backward), {len(kernels)} generated kernels")
    for k in kernels:
        print(f"  {k}")
    print("library calls: " + ", ".join(f"{name} x{n}" for name, n in sorted(library.items())))
    for what, names in fused.items():
        print(f"{what}: {'fused, in ' + ', '.join(names) if names else 'no kernel named for it'}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"preset": args.preset, "device": device, "graphs": len(codes), "kernels": kernels,
                       "library": library, "fused": fused}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
