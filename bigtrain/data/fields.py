"""Checks of the ``[data]`` fields that name a tokenizer and records, each naming the field and the fix.

:func:`data_field_problems` is one of :mod:`bigtrain.validation`'s rules (the config and which
files and packages exist); :func:`tokenizer_problem` reads the tokenizer itself and compares its
vocabulary with ``model.vocab_size`` (the pre-launch checks of :mod:`bigtrain.preflight`).
"""

from __future__ import annotations

import os
from pathlib import Path

from bigtrain.config import Config
from bigtrain.data.documents import DOCUMENT_SUFFIXES, corpus_files, left_out_files, left_out_summary, parquet_missing
from bigtrain.data.tokenizer import (BYTES, HF_FILE, TokenizerError, document_end_id, load_tokenizer, missing_package,
                                     tokenizer_file, tokenizer_kind)
from bigtrain.field_checks import looked_in


def _other_tokenizer_file(path: Path) -> Path | None:
    """A folder's tokenizer file that is not its tokenizer.json (``path``): SentencePiece's or tiktoken's."""
    if path.name != HF_FILE or not path.parent.is_dir():
        return None
    return next((f for f in sorted(path.parent.glob("*.model")) + sorted(path.parent.glob("*.tiktoken"))
                 if f.is_file()), None)


def data_field_problems(cfg: Config) -> list[str]:
    d = cfg.data
    if cfg.model.family != "llama":
        return []
    problems = []
    if not d.tokenizer.strip():
        problems.append("data.tokenizer is empty; use 'bytes', a tokenizer.json (or a folder holding one) or a "
                        ".tiktoken file")
    elif d.tokenizer != BYTES:
        try:
            path = tokenizer_file(d.tokenizer)
            where = None if path.is_file() else (f"{path} does not exist" if path.name == HF_FILE
                                                 and path.parent.is_dir() else f"no such file{looked_in(d.tokenizer)}")
        except (OSError, ValueError) as e:  # a name no file can have (too long)
            where = f"cannot be read ({getattr(e, 'strerror', None) or e})"
        if where and (other := _other_tokenizer_file(path)):
            # a Llama 2 / Mistral / Llama 3 download that has no tokenizer.json: the folder's own
            # file named by the fix, not only "does not exist"
            problems.append(f"data.tokenizer = '{d.tokenizer}': {where}, but the folder holds {other.name}: give "
                            f"it (data.tokenizer = '{other}') if it is a tiktoken file (Llama 3's), else make a "
                            f"tokenizer.json beside it (transformers' AutoTokenizer.from_pretrained(FOLDER)"
                            f".save_pretrained(FOLDER) writes one; nothing is downloaded)")
        elif where:
            problems.append(f"data.tokenizer = '{d.tokenizer}': {where}; give a local tokenizer.json, a folder "
                            f"holding one, a .tiktoken file, or 'bytes' (nothing is downloaded)")
        elif tokenizer_kind(d.tokenizer) == "tiktoken" and _binary(path):
            # Llama 2's and Mistral's tokenizer.model (a SentencePiece protobuf) was taken for a tiktoken
            # file: "pip install tiktoken", then a parse error (Llama 3's tokenizer.model is tiktoken's text)
            problems.append(f"data.tokenizer = '{d.tokenizer}' is a binary file (a SentencePiece model?), not a "
                            f"tiktoken file's 'BASE64 RANK' lines; bigtrain does not read SentencePiece: give the "
                            f"tokenizer.json beside it, or make one (transformers' "
                            f"AutoTokenizer.from_pretrained(FOLDER).save_pretrained(OUT) writes OUT/tokenizer.json)")
        else:
            kind = tokenizer_kind(d.tokenizer)
            need = missing_package(kind)
            if need:
                problems.append(f"data.tokenizer = '{d.tokenizer}' is a {'tokenizer.json' if kind == 'hf' else 'tiktoken file'}"
                                f", which needs a package that is not installed: {need} (or use 'bytes')")
    if not d.text_field.strip():
        problems.append("data.text_field is empty; give the key of each JSON Lines record (or Parquet column) that "
                        "holds its text, e.g. 'text'")
    source = Path(os.path.expanduser(d.source))
    if d.source.endswith(".parquet") or _has_parquet(source):
        need = parquet_missing()
        if need:
            problems.append(f"data.source = '{d.source}' holds Parquet files, which need pyarrow: {need} (or convert "
                            f"them to JSON Lines: one {{\"{d.text_field or 'text'}\": ...}} record a line)")
    return problems


def _binary(path: Path) -> bool:
    """Whether a file's first bytes hold a NUL or are not UTF-8 (no tiktoken file's are)."""
    try:
        with open(path, "rb") as f:
            head = f.read(512)
    except OSError:
        return False
    try:
        head.decode("utf-8")
    except UnicodeDecodeError as e:
        if e.start < len(head) - 3:  # not a character cut at the end of the 512 bytes
            return True
    return b"\x00" in head


def _has_parquet(folder: Path) -> bool:
    try:
        return folder.is_dir() and any(p.suffix == ".parquet" for p in corpus_files(folder))
    except (OSError, ValueError):  # unreadable, or a name no file can have: data.source's own check says so
        return False


def tokenizer_problem(cfg: Config, vocab: int | None = None, vocab_field: str = "model.vocab_size") -> str | None:
    """The tokenizer can be read, data.document_end is one of its tokens, and every id it gives fits
    the model's vocabulary (``vocab``, set by ``vocab_field``; model.vocab_size by default)."""
    d, m = cfg.data, cfg.model
    vocab = m.vocab_size if vocab is None else vocab
    try:
        tokenizer = load_tokenizer(d.tokenizer)
        document_end_id(tokenizer, d.document_end)
    except TokenizerError as e:
        return str(e)
    if tokenizer.vocab_size > vocab:
        text = (f"data.tokenizer = '{d.tokenizer}' has {tokenizer.vocab_size} ids, more than {vocab_field} = "
                f"{vocab}: its ids would index past the embedding; ")
        if vocab_field != "model.vocab_size":  # the model's own file sets it
            return text + f"use the tokenizer the model was made for, or a model whose {vocab_field} is at least " \
                          f"{tokenizer.vocab_size}"
        return (text + f"set model.vocab_size = {tokenizer.vocab_size} (or a multiple of 64 above it, such as "
                f"{-(-tokenizer.vocab_size // 64) * 64})"
                + (" or use the tokenizer that model.init_from's weights were trained with" if m.init_from else ""))
    return None


def records_problem(cfg: Config) -> str | None:
    """A folder source with nothing to read."""
    d = cfg.data
    if d.source == "stdlib":
        return None
    source = Path(os.path.expanduser(d.source))
    try:
        files = corpus_files(source)
    except OSError as e:
        return f"data.source = '{d.source}': the folder cannot be listed ({e.strerror})"
    if not files:
        return (f"data.source = '{d.source}': no text, .jsonl or .parquet files in this folder (looked for "
                f"{', '.join(DOCUMENT_SUFFIXES)}{holds(source)}); give a folder with such files, a file, or a .bin / "
                f".npy token file")
    return None


def holds(folder: Path) -> str:
    """'; it holds 3 .js, 1 .csv': what an empty-looking corpus folder has instead ('' for nothing)."""
    try:
        files = left_out_files(folder)
    except OSError:
        return ""
    return f"; it holds {left_out_summary(folder, files)}" if files else "; it holds no files"

