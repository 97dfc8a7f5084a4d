"""The link between the compute device and the host tier of offload: the one place that knows which
of the two a tensor is on, and moves bytes between them.

On a GPU (ZeRO-Offload / ZeRO-Infinity): the fp32 masters and the optimizer's state are host
tensors; each unit's gradient shard comes down (:meth:`HostLink.to_host`) into a pinned host buffer
and the updated weights go up (:meth:`HostLink.to_device`) through a pinned staging buffer in the
compute dtype (the cast runs on the host, so 2 bytes a parameter cross the bus in bf16, not 4).
Both run ``non_blocking`` on side copy streams, one each way, so they overlap the compute stream,
each other and the host's work:

- down (:mod:`.grad_stream`): its stream waits for the work queued on the compute stream so far
  and for the collective that reduced the gradient bucket; the compute stream never waits for it
  (the backward goes on); an event recorded after the copy is what the host waits on before it
  reads the buffer (:class:`Arriving`); the bucket is written again only after that read.
- up: the staging buffer is written on the host only after its previous copy's event completed;
  the compute stream waits for the copy stream (:meth:`HostLink.wait`) before it reads the weights
  (an all-gather, a forward). The destination is a tensor the engine keeps (a parameter shard) or
  one allocated on the compute stream just before (a gather's source), freed after that stream
  waited for the copy: the caching allocator then reuses its block only for work queued after.

``separate`` on a CPU device (tests): the host tier still keeps its own tensors, distinct from
the compute shards, and every copy happens, so the CUDA path's logic runs in CPU tests; streams,
events and pinning are no-ops there (pinned memory needs CUDA).
"""

from __future__ import annotations

import weakref

import torch


class HostLink:
    def __init__(self, device: torch.device, separate: bool = False, staging_slots: int = 4):
        self.device = torch.device(device)
        self.host = torch.device("cpu")
        self.cuda = self.device.type == "cuda"
        self.separate = separate or self.device.type != "cpu"  # host tensors apart from the compute ones
        self.stream = torch.cuda.Stream(self.device) if self.cuda else None  # host -> device
        # Device -> host on a stream of its own: a gradient's copy waits for its collective there,
        # and must not hold up the weights going the other way (PCIe carries both at once).
        self.down_stream = torch.cuda.Stream(self.device) if self.cuda else None
        # Pinned staging ring for host -> device copies: a slot is reused once its copy completed.
        self._slots: list[list] = [[None, None] for _ in range(max(2, staging_slots))]  # [buffer, event]
        self._next = 0
        self.bytes_down = 0  # device -> host
        self.bytes_up = 0  # host -> device
        # The host tier's tensors, by storage: on a CPU device (``separate``) host and device tensors
        # are both CPU tensors, and this is what tells them apart (kept alive: the identity of a
        # freed storage could be reused).
        self._host: dict[int, torch.Tensor] = {}
        # Pinned by cudaHostRegister: kept alive here, and unregistered before they are freed (at
        # close, or when the link is collected: freed memory left registered would make a later
        # registration of the same addresses fail). Collected, the link may still have copies in
        # flight (a deleted trainer's last weights going up): the streams are waited for first, so
        # that no copy reads or writes host memory after it was unpinned and freed.
        self._registered: list[torch.Tensor] = []
        streams = [s for s in (self.stream, self.down_stream) if s is not None]
        self._unpin = weakref.finalize(self, _unregister_all, self._registered, streams)
        self._unpin.atexit = False  # the process's exit frees them; CUDA may be shut down by then

    # -- host memory -----------------------------------------------------------------------------------
    def empty(self, numel: int, dtype: torch.dtype, pinned: bool = True) -> torch.Tensor:
        """A host tensor (pinned on CUDA where it is copied to or from the device). Pinned by
        registering plain memory with CUDA (``cudaHostRegister``), not through torch's caching host
        allocator, which rounds every block up to a power of two (a 0.8 GB buffer takes 1 GiB) and
        keeps freed blocks: the host tier then holds exactly the bytes the planner counts."""
        t = torch.empty(numel, dtype=dtype, device=self.host)
        if pinned and self.cuda and t.numel():
            _register(t)
            self._registered.append(t)
        return self.adopt(t)

    def adopt(self, t: torch.Tensor) -> torch.Tensor:
        """Count ``t`` (a host tensor made elsewhere: a master, an offloaded shard) in the host tier."""
        self._host[t.untyped_storage()._cdata] = t
        return t

    def tier_of(self, t: torch.Tensor) -> str:
        """Where ``t`` lives: ``device`` or ``host``, from its device on a GPU, and on a CPU device
        from whether the host tier made or adopted it (``separate``) or not (the host is the device)."""
        if t.device.type != "cpu":
            return "device"
        if self.device.type != "cpu":
            return "host"
        return "host" if self.separate and t.untyped_storage()._cdata in self._host else "device"

    def reserve_staging(self, numel: int, dtype: torch.dtype) -> None:
        """Allocate the staging ring now, each slot ``numel`` elements of ``dtype`` (the largest
        copy up; pinning is slow, and the first step should not pay for it)."""
        for slot in self._slots:
            if slot[0] is None or slot[0].dtype != dtype or slot[0].numel() < numel:
                slot[0] = self.empty(numel, dtype)

    def buffers(self) -> list[torch.Tensor]:
        """The link's own host buffers (the staging ring)."""
        return [s[0] for s in self._slots if s[0] is not None]

    def zeros(self, numel: int, dtype: torch.dtype, pinned: bool = True) -> torch.Tensor:
        return self.empty(numel, dtype, pinned).zero_()

    def _staging(self, numel: int, dtype: torch.dtype) -> tuple[torch.Tensor, list]:
        slot = self._slots[self._next]
        self._next = (self._next + 1) % len(self._slots)
        if slot[1] is not None:
            slot[1].synchronize()  # its last copy has left the buffer
        buffer = slot[0]
        if buffer is None or buffer.dtype != dtype or buffer.numel() < numel:
            slot[0] = buffer = self.empty(numel, dtype)
        return buffer[:numel], slot

    # -- copies ----------------------------------------------------------------------------------------
    def to_host(self, source: torch.Tensor, host: torch.Tensor, after=None) -> "Arriving":
        """Start copying the device tensor ``source`` into ``host`` (same dtype) once the compute
        stream's work queued so far and ``after`` (the work handle of a collective writing
        ``source``, or None) are done; read it with :meth:`Arriving.read`, on any thread. The
        compute stream does not wait for the copy: the caller writes ``source`` again only after
        the read (a gradient bucket is reused once its fold has read it)."""
        self.bytes_down += source.numel() * source.element_size()
        if not self.cuda:
            return Arriving(host, None, source, after)  # copied by the reader, after the collective's wait
        self.down_stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(self.down_stream):
            if after is not None:
                after.wait()  # NCCL: the copy stream waits for the collective; the compute stream goes on
            host.copy_(source, non_blocking=True)
            done = torch.cuda.Event()
            done.record(self.down_stream)
        return Arriving(host, done)

    def to_device(self, host: torch.Tensor, target: torch.Tensor) -> None:
        """Start copying the host tensor ``host`` into ``target`` on the device, cast to its dtype on
        the host; the compute stream waits for it at :meth:`wait`."""
        staging, slot = self._staging(host.numel(), target.dtype)
        staging.copy_(host)  # the cast, on the host
        self.bytes_up += target.numel() * target.element_size()
        if not self.cuda:
            target.copy_(staging)
            return
        # The copy may overwrite the target only after the compute stream's reads of it queued so far.
        self.stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(self.stream):
            target.copy_(staging, non_blocking=True)
            slot[1] = torch.cuda.Event()
            slot[1].record(self.stream)

    def wait(self) -> None:
        """The compute stream waits for every copy issued so far (the host does not block)."""
        if self.cuda:
            torch.cuda.current_stream(self.device).wait_stream(self.stream)

    def synchronize(self) -> None:
        """The host waits for every copy issued so far."""
        if self.cuda:
            self.stream.synchronize()
            self.down_stream.synchronize()

    def close(self) -> None:
        """Unpin what this link pinned (the copies have completed first)."""
        self.synchronize()
        self._unpin()

    def counted(self) -> dict[str, int]:
        return {"down": self.bytes_down, "up": self.bytes_up}

    def staging_bytes(self) -> int:
        return sum(s[0].untyped_storage().nbytes() for s in self._slots if s[0] is not None)


def _register(t: torch.Tensor) -> None:
    """Page-lock ``t``'s memory for asynchronous copies (CUDA only)."""
    error = int(torch.cuda.cudart().cudaHostRegister(t.data_ptr(), t.untyped_storage().nbytes(), 0))
    if error:
        raise RuntimeError(f"offload: pinning {t.untyped_storage().nbytes()} bytes of host memory failed "
                           f"(cudaHostRegister error {error}): the host may lack the memory, or the locked-memory "
                           f"limit (ulimit -l) is too low")


def _unregister_all(tensors: list[torch.Tensor], streams: list) -> None:
    if tensors:
        for stream in streams:
            stream.synchronize()
    for t in tensors:
        torch.cuda.cudart().cudaHostUnregister(t.data_ptr())
    tensors.clear()


class Arriving:
    """A host buffer that a device -> host copy is filling: :meth:`read` waits for the copy (on a
    CPU device it makes the copy, after the collective that writes the source)."""

    def __init__(self, host: torch.Tensor, done, source: torch.Tensor | None = None, after=None):
        self.host, self.done, self._source, self._after = host, done, source, after

    def read(self) -> torch.Tensor:
        if self.done is not None:
            self.done.synchronize()
            self.done = None
        if self._source is not None:
            if self._after is not None:
                self._after.wait()
            self.host.copy_(self._source)
            self._source = self._after = None
        return self.host
