"""Byte-level corpora and pre-tokenized files.

The default corpus needs no download: this machine's Python standard library sources, as bytes
(vocabulary 256), cached once as a flat token file that is memory-mapped afterwards. A user's text
file or folder is read the same way with ``data.tokenizer = "bytes"``; pre-tokenized ``.bin``
(uint16) and ``.npy`` files are mapped as they are. Text through a real tokenizer, and JSON Lines or
Parquet records, go through :mod:`bigtrain.data.shards` instead (:mod:`bigtrain.data.load` decides).
"""

from __future__ import annotations

import hashlib
import os
import sys
import sysconfig
import uuid
from pathlib import Path

import numpy as np

COPY_BLOCK = 1 << 20  # bytes read at a time into a byte corpus
TEXT_SUFFIXES = (".py", ".txt", ".md", ".rst", ".c", ".h", ".json", ".toml", ".cfg", ".html")


def cache_path(cache_dir: str = "") -> Path:
    """The folder of cached corpora (``data.cache_dir``), not created."""
    return Path(os.path.expanduser(cache_dir)) if cache_dir else Path.home() / ".cache" / "bigtrain"


def cache_root(cache_dir: str = "") -> Path:
    root = cache_path(cache_dir)
    root.mkdir(parents=True, exist_ok=True)
    return root


def text_files(source: Path) -> list[Path]:
    if source.is_file():
        return [source]
    return [p for p in folder_files(source) if p.suffix in TEXT_SUFFIXES]


def folder_files(folder: Path) -> list[Path]:
    """Every file under ``folder``, in path order, through linked folders too (each real folder
    once, so a link to an ancestor ends). Path.rglob does not enter a linked folder: a corpus put
    together from links (``ln -s /data/wiki corpus/wiki``) trained on none of their files, and the
    left-out files' warning did not see them either."""
    found, seen = [], set()
    for top, subfolders, names in os.walk(folder, followlinks=True):
        real = os.path.realpath(top)
        if real in seen:
            subfolders[:] = []
            continue
        seen.add(real)
        subfolders.sort()  # which of two links to one folder is read must not depend on the listing's order
        found += [p for p in (Path(top) / n for n in names) if p.is_file()]
    return sorted(found)


def stdlib_files() -> list[Path]:
    """The standard library's own .py files (not site-packages, not its test suite), in a fixed order.

    The walk skips those folders instead of listing them: an interpreter's site-packages can hold
    tens of thousands of files (43,000 on the machine this was measured on: 0.47 s of CPU a call,
    paid by every rank that found the corpus not cached yet). The names are matched below the
    library's folder only, so a Python installed under a folder called ``test`` keeps its library."""
    root = Path(sysconfig.get_paths()["stdlib"])
    found = []
    for folder, subfolders, names in os.walk(root):
        subfolders[:] = [d for d in subfolders if d not in ("site-packages", "test")]
        found += [Path(folder) / n for n in names if n.endswith(".py")]
    return sorted(found)


def temp_beside(path: Path) -> Path:
    """A name beside ``path`` to write it under before renaming it into place, which no other writer
    uses: a cache folder may be shared by several machines (a home directory on NFS), whose
    processes can have the same pid (containers number theirs alike). Two writers of one temporary
    file truncated each other's bytes, and the second rename found nothing (or a reader mapped a
    corpus cut short)."""
    return path.with_name(f".{path.name}.tmp-{uuid.uuid4().hex}")


def _cache_name(key: str, max_bytes: int) -> str:
    return f"bytes-{hashlib.sha1(key_bytes(f'{key}|{max_bytes}')).hexdigest()[:16]}.u8"


def key_bytes(key: str) -> bytes:
    """A cache key holding file paths, as bytes: a file name that is not UTF-8 (an old archive's
    Latin-1 'caf\\xe9.txt') is a str with surrogates, which .encode() refused with a traceback naming
    no file; surrogateescape gives back its bytes, and any other key the UTF-8 it had."""
    return key.encode("utf-8", "surrogateescape")


def cached_corpus(key: str, cache_dir: str, max_bytes: int) -> Path:
    """Where the byte corpus of ``key`` (:func:`files_key`, :func:`stdlib_key`) is cached."""
    return cache_path(cache_dir) / _cache_name(key, max_bytes)


def stdlib_key() -> str:
    # The installed standard library does not change under a given interpreter: key the cache on
    # it instead of stat-ing a thousand files at every start.
    return f"stdlib:{sys.version}:{sysconfig.get_paths()['stdlib']}"


def token_dtype_problem(dtype: np.dtype) -> str | None:
    """Why an array of ``dtype`` cannot hold token ids (None when it can): ids are integers, and
    casting floats, complex numbers or booleans to them would train on something else, silently."""
    if dtype.kind in "ui" and dtype.fields is None:
        return None
    return (f"holds {dtype} values, not integer token ids; save the ids as integers "
            f"(np.uint16 for vocabularies up to 65536, np.int32 above)")


def files_key(files: list[Path]) -> str:
    """Every file's path, size and modification time: an edit invalidates the cache."""
    return ";".join(f"{f}:{f.stat().st_size}:{f.stat().st_mtime_ns}" for f in files)


def build_byte_corpus(files: list[Path], cache: Path, max_bytes: int, key: str | None = None) -> Path:
    """Concatenate files as bytes into a cached uint8 token file; reuse it if present. The cache
    is named by ``key`` when given, else by :func:`files_key`."""
    if not files:
        raise ValueError(f"data.source: no text files found (looked for {', '.join(TEXT_SUFFIXES)})")
    path = cache / _cache_name(key if key is not None else files_key(files), max_bytes)
    if path.exists():
        return path
    # Copied a block at a time into a file renamed into place: the files held in memory and joined
    # took twice the corpus (a 256 MB folder peaked at 541 MB; data.max_bytes = 0 on a 20 GB one, 40 GB).
    tmp, total = temp_beside(path), 0
    try:
        with open(tmp, "wb") as out:
            for f in files:
                with open(f, "rb") as src:
                    while block := src.read(min(COPY_BLOCK, max_bytes - total) if max_bytes else COPY_BLOCK):
                        out.write(block)
                        total += len(block)
                if max_bytes and total >= max_bytes:
                    break
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)  # (renamed away: nothing left to remove)
    return path


def load_token_file(source: str) -> np.ndarray:
    """A pre-tokenized ``.npy`` / ``.bin`` file, memory-mapped as a 1-D array of ids."""
    src = Path(os.path.expanduser(source))
    if src.suffix == ".npy":
        tokens = np.load(src, mmap_mode="r")
        problem = token_dtype_problem(tokens.dtype)
        if problem:
            raise ValueError(f"data.source = '{source}' {problem}")
        return tokens.reshape(-1)
    return np.memmap(src, dtype=np.uint16, mode="r")


def load_byte_corpus(source: str, cache_dir: str = "", max_bytes: int = 0) -> np.ndarray:
    """The byte-level corpus of 'stdlib' or a text file / folder, cached and memory-mapped."""
    if source == "stdlib":
        key = stdlib_key()
        path = cache_root(cache_dir) / _cache_name(key, max_bytes)
        if not path.exists():
            path = build_byte_corpus(stdlib_files(), cache_root(cache_dir), max_bytes, key)
        return np.memmap(path, dtype=np.uint8, mode="r")
    path = build_byte_corpus(text_files(Path(os.path.expanduser(source))), cache_root(cache_dir), max_bytes)
    return np.memmap(path, dtype=np.uint8, mode="r")
