"""Giving an optimizer per-parameter state (a resume, a re-layout) in the dtypes its spec declares.

``torch.optim.Optimizer.load_state_dict`` places each state tensor of a floating-point parameter in
the parameter's dtype (all but ``step``): right for AdamW's fp32 moments of fp32 masters, wrong
for state declared in another dtype. 8-bit AdamW's int8/uint8 moment codes would come back as fp32
values, and its step's ``codes.view(torch.uint8)`` would then read four bytes per element. So the
state whose declared dtype torch would not keep is placed here, on the parameter's device in its
declared dtype, and never goes through that cast (nor through an fp32 copy four times its size).
"""

from __future__ import annotations

import torch

from bigtrain.optim.spec import OptimizerSpec

STATE_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16, "int8": torch.int8,
                "uint8": torch.uint8}


def declared_dtypes(spec: OptimizerSpec) -> dict[str, torch.dtype]:
    """{state name: the torch dtype ``spec`` declares for it}."""
    return {s.name: STATE_DTYPES[s.dtype] for s in spec.state}


def _torch_places(key: str, declared: torch.dtype, param: torch.Tensor) -> bool:
    """Whether ``load_state_dict`` leaves state ``key`` of ``param`` in its declared dtype: the step
    count (kept, or made fp32 on the parameter's device for a fused kernel), and any tensor declared
    in the dtype torch casts to (the parameter's, when it is floating-point)."""
    return key == "step" or (declared == param.dtype if param.is_floating_point() else True)


def load_state(optimizer: torch.optim.Optimizer, states: dict, spec: OptimizerSpec) -> None:
    """Give ``optimizer`` the per-parameter ``states`` ({param: {name: tensor}}) of ``spec``'s
    declared names: through its own ``load_state_dict`` (which places a fused kernel's step count
    on the parameter's device) for what that keeps in the declared dtype, and the rest placed here
    on the parameter's device unchanged. A given tensor in another dtype than declared is refused:
    converting it could only hide the bug that made it."""
    declared = declared_dtypes(spec)
    order = {id(p): i for i, p in enumerate(p for g in optimizer.param_groups for p in g["params"])}
    through_torch, placed = {}, {}
    for p, state in states.items():
        spec.check_state(state, f"the state given for a parameter of shape {tuple(p.shape)}")
        for key, value in state.items():
            if torch.is_tensor(value) and value.dtype != declared[key]:
                raise ValueError(f"optimizer {spec.name!r}: state {key!r} of a parameter of shape {tuple(p.shape)} "
                                 f"is {value.dtype} but the optimizer declares {declared[key]}")
        through_torch[order[id(p)]] = {k: v for k, v in state.items() if _torch_places(k, declared[k], p)}
        placed[p] = {k: v.to(device=p.device) for k, v in state.items() if not _torch_places(k, declared[k], p)}
    packed = optimizer.state_dict()
    packed["state"] = through_torch
    optimizer.load_state_dict(packed)
    for p, state in placed.items():
        optimizer.state[p].update(state)
