"""Documents of a text corpus, in a fixed order: what a tokenizer reads.

``data.source`` names a text file (one document), a JSON Lines file (one document a line: the string
in its ``data.text_field``), a Parquet file (one document a row of that column; needs ``pyarrow``),
a ``.json`` file of records (an array of objects, or JSON lines: :func:`json_records_source`), or
a folder of such files (sorted by path, each read as its suffix says; a ``.json`` file in a folder
is text, as a code folder's ``package.json`` is). ``data.max_bytes`` caps
the UTF-8 bytes taken, in that order; the last document is cut at the cap.
"""

from __future__ import annotations

import importlib.util
import json
import shlex
from collections.abc import Iterator
from pathlib import Path

from bigtrain.data.corpus import TEXT_SUFFIXES, folder_files
from bigtrain.data.json_array import JSONShapeError, array_items, top_level

RECORD_SUFFIXES = (".jsonl", ".parquet")  # a document per line / row, in data.text_field
DOCUMENT_SUFFIXES = TEXT_SUFFIXES + RECORD_SUFFIXES


class DocumentError(ValueError):
    """A corpus file that cannot be read as documents; the message names the file, line and field."""


# The first bytes of compressed files: a corpus named as one was read as text (its compressed bytes
# trained on, without a word at the byte level).
COMPRESSED_MAGIC = {b"\x1f\x8b": "gzip", b"\x28\xb5\x2f\xfd": "zstd", b"BZh": "bzip2",
                    b"\xfd7zXZ\x00": "xz", b"PK\x03\x04": "zip"}
DECOMPRESS = {"gzip": "gunzip -k", "zstd": "zstd -d", "bzip2": "bunzip2 -k", "xz": "unxz -k", "zip": "unzip"}


def compressed_problem(path: Path) -> str | None:
    """Why a ``data.source`` file cannot be read as it is: compressed (gzip, zstd, ...), by its
    first bytes; None for anything else (or a file that cannot be read: said elsewhere)."""
    try:
        with open(path, "rb") as f:
            head = f.read(6)
    except OSError:
        return None
    kind = next((k for magic, k in COMPRESSED_MAGIC.items() if head.startswith(magic)), None)
    if kind is None:
        return None
    if kind == "zip" and _torch_saved(path):  # torch.save writes a zip: "unzip ids.pt" was the advice
        return (f"data.source = '{path}' is a PyTorch file (torch.save), not text or token ids bigtrain reads; save "
                f"the ids with numpy instead: np.save('ids.npy', tensor.numpy()) (integers), and give the .npy")
    return (f"data.source = '{path}' is a {kind}-compressed file, which bigtrain does not decompress (its compressed "
            f"bytes would be trained on as text); decompress it first ({DECOMPRESS[kind]} {shlex.quote(str(path))}) and give the "
            f"plain file")


def saved_dataset_problem(path: Path) -> str | None:
    """A Hugging Face ``datasets`` folder written by ``save_to_disk`` (``*.arrow`` shards beside its
    ``state.json`` and ``dataset_info.json``): read as a corpus folder, its two JSON metadata files
    were the whole corpus (.json is read as text) and its records were left out."""
    try:
        if not (path.is_dir() and (path / "state.json").is_file() and (path / "dataset_info.json").is_file()
                and any(path.glob("*.arrow"))):
            return None
    except OSError:
        return None
    return (f"data.source = '{path}' is a Hugging Face datasets folder (save_to_disk's .arrow files), which bigtrain "
            f"does not read (only its JSON metadata would be trained on); write it as Parquet or JSON Lines first: "
            f"datasets.load_from_disk('{path}').to_parquet('corpus.parquet'), and give that file (with "
            f"data.text_field naming the text column)")


def _torch_saved(path: Path) -> bool:
    """Whether a zip file is torch.save's (its archive holds a pickle: ``NAME/data.pkl``)."""
    import zipfile

    try:
        with zipfile.ZipFile(path) as archive:
            return any(name.endswith("/data.pkl") or name == "data.pkl" for name in archive.namelist())
    except (OSError, zipfile.BadZipFile):
        return False


def corpus_files(source: Path) -> list[Path]:
    """The files a source holds, in the order they are read."""
    if source.is_file():
        return [source]
    return [p for p in folder_files(source) if p.suffix in DOCUMENT_SUFFIXES]


def left_out_files(source: Path) -> list[Path]:
    """The files of a folder source that :func:`corpus_files` does not read (their suffix is none of
    :data:`DOCUMENT_SUFFIXES`), hidden files and folders aside (``.git``, ``.DS_Store``): a folder of
    .js, .csv or suffix-less files beside its .md ones trained on less than its owner thought,
    without a word (the launcher says so)."""
    if not source.is_dir():
        return []
    return sorted(p for p in folder_files(source) if p.suffix not in DOCUMENT_SUFFIXES
                  and not any(part.startswith(".") for part in p.relative_to(source).parts))


TOOL_FOLDERS = ("node_modules", "site-packages", "__pycache__")  # a project's tools, not its text


def tool_folder_files(source: Path, files: list[Path]) -> dict[str, int]:
    """Of the files a folder source reads, those under a hidden folder (.venv, .git, .tox) or a tool's
    (node_modules, site-packages), counted by that folder's name: a project folder given as the
    corpus trained on its virtual environment's thousands of .py files."""
    counts: dict[str, int] = {}
    for f in files:
        try:
            parts = f.relative_to(source).parts[:-1]
        except ValueError:
            continue
        home = next((p for p in parts if p.startswith(".") or p in TOOL_FOLDERS), None)
        if home is not None:
            counts[home] = counts.get(home, 0) + 1
    return counts


def left_out_summary(source: Path, files: list[Path], shown: int = 6) -> str:
    """'5 .js, 3 .csv, 1 without a suffix (LICENSE)': ``files`` counted by suffix, most first."""
    counts: dict[str, int] = {}
    for f in files:
        counts[f.suffix] = counts.get(f.suffix, 0) + 1
    ranked = sorted(counts.items(), key=lambda kv: (not kv[0], -kv[1], kv[0]))  # suffix-less files last
    parts = []
    for suffix, count in ranked[:shown]:
        if suffix:
            parts.append(f"{count} {suffix}")
        else:
            names = [f.relative_to(source).as_posix() for f in files if not f.suffix][:3]
            parts.append(f"{count} without a suffix ({', '.join(names)}{', ...' if count > len(names) else ''})")
    if len(ranked) > shown:
        parts.append(f"{sum(c for _, c in ranked[shown:])} of {len(ranked) - shown} other suffixes")
    return ", ".join(parts)


def has_records(files: list[Path]) -> bool:
    return any(f.suffix in RECORD_SUFFIXES for f in files)


JSON_SUFFIX = ".json"


def json_records_source(source: Path) -> bool:
    """Whether ``data.source`` names one ``.json`` file, read as records (a top-level array of
    objects, or JSON lines, as datasets' ``to_json`` writes), not as one document of JSON syntax.
    Only a file named by itself: in a folder a ``.json`` file is text (a project's configuration
    files), as before."""
    return source.suffix == JSON_SUFFIX and source.is_file()


def parquet_missing() -> str | None:
    return None if importlib.util.find_spec("pyarrow") else "pip install pyarrow"


def _record_text(record: object, field: str, where: str) -> str:
    """The text under ``field`` of one record (``where``: its file and line or item, for the error)."""
    text = record.get(field) if isinstance(record, dict) else None
    if isinstance(record, dict) and field in record and not isinstance(text, str):
        # the key is there: "set data.text_field to the key that holds the text" named the one it had
        shown = repr(text) if len(repr(text)) <= 40 else repr(text)[:37] + "..."
        raise DocumentError(f"data.text_field = '{field}': {where} holds {shown} under it ({type(text).__name__}, "
                            f"not text); make every record's '{field}' a string, or set data.text_field to the key "
                            f"that holds the text")
    if not isinstance(text, str):
        keys = ", ".join(repr(k) for k in list(record)[:8]) if isinstance(record, dict) else "none"
        raise DocumentError(f"data.text_field = '{field}': {where} has no text under it "
                            f"(its keys: {keys}); set data.text_field to the key that holds the text")
    return text


def _jsonl(path: Path, field: str) -> Iterator[str]:
    with open(path, "rb") as f:
        for number, raw in enumerate(f, 1):
            try:
                # a byte-order mark (Windows tools write one) starts the file, not its first record
                line = raw.decode("utf-8-sig" if number == 1 else "utf-8")
            except UnicodeDecodeError as e:  # name the file and line (the codec's message names neither)
                raise DocumentError(f"data.source: {path} line {number} is not UTF-8 ({e.reason} at byte {e.start} "
                                    f"of the line); save the file as UTF-8") from None
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except ValueError as e:
                raise DocumentError(f"data.source: {path} line {number} is not JSON ({e})") from None
            yield _record_text(record, field, f"{path} line {number}")


JSON_SHAPES = ("bigtrain reads a .json data.source as records: a top-level array of objects ([{\"text\": ...}, ...], "
               "datasets' to_json(lines=False)) or JSON lines (one object a line, datasets' to_json())")


def _json_records(path: Path, field: str) -> Iterator[str]:
    """A ``.json`` file's records: its top-level array's objects (streamed), or its lines."""
    try:
        first = top_level(path)
        if first == "[":
            for index, record in array_items(path):
                yield _record_text(record, field, f"{path} item {index + 1} of its array")
            return
    except JSONShapeError as e:
        fix = "save the file as UTF-8" if str(e).startswith("is not UTF-8") else JSON_SHAPES
        raise DocumentError(f"data.source: {path} {e}; {fix}") from None
    if first is None:
        return  # empty: no records, as an empty .jsonl
    if first == "{" and _first_line_is_an_object(path):
        yield from _jsonl(path, field)
        return
    shape = ("one JSON object over several lines" if first == "{"
             else f"neither an array nor JSON lines (it starts with {first!r})")
    raise DocumentError(f"data.source: {path} is {shape}, not records; {JSON_SHAPES}. Write its records as one of "
                        f"these, or give a .txt file to train on it as one plain-text document")


def _first_line_is_an_object(path: Path) -> bool:
    with open(path, "rb") as f:
        for raw in f:
            if raw.strip():
                try:
                    return isinstance(json.loads(raw), dict)
                except ValueError:
                    return False
    return False


def _parquet(path: Path, field: str) -> Iterator[str]:
    need = parquet_missing()
    if need:
        raise DocumentError(f"data.source: {path} is a Parquet file, which needs pyarrow: {need}")
    import pyarrow.parquet as pq

    handle = pq.ParquetFile(path)
    if field not in handle.schema_arrow.names:
        raise DocumentError(f"data.text_field = '{field}': {path} has no such column (its columns: "
                            f"{', '.join(handle.schema_arrow.names[:8])}); set data.text_field to the text column")
    row = 0
    for batch in handle.iter_batches(columns=[field], batch_size=1024):
        for text in batch.column(0).to_pylist():
            row += 1
            if text is None:
                continue
            if not isinstance(text, str):  # str() of a list of messages, bytes or a number is not the text
                raise DocumentError(f"data.text_field = '{field}': {path} row {row} holds {type(text).__name__}, not "
                                    f"text; set data.text_field to a column of strings (or turn the column into text "
                                    f"first, e.g. a chat template applied to its messages)")
            yield text


def file_documents(path: Path, field: str, not_utf8: list[str] | None = None,
                   json_records: bool = False) -> Iterator[str]:
    """The documents of one file. A text file that is not UTF-8 (Latin-1, say) is read with its
    undecodable bytes as U+FFFD rather than stopping the run, and its path is added to
    ``not_utf8``: the launcher says so (every accented letter of such a file became the same token,
    without a word). ``json_records``: a ``.json`` file is records (:func:`json_records_source`)."""
    if json_records and path.suffix == JSON_SUFFIX:
        yield from _json_records(path, field)
    elif path.suffix == ".jsonl":
        yield from _jsonl(path, field)
    elif path.suffix == ".parquet":
        yield from _parquet(path, field)
    else:
        data = path.read_bytes()
        try:
            yield data.decode("utf-8")
        except UnicodeDecodeError:
            if not_utf8 is not None:
                not_utf8.append(str(path))
            yield data.decode("utf-8", errors="replace")


class Documents:
    """Every document of ``files`` in order, at most ``max_bytes`` bytes of UTF-8 in all (0: no cap).
    Once iterated, ``cut`` says whether the cap left text out (the launcher says so: a cap that
    keeps a demo short must not drop most of a user's corpus without a word), and ``not_utf8``
    lists the text files read with undecodable bytes replaced (:func:`file_documents`).
    ``json_records``: the ``.json`` files are records (a ``.json`` data.source)."""

    def __init__(self, files: list[Path], field: str, max_bytes: int = 0, json_records: bool = False):
        self.files, self.field, self.max_bytes, self.cut = files, field, max_bytes, False
        self.json_records = json_records
        self.not_utf8: list[str] = []

    def __iter__(self) -> Iterator[str]:
        total, cap = 0, self.max_bytes
        for path in self.files:
            for text in file_documents(path, self.field, self.not_utf8, self.json_records):
                if cap:
                    if total >= cap:  # full: a document with any text left is text left out
                        if text:
                            self.cut = True
                            return
                        continue
                    data = text.encode("utf-8")
                    if total + len(data) > cap:
                        self.cut = True
                        yield data[:cap - total].decode("utf-8", errors="ignore")
                        return
                    total += len(data)
                yield text
