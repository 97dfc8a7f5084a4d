"""A text corpus tokenized once, in parallel, into sharded memory-mapped id files.

``data.cache_dir/tok-KEY/`` holds ``shard-NNNNN.bin`` (the ids of consecutive documents: uint8 for
bytes, uint16 for vocabularies up to 65536, else uint32), one ``shard-NNNNN.json`` each (its token count and
SHA-256, written after the shard, so a shard without one is unfinished) and ``manifest.json``
(written last: the corpus is complete). KEY is a digest of the content: every file's bytes and
path under the source, the tokenizer file's bytes, ``data.text_field`` and ``data.max_bytes``: the
same text with the same tokenizer is tokenized once wherever it lies, and an edit makes a new
corpus. File digests are remembered by (path, size, mtime) so an unchanged corpus is not read again
to find its key.

Building: documents are read in order and cut into shards of about ``shard_bytes`` of text; a pool
of processes tokenizes them, each writing its shard atomically. An interrupted build resumes: a
shard whose marker matches the text it would hold (and whose file matches its checksum) is kept.
One process builds while others wait on a file lock (``bigtrain train`` builds in the launcher
before the ranks start; ranks under another launcher take turns, the first builds, the rest find
it). :func:`verify` re-reads every shard against its checksum (the launcher does, once a launch).

:class:`ShardedTokens` maps the shards as one sequence of ids for the sampler: slices are views,
and ``np.asarray`` of a slice reads across shard boundaries.
"""

from __future__ import annotations

import errno
import fcntl
import hashlib
import json
import multiprocessing
import os
from collections import deque
from collections.abc import Iterator
from concurrent.futures import Future, ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from pathlib import Path

import numpy as np

from bigtrain.data.corpus import key_bytes, temp_beside
from bigtrain.data.documents import Documents
from bigtrain.data.tokenizer import document_end_id, file_digest, ids_dtype, load_tokenizer

# 2: tokenizer.json files read without their truncation and padding, ids sized by the largest.
# 3: special-token text in a document ("<|endoftext|>" quoted on a web page) encoded as ordinary text,
# not as the special id: a format-2 corpus of a tokenizer.json may hold ids its documents' text injected.
# FORMAT is in the key, so such a corpus is tokenized again under a new folder (the old one is not read).
# (Also 3: a .json data.source is read as records, where format 2 read it as one document of JSON text.)
FORMAT = 3
SHARD_BYTES = 32 << 20  # text per shard: a worker's unit of work and of resumption
# Text encoded at a time within a shard: a tokenizers Encoding keeps strings, offsets and masks for
# every token (a 32 MB shard encoded in one call peaked at 2.0 GB in its worker), so each group's
# ids are narrowed to the shard's dtype and its encodings freed before the next group is encoded.
ENCODE_BYTES = 1 << 20
MANIFEST = "manifest.json"
DIGESTS = "file-digests.json"


class CorpusError(ValueError):
    """A tokenized corpus that is damaged or cannot be built; the message says what to do."""


# -- the content key ------------------------------------------------------------------------------
def file_digests(files: list[Path], cache: Path) -> list[str]:
    """SHA-256 of each file, remembered in ``cache/file-digests.json`` by (path, size, mtime)."""
    memo_path = cache / DIGESTS
    try:
        memo = json.loads(memo_path.read_text())
    except (OSError, ValueError):
        memo = {}
    out, changed = [], False
    for f in files:
        st = f.stat()
        stamp = [st.st_size, st.st_mtime_ns]
        entry = memo.get(str(f.absolute()))
        if not (isinstance(entry, list) and entry[:2] == stamp):
            entry, changed = stamp + [file_digest(f)], True
            memo[str(f.absolute())] = entry
        out.append(entry[2])
    if changed:
        _write_text(memo_path, json.dumps(memo))
    return out


def corpus_key(source: Path, files: list[Path], tokenizer_digest: str, text_field: str, max_bytes: int,
               cache: Path, document_end: str = "", json_records: bool = False) -> str:
    # (document_end only when set: unset, a corpus keeps the key it had without the field. "once":
    # since a tokenizer that ends each document with that token itself no longer gets it twice; a
    # corpus cached before then may hold two ends a document, and is not reused. json_records: a
    # .json file named as the source is records, the same file in a folder named as the source is
    # text, and both have the same relative path and bytes.)
    end = f"|end={document_end!r} once" if document_end else ""
    end += "|json-records" if json_records else ""
    h = hashlib.sha256(f"bigtrain-corpus {FORMAT}|{tokenizer_digest}|{text_field}|{max_bytes}{end}".encode())
    root = source if source.is_dir() else source.parent
    for f, digest in zip(files, file_digests(files, cache)):
        h.update(key_bytes(f"|{f.relative_to(root).as_posix()}:{digest}"))
    return h.hexdigest()[:20]


# -- files ----------------------------------------------------------------------------------------
def _write_text(path: Path, text: str) -> None:
    tmp = temp_beside(path)  # unique across machines sharing the cache
    tmp.write_text(text)
    os.replace(tmp, path)


def _write_ids(path: Path, ids: np.ndarray) -> str:
    tmp = temp_beside(path)  # unique across machines sharing the cache
    ids.tofile(tmp)
    os.replace(tmp, path)
    return hashlib.sha256(ids.tobytes()).hexdigest()


def shard_name(index: int) -> str:
    return f"shard-{index:05d}"


# -- building -------------------------------------------------------------------------------------
def _text_batches(docs: Iterator[str], shard_bytes: int) -> Iterator[list[str]]:
    batch, size = [], 0
    for text in docs:
        if not text:
            continue
        batch.append(text)
        size += len(text)
        if size >= shard_bytes:
            yield batch
            batch, size = [], 0
    if batch:
        yield batch


def _texts_digest(texts: list[str]) -> str:
    h = hashlib.sha256()
    for t in texts:
        data = t.encode("utf-8")
        h.update(len(data).to_bytes(8, "little"))
        h.update(data)
    return h.hexdigest()


_WORKER_TOKENIZERS: dict[str, object] = {}  # per process: each worker loads the tokenizer once


def _tokenize_shard(spec: str, folder: str, index: int, texts: list[str], text_digest: str,
                    end: int | None = None) -> dict:
    """Tokenize one shard's documents (each followed by the id ``end``, when given) and write its
    ids and marker (runs in a worker)."""
    tokenizer = _WORKER_TOKENIZERS.get(spec) or _WORKER_TOKENIZERS.setdefault(spec, load_tokenizer(spec))
    dtype = ids_dtype(tokenizer.vocab_size)
    encoded = []
    for group in _groups(texts, ENCODE_BYTES):
        encoded += [ids.astype(dtype) for ids in tokenizer.encode_batch(group)]  # ids < vocab_size: no wrap
    if end is not None:  # appended as an id: as text it could merge with the document's last characters
        encoded = [np.append(ids, np.asarray(end, dtype)) for ids in encoded]
    ids = np.concatenate(encoded) if encoded else np.zeros(0, dtype)
    name = shard_name(index)
    sha = _write_ids(Path(folder) / f"{name}.bin", ids)
    marker = {"tokens": int(len(ids)), "sha256": sha, "text_sha256": text_digest, "documents": len(texts)}
    _write_text(Path(folder) / f"{name}.json", json.dumps(marker))
    return marker


def _groups(texts: list[str], size: int) -> Iterator[list[str]]:
    """``texts`` in order, in consecutive groups of about ``size`` characters (a longer text alone)."""
    group, chars = [], 0
    for text in texts:
        if group and chars + len(text) > size:
            yield group
            group, chars = [], 0
        group.append(text)
        chars += len(text)
    if group:
        yield group


def end_added_by_tokenizer(tokenizer, end: int) -> bool:
    """Whether ``tokenizer`` itself puts the id ``end`` last in every document (a post-processor such
    as ``$A </s>``): data.document_end naming that token then gave each document two of them."""
    trailing = tokenizer.frame_ids()[1]
    return bool(trailing) and trailing[-1] == end


def _worker_init() -> None:
    # One thread per worker process: the pool is the parallelism (and a forked tokenizers library
    # that already used its thread pool would warn and fall back anyway).
    os.environ["TOKENIZERS_PARALLELISM"] = "false"


def _finished_shard(folder: Path, index: int, text_digest: str, itemsize: int) -> dict | None:
    """The marker of a shard an earlier build finished from the same text, when its file is intact."""
    name = shard_name(index)
    try:
        marker = json.loads((folder / f"{name}.json").read_text())
        path = folder / f"{name}.bin"
        if (marker.get("text_sha256") == text_digest and path.stat().st_size == marker["tokens"] * itemsize
                and file_digest(path) == marker["sha256"]):
            return marker
    except (OSError, ValueError, KeyError, TypeError):
        pass
    return None


def build(folder: Path, files: list[Path], spec: str, text_field: str, max_bytes: int, source: str,
          workers: int = 0, shard_bytes: int = SHARD_BYTES, log=None, document_end: str = "",
          json_records: bool = False) -> dict:
    """Tokenize ``files`` into ``folder`` (resuming what an earlier build finished); returns the
    manifest. ``workers``: processes (0: one per CPU this process may use); ``document_end``: the
    token put after each document (data.document_end); ``json_records``: the source is one .json
    file of records (:func:`~bigtrain.data.documents.json_records_source`)."""
    tokenizer = load_tokenizer(spec)
    end = document_end_id(tokenizer, document_end)
    added_by_tokenizer = end is not None and end_added_by_tokenizer(tokenizer, end)
    if added_by_tokenizer:
        end = None  # its post-processor puts it after each document already: once is the field's meaning
        if log:
            log(f"bigtrain: data.document_end = {document_end!r}: data.tokenizer already ends every document with "
                f"it (its post-processor), so it is not put there a second time")
    dtype = ids_dtype(tokenizer.vocab_size)
    folder.mkdir(parents=True, exist_ok=True)
    workers = workers or len(os.sched_getaffinity(0))
    if multiprocessing.current_process().daemon:  # a daemonic process may not start children: tokenize here
        workers = 1
    # An executor, not multiprocessing.Pool: a Pool replaces a worker the system killed (out of memory on
    # a long document) and waits for its shard forever, the launcher silent; the executor says it broke.
    context = multiprocessing.get_context("fork")
    pool = ProcessPoolExecutor(workers, mp_context=context, initializer=_worker_init) if workers > 1 else None
    markers: dict[int, dict] = {}
    pending: deque = deque()
    kept = 0
    docs = Documents(files, text_field, max_bytes, json_records)
    try:
        for index, texts in enumerate(_text_batches(docs, shard_bytes)):
            digest = _texts_digest(texts)
            done = _finished_shard(folder, index, digest, dtype.itemsize)
            if done is not None:
                markers[index], kept = done, kept + 1
                continue
            args = (spec, str(folder), index, texts, digest, end)
            if pool is None:
                markers[index] = _tokenize_shard(*args)
                continue
            pending.append((index, max(map(len, texts)), pool.submit(_tokenize_shard, *args)))
            while len(pending) >= 2 * workers:  # bounded: the text of at most 2 shards a worker in memory
                i, longest, result = pending.popleft()
                markers[i] = _shard_result(result, i, longest)
        while pending:
            i, longest, result = pending.popleft()
            markers[i] = _shard_result(result, i, longest)
    except BaseException:
        if pool is not None:
            _stop_now(pool)
        raise
    finally:
        if pool is not None:
            pool.shutdown(wait=True, cancel_futures=True)
    shards = [{"file": f"{shard_name(i)}.bin", "tokens": markers[i]["tokens"], "sha256": markers[i]["sha256"]}
              for i in sorted(markers)]
    manifest = {"format": FORMAT, "dtype": dtype.name, "vocab_size": tokenizer.vocab_size, "tokenizer": spec,
                "tokenizer_sha256": tokenizer.digest, "text_field": text_field, "max_bytes": max_bytes,
                "document_end": document_end, "document_end_by_tokenizer": added_by_tokenizer,
                "source": source, "files": len(files), "documents": sum(m["documents"] for m in markers.values()),
                "tokens": sum(s["tokens"] for s in shards), "shards": shards, "resumed_shards": kept,
                "cut_at_max_bytes": docs.cut, "not_utf8_files": len(docs.not_utf8), "not_utf8": docs.not_utf8[:5]}
    _write_text(folder / MANIFEST, json.dumps(manifest, indent=1))
    if log:
        log(f"bigtrain: tokenized {manifest['documents']:,} document{'s' if manifest['documents'] != 1 else ''} into {manifest['tokens']:,} tokens "
            f"({len(shards)} shard{'s' if len(shards) != 1 else ''}{f', {kept} kept from an earlier build' if kept else ''}) "
            f"in {folder}")
    return manifest


def _shard_result(result: Future, index: int, longest: int) -> dict:
    """The marker of a shard a worker tokenized; a worker that died (killed: out of memory?) is said."""
    try:
        return result.result()
    except BrokenProcessPool:
        raise CorpusError(f"a process tokenizing the corpus died (shard {index}, whose longest document is "
                          f"{longest:,} characters; killed by the system, out of memory?): a tokenizer holds "
                          f"about a hundred times a document's text while it encodes it, so give long texts as "
                          f"several documents (files, or JSON Lines: one document a line)") from None


def _stop_now(pool: ProcessPoolExecutor) -> None:
    """Stop the workers at once (an error, Ctrl-C): shutdown() alone lets each finish its shard."""
    pool.shutdown(wait=False, cancel_futures=True)
    terminate = getattr(pool, "terminate_workers", None)  # Python 3.14
    if terminate is not None:
        terminate()
        return
    for process in list((getattr(pool, "_processes", None) or {}).values()):
        process.terminate()


def read_manifest(folder: Path) -> dict | None:
    try:
        manifest = json.loads((folder / MANIFEST).read_text())
    except (OSError, ValueError):
        return None
    return manifest if isinstance(manifest, dict) and manifest.get("format") == FORMAT else None


def verify(folder: Path, manifest: dict) -> None:
    """Every shard against its size and checksum; raises CorpusError naming the first bad one."""
    itemsize = np.dtype(manifest["dtype"]).itemsize
    for shard in manifest["shards"]:
        path = folder / shard["file"]
        try:
            ok = path.stat().st_size == shard["tokens"] * itemsize and file_digest(path) == shard["sha256"]
        except OSError:
            ok = False
        if not ok:
            raise CorpusError(f"the tokenized corpus {folder} is damaged ({shard['file']} does not match its "
                              f"checksum); delete that folder and it is tokenized again")


def prepared(folder: Path, files: list[Path], spec: str, text_field: str, max_bytes: int, source: str,
             check: bool = False, log=None, **build_args) -> dict:
    """The manifest of the corpus in ``folder``, built first (under a file lock) if it is not
    complete; ``check`` re-verifies an existing corpus's checksums."""
    folder.parent.mkdir(parents=True, exist_ok=True)
    manifest = read_manifest(folder)
    if manifest is not None:
        if check:
            verify(folder, manifest)
        return manifest
    with open(folder.parent / f"{folder.name}.lock", "w") as lock:
        try:
            fcntl.flock(lock, fcntl.LOCK_EX)  # one builder; the others wait and find it built
        except OSError as e:
            # A filesystem without flock (some network ones, shared by several machines): every
            # process builds. Safe, only slower: the same text gives the same files, each written
            # under a name of its own and renamed into place (temp_beside), the manifest last.
            if e.errno not in (errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOSYS, errno.EINVAL):
                raise
        manifest = read_manifest(folder)
        if manifest is None:
            if log:
                log(f"bigtrain: tokenizing {source} with {spec} (once; cached in {folder})")
            manifest = build(folder, files, spec, text_field, max_bytes, source, log=log, **build_args)
        return manifest


# -- reading --------------------------------------------------------------------------------------
class ShardedTokens:
    """The shards of a corpus as one 1-D sequence of ids: ``len``, slices (views, no copy) and
    ``np.asarray`` (which reads the ids of the view, across shard boundaries)."""

    def __init__(self, shards: list[np.ndarray], start: int = 0, stop: int | None = None):
        self._shards = [s for s in shards if len(s)]
        self._ends = np.cumsum([len(s) for s in self._shards], dtype=np.int64)
        total = int(self._ends[-1]) if len(self._ends) else 0
        self.start, self.stop = start, total if stop is None else stop
        self.dtype = self._shards[0].dtype if self._shards else np.dtype(np.uint16)

    @classmethod
    def open(cls, folder: Path, manifest: dict) -> "ShardedTokens":
        dtype = np.dtype(manifest["dtype"])
        maps = []
        for shard in manifest["shards"]:
            path = folder / shard["file"]
            size = path.stat().st_size if path.exists() else -1
            if size != shard["tokens"] * dtype.itemsize:
                raise CorpusError(f"the tokenized corpus {folder} is damaged ({shard['file']} has {size} bytes, its "
                                  f"manifest says {shard['tokens'] * dtype.itemsize}); delete that folder and it is "
                                  f"tokenized again")
            if shard["tokens"]:
                maps.append(np.memmap(path, dtype=dtype, mode="r"))
        return cls(maps)

    def __len__(self) -> int:
        return self.stop - self.start

    def __getitem__(self, key):
        if isinstance(key, slice):
            first, last, step = key.indices(len(self))
            if step != 1:
                raise ValueError("ShardedTokens slices with step 1 only")
            return self._view(self.start + first, self.start + max(first, last))
        index = int(key) + (len(self) if int(key) < 0 else 0)
        if not 0 <= index < len(self):
            raise IndexError(key)
        return self._read(self.start + index, self.start + index + 1)[0]

    def _view(self, start: int, stop: int) -> "ShardedTokens":
        view = object.__new__(ShardedTokens)
        view._shards, view._ends, view.dtype = self._shards, self._ends, self.dtype
        view.start, view.stop = start, stop
        return view

    def _read(self, start: int, stop: int) -> np.ndarray:
        parts = []
        shard = int(np.searchsorted(self._ends, start, side="right"))
        while start < stop:
            begin = int(self._ends[shard - 1]) if shard else 0
            take = min(stop, int(self._ends[shard])) - start
            parts.append(np.asarray(self._shards[shard][start - begin:start - begin + take]))
            start += take
            shard += 1
        if not parts:
            return np.zeros(0, self.dtype)
        return np.concatenate(parts) if len(parts) > 1 else parts[0]

    def __array__(self, dtype=None, copy=None) -> np.ndarray:
        out = self._read(self.start, self.stop) if len(self) else np.zeros(0, self.dtype)
        return out.astype(dtype, copy=False) if dtype is not None else out
