"""torch.distributed.checkpoint (DCP) with chunks we name ourselves.

Saving: each rank hands :func:`save_chunks` the rectangles of full tensors it owns
(:class:`~bigtrain.parallel.chunks.SavedChunk`: entry name, full shape, offsets, a view of its data). A
:class:`DefaultSavePlanner` subclass turns them into one ``WriteItem`` each (``SHARD`` with a
``ChunkStorageMetadata``), so DCP's own global planning merges every rank's chunks into one
entry per tensor with its full shape, and its validation rejects overlapping chunks and chunks
that do not cover the tensor. The writer resolves one item at a time (copying only a view that
does not own its storage), so a rank holds its shards plus one chunk's buffer. A chunk kept in
offload's files (``SavedChunk.readable``) is read back in, its unit at a time, when it is resolved.

Loading: :class:`ChunkReader` reads the metadata once; :meth:`ChunkReader.read` takes the
rectangles a rank needs with the tensors to fill, and DCP's resharding helper
(``create_read_items_for_chunk_list``) finds the overlapping saved chunks. Each call is one
``dcp.load`` with ``no_dist=True``: loading needs no collective, so every rank reads its own
batches at its own pace, a bounded batch (one ZeRO unit, one parameter) at a time.
"""

from __future__ import annotations

import warnings
from contextlib import contextmanager, nullcontext
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter
from torch.distributed.checkpoint.default_planner import DefaultSavePlanner
from torch.distributed.checkpoint.metadata import (ChunkStorageMetadata, Metadata, MetadataIndex,
                                                   TensorProperties, TensorStorageMetadata)
from torch.distributed.checkpoint.planner import (LoadPlan, LoadPlanner, ReadItem, SavePlan, TensorWriteData,
                                                  WriteItem, WriteItemType)
from torch.distributed.checkpoint.planner_helpers import create_read_items_for_chunk_list

from bigtrain.parallel.chunks import SavedChunk

_NO_GROUP = "torch.distributed is disabled, unavailable or uninitialized"


@contextmanager
def _one_process():
    """DCP warns when it runs without a process group: here one process (or a rank reading on its
    own) is the intent, not a forgotten ``init_process_group``."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=_NO_GROUP)
        yield


class _ChunkSavePlanner(DefaultSavePlanner):
    """DCP's default planning (dedup, global metadata, validation) over chunks we list ourselves."""

    def __init__(self, chunks: list[SavedChunk]):
        super().__init__(flatten_state_dict=False, flatten_sharded_tensors=False)
        self._data = {}
        self._items = []
        self._window = self._window_of = self._last = None  # a chunk read back in: see resolve_data
        for c in chunks:
            offsets = torch.Size(c.offsets)
            key = (c.fqn, tuple(offsets))
            if key in self._data:
                raise ValueError(f"checkpoint: two chunks of {c.fqn} at {c.offsets} on one rank")
            self._data[key] = c
            self._items.append(WriteItem(
                index=MetadataIndex(c.fqn, offsets),
                type=WriteItemType.SHARD if c.shape else WriteItemType.TENSOR,
                tensor_data=TensorWriteData(chunk=ChunkStorageMetadata(offsets=offsets, sizes=c.data.shape),
                                            properties=TensorProperties.create_from_tensor(c.data),
                                            size=torch.Size(c.shape))))

    def create_local_plan(self) -> SavePlan:
        self.plan = SavePlan(self._items)
        return self.plan

    def resolve_data(self, write_item: WriteItem) -> torch.Tensor:
        chunk = self._data[(write_item.index.fqn, tuple(write_item.index.offset))]
        if chunk.readable is None:
            return _exact_storage(chunk.data)
        # Offload's files: the chunk's unit read back in (the last one's back to its files) and the
        # chunk copied out of it; the last copy's bytes are given back, as the serial loader asks
        # for an item only once the one before is written (save_chunks: no copy-ahead).
        if self._last is not None:
            self._last.untyped_storage().resize_(0)
        if self._window_of is not chunk.readable:
            self.close()
            self._window, self._window_of = chunk.readable(), chunk.readable
            self._window.__enter__()
        self._last = chunk.data.clone()
        return self._last

    def close(self) -> None:
        """The last unit read back in goes back to its files."""
        if self._window is not None:
            window, self._window, self._window_of = self._window, None, None
            window.__exit__(None, None, None)
        self._last = None


_NUMPY_FREE = {torch.bfloat16: torch.int16}  # dtypes numpy lacks: aliased through a same-size integer


def _exact_storage(view: torch.Tensor) -> torch.Tensor:
    """The same bytes as the contiguous CPU ``view``, as a tensor whose storage is exactly them (no
    copy: numpy aliases the memory and keeps ``view`` alive). FileSystemWriter clones a tensor whose
    storage is larger than itself, and in torch 2.13 it keeps every tensor it wrote to a file
    (``tensor_dict``, for its safetensors branch) until the file is closed: clones of views would
    add up to the whole shard. Aliases cost nothing."""
    if view.device.type != "cpu" or not view.is_contiguous() or view.untyped_storage().nbytes() == view.nbytes:
        return view
    as_int = _NUMPY_FREE.get(view.dtype)
    if as_int is not None:
        return torch.from_numpy(view.view(as_int).numpy()).view(view.dtype)
    return torch.from_numpy(view.numpy())


def save_chunks(path: Path, chunks: list[SavedChunk], process_group=None) -> Metadata:
    """Write this rank's ``chunks`` into ``path``; a collective over ``process_group`` (the default
    group) when torch.distributed is initialized with more than one rank. On return every rank's
    files and the ``.metadata`` are written (the coordinator writes it after all ranks report)."""
    no_dist = not dist.is_initialized() or dist.get_world_size(process_group) == 1
    # Chunks read back in from offload's files as they are written must be resolved one at a time
    # (with CUDA, DCP's default loader resolves 10 MB of items ahead of the write).
    ahead = 0 if any(c.readable is not None for c in chunks) else 10_000_000
    writer = FileSystemWriter(path, single_file_per_rank=True, sync_files=True, thread_count=1,
                              per_thread_copy_ahead=ahead)
    planner = _ChunkSavePlanner(chunks)
    try:
        with _one_process() if no_dist else nullcontext():
            return dcp.save({}, storage_writer=writer, planner=planner,
                            process_group=None if no_dist else process_group, no_dist=no_dist)
    finally:
        planner.close()


class _ChunkLoadPlanner(LoadPlanner):
    """Reads the requested rectangles into the given tensors (views into the rank's shards)."""

    def __init__(self, requests: list[tuple[str, tuple[int, ...], torch.Tensor]]):
        self.requests = requests

    def set_up_planner(self, state_dict, metadata=None, is_coordinator=False) -> None:
        self.metadata = metadata

    def create_local_plan(self) -> LoadPlan:
        by_fqn: dict[str, list] = {}
        self.dest = {}
        for fqn, offsets, tensor in self.requests:
            by_fqn.setdefault(fqn, []).append(ChunkStorageMetadata(torch.Size(offsets), tensor.shape))
            self.dest[(fqn, tuple(offsets))] = tensor
        items: list[ReadItem] = []
        for fqn, wanted in by_fqn.items():
            items += create_read_items_for_chunk_list(fqn, self.metadata.state_dict_metadata[fqn], wanted)
        return LoadPlan(items)

    def create_global_plan(self, global_plan: list[LoadPlan]) -> list[LoadPlan]:
        return global_plan

    def finish_plan(self, central_plan: LoadPlan) -> LoadPlan:
        return central_plan

    def load_bytes(self, read_item, value) -> None:
        raise RuntimeError(f"sharded checkpoint: unexpected bytes entry {read_item.dest_index.fqn}")

    def resolve_tensor(self, read_item: ReadItem) -> torch.Tensor:
        dest = self.dest[(read_item.dest_index.fqn, tuple(read_item.dest_index.offset))]
        for dim, (start, length) in enumerate(zip(read_item.dest_offsets, read_item.lengths)):
            dest = dest.narrow(dim, start, length)
        return dest

    def commit_tensor(self, read_item: ReadItem, tensor: torch.Tensor) -> None:
        pass  # resolve_tensor handed out a view of the destination: already in place


class _CachedReader(FileSystemReader):
    def __init__(self, path: Path):
        super().__init__(path)
        self._metadata = None

    def read_metadata(self, *args, **kwargs) -> Metadata:
        if self._metadata is None:
            self._metadata = super().read_metadata(*args, **kwargs)
        return self._metadata


class ChunkReader:
    """Reads rectangles of a DCP checkpoint's tensors, a batch at a time, with no collectives."""

    def __init__(self, path: Path):
        self.path = Path(path)
        self._reader = _CachedReader(self.path)
        self.metadata = self._reader.read_metadata()

    @property
    def entries(self) -> dict[str, TensorStorageMetadata]:
        return {k: v for k, v in self.metadata.state_dict_metadata.items() if isinstance(v, TensorStorageMetadata)}

    def has(self, fqn: str) -> bool:
        return fqn in self.metadata.state_dict_metadata

    def shape(self, fqn: str) -> tuple[int, ...]:
        return tuple(self._entry(fqn).size)

    def _entry(self, fqn: str) -> TensorStorageMetadata:
        entry = self.metadata.state_dict_metadata.get(fqn)
        if entry is None:
            raise KeyError(f"checkpoint {self.path} has no entry {fqn!r} (saved from another model?)")
        return entry

    def empty(self, fqn: str) -> torch.Tensor:
        """An uninitialized tensor shaped and typed like the whole saved entry (for small ones)."""
        entry = self._entry(fqn)
        return torch.empty(entry.size, dtype=entry.properties.dtype)

    def read(self, requests: list[tuple[str, tuple[int, ...], torch.Tensor]]) -> None:
        """Fill each ``(fqn, offsets, tensor)``: the rectangle of entry ``fqn`` at ``offsets`` shaped
        like ``tensor`` is copied into it (a view into the caller's storage, usually)."""
        for fqn, offsets, tensor in requests:
            size = self._entry(fqn).size
            if len(offsets) != len(size) or any(o + s > n for o, s, n in zip(offsets, tensor.shape, size)):
                raise ValueError(f"checkpoint {self.path}: entry {fqn!r} has shape {tuple(size)}, which has no "
                                 f"chunk {tuple(tensor.shape)} at {tuple(offsets)} (saved from another model?)")
        if requests:
            with _one_process():
                dcp.load({}, storage_reader=self._reader, planner=_ChunkLoadPlanner(requests), no_dist=True)
