"""Text through a real tokenizer: a small byte-level BPE ``tokenizer.json`` that the tests train
themselves with the ``tokenizers`` library (no download), corpora as text folders and JSON Lines
records, tokenized once in parallel into sharded memory-mapped id files (resumable, checksummed,
cached by content), sampled as any corpus is, and exported beside the weights so that transformers'
AutoTokenizer and AutoModelForCausalLM load the folder and give bigtrain's logits."""

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from bigtrain.check.reference import reference_losses
from bigtrain.checkpoint.export import checkpoint_weights
from bigtrain.cli import main
from bigtrain.config import ConfigError, DataConfig, load_config
from bigtrain.data import ShardedTokens, TokenSampler, load_corpus, prepare_corpus
from bigtrain.data.load import shard_folder
from bigtrain.data.shards import CorpusError, read_manifest
from bigtrain.data.tokenizer import CL100K_PATTERN, write_for_transformers
from bigtrain.models.llama import build_model
from bigtrain.preflight import data_problems
from bigtrain.testing import run_ranks
from bigtrain.validation import validate
from tests.helpers import byte_level_bpe, run_steps, stdlib_texts, tiny_config, trainer_on_rank

tokenizers = pytest.importorskip("tokenizers")

VOCAB = 300  # the BPE's ids; the model's vocabulary is larger (padded), as real models' often are
MODEL_VOCAB = 320


def _texts() -> list[str]:
    """Twenty standard-library modules: the same text on every run of this machine's Python."""
    return stdlib_texts(20)


@pytest.fixture(scope="module")
def bpe(tmp_path_factory):
    """(tokenizer.json path, the tokenizers object): a byte-level BPE of VOCAB ids trained here."""
    tok = byte_level_bpe(VOCAB, ["<|endoftext|>"], _texts())
    path = tmp_path_factory.mktemp("tokenizer") / "tokenizer.json"
    tok.save(str(path))
    assert tok.get_vocab_size() == VOCAB
    return path, tok


@pytest.fixture(scope="module")
def text_folder(tmp_path_factory):
    folder = tmp_path_factory.mktemp("text")
    for i, text in enumerate(_texts()):
        (folder / f"doc{i:02d}.txt").write_text(text)
    return folder


def _expected_ids(tok, texts) -> np.ndarray:
    return np.concatenate([np.asarray(tok.encode(t).ids) for t in texts])


def _data(source, tokenizer, cache, **kw) -> DataConfig:
    return DataConfig(**{"source": str(source), "tokenizer": str(tokenizer), "cache_dir": str(cache), "max_bytes": 0,
                         **kw})


# -- the shards ---------------------------------------------------------------------------------
def test_shards_hold_each_documents_ids_in_order_and_sample_as_one_array(bpe, text_folder, tmp_path):
    path, tok = bpe
    d = _data(text_folder, path, tmp_path)
    manifest = prepare_corpus(d, shard_bytes=60_000, workers=2)
    assert len(manifest["shards"]) >= 5 and manifest["documents"] == 20 and manifest["dtype"] == "uint16"
    tokens = load_corpus(d)
    expected = _expected_ids(tok, _texts())
    assert isinstance(tokens, ShardedTokens) and len(tokens) == len(expected)
    assert np.array_equal(np.asarray(tokens), expected)
    # Slices that straddle shard boundaries, views of views, and the sampler's windows.
    first_end = manifest["shards"][0]["tokens"]
    for a, b in ((0, 5), (first_end - 3, first_end + 4), (100, len(expected) - 7)):
        assert np.array_equal(np.asarray(tokens[a:b]), expected[a:b])
    assert np.array_equal(np.asarray(tokens[10:][first_end - 20:first_end]), expected[first_end - 10:first_end + 10])
    ours, plain = (TokenSampler(t, 32, 8, seed=3, val_fraction=0.05) for t in (tokens, expected))
    for step in (0, 7):
        for a, b in zip(ours.batch(step, 0, 8) + ours.eval_batch(1, 2, 0, 8),
                        plain.batch(step, 0, 8) + plain.eval_batch(1, 2, 0, 8)):
            assert torch.equal(a, b)


def test_held_out_and_blended_corpora_are_tokenized_before_launch_as_the_training_corpus_is(bpe, text_folder,
                                                                                            tmp_path):
    """data.val_source and data.blend with a real tokenizer: prepared into shards of their own by the
    launcher's preparation (with the training corpus's tokenizer); the evaluation's windows are the
    held-out corpus's ids, the blended corpus's training ids its text's."""
    from bigtrain.data.load import prepare_run_data, run_sampler

    path, tok = bpe
    val_text = "A held-out document, in words the training corpus may not have. " * 20
    (tmp_path / "val.txt").write_text(val_text)
    blended_text = "def blended(x):\n    return [x for x in range(x)]\n" * 30
    (tmp_path / "code.txt").write_text(blended_text)
    cfg = load_config(preset="tiny", overrides=[f"--data.source={text_folder}", f"--data.tokenizer={path}",
                                                f"--data.val_source={tmp_path / 'val.txt'}", f"--model.vocab_size={VOCAB}",
                                                f"--data.cache_dir={tmp_path / 'cache'}", "--data.seq_len=16",
                                                f"--data.blend={tmp_path / 'code.txt'}=0.25"])
    prepare_run_data(cfg, tmp_path / "run", main=True)
    blended = run_sampler(cfg)
    sampler = blended.parts[0]
    expected = np.asarray(tok.encode(val_text).ids)
    assert isinstance(sampler.val_tokens, ShardedTokens) and np.array_equal(np.asarray(sampler.val_tokens), expected)
    assert np.array_equal(np.asarray(sampler.tokens), _expected_ids(tok, _texts()))  # all of it trains
    assert np.array_equal(np.asarray(blended.parts[1].tokens), np.asarray(tok.encode(blended_text).ids))
    x, y = blended.eval_batch(1, 2, 0, 8)  # data.val_source's windows, blend or not
    starts = np.linspace(0, len(expected) - 17, 16).round().astype(np.int64)[8:]
    assert torch.equal(x, torch.from_numpy(np.stack([expected[s:s + 16] for s in starts])))


def test_a_shard_is_encoded_a_group_of_documents_at_a_time(bpe, text_folder, tmp_path, monkeypatch):
    """A shard's documents go to the tokenizer in groups of about ENCODE_BYTES of text, not all at
    once: a tokenizers Encoding holds strings, offsets and masks for every token, and a 32 MB shard
    of JSON Lines encoded in one call peaked at 2.0 GB in its worker. The ids are those of each
    document encoded alone, the end id after each, in order."""
    import bigtrain.data.shards as shards
    from bigtrain.data.tokenizer import load_tokenizer

    path, tok = bpe
    real, calls = load_tokenizer(str(path)), []

    class Counting:
        vocab_size, kind = real.vocab_size, real.kind

        def encode_batch(self, texts):
            calls.append([len(t) for t in texts])
            return real.encode_batch(texts)

        def __getattr__(self, name):  # frame_ids, token_id: the real tokenizer's
            return getattr(real, name)

    monkeypatch.setattr(shards, "ENCODE_BYTES", 30_000)
    monkeypatch.setitem(shards._WORKER_TOKENIZERS, str(path), Counting())
    d = _data(text_folder, path, tmp_path, document_end="<|endoftext|>")
    prepare_corpus(d, shard_bytes=200_000, workers=1)  # in this process: the counting tokenizer
    assert len(calls) > 2 and sum(len(c) for c in calls) == 20
    assert all(len(c) == 1 or sum(c) <= 30_000 for c in calls), calls
    end = tok.token_to_id("<|endoftext|>")
    expected = np.concatenate([np.append(tok.encode(t).ids, end) for t in _texts()])
    assert np.array_equal(np.asarray(load_corpus(d)), expected)


def test_data_document_end_puts_its_token_after_each_document(bpe, text_folder, tmp_path):
    """data.document_end = '<|endoftext|>': each document's ids, then that token's id (appended as an
    id, not text), in a corpus of its own (the cache key holds it); without it the documents run into
    each other as before (the same key as before the field existed)."""
    path, tok = bpe
    end = tok.token_to_id("<|endoftext|>")
    plain, ended = _data(text_folder, path, tmp_path), _data(text_folder, path, tmp_path, document_end="<|endoftext|>")
    assert shard_folder(plain) != shard_folder(ended)
    manifest = prepare_corpus(ended, shard_bytes=60_000, workers=2)
    expected = np.concatenate([np.append(tok.encode(t).ids, end) for t in _texts()])
    assert manifest["document_end"] == "<|endoftext|>" and np.array_equal(np.asarray(load_corpus(ended)), expected)
    assert np.array_equal(np.asarray(load_corpus(plain)), _expected_ids(tok, _texts()))


def test_a_document_end_the_tokenizer_appends_itself_is_put_once(bpe, text_folder, tmp_path):
    """A tokenizer.json whose post-processor ends each document with <|endoftext|> (``$A <|endoftext|>``),
    and data.document_end = '<|endoftext|>': each document ended with two of them. Now once, as without
    the field; the manifest and the build's log say the tokenizer put it there."""
    from tokenizers import Tokenizer, processors

    path, tok = bpe
    end = tok.token_to_id("<|endoftext|>")
    own = Tokenizer.from_file(str(path))
    own.post_processor = processors.TemplateProcessing(single="$A <|endoftext|>", special_tokens=[("<|endoftext|>", end)])
    appends = tmp_path / "appends" / "tokenizer.json"
    appends.parent.mkdir()
    own.save(str(appends))
    expected = np.concatenate([np.append(tok.encode(t).ids, end) for t in _texts()])
    said = []
    for document_end in ("", "<|endoftext|>"):
        d = _data(text_folder, appends, tmp_path, document_end=document_end)
        manifest = prepare_corpus(d, shard_bytes=60_000, workers=1, log=said.append)
        assert np.array_equal(np.asarray(load_corpus(d)), expected), document_end
        assert manifest["document_end_by_tokenizer"] is bool(document_end)
    assert sum("not put there a second time" in line for line in said) == 1
    # A tokenizer that puts nothing after a document still gets the token from the field.
    d = _data(text_folder, path, tmp_path, document_end="<|endoftext|>")
    assert np.array_equal(np.asarray(load_corpus(d)), expected)


@pytest.mark.parametrize("tokenizer, end, accepted", [("bpe", "<|endoftext|>", True), ("bpe", "</s>", False),
                                                      ("bytes", "|", True), ("bytes", "<eos>", False)])
def test_a_document_end_that_is_not_one_token_is_refused_before_launch(bpe, text_folder, tmp_path, tokenizer, end,
                                                                      accepted):
    spec = str(bpe[0]) if tokenizer == "bpe" else "bytes"
    cfg = load_config(preset="tiny", overrides=[f"--data.source={text_folder}", f"--data.tokenizer={spec}",
                                                f"--data.cache_dir={tmp_path}", "--data.max_bytes=0",
                                                f"--model.vocab_size={VOCAB}", f"--data.document_end={end}"])
    problems = data_problems(cfg)
    assert (problems == []) if accepted else ("data.document_end" in problems[0] and "one token" in problems[0])


def test_a_document_end_with_ids_tokenized_already_is_refused(tmp_path):
    ids = tmp_path / "ids.npy"
    np.save(ids, np.arange(1000, dtype=np.uint16) % 256)
    cfg = load_config(preset="tiny", overrides=[f"--data.source={ids}", "--data.document_end=<|endoftext|>"])
    assert "data.document_end" in data_problems(cfg)[0]


def test_an_interrupted_build_resumes_and_a_damaged_shard_is_found(bpe, text_folder, tmp_path):
    path, _ = bpe
    d = _data(text_folder, path, tmp_path)
    first = prepare_corpus(d, shard_bytes=60_000, workers=1)
    folder = shard_folder(d)
    # As if the build died: no manifest, the last shard never written, one shard's file torn.
    (folder / "manifest.json").unlink()
    last = first["shards"][-1]["file"]
    (folder / last).unlink()
    torn = folder / first["shards"][1]["file"]
    torn.write_bytes(torn.read_bytes()[:-2])
    again = prepare_corpus(d, shard_bytes=60_000, workers=1)
    assert again["resumed_shards"] == len(first["shards"]) - 2  # all but the missing and the torn one
    assert [s["sha256"] for s in again["shards"]] == [s["sha256"] for s in first["shards"]]

    data = bytearray((folder / last).read_bytes())
    data[10] ^= 1  # a flipped bit, same size: the sizes agree, the checksum does not
    (folder / last).write_bytes(bytes(data))
    with pytest.raises(CorpusError, match=rf"damaged \({last} does not match its checksum\); delete that folder"):
        prepare_corpus(d, check=True)


def test_a_tokenizing_process_the_system_kills_is_said_not_waited_for(bpe, text_folder, tmp_path, monkeypatch):
    """A worker killed while it tokenizes a shard (the out-of-memory killer, on a long document): the
    build stops with a CorpusError naming the shard and the fix. multiprocessing.Pool replaced the
    worker and waited for its shard forever, the launcher printing nothing (SIGALRM ends that here)."""
    import os
    import signal

    import bigtrain.data.shards as shards
    from bigtrain.data.tokenizer import load_tokenizer

    real, doomed = load_tokenizer(str(bpe[0])), _texts()[10]

    class KilledOnOneDocument:  # what the forked workers find loaded (shards._WORKER_TOKENIZERS)
        vocab_size = real.vocab_size

        def encode_batch(self, texts):
            if doomed in texts:
                os.kill(os.getpid(), signal.SIGKILL)
            return real.encode_batch(texts)

    def hung(*_):
        raise AssertionError("the build waited for a shard whose process was killed")

    monkeypatch.setitem(shards._WORKER_TOKENIZERS, str(bpe[0]), KilledOnOneDocument())
    previous = signal.signal(signal.SIGALRM, hung)
    signal.alarm(60)
    try:
        with pytest.raises(CorpusError, match=r"a process tokenizing the corpus died \(shard \d+, whose longest "
                                              r"document is [\d,]+ characters; killed by the system, out of memory"):
            prepare_corpus(_data(text_folder, bpe[0], tmp_path), shard_bytes=60_000, workers=2)
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)
    # Nothing half-built is taken for the corpus: the next build finishes it.
    monkeypatch.delitem(shards._WORKER_TOKENIZERS, str(bpe[0]))
    assert np.array_equal(np.asarray(load_corpus(_data(text_folder, bpe[0], tmp_path))), _expected_ids(bpe[1], _texts()))


def test_the_cache_is_keyed_by_content(bpe, text_folder, tmp_path):
    path, _ = bpe
    copy = tmp_path / "elsewhere"
    shutil.copytree(text_folder, copy)
    a, b = _data(text_folder, path, tmp_path / "cache"), _data(copy, path, tmp_path / "cache")
    assert shard_folder(a) == shard_folder(b)  # the same text, wherever it lies
    prepare_corpus(a)
    assert read_manifest(shard_folder(b)) is not None  # found: not tokenized again
    (copy / "doc03.txt").write_text("an edit")
    assert shard_folder(b) != shard_folder(a)
    assert shard_folder(_data(copy, path, tmp_path / "cache", max_bytes=1000)) != shard_folder(b)


def test_jsonl_records_are_read_from_data_text_field(bpe, tmp_path):
    path, tok = bpe
    texts = ["first document\n", "zweites Dokument: äöü\n", "third"]
    source = tmp_path / "records.jsonl"
    source.write_text("\n".join(json.dumps({"id": i, "content": t}) for i, t in enumerate(texts)) + "\n\n")
    d = _data(source, path, tmp_path, text_field="content")
    assert np.array_equal(np.asarray(load_corpus(d)), _expected_ids(tok, texts))
    with pytest.raises(ValueError, match=r"data.text_field = 'text': .*records.jsonl line 1 has no text under it "
                                         r"\(its keys: 'id', 'content'\); set data.text_field"):
        load_corpus(_data(source, path, tmp_path))


def test_a_jsonl_line_that_is_not_utf8_is_named_with_its_file_and_line(tmp_path):
    """The launcher printed only "'utf-8' codec can't decode byte 0xff in position 51" (no file, no line)."""
    source = tmp_path / "r.jsonl"
    source.write_bytes(b'{"text": "fine"}\r\n{"text": "bad \xff\xfe byte"}\n')
    with pytest.raises(ValueError, match=r"data.source: .*r.jsonl line 2 is not UTF-8 \(invalid start byte at byte "
                                         r"14 of the line\); save the file as UTF-8"):
        load_corpus(_data(source, "bytes", tmp_path))


def test_byte_level_jsonl_needs_no_tokenizer(tmp_path):
    source = tmp_path / "r.jsonl"
    source.write_text(json.dumps({"text": "héllo"}) + "\n" + json.dumps({"text": "!"}) + "\n")
    d = _data(source, "bytes", tmp_path)
    assert bytes(np.asarray(load_corpus(d))) == "héllo!".encode()


# -- checks before launch -------------------------------------------------------------------------
def test_the_vocabulary_is_checked_against_the_model_before_launch(bpe, text_folder, corpus_cache):
    path, _ = bpe
    cfg = tiny_config(corpus_cache, f"--data.source={text_folder}", f"--data.tokenizer={path}")
    assert data_problems(cfg) == [
        f"data.tokenizer = '{path}' has {VOCAB} ids, more than model.vocab_size = 256: its ids would index past the "
        f"embedding; set model.vocab_size = {VOCAB} (or a multiple of 64 above it, such as 320)"]
    fine = tiny_config(corpus_cache, f"--data.source={text_folder}", f"--data.tokenizer={path}",
                       f"--model.vocab_size={MODEL_VOCAB}")
    assert data_problems(fine) == []


def test_a_tokenizer_whose_ids_outrun_its_count_is_sized_by_its_largest_id(tmp_path, corpus_cache):
    """A tokenizer.json may leave ids unused (3 tokens here, the largest id 70000): its size is its
    largest id + 1, or the check against the model passes and the shards, typed by the count, wrap
    70000 to 112 in uint8 without a word."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    from bigtrain.data.tokenizer import load_tokenizer

    tok = Tokenizer(models.WordLevel({"[UNK]": 0, "a": 1, "b": 2, "c": 70000}, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    path = tmp_path / "tokenizer.json"
    tok.save(str(path))
    assert load_tokenizer(str(path)).vocab_size == 70001
    source = tmp_path / "records.jsonl"
    source.write_text("".join(json.dumps({"text": "a b c " * 30}) + "\n" for _ in range(3)))
    cfg = tiny_config(corpus_cache, f"--data.source={source}", f"--data.tokenizer={path}")
    assert data_problems(cfg) == [
        f"data.tokenizer = '{path}' has 70001 ids, more than model.vocab_size = 256: its ids would index past the "
        f"embedding; set model.vocab_size = 70001 (or a multiple of 64 above it, such as 70016)"]
    ids = np.asarray(load_corpus(_data(source, path, tmp_path)))
    assert np.array_equal(ids, [1, 2, 70000] * 90)


def test_truncation_and_padding_saved_in_a_tokenizer_json_do_not_cut_documents(bpe, tmp_path):
    """A tokenizer.json saved with truncation or padding on (a pipeline's settings) would cut every
    document to max_length ids and pad the short ones with pad ids: the corpus is each whole document."""
    from tokenizers import Tokenizer

    path, tok = bpe
    cutting = Tokenizer.from_file(str(path))
    cutting.enable_truncation(8)
    cutting.enable_padding(pad_id=0, pad_token="<|endoftext|>")
    folder = tmp_path / "cutting"
    folder.mkdir()
    cutting.save(str(folder / "tokenizer.json"))
    texts = ["def main(argv):\n    return sorted(argv)  # a long first document\n" * 4, "x = 1"]
    source = tmp_path / "records.jsonl"
    source.write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))
    ids = np.asarray(load_corpus(_data(source, folder, tmp_path)))
    assert np.array_equal(ids, _expected_ids(tok, texts))


def test_the_hf_familys_tokenizer_and_ids_are_checked_against_its_config_json(bpe, corpus_cache, tmp_path):
    """The hf family's embedding has its config.json's vocab_size; model.vocab_size is not read. The
    checks compare with the config.json's (256 here): with model.vocab_size = 512 a 300-id tokenizer
    passed, and at tp=2 the vocabulary-parallel embedding trained on the ids past 255 without a word."""
    path, _ = bpe
    fixture = Path(__file__).parent / "fixtures" / "hf" / "llama"
    config_json = fixture / "config.json"
    hf = ["--model.family=hf", f"--model.hf_config={fixture}", "--model.vocab_size=512"]
    text = tmp_path / "a.txt"
    text.write_text("def f(x):\n    return x\n" * 40)
    cfg = tiny_config(corpus_cache, *hf, f"--data.source={text}", f"--data.tokenizer={path}")
    assert data_problems(cfg) == [
        f"data.tokenizer = '{path}' has {VOCAB} ids, more than vocab_size of {config_json} = 256: its ids would "
        f"index past the embedding; use the tokenizer the model was made for, or a model whose vocab_size of "
        f"{config_json} is at least {VOCAB}"]
    ids = tmp_path / "ids.npy"
    np.save(ids, np.r_[np.zeros(50), 300, np.zeros(50)].astype(np.int32))
    cfg = tiny_config(corpus_cache, *hf, f"--data.source={ids}")
    assert data_problems(cfg) == [
        f"data.source = '{ids}' holds token id 300 at position 50, outside 0 .. vocab_size of {config_json} - 1 = "
        f"255; the largest id is 300: set vocab_size of {config_json} to at least 301, or re-tokenize"]


def test_tokenizer_problems_name_the_field_and_the_fix(bpe, corpus_cache, tmp_path, monkeypatch):
    from bigtrain.data import tokenizer as tokenizer_module

    with pytest.raises(ConfigError, match=r"data.tokenizer = '.*missing.json': no such file; give a local "
                                          r"tokenizer.json"):
        tiny_config(corpus_cache, f"--data.tokenizer={tmp_path / 'missing.json'}")
    with pytest.raises(ConfigError, match=r"data.text_field is empty"):
        tiny_config(corpus_cache, "--data.text_field=")
    real = tokenizer_module.missing_package
    monkeypatch.setattr(tokenizer_module, "missing_package",
                        lambda kind: "pip install tokenizers" if kind == "hf" else real(kind))
    monkeypatch.setattr("bigtrain.data.fields.missing_package", tokenizer_module.missing_package)
    with pytest.raises(ConfigError, match=r"is a tokenizer.json, which needs a package that is not installed: "
                                          r"pip install tokenizers"):
        tiny_config(corpus_cache, f"--data.tokenizer={bpe[0]}", f"--model.vocab_size={MODEL_VOCAB}")
    tiktoken_file = tmp_path / "enc.tiktoken"
    tiktoken_file.write_text("")
    if real("tiktoken"):
        with pytest.raises(ConfigError, match=r"tiktoken file, which needs a package that is not installed: "
                                              r"pip install tiktoken"):
            tiny_config(corpus_cache, f"--data.tokenizer={tiktoken_file}")


def test_parquet_is_read_when_pyarrow_is_there_and_refused_clearly_when_not(bpe, corpus_cache, tmp_path):
    path, tok = bpe
    source = tmp_path / "records.parquet"
    try:
        import pyarrow as pa
        import pyarrow.parquet as pq
    except ImportError:
        source.write_bytes(b"PAR1")
        with pytest.raises(ConfigError, match=r"holds Parquet files, which need pyarrow: pip install pyarrow"):
            tiny_config(corpus_cache, f"--data.source={source}")
        return
    texts = ["one row", "another row", "a third"]
    pq.write_table(pa.table({"body": texts, "n": [1, 2, 3]}), source)
    d = _data(source, path, tmp_path, text_field="body")
    assert np.array_equal(np.asarray(load_corpus(d)), _expected_ids(tok, texts))


def test_a_parquet_column_that_is_not_text_is_named(monkeypatch, tmp_path):
    """A column of lists (chat messages), bytes or numbers was turned into text by str(): the run
    trained on "[{'role': 'user', ...}]". Refused as JSON Lines refuses it. (pyarrow stands in here:
    the venv has none; the reader asks it for nothing but the column's values.)"""
    import sys
    import types

    from bigtrain.data import documents as documents_module
    from bigtrain.data.documents import DocumentError, file_documents

    class ParquetFile:
        schema_arrow = types.SimpleNamespace(names=["text", "messages"])

        def __init__(self, path):
            pass

        def iter_batches(self, columns, batch_size):
            rows = {"text": ["a document", None, "another"], "messages": [None, [{"role": "user", "content": "hi"}]]}
            yield types.SimpleNamespace(column=lambda i: types.SimpleNamespace(to_pylist=lambda: rows[columns[0]]))

    parquet = types.ModuleType("pyarrow.parquet")
    parquet.ParquetFile = ParquetFile
    pyarrow = types.ModuleType("pyarrow")
    pyarrow.parquet = parquet
    monkeypatch.setitem(sys.modules, "pyarrow", pyarrow)
    monkeypatch.setitem(sys.modules, "pyarrow.parquet", parquet)
    monkeypatch.setattr(documents_module, "parquet_missing", lambda: None)
    path = tmp_path / "chat.parquet"
    assert list(file_documents(path, "text")) == ["a document", "another"]
    with pytest.raises(DocumentError, match=r"data.text_field = 'messages': .*chat.parquet row 2 holds list, not text; "
                                            r"set data.text_field to a column of strings"):
        list(file_documents(path, "messages"))


def test_a_text_file_that_is_not_utf8_is_said_before_launch(bpe, tmp_path, capsys):
    """A Latin-1 text file in a tokenized corpus had its accented letters read as U+FFFD without a
    word (JSON Lines that is not UTF-8 was refused, a .txt trained on replacement characters): its
    path is named before launch, once, with the fix; a UTF-8 corpus says nothing."""
    from bigtrain.data.load import prepare_run_data

    path, _ = bpe
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    (corpus / "a.txt").write_text("".join(_texts()[:2]), encoding="utf-8")
    (corpus / "b.txt").write_bytes("Caf\u00e9, na\u00efve, \u00fcber: ".encode("latin-1") * 50)
    overrides = [f"--data.source={corpus}", f"--data.tokenizer={path}", f"--data.cache_dir={tmp_path / 'cache'}",
                 f"--model.vocab_size={MODEL_VOCAB}"]
    prepare_run_data(load_config(preset="tiny", overrides=overrides), tmp_path / "run", main=True)
    err = capsys.readouterr().err
    assert (f"bigtrain: warning: data.source = '{corpus}': 1 text file is not UTF-8 ({corpus / 'b.txt'}); its "
            f"undecodable bytes were read as U+FFFD") in err, err
    assert "convert them to UTF-8" in err
    assert "or train on bytes (data.tokenizer = 'bytes')" in err
    # Bytes already, through documents for data.document_end: the fix is to leave that field unset,
    # not "train on bytes" (this run's own tokenizer), and without it the bytes are read as they are.
    ended = [f"--data.source={corpus}", "--data.document_end=\n", f"--data.cache_dir={tmp_path / 'cache'}"]
    prepare_run_data(load_config(preset="tiny", overrides=ended), tmp_path / "run", main=True)
    err = capsys.readouterr().err
    assert "1 text file is not UTF-8" in err and "data.tokenizer = 'bytes'" not in err, err
    assert "or leave data.document_end = '' (the byte-level corpus then reads the files' bytes as they are)" in err
    raw = load_corpus(DataConfig(source=str(corpus / "b.txt"), cache_dir=str(tmp_path / "cache"), max_bytes=0))
    assert bytes(np.asarray(raw)) == (corpus / "b.txt").read_bytes()
    (corpus / "b.txt").write_text("Caf\u00e9, na\u00efve, \u00fcber: " * 50, encoding="utf-8")
    prepare_run_data(load_config(preset="tiny", overrides=overrides), tmp_path / "run", main=True)
    assert "UTF-8" not in capsys.readouterr().err


# -- end to end: train at dp=2, export, load with transformers --------------------------------------
def _export_and_compare(run_dir: Path, out: Path, cfg_model, tok) -> None:
    """Export, load with AutoTokenizer + AutoModelForCausalLM, and compare ids and logits."""
    transformers = pytest.importorskip("transformers")
    assert main(["export", str(run_dir), str(out), "--format", "hf"]) == 0
    text = "def main(argv):\n    return sorted(argv)  # ünïcode\n"
    hf_tok = transformers.AutoTokenizer.from_pretrained(str(out))
    ids = hf_tok(text)["input_ids"]
    assert ids == tok.encode(text).ids and hf_tok.decode(ids) == text
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(out), attn_implementation="eager").eval()
    tokens = torch.tensor([ids])
    model = build_model(cfg_model, device="cpu")
    model.init_buffers()
    newest = sorted((run_dir / "checkpoints").glob("step_*"))[-1]
    model.load_state_dict(checkpoint_weights(newest), strict=False)
    with torch.no_grad():
        ours, theirs = model(tokens), hf(tokens).logits
    assert (ours - theirs).abs().max().item() < 1e-5


def train_and_save(rank, world_size, cfg, run_dir):
    trainer = trainer_on_rank(rank, world_size, cfg, run_dir)
    losses = run_steps(trainer, 3)
    trainer.save()
    return losses


def test_jsonl_dataset_trains_at_dp2_as_one_process_and_exports_for_transformers(bpe, tmp_path):
    path, tok = bpe
    source = tmp_path / "data.jsonl"
    source.write_text("".join(json.dumps({"content": t}) + "\n" for t in _texts()))
    cfg = tiny_config(str(tmp_path / "cache"), f"--data.source={source}", f"--data.tokenizer={path}",
                      "--data.text_field=content", "--data.max_bytes=0", f"--model.vocab_size={MODEL_VOCAB}",
                      "--parallel.dp=2", "--train.micro_batch=4")
    # Both ranks open the corpus at once: one tokenizes under the lock, the other waits and maps it.
    results = run_ranks(train_and_save, 2, cfg, str(tmp_path / "run"))
    expected = reference_losses(cfg, 3)
    for losses in results:
        torch.testing.assert_close(torch.tensor(losses), torch.tensor(expected), rtol=1e-5, atol=0)
    _export_and_compare(tmp_path / "run", tmp_path / "hf", cfg.model, tok)


@pytest.mark.slow
def test_text_folder_trains_at_dp2_through_the_launcher_and_exports_for_transformers(bpe, text_folder, tmp_path):
    path, tok = bpe
    cache, run = tmp_path / "cache", tmp_path / "run"
    args = ["train", "--preset", "tiny", "--output-dir", str(run), "--logging.progress=false", "--train.steps=4",
            f"--data.cache_dir={cache}", f"--data.source={text_folder}", f"--data.tokenizer={path}",
            "--data.max_bytes=0", f"--model.vocab_size={MODEL_VOCAB}", "--parallel.dp=2"]
    done = subprocess.run([sys.executable, "-m", "bigtrain", *args], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.count("bigtrain: tokenizing") == 1  # by the launcher, before the ranks started
    manifest = read_manifest(shard_folder(_data(text_folder, path, cache)))
    assert manifest["tokens"] == len(_expected_ids(tok, _texts()))
    assert (run / "tokenizer.json").read_bytes() == path.read_bytes()  # kept with the run for its export
    cfg = tiny_config(str(cache), f"--model.vocab_size={MODEL_VOCAB}")
    _export_and_compare(run, tmp_path / "hf", cfg.model, tok)
    assert json.loads((tmp_path / "hf" / "tokenizer_config.json").read_text())["tokenizer_class"] == \
        "PreTrainedTokenizerFast"


def test_a_corpus_shorter_than_a_window_is_refused_before_launch(bpe, tmp_path):
    path, _ = bpe
    source = tmp_path / "short.txt"
    source.write_text("too short")
    code = main(["train", "--preset", "tiny", "--output-dir", str(tmp_path / "run"), f"--data.source={source}",
                 f"--data.tokenizer={path}", f"--data.cache_dir={tmp_path}", f"--model.vocab_size={MODEL_VOCAB}"])
    assert code == 2
    validate(tiny_config(str(tmp_path), f"--data.source={source}", f"--data.tokenizer={path}",
                         f"--model.vocab_size={MODEL_VOCAB}"))  # the config alone is fine: the length is known later


def test_a_held_out_slice_shorter_than_a_window_is_refused_before_launch(bpe, tmp_path):
    """Its length is known once tokenized (in the launcher): a data.val_fraction that holds out less
    than one window is named there, not raised by the sampler in every rank."""
    from bigtrain.data.load import prepare_run_data

    path, _ = bpe
    source = tmp_path / "records.jsonl"
    source.write_text("".join(json.dumps({"text": t[:1000]}) + "\n" for t in _texts()[:3]))
    fine = tiny_config(str(tmp_path), f"--data.source={source}", f"--data.tokenizer={path}",
                       f"--model.vocab_size={MODEL_VOCAB}", "--data.val_fraction=0.2")
    prepare_run_data(fine, tmp_path / "run", main=True)
    short = tiny_config(str(tmp_path), f"--data.source={source}", f"--data.tokenizer={path}",
                        f"--model.vocab_size={MODEL_VOCAB}", "--data.val_fraction=0.01")
    with pytest.raises(ConfigError, match=r"data.val_fraction = 0.01 holds out \d+ tokens, fewer than one window "
                                          r"\(data.seq_len \+ 1 = 33\); raise data.val_fraction .*\(data.source = "
                                          r"'.*records.jsonl' tokenizes to \d+ tokens\)$"):
        prepare_run_data(short, tmp_path / "run", main=True)


def test_a_cap_that_cuts_a_users_corpus_is_said_before_launch(bpe, tmp_path, capsys):
    """data.max_bytes (16 MB by default, to keep the 'stdlib' demo short) cut a user's corpus without
    a word: a run on a 10 GB folder trained on its first 16 MB. Said now, for byte-level text (its
    files' bytes) and tokenized records (the manifest records whether the cap cut); not for a cap
    the corpus fits exactly, nor without one."""
    from bigtrain.data.load import prepare_run_data

    path, _ = bpe
    text = "def f(x):\n    return x\n" * 100  # 2,400 bytes
    folder, records = tmp_path / "text", tmp_path / "records.jsonl"
    folder.mkdir()
    (folder / "a.txt").write_text(text)
    records.write_text("".join(json.dumps({"text": text}) + "\n" for _ in range(3)))
    for source, tokenizer, size in ((folder, "bytes", 2400), (records, path, 3 * 2400)):
        for cap, said in ((1000, True), (0, False), (size, False)):
            cfg = tiny_config(str(tmp_path), f"--data.source={source}", f"--data.tokenizer={tokenizer}",
                              f"--model.vocab_size={MODEL_VOCAB}", f"--data.max_bytes={cap}")
            prepare_run_data(cfg, tmp_path / "run", main=True)
            warning = (f"bigtrain: warning: data.max_bytes = {cap} cut data.source = '{source}' short: the run reads "
                       f"only its first {cap:,} bytes of text; set data.max_bytes = 0 to read all of it")
            assert (warning in capsys.readouterr().err) == said, (source, cap)


def test_a_corpus_the_cap_cut_below_a_window_names_the_cap(tmp_path):
    """Records cut by data.max_bytes to fewer tokens than a window: "lower data.seq_len or give a
    longer corpus", of a corpus that was long."""
    from bigtrain.data.load import prepare_run_data

    records = tmp_path / "records.jsonl"
    records.write_text("".join(json.dumps({"text": "long enough " * 10}) + "\n" for _ in range(3)))
    cfg = tiny_config(str(tmp_path), f"--data.source={records}", "--data.max_bytes=20")
    with pytest.raises(ConfigError, match=r"tokenizes to 20 tokens \(data.max_bytes = 20 cut it short\), fewer than "
                                          r"data.seq_len \+ 2 = 34; raise data.max_bytes \(0: no cap\)"):
        prepare_run_data(cfg, tmp_path / "run", main=True)


def test_the_cap_warning_is_said_by_the_launcher_not_again_by_its_rank_0(tmp_path, monkeypatch, capsys):
    """bigtrain train --parallel.dp=2 on a capped corpus said the warning twice: the launcher, which
    prepares the data before the launch, then its rank 0 doing the same."""
    from bigtrain.data.load import prepare_run_data
    from bigtrain.distributed.launch import LAUNCHER_ENV, parent_of

    folder = tmp_path / "text"
    folder.mkdir()
    (folder / "a.txt").write_text("def f(x):\n    return x\n" * 100)  # 2,400 bytes
    cfg = tiny_config(str(tmp_path), f"--data.source={folder}", "--data.max_bytes=1000")
    for env, said in (({}, True), ({"RANK": "0", "WORLD_SIZE": "2", LAUNCHER_ENV: str(parent_of(os.getppid()))}, False)):
        for key, value in env.items():
            monkeypatch.setenv(key, value)
        prepare_run_data(cfg, tmp_path / "run", main=True)
        assert ("warning: data.max_bytes = 1000 cut" in capsys.readouterr().err) == said, env


def test_a_binary_tokenizer_file_is_named_as_no_tiktoken_file_before_anything_is_installed(corpus_cache, tmp_path):
    """Llama 2's tokenizer.model (SentencePiece's protobuf) was read as a tiktoken file: 'pip install
    tiktoken', and once installed, a parse error. Refused by what it is, with tiktoken or without."""
    model = tmp_path / "tokenizer.model"
    model.write_bytes(b"\n\x0b\n\x05<unk>\x15\x00\x00\x00\x00\x18\x02\n\x07\n\x03<s>\x15\x00\x00\x00\x00")
    with pytest.raises(ConfigError, match=r"is a binary file \(a SentencePiece model\?\), not a tiktoken file's"):
        tiny_config(corpus_cache, f"--data.tokenizer={model}")


def test_a_folder_without_tokenizer_json_names_the_tokenizer_file_it_holds(corpus_cache, tmp_path):
    """A Llama 2 / Llama 3 download with tokenizer.model and no tokenizer.json: "does not exist", with
    no word of the file beside it or how to make one."""
    (tmp_path / "tokenizer.model").write_bytes(b"\n\x0b\n\x05<unk>")
    with pytest.raises(ConfigError, match=rf"tokenizer.json does not exist, but the folder holds tokenizer.model: give "
                                          rf"it \(data.tokenizer = '{tmp_path}/tokenizer.model'\) if it is a tiktoken "
                                          rf"file .* AutoTokenizer.from_pretrained\(FOLDER\).save_pretrained\(FOLDER\)"):
        tiny_config(corpus_cache, f"--data.tokenizer={tmp_path}")


def test_an_empty_tiktoken_file_is_refused_by_field(corpus_cache, tmp_path):
    """tiktoken.Encoding of no ranks raised a bare 'max() arg is an empty sequence' from the launcher."""
    pytest.importorskip("tiktoken")
    empty = tmp_path / "empty.tiktoken"
    empty.write_text("")
    text = tmp_path / "a.txt"
    text.write_text("def f(x):\n    return x\n" * 40)
    cfg = tiny_config(corpus_cache, f"--data.source={text}", f"--data.tokenizer={empty}")
    assert data_problems(cfg) == [f"data.tokenizer = '{empty}' is an empty tiktoken encoding file (no tokens in it); "
                                  f"give a .tiktoken file of 'BASE64 RANK' lines, a tokenizer.json or 'bytes'"]


def test_a_tiktoken_file_tokenizes_and_exports_as_tokenizer_json(text_folder, tmp_path):
    """tiktoken is in the test extras (data.tokenizer claims .tiktoken files); skipped where it is not
    installed. data.document_end is one of the file's ranks, appended after each document."""
    import base64

    tiktoken = pytest.importorskip("tiktoken")
    transformers = pytest.importorskip("transformers")
    merges = [b"de", b"def", b"  ", b"    ", b"in", b"re", b"ret", b"se", b"sel", b"self"]
    ranks = {bytes([i]): i for i in range(256)}
    for m in merges:
        ranks.setdefault(m, len(ranks))
    enc_file = tmp_path / "small.tiktoken"
    enc_file.write_text("".join(f"{base64.b64encode(t).decode()} {r}\n" for t, r in ranks.items()))
    d = _data(text_folder, enc_file, tmp_path / "cache")
    enc = tiktoken.Encoding("small", pat_str=CL100K_PATTERN, mergeable_ranks=ranks, special_tokens={})
    expected = np.concatenate([np.asarray(enc.encode_ordinary(t)) for t in _texts()])
    assert np.array_equal(np.asarray(load_corpus(d)), expected)
    ended = _data(text_folder, enc_file, tmp_path / "cache", document_end="\n")  # one rank: the byte 10
    assert np.array_equal(np.asarray(load_corpus(ended)),
                          np.concatenate([np.append(enc.encode_ordinary(t), 10) for t in _texts()]))

    out = tmp_path / "hf"
    out.mkdir()
    write_for_transformers(str(enc_file), out, 64)
    text = "def f(self):\n    return self\n"
    assert transformers.AutoTokenizer.from_pretrained(str(out))(text)["input_ids"] == enc.encode_ordinary(text)


def test_generate_writes_with_the_runs_tokenizer_and_refuses_ids_without_one(bpe, tmp_path, capsys):
    """`bigtrain generate RUN` of a run trained with its own tokenizer was refused ("generate reads
    and writes bytes ... generate with transformers"), right after the README's train command: it
    encodes the prompt and decodes the ids with the run's tokenizer, greedy is the argmax over the
    tokenizer's ids (the model's padding rows past them are never drawn), and the run's Hugging
    Face export writes the same text. A model of another vocabulary with no tokenizer (pre-tokenized
    ids) is still refused by name."""
    from bigtrain.config import ModelConfig
    from bigtrain.generate import Decoder, GenerateError, load_model, sample, text_tokenizer

    path, tok = bpe
    text = tmp_path / "a.txt"
    text.write_text("".join(_texts()[:3]))
    run = tmp_path / "run"
    assert main(["train", "--preset", "tiny", "--train.steps=2", "--logging.progress=false", "--logging.report=false",
                 "--output-dir", str(run), f"--data.source={text}", f"--data.tokenizer={path}",
                 f"--data.cache_dir={tmp_path / 'cache'}", f"--model.vocab_size={MODEL_VOCAB}"]) == 0
    decoder, _ = load_model(run)
    prompt = tok.encode("def ").ids
    ids = list(prompt)
    with torch.no_grad():
        for _ in range(8):
            ids.append(int(decoder.model(torch.tensor([ids]))[0, -1, :VOCAB].argmax()))
    capsys.readouterr()
    args = ["--prompt", "def ", "--tokens", "8", "--temperature", "0"]
    assert main(["generate", str(run), *args]) == 0
    assert capsys.readouterr().out == tok.decode(ids, skip_special_tokens=False) + "\n"
    assert main(["export", str(run), str(tmp_path / "hf"), "--format", "hf"]) == 0
    capsys.readouterr()
    assert main(["generate", str(tmp_path / "hf"), *args]) == 0
    assert capsys.readouterr().out == tok.decode(ids, skip_special_tokens=False) + "\n"
    drawn = {t for seed in range(20) for t in sample(decoder, prompt, 4, temperature=50.0, seed=seed, vocab=VOCAB)}
    assert max(drawn) < VOCAB < MODEL_VOCAB

    cfg = ModelConfig(vocab_size=1024)
    ids_only = Decoder(build_model(cfg, device="meta"), cfg.vocab_size, cfg.max_seq_len)
    with pytest.raises(GenerateError, match=r"vocabulary of 1024 and no tokenizer .*pre-tokenized ids \(ids.bin\)"):
        text_tokenizer(tmp_path, ids_only, {"data": {"source": "ids.bin", "tokenizer": "bytes"}})


def test_a_hugging_face_family_run_exports_its_tokenizer_too(bpe, corpus_cache, tmp_path, capsys):
    """``export --format hf`` of a ``model.family = "hf"`` run went through the family's folder
    writer, which wrote config.json and the weights only: the folder of a run trained with a
    tokenizer came without one, and the export said nothing. It gets the run's tokenizer, as the
    Llama export does, so that ``AutoTokenizer`` loads the folder with the ids the run trained on."""
    transformers = pytest.importorskip("transformers")
    path, tok = bpe
    hf_config = json.loads((Path(__file__).parent / "fixtures" / "hf" / "qwen3" / "config.json").read_text())
    (tmp_path / "qwen3").mkdir()
    (tmp_path / "qwen3" / "config.json").write_text(json.dumps({**hf_config, "vocab_size": MODEL_VOCAB}))
    text = tmp_path / "a.txt"
    text.write_text("".join(_texts()[:3]))
    run, out = tmp_path / "run", tmp_path / "hf"
    assert main(["train", "--preset", "tiny", "--output-dir", str(run), "--model.family=hf",
                 f"--model.hf_config={tmp_path / 'qwen3'}", f"--data.source={text}", f"--data.tokenizer={path}",
                 f"--data.cache_dir={tmp_path / 'cache'}", "--train.steps=1", "--logging.progress=false",
                 "--logging.report=false"]) == 0
    assert main(["export", str(run), str(out), "--format", "hf"]) == 0
    sample = "def main(argv):\n    return sorted(argv)\n"
    assert transformers.AutoTokenizer.from_pretrained(str(out))(sample)["input_ids"] == tok.encode(sample).ids
    assert json.loads((out / "tokenizer_config.json").read_text())["model_max_length"] == \
        hf_config["max_position_embeddings"]


def test_exporting_a_byte_level_run_over_an_earlier_export_names_the_tokenizer_left_there(bpe, tmp_path,
                                                                                             corpus_cache, capsys):
    """An export writes config.json and the weights over the folder's; the tokenizer files of an
    earlier export (a run trained with a tokenizer) stayed, and AutoTokenizer loaded that BPE for a
    byte-level model without a word."""
    path, _ = bpe
    out = tmp_path / "hf"
    out.mkdir()
    shutil.copyfile(path, out / "tokenizer.json")
    (out / "tokenizer_config.json").write_text("{}")
    run = tmp_path / "run"
    assert main(["train", "--preset", "tiny", "--output-dir", str(run), f"--data.cache_dir={corpus_cache}",
                 "--data.max_bytes=400000", "--train.steps=1", "--logging.progress=false",
                 "--logging.report=false"]) == 0
    capsys.readouterr()
    assert main(["export", str(run), str(out), "--format", "hf"]) == 0
    assert (f"bigtrain export: warning: {out} holds tokenizer.json, tokenizer_config.json, which this byte-level "
            f"run did not write") in capsys.readouterr().err
    shutil.rmtree(out)
    assert main(["export", str(run), str(out), "--format", "hf"]) == 0
    assert "warning" not in capsys.readouterr().err


def test_overwrite_removes_the_tokenizer_copy_of_the_run_it_replaces(bpe, tmp_path, corpus_cache):
    """The run folder's copy of its tokenizer was not a run output: ``--overwrite`` with a
    byte-level run kept the BPE of the run it replaced, and the new run's export shipped it."""
    path, _ = bpe
    run, out = tmp_path / "run", tmp_path / "hf"
    run.mkdir()
    (run / "metrics.jsonl").write_text('{"step": 1, "loss": 5.0}\n')  # the run it replaces
    shutil.copyfile(path, run / "tokenizer.json")
    (run / "tokenizer.tiktoken").write_text("YQ== 0\n")
    assert main(["train", "--preset", "tiny", "--output-dir", str(run), f"--data.cache_dir={corpus_cache}",
                 "--data.max_bytes=400000", "--train.steps=1", "--logging.progress=false", "--logging.report=false",
                 "--overwrite"]) == 0
    assert not (run / "tokenizer.json").exists() and not (run / "tokenizer.tiktoken").exists()
    assert main(["export", str(run), str(out), "--format", "hf"]) == 0
    assert not (out / "tokenizer.json").exists()


def test_an_hf_export_names_the_tokenizers_bos_and_eos_so_generate_stops(bpe, tmp_path, corpus_cache):
    """config.json said bos_token_id = eos_token_id = null whatever the run's tokenizer, so
    transformers' generate() never stopped: the tokenizer's end-of-text token is its eos (a
    byte-level run has none: null, as before)."""
    transformers = pytest.importorskip("transformers")
    path, tok = bpe
    text = tmp_path / "a.txt"
    text.write_text("".join(_texts()[:3]))
    run, out = tmp_path / "run", tmp_path / "hf"
    common = ["--preset", "tiny", "--train.steps=1", "--logging.progress=false", "--logging.report=false"]
    assert main(["train", *common, "--output-dir", str(run), f"--data.source={text}", f"--data.tokenizer={path}",
                 f"--data.cache_dir={tmp_path / 'cache'}", f"--model.vocab_size={MODEL_VOCAB}"]) == 0
    assert main(["export", str(run), str(out), "--format", "hf"]) == 0
    end = tok.token_to_id("<|endoftext|>")
    config = json.loads((out / "config.json").read_text())
    assert config["eos_token_id"] == end and config["bos_token_id"] is None  # nothing before a document
    assert transformers.AutoModelForCausalLM.from_pretrained(str(out)).generation_config.eos_token_id == end
    # The tokenizer names it too: its eos_token was None, and `tokenizer.pad_token = tokenizer.eos_token`
    # (a collator, a batched pipeline) failed on the export.
    loaded = transformers.AutoTokenizer.from_pretrained(str(out))
    assert loaded.eos_token == "<|endoftext|>" and loaded.eos_token_id == end and loaded.bos_token is None
    assert loaded("def f(x):").input_ids == tok.encode("def f(x):").ids
    byte_run = tmp_path / "bytes"
    assert main(["train", *common, "--output-dir", str(byte_run), f"--data.cache_dir={corpus_cache}",
                 "--data.max_bytes=400000"]) == 0
    assert main(["export", str(byte_run), str(tmp_path / "bytes-hf"), "--format", "hf"]) == 0
    config = json.loads((tmp_path / "bytes-hf" / "config.json").read_text())
    assert config["bos_token_id"] is None and config["eos_token_id"] is None


def test_an_exported_tokenizer_names_only_special_tokens_as_bos_and_eos(bpe, tmp_path):
    """tokenizer_config.json names the config.json's bos / eos by their text when they are special
    tokens of the file; an ordinary token (a data.document_end of 'd') is not named, since
    transformers would make it special and split it out of every word that holds it."""
    transformers = pytest.importorskip("transformers")
    path, tok = bpe
    end = tok.token_to_id("<|endoftext|>")
    write_for_transformers(str(path), tmp_path, 64, {"bos_token_id": end, "eos_token_id": end})
    config = json.loads((tmp_path / "tokenizer_config.json").read_text())
    assert config["bos_token"] == config["eos_token"] == "<|endoftext|>"
    (tmp_path / "ordinary").mkdir()
    write_for_transformers(str(path), tmp_path / "ordinary", 64, {"eos_token_id": tok.token_to_id("d")})
    assert "eos_token" not in json.loads((tmp_path / "ordinary" / "tokenizer_config.json").read_text())
    loaded = transformers.AutoTokenizer.from_pretrained(str(tmp_path / "ordinary"))
    assert loaded("def add(d):").input_ids == tok.encode("def add(d):").ids


def test_bos_and_eos_are_what_framed_each_training_document(bpe, tmp_path):
    """A post-processor's tokens around each document come first (Llama's <s> ... </s>), then
    data.document_end (what the run put after each one), then an end-of-text token by name."""
    from tokenizers import Tokenizer, processors

    from bigtrain.data.tokenizer import ByteTokenizer, HFTokenizer, bos_eos_ids

    path, tok = bpe
    end = tok.token_to_id("<|endoftext|>")
    plain = HFTokenizer(path)
    assert bos_eos_ids(plain) == {"eos_token_id": end}
    assert bos_eos_ids(plain, "d") == {"eos_token_id": tok.token_to_id("d")}
    framing = Tokenizer.from_file(str(path))
    framing.post_processor = processors.TemplateProcessing(
        single="<|endoftext|> $A <|endoftext|>", special_tokens=[("<|endoftext|>", end)])
    framing.save(str(tmp_path / "framed.json"))
    assert bos_eos_ids(HFTokenizer(tmp_path / "framed.json"), "d") == {"bos_token_id": end, "eos_token_id": end}
    assert bos_eos_ids(ByteTokenizer()) == {} and bos_eos_ids(ByteTokenizer(), "\n") == {"eos_token_id": 10}


@pytest.mark.parametrize("tokenizer", ["bytes", "bpe"])
def test_a_compressed_data_file_is_refused_before_launch(bpe, tokenizer, tmp_path):
    """data.source = 'data.jsonl.gz' (as datasets are often shipped) was read as one text document:
    its gzip bytes trained on without a word at the byte level, or as U+FFFD with a tokenizer."""
    import gzip

    packed = tmp_path / "my data.jsonl.gz"
    packed.write_bytes(gzip.compress(b'{"text": "a document"}\n' * 200))
    chosen = [f"--data.tokenizer={bpe[0]}", f"--model.vocab_size={MODEL_VOCAB}"] if tokenizer == "bpe" else []
    cfg = load_config(preset="tiny", overrides=[f"--data.source={packed}", f"--data.cache_dir={tmp_path}", *chosen])
    with pytest.raises(ConfigError, match=r"data.source = '.*my data.jsonl.gz' is a gzip-compressed file, which bigtrain "
                                          r"does not decompress .*\(gunzip -k '.*my data.jsonl.gz'\)"):
        validate(cfg)


def test_a_plain_text_document_too_long_to_encode_here_is_said_before_the_build(bpe, tmp_path):
    """A .txt is one document, encoded in one call at about 165 times its text (a 64 MB file took a
    worker 10.6 GB): one needing more than half the machine's memory is said first, with the fix."""
    from bigtrain.data.load import long_document_warning

    path, _ = bpe
    (tmp_path / "corpus").mkdir()
    (tmp_path / "corpus" / "small.txt").write_text("a few words\n" * 10)
    (tmp_path / "corpus" / "book.txt").write_text("a long book\n" * 10_000)  # 120,000 bytes: 19.8 MB to encode
    d = _data(tmp_path / "corpus", path, tmp_path)
    said = long_document_warning(d, memory_bytes=32 << 20)
    assert said is not None and "book.txt is one document of 0.1 MB" in said and "JSON Lines" in said, said
    assert long_document_warning(d, memory_bytes=64 << 20) is None
    assert long_document_warning(_data(tmp_path / "corpus", "bytes", tmp_path), memory_bytes=1) is None  # not tokenized
