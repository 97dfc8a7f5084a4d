"""Special-token text inside a document is ordinary text, for every tokenizer kind.

A web page that quotes "<|endoftext|>" or "</s>" was encoded by a tokenizer.json as that special id
(``encode(text, add_special_tokens=False)`` still splits special tokens out of the text): documents
ended where their author only wrote characters, and a document could inject control tokens. The
reference here is independent of the tokenizer's special handling: the same tokenizer.json with its
special tokens removed from the file (the same model, pre-tokenizer and merges), which cannot know
the text as special. The ids bigtrain puts there itself (the post-processor's frame,
``data.document_end``) keep their ids; a corpus cached by the old behaviour (shard format 2) is not
reused."""

import json
from pathlib import Path

import numpy as np
import pytest

from bigtrain.config import DataConfig
from bigtrain.data import load_corpus, prepare_corpus
from bigtrain.data import shards
from bigtrain.data.load import shard_folder
from bigtrain.data.shards import read_manifest
from bigtrain.data.tokenizer import ByteTokenizer, HFTokenizer, write_for_transformers
from tests.helpers import byte_level_bpe, stdlib_texts

tokenizers = pytest.importorskip("tokenizers")

SPECIAL = ["<|endoftext|>", "</s>", "<s>"]
# Documents that quote special tokens, inside words, alone, and at their ends.
DOCUMENTS = ["print('<|endoftext|>')  # GPT-2's end of text\n", "</s>", "a<s>b</s>c<|endoftext|>",
             "plain text without any\n", "the tag <s> opens, </s> closes <|endoftext|>"]


@pytest.fixture(scope="module")
def bpe(tmp_path_factory):
    """(tokenizer.json with special tokens, the same file without them): a 300-id byte-level BPE."""
    tok = byte_level_bpe(300, SPECIAL, stdlib_texts(6))
    folder = tmp_path_factory.mktemp("tok")
    path = folder / "tokenizer.json"
    tok.save(str(path))
    return path, _without_special(path, folder / "plain.json")


def _without_special(path: Path, out: Path) -> Path:
    """``path`` with its special tokens taken out of the file (and no post-processor): its model
    encodes their text as it encodes any characters."""
    data = json.loads(path.read_text())
    data["added_tokens"] = [t for t in data["added_tokens"] if not t["special"]]
    data["post_processor"] = None
    out.write_text(json.dumps(data))
    return out


def _plain_ids(plain: Path, text: str) -> list[int]:
    from tokenizers import Tokenizer

    return Tokenizer.from_file(str(plain)).encode(text, add_special_tokens=False).ids


def _records(tmp_path: Path, texts: list[str]) -> Path:
    source = tmp_path / "docs.jsonl"
    source.write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))
    return source


def _data(source, tokenizer, cache, **kw) -> DataConfig:
    return DataConfig(source=str(source), tokenizer=str(tokenizer), cache_dir=str(cache), max_bytes=0, **kw)


def test_the_tokenizers_library_splits_special_text_out_unless_told_not_to(bpe):
    """What the fix rests on: add_special_tokens=False alone still gives the special id (the bug),
    encode_special_tokens (tokenizers >= 0.15) gives the reference's ids."""
    from tokenizers import Tokenizer

    path, plain = bpe
    tok = Tokenizer.from_file(str(path))
    end = tok.token_to_id("<|endoftext|>")
    assert end in tok.encode("a<|endoftext|>b", add_special_tokens=False).ids
    tok.encode_special_tokens = True
    assert tok.encode("a<|endoftext|>b", add_special_tokens=False).ids == _plain_ids(plain, "a<|endoftext|>b")


def test_special_text_in_a_document_tokenizes_as_ordinary_text(bpe, tmp_path):
    path, plain = bpe
    specials = {HFTokenizer(path).token_id(name) for name in SPECIAL}
    d = _data(_records(tmp_path, DOCUMENTS), path, tmp_path / "cache")
    prepare_corpus(d, workers=1)
    ids = np.asarray(load_corpus(d))
    assert np.array_equal(ids, np.concatenate([_plain_ids(plain, t) for t in DOCUMENTS]))
    assert not specials & set(ids.tolist())
    # Each document whole: the text of a special token neither ends nor splits it.
    tok = HFTokenizer(path)
    for text, encoded in zip(DOCUMENTS, tok.encode_batch(DOCUMENTS)):
        assert encoded.tolist() == _plain_ids(plain, text) and tok.decode(encoded.tolist()) == text
        assert tok.prompt_ids(text) == _plain_ids(plain, text)


def test_the_ids_bigtrain_puts_around_documents_keep_their_ids(bpe, tmp_path):
    """data.document_end = '<|endoftext|>' is appended as its id after each document; a post-processor
    framing each document with <s> ... </s> still puts those ids; the same text inside a document is
    text. The special ids appear exactly once per document each, where bigtrain put them."""
    from tokenizers import Tokenizer, processors

    path, plain = bpe
    tok = Tokenizer.from_file(str(path))
    bos, eos, end = (tok.token_to_id(t) for t in ("<s>", "</s>", "<|endoftext|>"))
    source = _records(tmp_path, DOCUMENTS)

    d = _data(source, path, tmp_path / "cache", document_end="<|endoftext|>")
    ids = np.asarray(load_corpus(d))
    assert np.array_equal(ids, np.concatenate([_plain_ids(plain, t) + [end] for t in DOCUMENTS]))
    assert (ids == end).sum() == len(DOCUMENTS)

    tok.post_processor = processors.TemplateProcessing(single="<s> $A </s>", special_tokens=[("<s>", bos), ("</s>", eos)])
    framing = tmp_path / "framing" / "tokenizer.json"
    framing.parent.mkdir()
    tok.save(str(framing))
    assert HFTokenizer(framing).frame_ids() == ([bos], [eos])
    ids = np.asarray(load_corpus(_data(source, framing, tmp_path / "cache")))
    assert np.array_equal(ids, np.concatenate([[bos] + _plain_ids(plain, t) + [eos] for t in DOCUMENTS]))
    assert (ids == bos).sum() == (ids == eos).sum() == len(DOCUMENTS)
    assert HFTokenizer(framing).prompt_ids("</s>") == [bos] + _plain_ids(plain, "</s>")


def test_a_corpus_cached_by_the_old_behaviour_is_tokenized_again(bpe, tmp_path, monkeypatch):
    """A format-2 cache (special text encoded as the special id) is not reused: FORMAT is in the key,
    so the corpus is tokenized again under a folder of its own, and a format-2 manifest is not read."""
    path, plain = bpe
    end = HFTokenizer(path).token_id("<|endoftext|>")
    d = _data(_records(tmp_path, DOCUMENTS), path, tmp_path / "cache")

    def old_encode_batch(self, texts):
        before, self._tok.encode_special_tokens = self._tok.encode_special_tokens, False
        try:
            return [np.asarray(e.ids, dtype=np.int64) for e in self._tok.encode_batch(texts)]
        finally:
            self._tok.encode_special_tokens = before  # (the build's tokenizer is cached per process)

    with monkeypatch.context() as old:
        old.setattr(shards, "FORMAT", 2)
        old.setattr(HFTokenizer, "encode_batch", old_encode_batch)
        prepare_corpus(d, workers=1)
        old_folder = shard_folder(d)
        assert end in np.asarray(load_corpus(d)).tolist()  # what the old build wrote
    assert read_manifest(old_folder) is None  # format 2: not read by this version
    assert shard_folder(d) != old_folder
    ids = np.asarray(load_corpus(d))
    assert np.array_equal(ids, np.concatenate([_plain_ids(plain, t) for t in DOCUMENTS])) and end not in ids


def test_byte_and_tiktoken_tokenizers_read_special_text_as_text(tmp_path):
    """The byte tokenizer has no special tokens, and a tiktoken file is read with special_tokens={}
    and encode_ordinary: the text of a special token is its characters (and converted for
    transformers, the file has no special tokens either, so AutoTokenizer agrees)."""
    import base64

    text = DOCUMENTS[2]
    assert ByteTokenizer().encode_batch([text])[0].tolist() == list(text.encode("utf-8"))
    tiktoken = pytest.importorskip("tiktoken")
    from bigtrain.data.tokenizer import CL100K_PATTERN, TiktokenTokenizer

    ranks = {bytes([i]): i for i in range(256)}
    ranks[b"</"] = 256
    enc_file = tmp_path / "small.tiktoken"
    enc_file.write_text("".join(f"{base64.b64encode(t).decode()} {r}\n" for t, r in ranks.items()))
    enc = tiktoken.Encoding("small", pat_str=CL100K_PATTERN, mergeable_ranks=ranks, special_tokens={})
    d = _data(_records(tmp_path, DOCUMENTS), enc_file, tmp_path / "cache")
    assert np.asarray(load_corpus(d)).tolist() == [i for t in DOCUMENTS for i in enc.encode_ordinary(t)]
    assert TiktokenTokenizer(enc_file).prompt_ids(text) == enc.encode_ordinary(text)
    transformers = pytest.importorskip("transformers")
    write_for_transformers(str(enc_file), tmp_path, 64)
    assert transformers.AutoTokenizer.from_pretrained(str(tmp_path))(text)["input_ids"] == enc.encode_ordinary(text)


def test_transformers_splits_special_text_out_unless_told_not_to(bpe, tmp_path):
    """What write_for_transformers' docstring says: the exported tokenizer, called on text, gives a
    special token's text its id (transformers' default); split_special_tokens=True encodes as training."""
    transformers = pytest.importorskip("transformers")
    path, plain = bpe
    end = HFTokenizer(path).token_id("<|endoftext|>")
    write_for_transformers(str(path), tmp_path, 64, {"eos_token_id": end})
    loaded = transformers.AutoTokenizer.from_pretrained(str(tmp_path))
    text = DOCUMENTS[0]
    assert end in loaded(text)["input_ids"]
    assert loaded(text, split_special_tokens=True)["input_ids"] == HFTokenizer(path).encode_batch([text])[0].tolist()
