"""A ``.json`` data.source is records: a top-level array of objects (datasets' ``to_json(lines=False)``)
or JSON lines (datasets' ``to_json()``, its default), each document the string under
``data.text_field``, as a ``.jsonl`` file's. It was read as one plain-text document (its brackets,
quotes and keys trained on). The array is streamed item by item (checked here with reads of a few
bytes, which split items, strings and UTF-8 characters); the shapes that are not records, a missing
field and a broken file are errors naming the file, the place and the fix."""

import json
from pathlib import Path

import numpy as np
import pytest

from bigtrain.config import DataConfig
from bigtrain.data import load_corpus, prepare_corpus, uses_shards
from bigtrain.data.documents import Documents, DocumentError
from bigtrain.data.json_array import JSONShapeError, array_items
from bigtrain.data.load import shard_folder, single_file_warning

RECORDS = [{"id": 1, "text": "first document\n"},
           {"id": 2, "text": "zweites Dokument: äöü €\n", "meta": [1, {"a": "]"}]},
           {"id": 3, "text": "third, with \"quotes\", [brackets] and {braces}"}, {"id": 4, "text": ""}]
TEXTS = [r["text"] for r in RECORDS]


def _data(source: Path, cache: Path, **kw) -> DataConfig:
    return DataConfig(source=str(source), tokenizer="bytes", cache_dir=str(cache), max_bytes=0, **kw)


def _ids(texts) -> list[int]:
    return [b for t in texts for b in t.encode("utf-8")]


@pytest.mark.parametrize("shape", ["array", "array-indented", "lines"])
def test_a_json_file_is_read_as_records_of_its_text_field(shape, tmp_path):
    source = tmp_path / "data.json"
    if shape == "lines":
        source.write_text("".join(json.dumps(r) + "\n" for r in RECORDS))
    else:
        source.write_text(json.dumps(RECORDS, indent=2 if shape == "array-indented" else None, ensure_ascii=False))
    d = _data(source, tmp_path / "cache")
    assert uses_shards(d) and single_file_warning(d) is None
    assert list(Documents([source], "text", json_records=True)) == TEXTS
    assert np.asarray(load_corpus(d)).tolist() == _ids(TEXTS)


def test_a_json_array_is_streamed_across_reads_that_split_its_items(tmp_path):
    """Reads of 1 to 7 bytes split keys, strings, escapes, numbers and a 3-byte UTF-8 character
    (the euro sign); the items are those json.load finds. A long item grows the read."""
    items = [*RECORDS, 12345, -0.5e3, "a string", [1, [2]], {"long": "x" * 5000}, None, True]
    path = tmp_path / "a.json"
    path.write_text(" \n" + json.dumps(items, ensure_ascii=False) + "\n\n")
    for chunk in range(1, 8):
        assert [item for _, item in array_items(path, chunk)] == items, chunk
    # A number cut after its '.', 'e' or 'e-' decodes as the digits before it: those items ended
    # there, and the rest was "followed by '.', not ',' or ']'" (read again, the number whole).
    numbers = [12.5, 0.25, 3e-07, 4.5e+22, -1e+100, 7, 0.125]
    path.write_text(json.dumps(numbers))
    for chunk in range(1, 12):
        assert [item for _, item in array_items(path, chunk)] == numbers, chunk
    path.write_text("[ ]")
    assert list(array_items(path, 1)) == []


@pytest.mark.parametrize("content, said", [
    ('[{"text": "a"}, {"text": "b"', r"ends inside item 2 of its top-level array \(a file cut short\?\)"),
    ('[{"text": "a"}, {"text": "b', r"ends inside item 2 of its top-level array \(a file cut short\?\)"),
    ('[{"text": "a"}, ', r"ends inside its top-level array, after item 1 \(a file cut short\?\)"),
    ('[{"text": "a"}, {"text": "b"}', r"item 2 of its top-level array is followed by the end of the file"),
    ('[{"text": "a"},]', r"item 2 of its top-level array is not JSON \(Expecting value\)"),
    ('[{"text": "a"} {"text": "b"}]', r"item 1 of its top-level array is followed by '\{', not ',' or '\]'"),
    ('[{"text": "a"}, {"text": nope}]', r"item 2 of its top-level array is not JSON"),
    ('[{"text": "a"}]\n[{"text": "b"}]', r"holds more after its top-level array"),
])
def test_a_broken_json_array_is_named_with_the_item_at_fault(content, said, tmp_path):
    path = tmp_path / "broken.json"
    path.write_text(content)
    for chunk in (1, 3, 1 << 20):
        with pytest.raises(JSONShapeError, match=said):
            list(array_items(path, chunk))
    with pytest.raises(DocumentError, match=rf"data.source: .*broken.json {said}.*top-level array of objects"):
        list(Documents([path], "text", json_records=True))


def test_a_broken_item_early_in_a_large_array_is_said_without_reading_the_rest(tmp_path, monkeypatch):
    import bigtrain.data.json_array as module

    path = tmp_path / "big.json"
    with open(path, "w") as f:
        f.write('[{"text": "a"}, {"text": oops}, ')
        f.write(", ".join(json.dumps({"text": "y" * 1000}) for _ in range(4000)) + "]")
    read = []

    class Counting:
        def __init__(self, f):
            self.f = f

        def read(self, n):
            data = self.f.read(n)
            read.append(len(data))
            return data

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            self.f.close()

    monkeypatch.setattr(module, "open", lambda p, mode: Counting(open(p, mode)), raising=False)
    with pytest.raises(JSONShapeError, match="item 2 of its top-level array is not JSON"):
        list(array_items(path, 4096))
    assert sum(read) <= 2 * 4096 < path.stat().st_size


@pytest.mark.parametrize("shape", ["array", "lines"])
def test_a_record_without_the_text_field_names_the_field_its_keys_and_the_fix(shape, tmp_path):
    records = [{"text": "a"}, {"content": "b", "id": 7}]
    source = tmp_path / "data.json"
    source.write_text(json.dumps(records) if shape == "array" else "".join(json.dumps(r) + "\n" for r in records))
    where = "item 2 of its array" if shape == "array" else "line 2"
    with pytest.raises(DocumentError, match=rf"data.text_field = 'text': .*data.json {where} has no text under it "
                                            r"\(its keys: 'content', 'id'\); set data.text_field to the key"):
        prepare_corpus(_data(source, tmp_path / "cache"), workers=1)
    first = "item 1 of its array" if shape == "array" else "line 1"
    with pytest.raises(DocumentError, match=rf"data.text_field = 'content': .*data.json {first} has no text"):
        list(Documents([source], "content", json_records=True))
    source.write_text(json.dumps(["just a string"]))
    with pytest.raises(DocumentError, match=r"item 1 of its array has no text under it \(its keys: none\)"):
        list(Documents([source], "text", json_records=True))
    # the key is there but holds no string: "set data.text_field to the key that holds the text" named the one it had
    source.write_text(json.dumps([{"text": 5}]))
    with pytest.raises(DocumentError, match=r"item 1 of its array holds 5 under it \(int, not text\); make every "
                                            r"record's 'text' a string"):
        list(Documents([source], "text", json_records=True))


@pytest.mark.parametrize("content, said", [
    ('{\n  "version": 1,\n  "data": [{"text": "a"}]\n}\n', "is one JSON object over several lines, not records"),
    ('"a string"', "is neither an array nor JSON lines \\(it starts with '\"'\\), not records"),
    ("plain words", "is neither an array nor JSON lines \\(it starts with 'p'\\), not records"),
])
def test_a_json_file_that_is_not_records_is_refused_with_the_shapes_it_may_have(content, said, tmp_path):
    source = tmp_path / "data.json"
    source.write_text(content)
    with pytest.raises(DocumentError, match=rf"data.source: .*data.json {said}; bigtrain reads a .json data.source as "
                                            r"records: a top-level array of objects .* or JSON lines .*give a .txt file"):
        prepare_corpus(_data(source, tmp_path / "cache"), workers=1)


def test_a_json_file_that_is_not_utf8_is_named_with_the_byte(tmp_path):
    source = tmp_path / "data.json"
    source.write_bytes(b'[{"text": "caf\xe9"}]')
    with pytest.raises(DocumentError, match=r"data.json is not UTF-8 \(invalid continuation byte at byte 14\); save the "
                                            r"file as UTF-8"):
        list(Documents([source], "text", json_records=True))


@pytest.mark.parametrize("name", ["data.json", "data-lines.json", "data.jsonl"])
def test_records_after_a_byte_order_mark_are_read(name, tmp_path):
    """A file saved by a Windows tool starts with a UTF-8 byte-order mark (and may end its lines with
    CRLF): it was refused, line 1 "not JSON (Unexpected UTF-8 BOM ...)" or "neither an array nor
    JSON lines (it starts with '\\ufeff')"."""
    source = tmp_path / name
    lines = "\r\n".join(json.dumps(r, ensure_ascii=False) for r in RECORDS)
    source.write_bytes(b"\xef\xbb\xbf" + (json.dumps(RECORDS) if name == "data.json" else lines).encode())
    assert list(Documents([source], "text", json_records=True)) == TEXTS


def test_an_empty_json_file_has_no_records(tmp_path):
    source = tmp_path / "data.json"
    source.write_text("  \n")
    assert list(Documents([source], "text", json_records=True)) == []


def test_a_json_file_in_a_folder_is_still_text_and_cached_apart_from_the_same_file_as_records(tmp_path):
    """A folder's .json files are text (a project's package.json), as before; the same file named as
    the source is records, under a cache key of its own (same relative path, same bytes)."""
    folder = tmp_path / "src"
    folder.mkdir()
    source = folder / "data.json"
    source.write_text(json.dumps(RECORDS))
    as_text, as_records = _data(folder, tmp_path / "cache", document_end="\n"), _data(source, tmp_path / "cache",
                                                                                   document_end="\n")
    assert shard_folder(as_text) != shard_folder(as_records)
    assert np.asarray(load_corpus(as_text)).tolist() == _ids([source.read_text() + "\n"])
    assert np.asarray(load_corpus(as_records)).tolist() == _ids(t + "\n" for t in TEXTS if t)
