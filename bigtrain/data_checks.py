"""The corpus a run reads, checked before any rank starts (:func:`bigtrain.preflight.preflight` calls
these): ``data.source`` (and ``data.val_source``, each ``data.blend`` corpus) against the model and the
sampler: the files' dtype and ids against the vocabulary, their length against the sampler's window,
a text corpus's tokenizer, records and cache folder. One problem at most per corpus, naming the field
and a fix."""

from __future__ import annotations

import copy
import os
import stat
import sysconfig
from pathlib import Path

import numpy as np

from bigtrain.config import Config
from bigtrain.families import family_of, model_vocabulary
from bigtrain.data.corpus import (TEXT_SUFFIXES, cache_path, cached_corpus, files_key, stdlib_files, stdlib_key, text_files,
                                  token_dtype_problem)
from bigtrain.data.blend_spec import parse_blend
from bigtrain.data.load import blended_config, held_out_config, is_token_file, source_files, uses_shards
from bigtrain.data.fields import holds, records_problem, tokenizer_problem
from bigtrain.data.sampler import split_problem
from bigtrain.writable import writable_dir_problem

SCAN_CHUNK = 1 << 24  # token ids compared with the vocabulary per step of the scan (64 MiB of int32)

def _kind(mode: int) -> str:
    for test, what in ((stat.S_ISCHR, "a character device"), (stat.S_ISBLK, "a block device"),
                       (stat.S_ISFIFO, "a FIFO"), (stat.S_ISSOCK, "a socket")):
        if test(mode):
            return what
    return "not a regular file"


def data_problems(cfg: Config) -> list[str]:
    """The corpus ``data.source`` names, against the model and the sampler: one problem at most."""
    d, family = cfg.data, family_of(cfg)
    if not family.reads_tokens:  # its own data (a recommender's): validation checked it
        return []
    vocab, vocab_field = model_vocabulary(cfg)  # a family described by its own file (a config.json) sets it there
    need = d.seq_len + 2  # TokenSampler draws starts in [0, len - seq_len - 1): a window of seq_len + 1, and one more
    if d.document_end and is_token_file(d.source):
        return [f"data.document_end = {d.document_end!r} with data.source = '{d.source}', ids tokenized already: "
                f"it is put between documents as they are tokenized; leave data.document_end = '' (or give the text)"]
    if (d.tokenizer != "bytes" or d.document_end) and (problem := tokenizer_problem(cfg, vocab, vocab_field)):
        return [problem]
    if d.source == "stdlib" and uses_shards(d):
        return [problem] if (problem := _writable_cache_problem(cfg)) else []
    if d.source == "stdlib":
        problem = _cache_problem(cfg, stdlib_key())
        if problem is None and d.max_bytes and d.max_bytes < need:
            problem = (f"data.max_bytes = {d.max_bytes} caps the corpus below data.seq_len + 2 = {need} tokens "
                       f"(one window and the next target); raise data.max_bytes or set it to 0")
        if problem is None and d.val_fraction:
            problem = _held_out_problem(d, "data.source = 'stdlib' has", _stdlib_tokens(d))
        return [problem] if problem else []
    src = Path(os.path.expanduser(d.source))
    try:
        mode = os.stat(src).st_mode
    except (OSError, ValueError) as e:
        return [f"data.source = '{d.source}': cannot be read ({getattr(e, 'strerror', None) or e})"]
    if not (stat.S_ISREG(mode) or stat.S_ISDIR(mode)):
        return [f"data.source = '{d.source}' is {_kind(mode)}, not a file or folder; give a text file or folder, "
                f"or a .bin / .npy token file"]
    if uses_shards(d):  # tokenized into shards before launch (bigtrain.data.shards); its length is known then
        problem = records_problem(cfg) or _writable_cache_problem(cfg)
        return [problem] if problem else []
    if src.suffix in (".bin", ".npy"):  # as load_tokens decides
        if stat.S_ISDIR(mode):
            return [f"data.source = '{d.source}' is a folder; a .bin / .npy source must be a token file"]
        problem = _token_file_problem(d, src, vocab, vocab_field)
    else:
        problem = _text_problem(cfg, src, need)
    return [problem] if problem else []


def held_out_source_problems(cfg: Config) -> list[str]:
    """``data.val_source`` and the corpora of ``data.blend`` held to ``data.source``'s checks (each is
    read the same way, and its ids meet the same embedding), each message naming its field."""
    d, problems = cfg.data, []
    named = [(held_out_config(d), f"data.val_source = '{d.val_source}'", "data.val_source")] if d.val_source else []
    named += [(blended_config(d, path), f"data.blend's {path}", "data.blend") for path, _ in parse_blend(d.blend)]
    for data, label, field in named:
        as_source = copy.copy(cfg)
        as_source.data = data
        problems += [p.replace(f"data.source = '{data.source}'", label).replace("data.source", field)
                     for p in data_problems(as_source)]
    return problems + held_out_overlap_problems(cfg)


def held_out_overlap_problems(cfg: Config) -> list[str]:
    """``data.val_source`` that reads a file a training corpus reads (the same path given twice, a
    file of the training folder given as its validation split, a folder holding the training file):
    eval_loss was measured on text the run trains on, without a word."""
    d = cfg.data
    if not d.val_source or not family_of(cfg).reads_tokens:
        return []
    held = _read_files(held_out_config(d))
    for label, data in [(f"data.source = '{d.source}'", d)] + [
            (f"data.blend's {path}", blended_config(d, path)) for path, _ in parse_blend(d.blend)]:
        shared = sorted(held & _read_files(data))
        if shared:
            said = f"{shared[0]}" + (f" and {len(shared) - 1:,} more" if len(shared) > 1 else "")
            return [f"data.val_source = '{d.val_source}' reads what {label} trains on ({said}): the held-out loss "
                    f"would be measured on training text; give a held-out corpus apart from the training data, or "
                    f"data.val_source = '' with data.val_fraction (a tail of data.source the run never trains on)"]
    return []


def _read_files(d) -> set[Path]:
    try:
        return {f.resolve() for f in source_files(d)}
    except OSError:  # a corpus that cannot be listed: its own check says so
        return set()


def _stdlib_tokens(d) -> int:
    """The byte corpus of the standard library: its cached file's length, else its files' bytes up to
    data.max_bytes (stat-ed only when data.val_fraction needs the length)."""
    cached = cached_corpus(stdlib_key(), d.cache_dir, d.max_bytes)
    if cached.is_file():
        return cached.stat().st_size
    total = sum(f.stat().st_size for f in stdlib_files())
    return min(total, d.max_bytes) if d.max_bytes else total


def _held_out_problem(d, where: str, tokens: int) -> str | None:
    """The corpus of ``tokens`` ids cut by data.val_fraction: a training part and a held-out slice of
    a window each (the sampler's own rule, asked before launch rather than raised in every rank)."""
    problem = split_problem(tokens, d.seq_len, d.val_fraction) if d.val_fraction else None
    return f"{problem} ({where} {tokens} tokens)" if problem else None


def _unreadable(path: Path) -> str | None:
    try:
        with open(path, "rb"):
            return None
    except OSError as e:
        return e.strerror or str(e)


def _token_file_problem(d, path: Path, vocab: int, vocab_field: str) -> str | None:
    field, need = f"data.source = '{d.source}'", d.seq_len + 2
    reason = _unreadable(path)
    if reason:
        return f"{field}: cannot be read ({reason})"
    size = path.stat().st_size
    if size == 0:
        return f"{field} is empty; it needs at least data.seq_len + 2 = {need} token ids"
    if path.suffix == ".bin":
        if size % 2:
            return (f"{field} has an odd number of bytes ({size}): a .bin holds uint16 token ids, 2 bytes each; "
                    f"write it with np.asarray(ids, dtype=np.uint16).tofile(path), or save a .npy")
        tokens = np.memmap(path, dtype=np.uint16, mode="r")
    else:
        problem = _npy_header_problem(path, size)
        if problem:
            return f"{field} {problem}"
        try:
            tokens = np.load(path, mmap_mode="r", allow_pickle=False)
        except Exception as e:  # noqa: BLE001 - numpy raises several kinds on a damaged header or size
            return f"{field} is not a readable .npy array ({' '.join(str(e).split())[:200]}); save it with np.save"
        tokens = tokens.reshape(-1) if tokens.flags.c_contiguous else tokens.ravel(order="K")
    if len(tokens) < need:
        return (f"{field} has {len(tokens)} token ids, fewer than data.seq_len + 2 = {need} (one window and the "
                f"next target); lower data.seq_len or give a longer corpus")
    return (_held_out_problem(d, f"{field} has", len(tokens)) or _id_range_problem(field, tokens, vocab, vocab_field)
            or (_wide_ids_problem(field, tokens) if path.suffix == ".bin" else None))


def _wide_ids_problem(field: str, tokens: np.ndarray) -> str | None:
    """A .bin of ids written 4 or 8 bytes each (``np.int32(ids).tofile``), read as uint16: every id
    becomes its low half and a run of high halves, which are 0 (or tiny) for every id below 65536 and
    so pass the vocabulary check, and the run would train on every other token replaced by 0. Seen in
    the first ids: the values at odd positions are far below those at even positions. Real uint16 text
    has no such pattern (its odd positions are as varied as the even ones)."""
    head = np.asarray(tokens[:min(len(tokens), 1 << 20) // 2 * 2])
    if len(head) < 64:
        return None
    low, high = head[0::2], head[1::2]
    if int(high.max()) * 256 >= int(low.max()):
        return None
    return (f"{field}: every second uint16 value is at most {int(high.max())} while the others reach "
            f"{int(low.max())}: it looks like 32- or 64-bit ids (np.int32 / np.int64 .tofile) read 2 bytes at a "
            f"time; a .bin holds uint16 ids: write np.asarray(ids, dtype=np.uint16).tofile(path), or np.save a "
            f".npy (which keeps its dtype)")


def _npy_header_problem(path: Path, size: int) -> str | None:
    """The header alone: not a .npy at all, ids that are not integers, or fewer bytes than it promises."""
    fmt = np.lib.format
    with open(path, "rb") as f:
        if f.read(6) != b"\x93NUMPY":
            return "is not a .npy file (no NumPy header); save the ids with np.save, or name a text file .txt"
        f.seek(0)
        try:
            version = fmt.read_magic(f)
            read = fmt.read_array_header_1_0 if version == (1, 0) else fmt.read_array_header_2_0
            shape, _, dtype = read(f)
        except Exception as e:  # noqa: BLE001 - a damaged header: say what numpy says
            return f"has a damaged .npy header ({' '.join(str(e).split())[:200]}); save it again with np.save"
        problem = token_dtype_problem(dtype)
        if problem:
            return problem
        promised = f.tell() + int(np.prod(shape, dtype=object)) * dtype.itemsize
    if promised > size:
        return (f"is truncated: its header promises {int(np.prod(shape, dtype=object))} ids ({promised} bytes), "
                f"the file has {size} bytes; save it again with np.save")
    return None


def _id_range_problem(field: str, tokens: np.ndarray, vocab: int, vocab_field: str = "model.vocab_size") -> str | None:
    """Scan the ids chunk by chunk (memory-mapped: the file is never loaded whole): the first id
    out of range, and the largest and smallest of all, for the fix."""
    info = np.iinfo(tokens.dtype)
    if info.min >= 0 and info.max < vocab:
        return None  # every value the dtype can hold is a valid id: nothing to scan
    first, low, high = None, 0, 0
    for start in range(0, len(tokens), SCAN_CHUNK):
        chunk = np.asarray(tokens[start:start + SCAN_CHUNK])
        low, high = min(low, int(chunk.min())), max(high, int(chunk.max()))
        if first is None and (low < 0 or high >= vocab):
            bad = (chunk < 0) | (chunk >= vocab)
            at = int(np.argmax(bad))
            first = (start + at, int(chunk[at]))
    if first is None:
        return None
    at, value = first
    text = f"{field} holds token id {value} at position {at}, outside 0 .. {vocab_field} - 1 = {vocab - 1}"
    if high >= vocab:
        text += f"; the largest id is {high}: set {vocab_field} to at least {high + 1}, or re-tokenize"
    if low < 0:
        text += f"; the smallest is {low}: ids cannot be negative, re-tokenize"
    return text


def _text_problem(cfg: Config, src: Path, need: int) -> str | None:
    d = cfg.data
    field = f"data.source = '{d.source}'"
    if cfg.model.vocab_size < 256:  # validate judged the name ('x.bin/' ends otherwise than its suffix)
        return f"{field} is read as byte-level text, which needs model.vocab_size >= 256; set it to 256"
    if src.is_dir():
        try:
            next(os.scandir(src), None)
        except OSError as e:
            return f"{field}: the folder cannot be listed ({e.strerror})"
    files = text_files(src)
    if not files:
        return (f"{field}: no text files in this folder (looked for {', '.join(TEXT_SUFFIXES)}"
                f"{holds(src)}); give a folder with such files, a text file, or a .bin / .npy token file")
    total = 0
    for f in files:
        reason = _unreadable(f)
        if reason:
            return f"{field}: '{f}' cannot be read ({reason})"
        total += f.stat().st_size
        if d.max_bytes and total >= d.max_bytes:
            total = d.max_bytes
            break
    if total < need:
        cap = f" (data.max_bytes = {d.max_bytes})" if d.max_bytes and total == d.max_bytes else ""
        return (f"{field} has {total} bytes of text{cap}, fewer than data.seq_len + 2 = {need} tokens (one window "
                f"and the next target); lower data.seq_len or give a longer corpus")
    problem = _held_out_problem(d, f"{field} has", total)
    if problem:
        return problem
    try:
        key = files_key(files)
    except OSError as e:
        return f"{field}: a file changed while it was read ({e.strerror}); try again"
    return _cache_problem(cfg, key)


def _writable_cache_problem(cfg: Config) -> str | None:
    where = cfg.data.cache_dir or str(cache_path(""))
    problem = writable_dir_problem(where, "data.cache_dir")
    if problem and not cfg.data.cache_dir:
        problem += " (the default, under your home folder; set data.cache_dir)"
    return problem


def _cache_problem(cfg: Config, key: str) -> str | None:
    """A text corpus is tokenized into data.cache_dir once: the folder must be writable unless
    the corpus is already there."""
    try:
        if cached_corpus(key, cfg.data.cache_dir, cfg.data.max_bytes).is_file():
            return None
    except (OSError, ValueError):
        pass
    where = cfg.data.cache_dir or str(cache_path(""))
    problem = writable_dir_problem(where, "data.cache_dir")
    if problem and not cfg.data.cache_dir:
        problem += " (the default, under your home folder; set data.cache_dir)"
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    if problem is None and cfg.data.source == "stdlib" and not (stdlib / "os.py").is_file():
        problem = "data.source = 'stdlib': this Python has no standard library sources to read; give a corpus"
    return problem
