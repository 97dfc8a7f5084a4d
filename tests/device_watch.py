"""Catching device mixing without a GPU: NCCL takes only device tensors, Gloo takes anything, so a
CPU run would never notice a host tensor handed to a collective. :class:`DeviceWatch` makes the
places where that goes wrong visible on the CPU too, and checks the same thing on a GPU:

* every tensor handed to an :class:`AxisComm` collective (and every norm accumulator that
  ``square_sums`` returns) must be on the expected device, and must not be a *host copy*: the result
  of ``.cpu()`` or anything computed from one, until an explicit ``.to(device)`` places it again (on
  the CPU ``.cpu()`` is a no-op, so this taint is the only way to see the mistake there);
* every tensor that bigtrain code creates with a factory (``torch.zeros``, ``torch.tensor``, ...)
  must name its device: a tensor created without one lands on the CPU whatever the model's
  device (the bug of a bookkeeping tensor such as a norm accumulator or a barrier flag).

Violations are collected, not raised (they may happen inside autograd hooks); ``problems`` lists
them with the file and line, or the collective, where they happened.
"""

from __future__ import annotations

import os
import sys

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_flatten

import bigtrain
from bigtrain.distributed.comm import AxisComm

BIGTRAIN_DIR = os.path.dirname(os.path.abspath(bigtrain.__file__)) + os.sep
FACTORIES = {torch.zeros, torch.ones, torch.empty, torch.full, torch.tensor, torch.as_tensor, torch.arange,
             torch.randn, torch.rand, torch.randint, torch.eye, torch.linspace}
COLLECTIVES = ("all_reduce", "all_gather", "reduce_scatter", "all_to_all", "broadcast", "send_op", "recv_op",
               "send", "recv", "max")
_HOST = "_bigtrain_host_copy"


def _tensors(*trees):
    leaves, _ = tree_flatten(list(trees))
    return [t for t in leaves if isinstance(t, torch.Tensor)]


def _bigtrain_caller(depth: int = 2) -> str | None:
    frame = sys._getframe(depth)
    name = frame.f_code.co_filename
    if name.startswith(BIGTRAIN_DIR):
        return f"{name[len(BIGTRAIN_DIR):]}:{frame.f_lineno} ({frame.f_code.co_name})"
    return None


class _Watch(TorchFunctionMode):
    def __init__(self, owner: "DeviceWatch"):
        super().__init__()
        self.owner = owner

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in FACTORIES and kwargs.get("device") is None:
            where = _bigtrain_caller()
            if where is not None:
                self.owner.problems.append(f"{where}: torch.{func.__name__} without a device")
        out = func(*args, **kwargs)
        name = getattr(func, "__name__", "")
        if name == "cpu":
            for t in _tensors(out):
                setattr(t, _HOST, True)
        elif name in ("to", "cuda") and (kwargs.get("device") is not None or name == "cuda"
                                         or any(isinstance(a, (torch.device, str, torch.Tensor)) for a in args[1:])):
            for t in _tensors(out):  # placed explicitly (on the CPU the same object: placed again)
                if hasattr(t, _HOST):
                    delattr(t, _HOST)
        elif any(getattr(t, _HOST, False) for t in _tensors(args, kwargs)):
            for t in _tensors(out):  # computed from a host copy: a host copy too
                setattr(t, _HOST, True)
        return out


class DeviceWatch:
    """``with DeviceWatch(device) as watch: ...`` then ``assert not watch.problems``."""

    def __init__(self, device: torch.device | str, norms_on: torch.device | str | None = None):
        """``norms_on``: where ``square_sums`` must put its accumulator, if not on ``device``: on the
        host when the fp32 gradients live there (offload streams them to the host, issue 28; the
        engine moves the two sums to ``device`` for the collective, which is still checked)."""
        self.device = torch.device(device)
        self.norms_on = torch.device(norms_on) if norms_on is not None else self.device
        self.problems: list[str] = []
        self.checked = 0  # tensors handed to collectives that were looked at
        self._saved: dict[str, object] = {}
        self._mode = _Watch(self)

    def _check(self, what: str, tensors, expected: torch.device | None = None) -> None:
        expected = expected or self.device
        for t in tensors:
            self.checked += 1
            if not _same_device(t.device, expected):
                self.problems.append(f"{what}: a {tuple(t.shape)} {t.dtype} tensor on {t.device}, "
                                     f"expected {expected}")
            elif getattr(t, _HOST, False):
                self.problems.append(f"{what}: a {tuple(t.shape)} {t.dtype} host copy (made by .cpu()) "
                                     f"handed to a collective")

    def _wrap_collective(self, name: str):
        original = getattr(AxisComm, name)
        watch = self

        def checked(comm, *args, **kwargs):
            watch._check(f"AxisComm({comm.axis}).{name}", _tensors(args, kwargs))
            return original(comm, *args, **kwargs)

        return original, checked

    def _wrap_square_sums(self, module):
        original = module.square_sums
        watch = self

        def checked(*args, **kwargs):
            parts = original(*args, **kwargs)
            watch._check(f"{module.__name__}.square_sums", [parts], watch.norms_on)
            return parts

        return original, checked

    def __enter__(self) -> "DeviceWatch":
        from bigtrain.parallel import replicated
        from bigtrain.parallel.zero import engine

        for name in COLLECTIVES:
            original, checked = self._wrap_collective(name)
            self._saved[name] = original
            setattr(AxisComm, name, checked)
        for module in (engine, replicated):
            original, checked = self._wrap_square_sums(module)
            self._saved[module] = original
            module.square_sums = checked
        self._mode.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        self._mode.__exit__(*exc)
        for key, original in self._saved.items():
            if isinstance(key, str):
                setattr(AxisComm, key, original)
            else:
                key.square_sums = original
        self._saved.clear()


def _same_device(actual: torch.device, expected: torch.device) -> bool:
    if actual.type != expected.type:
        return False
    # cuda:N against a bare "cuda": the current device.
    if expected.type == "cuda" and expected.index is None:
        return actual.index in (None, torch.cuda.current_device())
    return expected.index is None or actual.index in (None, expected.index)
