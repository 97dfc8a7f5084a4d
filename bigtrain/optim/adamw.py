"""AdamW through the seam: torch's implementation, fused where the device has the kernel.

torch's fused AdamW (one kernel over every tensor of a group) exists for CPU, CUDA and a few other
devices in torch 2.13; elsewhere the foreach implementation (a few multi-tensor ops) runs. The two
agree to ~1e-7 relative in fp32; ``benchmarks/bench_optimizer_step.py`` measures their speed
(docs/benchmarks.md, "Optimizer step").
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from bigtrain.optim.spec import OptimizerSpec, StateTensor, register_optimizer

if TYPE_CHECKING:
    import torch

    from bigtrain.config import OptimConfig


def fused_available(device: "torch.device") -> bool:
    """Whether torch has fused optimizer kernels for ``device``'s type."""
    try:
        from torch.optim.optimizer import _get_fused_kernels_supported_devices
    except ImportError:  # a torch that moved the private helper: fused on CUDA only, the safe guess
        return device.type == "cuda"
    return device.type in _get_fused_kernels_supported_devices()


def build_adamw_optimizer(groups: list[dict], cfg: "OptimConfig", fused: bool | None = None) -> "torch.optim.AdamW":
    """torch AdamW over ``groups`` (each carrying its ``weight_decay``); ``fused=None`` picks the
    fused kernel when the parameters' device has one, foreach otherwise."""
    import torch

    params = [p for g in groups for p in g["params"]]
    if fused is None:
        fused = bool(params) and fused_available(params[0].device) and all(p.is_floating_point() for p in params)
    kernel = {"fused": True} if fused else {"foreach": True}
    return torch.optim.AdamW(groups, lr=cfg.lr, betas=(cfg.beta1, cfg.beta2), eps=cfg.eps, **kernel)


ADAMW = register_optimizer(OptimizerSpec(
    name="adamw",
    state=(StateTensor("exp_avg"), StateTensor("exp_avg_sq"), StateTensor("step", per="tensor")),
    build=build_adamw_optimizer,
    summary="AdamW (Loshchilov & Hutter): two fp32 moments, 8 bytes per parameter, plus a step count per tensor",
))
