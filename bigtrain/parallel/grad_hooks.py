"""Gradient-ready hooks that do not keep their owner alive.

A hook registered on a parameter (``register_post_accumulate_grad_hook``) is held by the tensor,
and torch's garbage-collector traversal does not look inside a tensor that C++ also holds (every
parameter in a model). So a hook that reaches its parameter again, as a bound method of the engine
that owns the parameters does, makes a cycle that Python never frees: a deleted trainer stayed
alive with its weights, gradients and optimizer state (16.4 GiB of a llama-1b on a GPU,
tests/test_device_placement.py). The hook here holds its owner weakly: once the owner is gone,
the hook does nothing and the parameter is free to go too.
"""

from __future__ import annotations

import weakref
from typing import Callable, Iterable

import torch


def on_grad_ready(params: Iterable[torch.Tensor], method: Callable[[torch.Tensor], None]) -> list:
    """Call the bound ``method`` with each of ``params`` once its gradient is accumulated, holding
    ``method``'s object weakly. Returns the hooks' handles."""
    owner = weakref.WeakMethod(method)

    def ready(param: torch.Tensor) -> None:
        bound = owner()
        if bound is not None:
            bound(param)

    return [p.register_post_accumulate_grad_hook(ready) for p in params]
