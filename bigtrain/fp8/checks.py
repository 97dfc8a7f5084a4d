"""``precision.fp8`` against the rest of a config and the machine, before any process starts.

Imports no torch (as :mod:`bigtrain.validation`): the caller passes what it knows of the device.
"""

from __future__ import annotations

from bigtrain.config import Config

FP8_RECIPES = ("none", "tensorwise", "rowwise")  # bigtrain.fp8.scaling.SCALINGS and 'none'
MIN_CAPABILITY = (8, 9)  # bigtrain.fp8.linear.MIN_CAPABILITY
_EMULATE = "set precision.fp8_emulate = true (the same float8 rounding with bf16/fp32 matmuls: correct, not faster)"


def check_fp8(cfg: Config, block_linears: bool = True, shapes: Config | None = None) -> list[str]:
    """The recipe's name, what float8 layers compose with, and the float8 kernels' shapes.
    ``block_linears``: the model family has blocks of plain linear layers to convert (its
    ``Family.block_linears``); ``shapes``: a config whose [model] fields describe the model (``cfg``
    itself for bigtrain's Llama), or None: its kernel shapes are not checked here (a family described
    by its own file checks them against it: families/hf.py)."""
    pr, m = cfg.precision, cfg.model
    if pr.fp8 not in FP8_RECIPES:
        return [f"precision.fp8 = '{pr.fp8}': must be one of {', '.join(repr(r) for r in FP8_RECIPES)}"]
    if pr.fp8 == "none":
        return []
    problems = []
    if not block_linears:
        problems.append(f"precision.fp8 = '{pr.fp8}' converts the linear layers of a decoder's blocks; "
                        f"model.family = '{m.family}' has none: use precision.fp8 = 'none'")
    if pr.mode == "fp16":
        problems.append(f"precision.fp8 = '{pr.fp8}' with precision.mode = 'fp16' is not supported (fp16's range "
                        f"and loss scale are not what the float8 recipes were checked with): use precision.mode = "
                        f"'bf16'")
    elif pr.mode != "bf16" and not pr.fp8_emulate:
        problems.append(f"precision.fp8 = '{pr.fp8}': the float8 kernels take and return bf16; use precision.mode = "
                        f"'bf16', or {_EMULATE} to check float8 numerics in fp32")
    if cfg.memory.activation_compression != "none":
        # int8 compression replaces a linear's computation: the float8 one would silently not run.
        problems.append(f"precision.fp8 = '{pr.fp8}' with memory.activation_compression = "
                        f"'{cfg.memory.activation_compression}': both change how the block linears compute; "
                        f"use one of them")
    if not pr.fp8_emulate and block_linears and shapes is not None:
        problems += kernel_shape_problems(shapes)
    return problems


def kernel_shape_problems(cfg: Config) -> list[str]:
    """torch._scaled_mm takes dimensions that are multiples of 16, in all three GEMMs of a linear:
    the local (tp-cut) features in and out, and the tokens of a micro-batch (dW's reduction)."""
    m, p = cfg.model, cfg.parallel
    if min(p.tp, p.sp, m.n_heads, m.dim) <= 0 or m.n_heads % max(1, m.kv_heads):
        return []  # reported by check_model / check_model_split
    kv = m.kv_heads * m.head_dim
    dims = {"model.dim": m.dim, "model.n_heads x head_dim / parallel.tp": m.n_heads * m.head_dim // p.tp,
            "model.n_kv_heads x head_dim / parallel.tp": kv // p.tp if m.kv_heads % p.tp == 0 else kv,
            "the feed-forward size / parallel.tp": m.ffn_dim // p.tp,
            "train.micro_batch x data.seq_len / parallel.sp": cfg.train.micro_batch * cfg.data.seq_len // p.sp}
    if m.moe_experts and m.moe_shared_expert:
        dims["the MoE shared expert's size"] = m.moe_shared_ffn_dim
    bad = [f"{name} = {value}" for name, value in dims.items() if value % 16]
    if not bad:
        return []
    return [f"precision.fp8 = '{cfg.precision.fp8}': float8 kernels (torch._scaled_mm) need multiples of 16, and "
            f"{', '.join(bad)} is not; change those sizes, or {_EMULATE}"]


def check_fp8_device(cfg: Config, cuda_available: bool | None, capability: tuple[int, int] | None) -> list[str]:
    """fp8 without emulation on a device with no float8 matmuls. ``cuda_available`` None: unknown
    (nothing checked); ``capability``: the CUDA device's (major, minor), None if unknown."""
    pr = cfg.precision
    if pr.fp8 == "none" or pr.fp8 not in FP8_RECIPES or pr.fp8_emulate or cuda_available is None:
        return []
    on_cpu = cfg.train.device == "cpu" or not cuda_available
    if on_cpu:
        where = "the CPU"
    elif capability is not None and tuple(capability) < MIN_CAPABILITY:
        where = f"a GPU of CUDA capability {capability[0]}.{capability[1]}"
    else:
        return []
    return [f"precision.fp8 = '{pr.fp8}' needs float8 matmuls (CUDA capability >= 8.9: Ada, Hopper or newer), and "
            f"this run computes on {where}: {_EMULATE}, or precision.fp8 = 'none'"]
