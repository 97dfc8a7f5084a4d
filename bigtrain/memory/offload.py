"""Activation offload: saved tensors go to host memory in forward and come back one module ahead in backward.

Each watched module (the embedding, every block, the final norm, the head) runs its forward inside
``saved_tensors_hooks``: a saved tensor of at least ``min_bytes`` is copied to the host and only the
host copy is kept; smaller ones, and parameters (resident anyway), stay where they are. Autograd
asks for a tensor back in backward (unpack). The first unpack of a module's group starts the copy
back of the group saved just before it in forward when that is the previous module of the same
pass (the next one backward needs): one module ahead, so at most two modules' offloaded tensors
are on the device at once. Checkpointed blocks compose: torch's non-reentrant checkpoint saves a
block's inputs through the hooks active when it is called (ours), and its recomputation packs into
its own hooks, never ours.

Device-agnostic: on CUDA the host copies are pinned and both directions run on a side stream
(``record_stream`` keeps the allocator from reusing memory a copy still reads; the compute stream
waits for a prefetch's event before it uses the tensor). On a CPU the "host" is the same memory:
the copies are made all the same, so the mechanism (what moves, when it comes back) runs and is
tested, and :class:`OffloadStats` counts what is resident on the compute device against what moved.

A tensor may be unpacked more than once (the zero-bubble pipeline's split backward keeps the graph
and reaches a linear again for its weight gradient): the host copy stays with the saved tensor
until autograd releases it, and every unpack after the first copies it back again.
"""

from __future__ import annotations

import weakref
from collections import deque
from dataclasses import dataclass, field

import torch
from torch import nn


@dataclass
class OffloadStats:
    """Bytes of saved tensors, by where they are; ``peak_resident``: the most saved bytes on the
    compute device at once (kept ones still alive plus offloaded ones brought back and alive)."""

    offloaded: int = 0  # bytes moved to the host (cumulative)
    kept: int = 0  # bytes left on the device (cumulative): small tensors
    offloaded_count: int = 0
    kept_count: int = 0
    resident: int = 0
    peak_resident: int = 0
    prefetched: int = 0  # bytes brought back ahead of their unpack
    fetched_late: int = 0  # bytes brought back on demand (no prefetch had started)
    # the latest ("prefetch" | "fetch" | "unpack", module index), in order: what the tests read
    events: deque = field(default_factory=lambda: deque(maxlen=4096))

    def add(self, nbytes: int) -> None:
        self.resident += nbytes
        self.peak_resident = max(self.peak_resident, self.resident)

    def sub(self, nbytes: int) -> None:
        self.resident -= nbytes

    def reset_peak(self) -> None:
        self.peak_resident = self.resident


class _Group:
    """The tensors one module saved in one forward: offloaded ones by handle."""

    def __init__(self, module_index: int, pass_id: int):
        self.module_index, self.pass_id = module_index, pass_id
        self.handles: list[_Offloaded] = []
        self.prefetch_started = False


class _Offloaded:
    """What autograd keeps for an offloaded tensor: the host copy, and the device copy a prefetch made."""

    __slots__ = ("host", "device", "group", "nbytes", "ready", "__weakref__")

    def __init__(self, host: torch.Tensor, device: torch.device, group: _Group, nbytes: int):
        self.host, self.device, self.group, self.nbytes = host, device, group, nbytes
        self.ready: tuple[torch.Tensor, object] | None = None  # (device copy, its copy's event)


class _Kept:
    """A saved tensor left on the device, wrapped so its release is counted."""

    __slots__ = ("tensor", "__weakref__")

    def __init__(self, tensor: torch.Tensor):
        self.tensor = tensor


class ActivationOffloader:
    """Offload the saved tensors of ``modules`` (given in forward order) to the host."""

    def __init__(self, modules: list[nn.Module], min_bytes: int = 1024):
        self.min_bytes = min_bytes
        self.stats = OffloadStats()
        self._current: tuple[int, _Group] | None = None
        self._last_index = -1
        self._pass = 0
        self._stream = None  # CUDA side stream, made on first use
        self._hooks: list = []
        self._groups: weakref.WeakValueDictionary = weakref.WeakValueDictionary()
        for i, module in enumerate(modules):
            module.register_forward_pre_hook(lambda m, args, i=i: self._enter(i))
            module.register_forward_hook(lambda m, args, out, i=i: self._exit(i))

    # -- forward: which group is saving ----------------------------------------------------------
    def _enter(self, index: int) -> None:
        if not torch.is_grad_enabled() or torch._C._current_graph_task_id() != -1:
            self._hooks.append(None)  # no graph, or a recomputation inside backward: nothing to offload
            return
        if index <= self._last_index:  # a module again: the next micro-batch's forward
            self._pass += 1
        self._last_index = index
        group = _Group(index, self._pass)
        self._groups[(self._pass, index)] = group  # weakly: a group lives as long as its saved tensors
        self._current = (index, group)
        hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack)
        hooks.__enter__()
        self._hooks.append(hooks)

    def _exit(self, index: int) -> None:
        hooks = self._hooks.pop()
        if hooks is not None:
            hooks.__exit__(None, None, None)
            self._current = None

    def _pack(self, t: torch.Tensor):
        nbytes = t.numel() * t.element_size()
        if nbytes < self.min_bytes or isinstance(t, nn.Parameter) or (t.is_leaf and t.requires_grad):
            kept = _Kept(t)
            self.stats.kept += nbytes
            self.stats.kept_count += 1
            self.stats.add(nbytes)
            weakref.finalize(kept, self.stats.sub, nbytes)
            return kept
        group = self._current[1]
        handle = _Offloaded(self._to_host(t), t.device, group, nbytes)
        group.handles.append(handle)
        self.stats.offloaded += nbytes
        self.stats.offloaded_count += 1
        return handle

    # -- backward: bring tensors back, one group ahead ----------------------------------------------
    def _unpack(self, packed):
        if isinstance(packed, _Kept):
            return packed.tensor
        group = packed.group
        self.stats.events.append(("unpack", group.module_index))
        if not group.prefetch_started:  # nobody prefetched this group: bring it all now
            self._prefetch(group, late=True)
        previous = self._previous(group)
        if previous is not None:
            self._prefetch(previous)
        if packed.ready is None:  # unpacked before (a kept graph): copy back again, now
            self._bring_back(packed)
        tensor, event = packed.ready
        packed.ready = None  # autograd holds it from here; it is freed when the node is done
        if event is not None:
            torch.cuda.current_stream().wait_event(event)
            tensor.record_stream(torch.cuda.current_stream())
        return tensor

    def _previous(self, group: _Group) -> _Group | None:
        """The group the module before ``group``'s saved in the same pass: backward needs it next.
        (Not the previous group saved: under an interleaved pipeline schedule that can be another
        micro-batch's, or a chunk whose input came from another rank.)"""
        return self._groups.get((group.pass_id, group.module_index - 1))

    def _prefetch(self, group: _Group, late: bool = False) -> None:
        if group.prefetch_started:
            return
        group.prefetch_started = True
        self.stats.events.append(("fetch" if late else "prefetch", group.module_index))
        for handle in group.handles:
            self._bring_back(handle)
            if late:
                self.stats.fetched_late += handle.nbytes
            else:
                self.stats.prefetched += handle.nbytes

    # -- copies --------------------------------------------------------------------------------------
    def _to_host(self, t: torch.Tensor) -> torch.Tensor:
        if t.device.type != "cuda":
            # The host is this memory: copy all the same, so the round trip is exercised.
            return t.detach().clone()
        stream = self._side_stream()
        host = torch.empty_like(t, device="cpu", pin_memory=True)
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            host.copy_(t, non_blocking=True)
        t.record_stream(stream)  # the allocator must not reuse t before the copy has read it
        return host

    def _bring_back(self, handle: _Offloaded) -> None:
        if handle.device.type != "cuda":
            tensor, event = handle.host.clone(), None
        else:
            stream = self._side_stream()
            stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(stream):
                tensor = handle.host.to(handle.device, non_blocking=True)
                event = torch.cuda.Event()
                event.record(stream)
        handle.ready = (tensor, event)
        self.stats.add(handle.nbytes)
        weakref.finalize(tensor, self.stats.sub, handle.nbytes)

    def _side_stream(self):
        if self._stream is None:
            self._stream = torch.cuda.Stream()
        return self._stream
