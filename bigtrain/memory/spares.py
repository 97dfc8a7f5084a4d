"""Spare buffers: the bytes of a storage being freed, kept for the next storage of the same size.

A host storage of 1 MiB or more freed goes back to the OS (:func:`bigtrain.memory.swap._free_to_the_os`
fixes glibc's mmap threshold so the offload files free memory), so the next one of that size gets new
pages, which the kernel zeroes and faults in one by one. Where the same sizes are freed and allocated
over and over (a unit written to its file and the next read in; ZeRO-3's gathered blocks, each
layer's the same size), the freed bytes are moved to a spare storage instead and the next storage
of that size takes them, its pages still mapped (DeepSpeed's fixed pool of staging buffers, without
re-pointing any tensor: the storage object stays, so every view of it, autograd's saved ones
included, stays valid; only its bytes change). Whoever keeps spares bounds them (``limit``) and drops
them when memory must be given back.

Moving bytes between storages needs ``UntypedStorage._swap_data_ptr_`` (torch 2.13; the GPU image's
2.11 lacks it): without it a storage taken is freed and one given gets new bytes, as before the spares.
"""

from __future__ import annotations

import threading

import torch

CAN_MOVE_BYTES = hasattr(torch.UntypedStorage, "_swap_data_ptr_")


class SpareBuffers:
    """Spare bytes by size, at most ``limit`` bytes of them (a thread may take while another gives)."""

    def __init__(self, limit: int = 0):
        self.limit = limit
        self._spares: dict[int, list[torch.UntypedStorage]] = {}
        self._lock = threading.Lock()

    def give(self, storage: torch.UntypedStorage, nbytes: int) -> None:
        """Give ``storage`` (holding none) ``nbytes`` bytes: a spare of that size if there is one (its
        pages mapped already), else new ones. Its values are whatever they were."""
        with self._lock:
            spares = self._spares.get(nbytes)
            spare = spares.pop() if spares else None
        if spare is None:
            storage.resize_(nbytes)
        else:  # the storage object stays (every view of it stays valid): only its bytes change
            storage._swap_data_ptr_(spare)

    def take(self, storage: torch.UntypedStorage, limit: int | None = None) -> None:
        """Take ``storage``'s bytes (it holds none after): kept as a spare while the spares stay within
        ``limit`` (``self.limit`` if None), else freed."""
        nbytes = storage.nbytes()
        if not nbytes:
            return
        limit = self.limit if limit is None else limit
        if not CAN_MOVE_BYTES or limit < nbytes or storage.device.type != "cpu":
            storage.resize_(0)
            return
        spare = torch.UntypedStorage(0)
        storage._swap_data_ptr_(spare)
        with self._lock:
            if sum(n * len(v) for n, v in self._spares.items()) + nbytes <= limit:
                self._spares.setdefault(nbytes, []).append(spare)
                return
        del spare  # over the limit: freed (its pages unmapped)

    def drop(self) -> None:
        """Free every spare (to the OS for blocks of 1 MiB or more)."""
        with self._lock:
            self._spares.clear()

    @property
    def nbytes(self) -> int:
        with self._lock:
            return sum(n * len(spares) for n, spares in self._spares.items())
