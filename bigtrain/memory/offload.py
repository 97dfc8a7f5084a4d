"""Activation offload: saved tensors go to host memory in forward and come back one module ahead in backward.

Each watched module (the embedding, every block, the final norm, the head) runs its forward inside
``saved_tensors_hooks``: a saved tensor of at least ``min_bytes`` is copied to the host and only the
host copy is kept; smaller ones, and weights (resident anyway), stay where they are. Autograd
asks for a tensor back in backward (unpack). An unpack from a module's group starts the copy
back of the group saved just before it in forward when that is the previous module of the same
pass (the next one backward needs) as soon as backward has freed the first of the group's own
copies: one module ahead, and the two together hold less than two modules' offloaded tensors.
Checkpointed blocks compose: torch's non-reentrant checkpoint saves a block's inputs through the
hooks active when it is called (ours), and its recomputation packs into its own hooks, never ours.

Device-agnostic: on CUDA the host copies are pinned and both directions run on a side stream
(``record_stream`` keeps the allocator from reusing memory a copy still reads; the compute stream
waits for a prefetch's event before it uses the tensor). On a CPU the "host" is the same memory:
the copies are made all the same, so the mechanism (what moves, when it comes back) runs and is
tested, and :class:`OffloadStats` counts what is resident on the compute device against what moved.

What moves is a storage, not a tensor: the views of one storage a module saves (a norm's output
that wq, wk and wv all save, SDPA's output and wo's view of it) share one host copy and come back
as one device copy, as they were. A storage saved again after an in-place change gets a copy of
its own. The module keeps its saved storages alive until its forward ends, so none is freed and
its memory reused (under the same identity) while the module still saves.

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
    kept: int = 0  # bytes left on the device (cumulative): small tensors (weights are not counted)
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
    """What one module saved in one forward: its offloaded storages, in order."""

    def __init__(self, module_index: int, pass_id: int):
        self.module_index, self.pass_id = module_index, pass_id
        self.storages: list[_Storage] = []
        self.by_key: dict[int, _Storage] | None = {}  # while the module runs: storage identity -> copy
        self.originals: list | None = []  # the device storages, held until the module's forward ends
        self.saved: list | None = []  # the tensors packed, held as long: checked for in-place changes at its end
        self.prefetch_started = False
        self.released_any = False  # backward has freed one of its device copies
        self.unpacked_any = False


class _Storage:
    """The host copy of one device storage, and its device copy once brought back."""

    __slots__ = ("host", "device", "nbytes", "version", "group", "ready", "event", "waiting", "holders",
                 "__weakref__")

    def __init__(self, host: torch.Tensor, device: torch.device, version: int, group: _Group):
        self.host, self.device, self.nbytes, self.version, self.group = host, device, host.numel(), version, group
        self.ready: torch.Tensor | None = None  # the device copy (uint8), between bring-back and unpack
        self.event = None  # CUDA: the copy's completion
        self.waiting = 0  # views packed and not yet unpacked since the last bring-back
        self.holders = 0  # device copy + views of it that are alive: the bytes are resident while > 0


class _View:
    """What autograd keeps for an offloaded tensor: its storage's copy and how to view it; and, to
    check it as autograd would, the tensor that was saved (weakly) and its version then."""

    __slots__ = ("stored", "dtype", "offset", "shape", "stride", "source", "version", "modified")

    def __init__(self, stored: _Storage, t: torch.Tensor, offset: int, stride: tuple[int, ...],
                 source: torch.Tensor):
        self.stored, self.dtype, self.offset, self.shape, self.stride = stored, t.dtype, offset, t.shape, stride
        self.source, self.version, self.modified = weakref.ref(source), source._version, False

    def check(self) -> None:
        source = self.source()
        _check_version(self.modified or (source is not None and source._version != self.version))


class _Kept:
    """A saved tensor left on the device, wrapped so its release is counted."""

    __slots__ = ("tensor", "version", "__weakref__")

    def __init__(self, tensor: torch.Tensor):
        self.tensor, self.version = tensor, tensor._version


def _check_version(modified: bool) -> None:
    """Autograd checks that a saved tensor was not changed in place before backward reads it, but not
    where saved-tensor hooks (these) hold it: the check is made here instead. Without it, a model
    plain autograd refuses trains on: a kept tensor's new values (wrong gradients), or an offloaded
    copy whose bytes, on CUDA, race the in-place write on the side stream."""
    if modified:
        raise RuntimeError("one of the variables needed for gradient computation has been modified by an inplace "
                           "operation (activation offload: a tensor saved for backward was changed in place after "
                           "it was saved, which plain autograd refuses too); make that operation out of place")


def _bytes_of(t: torch.Tensor) -> torch.Tensor:
    """The whole storage behind ``t`` as a flat uint8 tensor (no copy)."""
    return torch.empty(0, dtype=torch.uint8, device=t.device).set_(t.untyped_storage())


def _is_weight(t: torch.Tensor, depth: int = 3) -> bool:
    """A parameter, or a view of one (the transposed weight a linear saves): the same storage as the
    leaf that a short chain of one-input autograd nodes leads to."""
    if isinstance(t, nn.Parameter) or (t.is_leaf and t.requires_grad):
        return True
    fn = t.grad_fn
    for _ in range(depth):
        if fn is None:
            return False
        variable = getattr(fn, "variable", None)  # AccumulateGrad: the leaf itself
        if variable is not None:
            return variable.untyped_storage()._cdata == t.untyped_storage()._cdata
        inputs = [f for f, _ in fn.next_functions if f is not None]
        if len(inputs) != 1:
            return False
        fn = inputs[0]
    return False


def _viewed(data: torch.Tensor, view: _View) -> torch.Tensor:
    return torch.empty(0, dtype=view.dtype, device=data.device).set_(data.untyped_storage(), view.offset,
                                                                     view.shape, view.stride)


class ActivationOffloader:
    """Offload the saved tensors of ``modules`` (given in forward order) to the host."""

    def __init__(self, modules: list[nn.Module], min_bytes: int = 1024):
        self.min_bytes = min_bytes
        self.stats = OffloadStats()
        self._current: _Group | None = None
        self._last_index = -1
        self._pass = 0
        self._stream = None  # CUDA side stream, made on first use
        self._hooks: list = []
        self._groups: weakref.WeakValueDictionary = weakref.WeakValueDictionary()
        self._modules = list(modules)
        self._weights: set[int] = set()
        self._live: list[_View] = []  # offloaded views whose saved tensor may still be alive (checked, then dropped)
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
        # The module's weights by storage: a detached view of one (int8 compression's matmul) is one too.
        self._weights = {p.untyped_storage()._cdata for p in self._modules[index].parameters()}
        self._sweep()  # the module before may have changed its input in place (a residual stream's +=)
        self._current = _Group(index, self._pass)
        self._groups[(self._pass, index)] = self._current  # weakly: it lives as long as its saved tensors
        hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack)
        hooks.__enter__()
        self._hooks.append(hooks)

    def _exit(self, index: int) -> None:
        hooks = self._hooks.pop()
        if hooks is not None:
            hooks.__exit__(None, None, None)
            self._sweep()  # before the module's own saved tensors, held until now, may go
            self._current.by_key, self._current.originals, self._current.saved = None, None, None
            self._current = None

    def _pack(self, t: torch.Tensor):
        if t.untyped_storage()._cdata in self._weights or _is_weight(t):
            return t  # resident anyway, and not an activation
        nbytes = t.numel() * t.element_size()
        if nbytes < self.min_bytes:
            kept = _Kept(t)
            self.stats.kept += nbytes
            self.stats.kept_count += 1
            self.stats.add(nbytes)
            weakref.finalize(kept, self.stats.sub, nbytes)
            return kept
        group, source = self._current, t
        if t.untyped_storage().nbytes() > 2 * nbytes:  # a small view of a large storage: move the view only
            t = t.detach().clone(memory_format=torch.contiguous_format)
        key = t.untyped_storage()._cdata
        stored = group.by_key.get(key)
        if stored is None or stored.version != t._version:
            stored = _Storage(self._to_host(t), t.device, t._version, group)
            group.by_key[key] = stored
            group.originals.append(t.untyped_storage())
            group.storages.append(stored)
            self.stats.offloaded += stored.nbytes
            self.stats.offloaded_count += 1
        stored.waiting += 1
        view = _View(stored, t, t.storage_offset(), t.stride(), source)
        if t is source:  # not a small view's large storage, which the module may be done with
            group.saved.append(source)
        self._live.append(view)
        return view

    def _sweep(self) -> None:
        """Mark the offloaded views whose saved tensor was changed in place since it was saved (it is
        checked when unpacked, :func:`_check_version`); forget those whose tensor is gone (weakly
        held: a module's own are held until its forward ends), which nothing can change any more."""
        live = []
        for view in self._live:
            source = view.source()
            if source is None:
                continue
            if source._version != view.version:
                view.modified = True
            else:
                live.append(view)
        self._live = live

    # -- backward: bring tensors back, one group ahead ----------------------------------------------
    def _unpack(self, packed):
        if isinstance(packed, torch.Tensor):
            return packed
        if isinstance(packed, _Kept):
            _check_version(packed.tensor._version != packed.version)
            return packed.tensor
        packed.check()
        stored = packed.stored
        group = stored.group
        self.stats.events.append(("unpack", group.module_index))
        if not group.unpacked_any:  # backward has left the module after this one: drop what it never read
            group.unpacked_any = True
            self._drop_unread(self._groups.get((group.pass_id, group.module_index + 1)))
        if not group.prefetch_started:  # nobody prefetched this group: bring it all now
            self._prefetch(group, late=True)
        previous = self._previous(group)
        # Prefetch once backward has freed one of this group's copies (after the module's first
        # backward node): from then on the two groups together stay under two modules' worth.
        if previous is not None and (group.released_any or len(group.storages) == 1):
            self._prefetch(previous)
        if stored.ready is None:  # unpacked before (a kept graph): copy back again, now
            self._bring_back(stored)
            stored.waiting = max(stored.waiting, 1)
        data = stored.ready
        if stored.event is not None:
            torch.cuda.current_stream().wait_event(stored.event)
            data.record_stream(torch.cuda.current_stream())
        tensor = _viewed(data, packed)
        self._hold(stored, tensor)
        stored.waiting -= 1
        if stored.waiting <= 0:  # autograd holds the views from here; the storage goes with the last
            stored.ready, stored.event = None, None
        return tensor

    def _previous(self, group: _Group) -> _Group | None:
        """The group the module before ``group``'s saved in the same pass: backward needs it next.
        (Not the previous group saved: under an interleaved pipeline schedule that can be another
        micro-batch's, or a chunk whose input came from another rank.)"""
        return self._groups.get((group.pass_id, group.module_index - 1))

    @staticmethod
    def _drop_unread(group: _Group | None) -> None:
        """Forget device copies no unpack took (a tensor saved but never read in backward, such as
        the checkpointed block input ``_KeepInput`` saves for accounting); a later unpack (a kept
        graph) copies it back again."""
        for stored in group.storages if group is not None else []:
            stored.ready, stored.event = None, None

    def _prefetch(self, group: _Group, late: bool = False) -> None:
        if group.prefetch_started:
            return
        group.prefetch_started = True
        self.stats.events.append(("fetch" if late else "prefetch", group.module_index))
        for stored in group.storages:
            self._bring_back(stored)
            if late:
                self.stats.fetched_late += stored.nbytes
            else:
                self.stats.prefetched += stored.nbytes

    # -- copies and residency ---------------------------------------------------------------------
    def _to_host(self, t: torch.Tensor) -> torch.Tensor:
        data = _bytes_of(t)
        if t.device.type != "cuda":
            # The host is this memory: copy all the same, so the round trip is exercised.
            return data.clone()
        stream = self._side_stream()
        host = torch.empty(data.shape, dtype=torch.uint8, pin_memory=True)
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            host.copy_(data, non_blocking=True)
        data.record_stream(stream)  # the allocator must not reuse the storage before the copy read it
        return host

    def _bring_back(self, stored: _Storage) -> None:
        if stored.device.type != "cuda":
            data, event = stored.host.clone(), None
        else:
            stream = self._side_stream()
            stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(stream):
                data = stored.host.to(stored.device, non_blocking=True)
                event = torch.cuda.Event()
                event.record(stream)
        stored.ready, stored.event = data, event
        self._hold(stored, data)

    def _hold(self, stored: _Storage, tensor: torch.Tensor) -> None:
        """Count ``tensor`` (the device copy or a view of it) as keeping the copy resident."""
        if stored.holders == 0:
            self.stats.add(stored.nbytes)
        stored.holders += 1
        weakref.finalize(tensor, self._release, stored)

    def _release(self, stored: _Storage) -> None:
        stored.holders -= 1
        if stored.holders == 0:
            self.stats.sub(stored.nbytes)
            group = stored.group
            if not group.released_any:
                group.released_any = True
                previous = self._previous(group) if group.unpacked_any else None
                if previous is not None:  # a checkpointed block unpacks all at once: start it here
                    self._prefetch(previous)

    def _side_stream(self):
        if self._stream is None:
            self._stream = torch.cuda.Stream()
        return self._stream
