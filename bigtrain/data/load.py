"""Which corpus a ``[data]`` section names, made ready and opened as token ids.

- ``.bin`` / ``.npy``: pre-tokenized ids, memory-mapped as they are;
- 'stdlib', a text file or a folder with ``data.tokenizer = "bytes"``: the byte-level corpus
  (:mod:`bigtrain.data.corpus`);
- anything else (a real tokenizer, or JSON Lines / Parquet records): tokenized once into shards
  (:mod:`bigtrain.data.shards`) under ``data.cache_dir``.

:func:`prepare_corpus` builds what needs building and checks it (``bigtrain train`` calls it before
the ranks start); :func:`load_corpus` opens it on each rank (and builds it, under the lock, when no
one prepared it: a Trainer made directly, as the tests do).
"""

from __future__ import annotations

import os
import sys
import sysconfig
from dataclasses import replace
from pathlib import Path

from bigtrain.config import DataConfig
from bigtrain.data.blend_spec import parse_blend, source_share
from bigtrain.data.corpus import cache_root, load_byte_corpus, load_token_file, stdlib_files, text_files
from bigtrain.data.documents import (DOCUMENT_SUFFIXES, RECORD_SUFFIXES, corpus_files, has_records,
                                     json_records_source, left_out_files, left_out_summary, tool_folder_files)
from bigtrain.data.sampler import split_problem
from bigtrain.data.shards import ShardedTokens, corpus_key, prepared
from bigtrain.data.tokenizer import BYTES, file_digest, tokenizer_file

TOKEN_FILE_SUFFIXES = (".bin", ".npy")


def is_token_file(source: str) -> bool:
    return source.endswith(TOKEN_FILE_SUFFIXES)


def source_path(d: DataConfig) -> Path:
    return Path(sysconfig.get_paths()["stdlib"]) if d.source == "stdlib" else Path(os.path.expanduser(d.source))


def source_files(d: DataConfig) -> list[Path]:
    return stdlib_files() if d.source == "stdlib" else corpus_files(source_path(d))


def json_records(d: DataConfig) -> bool:
    """Whether ``data.source`` is one .json file, read as records (:func:`json_records_source`)."""
    return d.source != "stdlib" and json_records_source(source_path(d))


def uses_shards(d: DataConfig) -> bool:
    """Whether the corpus is tokenized into shards (a real tokenizer, or JSON Lines / Parquet / a
    .json file of records)."""
    if is_token_file(d.source):
        return False
    if d.tokenizer != BYTES or d.document_end:  # (the byte corpus puts nothing between its files)
        return True
    if d.source == "stdlib":
        return False
    try:
        return json_records(d) or has_records(corpus_files(source_path(d)))
    except OSError:  # a folder that cannot be listed: the pre-launch checks say so
        return False


def shard_folder(d: DataConfig, files: list[Path] | None = None) -> Path:
    """``data.cache_dir/tok-KEY``: where this corpus's shards are (or will be), by content."""
    files = source_files(d) if files is None else files
    digest = BYTES if d.tokenizer == BYTES else file_digest(tokenizer_file(d.tokenizer))
    cache = cache_root(d.cache_dir)
    key = corpus_key(source_path(d), files, digest, d.text_field, d.max_bytes, cache, d.document_end, json_records(d))
    return cache / f"tok-{key}"


def prepare_corpus(d: DataConfig, check: bool = True, log=None, **build_args) -> dict | None:
    """Tokenize the corpus into shards if it needs them and they are not there yet (``check``:
    verify an existing one's checksums); returns its manifest, None for the other corpora."""
    if not uses_shards(d):
        return None
    files = source_files(d)
    if not files:
        raise ValueError(f"data.source = '{d.source}': no text, .jsonl or .parquet files in it")
    return prepared(shard_folder(d, files), files, d.tokenizer, d.text_field, d.max_bytes, d.source,
                    check=check, log=log, document_end=d.document_end, json_records=json_records(d), **build_args)


def load_corpus(d: DataConfig):
    """The corpus's token ids as a 1-D sequence (a memory-mapped array, or :class:`ShardedTokens`)."""
    if is_token_file(d.source):
        return load_token_file(d.source)
    if not uses_shards(d):
        return load_byte_corpus(d.source, d.cache_dir, d.max_bytes)
    files = source_files(d)
    folder = shard_folder(d, files)
    manifest = prepared(folder, files, d.tokenizer, d.text_field, d.max_bytes, d.source,
                        document_end=d.document_end, json_records=json_records(d))
    return ShardedTokens.open(folder, manifest)


def held_out_config(d: DataConfig) -> DataConfig:
    """``data.val_source`` read as ``data.source`` is (the same tokenizer, text field and cap)."""
    return replace(blended_config(d, d.val_source), val_fraction=0.0)  # held out whole


def run_sampler(cfg, vocab_size: int | None = None, vocab_field: str = "model.vocab_size"):
    """The run's :class:`~bigtrain.data.sampler.TokenSampler` of ``cfg``'s corpus, batch, seed and
    held-out data: the one the trainer and every independent reference draw their batches from."""
    from bigtrain.data.sampler import TokenSampler

    d, t = cfg.data, cfg.train
    held_out = load_corpus(held_out_config(d)) if d.val_source else None
    source = TokenSampler(load_corpus(d), d.seq_len, t.global_batch, t.seed, d.ignore_target, d.val_fraction,
                          vocab_size=vocab_size, vocab_field=vocab_field, val_tokens=held_out)
    blend = parse_blend(d.blend)
    if not blend:
        return source
    from bigtrain.data.blend import BlendedSampler

    parts = [TokenSampler(load_corpus(blended_config(d, path)), d.seq_len, t.global_batch, t.seed, d.ignore_target,
                          d.val_fraction, vocab_size=vocab_size, vocab_field=vocab_field,
                          source_field=f"data.blend's {path}") for path, _ in blend]
    return BlendedSampler([source, *parts], [source_share(blend), *(share for _, share in blend)],
                          held_out_corpus=bool(d.val_source))


def blended_config(d: DataConfig, path: str) -> DataConfig:
    """A corpus of ``data.blend`` read as ``data.source`` is (the same tokenizer, text field and cap)."""
    return replace(d, source=path, val_source="", blend="")


def load_tokens(source: str, cache_dir: str = "", max_bytes: int = 0, tokenizer: str = BYTES,
                text_field: str = "text"):
    """:func:`load_corpus` from the fields themselves."""
    return load_corpus(DataConfig(source=source, cache_dir=cache_dir, max_bytes=max_bytes, tokenizer=tokenizer,
                                  text_field=text_field))


RUN_TOKENIZER_NAMES = {"hf": "tokenizer.json", "tiktoken": "tokenizer.tiktoken"}


def run_tokenizer(run_dir: Path) -> Path | None:
    """The copy of its tokenizer a run keeps (what ``bigtrain export`` writes beside the weights)."""
    for name in RUN_TOKENIZER_NAMES.values():
        if (Path(run_dir) / name).is_file():
            return Path(run_dir) / name
    return None


def tool_folder_warning(d: DataConfig) -> str | None:
    """A folder source whose read files include a hidden or tool folder's (.venv, .git, node_modules):
    said with their counts, since a project folder given as the corpus trained on its dependencies."""
    if d.source == "stdlib" or is_token_file(d.source):
        return None
    source = source_path(d)
    if not source.is_dir():
        return None
    try:
        counts = tool_folder_files(source, source_files(d))
    except OSError:
        return None
    if not counts:
        return None
    total = sum(counts.values())
    where = ", ".join(f"{name}/: {n:,}" for name, n in sorted(counts.items(), key=lambda kv: -kv[1]))
    return (f"data.source = '{d.source}' reads {total:,} file{'s' if total != 1 else ''} under hidden or tool folders "
            f"({where}), a project's environment rather than its text; point data.source at the folder of the "
            f"text itself, or move those out")


TABLE_SUFFIXES = (".csv", ".tsv")


def single_file_warning(d: DataConfig) -> str | None:
    """A single file ``data.source`` that is read as one plain-text document but was likely meant
    otherwise: a table (.csv / .tsv: its header, separators and quotes trained on as they are) or a
    binary file (NUL bytes: an .arrow, .pkl or .safetensors trained on as bytes, without a word)."""
    if d.source == "stdlib" or is_token_file(d.source):
        return None
    path = source_path(d)
    if not path.is_file() or path.suffix in RECORD_SUFFIXES or json_records(d):
        return None
    if path.suffix in TABLE_SUFFIXES:
        return (f"data.source = '{d.source}' is read as one plain-text document: its header, "
                f"{'commas' if path.suffix == '.csv' else 'tabs'} and quotes are trained on as they are (bigtrain "
                f"reads records only from .jsonl, .parquet and .json); to train on one column, write it as .jsonl lines "
                f"of {{\"{d.text_field}\": ...}}")
    try:
        with open(path, "rb") as f:
            head = f.read(4096)
    except OSError:
        return None
    if b"\x00" in head and head[:2] not in UTF16_BOMS:  # UTF-16 text: encoding_warning says so
        return (f"data.source = '{d.source}' holds NUL bytes: it looks binary, not text, and is trained on as it is; "
                f"give text (.txt, .jsonl, .parquet) or token ids (.npy, .bin)")
    return None


def cap_warning(d: DataConfig, manifest: dict | None) -> str | None:
    """``data.max_bytes`` cutting a corpus the user named (its default of 16 MB keeps the 'stdlib'
    demo short; on a user's corpus it dropped everything past it without a word): whether the cap
    cut a tokenized corpus is in its manifest, a byte-level one is its files' bytes."""
    if not d.max_bytes or d.source == "stdlib" or is_token_file(d.source):
        return None
    if manifest is not None:
        cut = bool(manifest.get("cut_at_max_bytes"))
    else:
        cut = sum(f.stat().st_size for f in text_files(source_path(d))) > d.max_bytes
    if not cut:
        return None
    return (f"data.max_bytes = {d.max_bytes} cut data.source = '{d.source}' short: the run reads only its first "
            f"{d.max_bytes:,} bytes of text; set data.max_bytes = 0 to read all of it")


def left_out_warning(d: DataConfig) -> str | None:
    """A folder ``data.source`` holding files that are not read (a suffix bigtrain does not read as
    text or records): the run trains on fewer documents than the folder holds. Said before launch
    with the count of each suffix left out; no field selects suffixes, so the fix is the files'."""
    if d.source == "stdlib" or is_token_file(d.source):
        return None
    source = source_path(d)
    try:
        left_out = left_out_files(source)
    except OSError:  # a folder that cannot be listed: the pre-launch checks say so
        return None
    if not left_out:
        return None
    read = len(source_files(d))
    them = "them" if len(left_out) != 1 else "it"
    return (f"data.source = '{d.source}': {len(left_out)} file{'s' if len(left_out) != 1 else ''} in this folder "
            f"{'are' if len(left_out) != 1 else 'is'} not read: {left_out_summary(source, left_out)}. The run reads "
            f"only the {read} ending in {', '.join(DOCUMENT_SUFFIXES)}; to train on {them} too, give {them} one of "
            f"these suffixes (text as .txt, records as .jsonl lines of {{\"{d.text_field}\": ...}}), or move {them} "
            f"out of the folder to silence this")


def corpus_tokens(d: DataConfig, manifest: dict | None) -> int | None:
    """The corpus's token count where it is cheap to know: a tokenized corpus's manifest, a token
    file's length, a byte-level corpus's bytes up to the cap. 'stdlib' is tens of MB: its cap when
    one is set (data.max_bytes = 200 read 200 bytes again every step without a word), else None."""
    if manifest is not None:
        return int(manifest["tokens"])
    if d.source == "stdlib":
        return d.max_bytes or None
    try:
        if is_token_file(d.source):
            return len(load_token_file(d.source))
        total = sum(f.stat().st_size for f in text_files(source_path(d)))
    except (OSError, ValueError):  # said by the pre-launch checks
        return None
    return min(total, d.max_bytes) if d.max_bytes else total


def small_corpus_warning(cfg, manifest: dict | None) -> str | None:
    """A corpus smaller than one step's batch trains (windows are drawn with replacement), but every
    step reads the same few tokens again: a user who gave a short file for a first try got a loss
    that fell to nothing, without a word of why."""
    d, t = cfg.data, cfg.train
    tokens = corpus_tokens(d, manifest)
    if tokens is None:
        return None
    train = tokens - int(tokens * d.val_fraction)
    batch = t.global_batch * d.seq_len
    if train >= batch:
        return None
    reads = t.steps * batch / max(train, 1)
    return (f"data.source = '{d.source}' has {train:,} training tokens, fewer than one step's batch (train.global_batch"
            f" x data.seq_len = {t.global_batch} x {d.seq_len} = {batch:,} tokens): windows are drawn with "
            f"replacement, so every step reads the same tokens again (the run's {t.steps:,} steps read each about "
            f"{reads:,.0f} times); give a longer corpus, or lower train.global_batch or data.seq_len")


UTF16_BOMS = (b"\xff\xfe", b"\xfe\xff")  # what Windows' "Unicode" text files start with


def _utf16(path) -> bool:
    try:
        with open(path, "rb") as f:
            return f.read(2) in UTF16_BOMS
    except OSError:
        return False


def encoding_warning(d: DataConfig, manifest: dict | None) -> str | None:
    """Text files of a tokenized corpus that were not UTF-8 (its manifest counts them): their
    undecodable bytes were read as U+FFFD, one token for every accented letter of a Latin-1 file.
    A byte-level corpus reads bytes as they are, but a UTF-16 file's are a NUL beside every ASCII
    letter: said too (it trained without a word). JSON Lines that is not UTF-8 is refused."""
    if manifest is None and d.source != "stdlib" and not is_token_file(d.source):
        try:
            utf16 = [str(f) for f in text_files(source_path(d)) if _utf16(f)]
        except OSError:  # said by the pre-launch checks
            utf16 = []
        if utf16:
            more = f" and {len(utf16) - 5} more" if len(utf16) > 5 else ""
            return (f"data.source = '{d.source}': {len(utf16)} text file{'s are' if len(utf16) != 1 else ' is'} "
                    f"UTF-16 ({', '.join(utf16[:5])}{more}): a byte-level run trains on {'their' if len(utf16) != 1 else 'its'} "
                    f"bytes as they are, a NUL byte beside every ASCII letter; convert to UTF-8 (e.g. iconv -f utf-16 "
                    f"-t utf-8)")
    count = (manifest or {}).get("not_utf8_files", 0)
    if not count:
        return None
    files = manifest.get("not_utf8", [])
    # a UTF-16 file decodes as UTF-8 but for its first two bytes: its letters come with NULs between
    source_encoding = "utf-16" if any(_utf16(f) for f in files) else "latin1"
    more = f" and {count - len(files)} more" if count > len(files) else ""
    if d.tokenizer != BYTES:
        other = "train on bytes (data.tokenizer = 'bytes')"
    elif not (json_records(d) or has_records(source_files(d))):
        # Bytes already: data.document_end is what made the text go through documents (the byte corpus,
        # without it, reads files as they are); "train on bytes" was the advice given to this very run.
        other = "leave data.document_end = '' (the byte-level corpus then reads the files' bytes as they are)"
    else:
        other = None  # records: bytes go through documents (and JSON Lines that is not UTF-8 is refused)
    return (f"data.source = '{d.source}': {count} text file{'s are' if count != 1 else ' is'} not UTF-8 "
            f"({', '.join(files)}{more}); {'their' if count != 1 else 'its'} undecodable bytes were read as U+FFFD, the replacement "
            f"character, so the model never sees those characters: convert them to UTF-8 (e.g. iconv -f "
            f"{source_encoding} -t utf-8){f', or {other}' if other else ''}")


# A tokenizer holds about this many times a document's text while it encodes it (a 64 MB .txt, one
# document, took one worker 10.6 GB: 165x, measured with tokenizers' byte-level BPE).
ENCODING_MEMORY_RATIO = 165


def long_document_warning(d: DataConfig, memory_bytes: int | None = None) -> str | None:
    """A plain-text file of a tokenized corpus is one document, encoded in one call: one whose
    encoding needs more than half this machine's memory (:data:`ENCODING_MEMORY_RATIO`) is said
    before the build, with the fix, rather than found when the system kills the worker."""
    if not uses_shards(d) or d.source == "stdlib" or json_records(d):
        return None
    try:
        files = [f for f in source_files(d) if f.suffix not in RECORD_SUFFIXES]
        largest = max(files, key=lambda f: f.stat().st_size, default=None)
        size = largest.stat().st_size if largest is not None else 0
    except OSError:
        return None
    if d.max_bytes:
        size = min(size, d.max_bytes)
    if memory_bytes is None:
        try:
            memory_bytes = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
        except (OSError, ValueError):
            return None
    need = size * ENCODING_MEMORY_RATIO
    if need <= memory_bytes // 2:
        return None
    return (f"data.source = '{d.source}': {largest.name} is one document of {size / 2**20:,.1f} MB, which a tokenizer "
            f"encodes at once in about {need / 2**30:,.1f} GB (this machine has {memory_bytes / 2**30:,.1f} GB); "
            f"give long texts as several documents (files, or JSON Lines: one document a line)")


def _other_corpus_warnings(d: DataConfig, manifest: dict | None, label: str) -> list[str]:
    """data.source's warnings (files left out, a cap that cut it, ...) of a corpus of data.blend or
    data.val_source, read as data.source (``d``), their messages naming it by ``label``."""
    found = (left_out_warning(d), tool_folder_warning(d), single_file_warning(d), cap_warning(d, manifest),
             encoding_warning(d, manifest))
    return [w.replace(f"data.source = '{d.source}'", label) for w in found if w]


def prepare_run_data(cfg, run_dir: Path, main: bool, log=None) -> None:
    """Before the ranks start: tokenize the corpus if it needs it (once; verified when it was there
    already), refuse one too short for a window, and keep the tokenizer in the run directory (on the
    main process), so the run's export finds it wherever the original file goes."""
    import shutil

    from bigtrain.config import ConfigError
    from bigtrain.data.tokenizer import tokenizer_kind
    from bigtrain.distributed.launch import launched_by_bigtrain

    d = cfg.data
    if main and (warning := long_document_warning(d)) and not launched_by_bigtrain():  # before the build runs
        print(f"bigtrain: warning: {warning}", file=sys.stderr)
    try:
        manifest = prepare_corpus(d, check=True, log=log if main else None)
    except ValueError as e:  # a record without its field, a damaged cache: one line naming it
        raise ConfigError(str(e)) from None
    if manifest is not None:
        tokens = manifest["tokens"]
        train = tokens - int(tokens * d.val_fraction)
        if train < d.seq_len + 2:
            # a cap that cut the corpus is the cause to name (the byte-level check names it too)
            cut = manifest.get("cut_at_max_bytes") and f" (data.max_bytes = {d.max_bytes} cut it short)"
            raise ConfigError(f"data.source = '{d.source}' tokenizes to {tokens} tokens{cut or ''}"
                              + (f" ({train} before the held-out slice)" if d.val_fraction else "")
                              + f", fewer than data.seq_len + 2 = {d.seq_len + 2}; "
                              + ("raise data.max_bytes (0: no cap) or lower data.seq_len" if cut else
                                 "lower data.seq_len or give a longer corpus"))
        problem = split_problem(tokens, d.seq_len, d.val_fraction)  # the held-out slice: a window too
        if problem:
            raise ConfigError(f"{problem} (data.source = '{d.source}' tokenizes to {tokens} tokens)")
    # Said by the main process of a run no launcher of ours started (else its launcher said them):
    # only there are they worked out (they walk folders and open files; every rank came here).
    say = main and not launched_by_bigtrain()
    warnings = [left_out_warning(d), tool_folder_warning(d), single_file_warning(d), cap_warning(d, manifest),
                encoding_warning(d, manifest), small_corpus_warning(cfg, manifest)] if say else []
    for path, _ in parse_blend(d.blend):
        blended = blended_config(d, path)
        try:
            part = prepare_corpus(blended, check=True, log=log if main else None)
        except ValueError as e:
            raise ConfigError(f"data.blend's {path}: {e}") from None
        if part is not None and (problem := split_problem(part["tokens"], d.seq_len, d.val_fraction)):
            raise ConfigError(f"{problem} (data.blend's {path} tokenizes to {part['tokens']} tokens)")
        warnings += _other_corpus_warnings(blended, part, f"data.blend's {path}") if say else []
    if d.val_source:
        held_out_data = held_out_config(d)
        try:
            held_out = prepare_corpus(held_out_data, check=True, log=log if main else None)
        except ValueError as e:
            raise ConfigError(f"data.val_source: {e}") from None
        if held_out is not None and held_out["tokens"] < d.seq_len + 1:
            raise ConfigError(f"data.val_source = '{d.val_source}' tokenizes to {held_out['tokens']} tokens, fewer than "
                              f"one window (data.seq_len + 1 = {d.seq_len + 1}); give a longer held-out corpus")
        if say:
            warnings += _other_corpus_warnings(held_out_data, held_out, f"data.val_source = '{d.val_source}'")
    for warning in filter(None, warnings):
        print(f"bigtrain: warning: {warning}", file=sys.stderr)
    if main and d.tokenizer != BYTES:
        run_dir = Path(run_dir)
        run_dir.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(tokenizer_file(d.tokenizer), run_dir / RUN_TOKENIZER_NAMES[tokenizer_kind(d.tokenizer)])
