"""Optimizer state keyed by parameter name (the full, unsharded view ``full_state`` returns)."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from bigtrain.optim import OptimizerSpec
from bigtrain.optim.loading import load_state


def optimizer_state_by_name(model: nn.Module, optimizer: torch.optim.Optimizer, spec: OptimizerSpec) -> dict[str, Any]:
    """Optimizer state keyed by parameter name instead of position, so it survives re-layouts;
    each entry holds exactly the state ``spec`` declares (checked), as copies on the CPU (a view of
    the live state would change under the caller with the next step)."""
    names = {id(p): n for n, p in model.named_parameters()}
    state = {}
    for p, s in optimizer.state.items():
        if not s:  # an entry torch's defaultdict made on a look-up: no state yet
            continue
        spec.check_state(s, f"the optimizer's state of {names[id(p)]}")
        state[names[id(p)]] = {k: v.detach().to("cpu", copy=True) if torch.is_tensor(v) else v for k, v in s.items()}
    return {"optimizer": spec.name, "state": state}


def load_optimizer_state_by_name(model: nn.Module, optimizer: torch.optim.Optimizer, spec: OptimizerSpec,
                                 saved: dict[str, Any]) -> None:
    params = dict(model.named_parameters())
    entries = spec.saved_state(saved)
    # Another pipeline stage's weights are not this model's: skipped. Copies: no two parameters, nor the
    # caller's dict, may share a state tensor that the optimizer updates in place.
    load_state(optimizer, {params[name]: {k: v.clone() if torch.is_tensor(v) else v for k, v in s.items()}
                           for name, s in entries.items() if name in params}, spec)
