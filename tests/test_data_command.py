"""``bigtrain data``: what a config trains on, in the run's own terms: its corpora and shares, their
tokens, how often the run reads each, and step 1's first windows as the tokenizer writes them."""

from __future__ import annotations

import numpy as np

from bigtrain.cli import main
from bigtrain.data import TokenSampler


def _shown(capsys, *args: str) -> str:
    capsys.readouterr()
    assert main(["data", "--preset", "tiny", *args]) == 0
    return capsys.readouterr().out


def test_a_corpus_its_reads_and_step_one_s_windows_are_what_the_run_trains_on(tmp_path, capsys):
    text = "".join(f"line {i}: something worth reading.\n" for i in range(500))
    (tmp_path / "corpus.txt").write_text(text)
    out = _shown(capsys, f"--data.source={tmp_path / 'corpus.txt'}", "--train.steps=100", "--windows", "3")
    data = text.encode()
    reads = 100 * 8 * 32 / len(data)  # steps x global batch x seq_len of the tiny preset, over the corpus
    assert f"data.source = '{tmp_path / 'corpus.txt'}': {len(data):,} training tokens; the run reads each about " \
           f"{reads:.3g} times" in out
    starts = TokenSampler(np.frombuffer(data, dtype=np.uint8), 32, 8, seed=1234).starts(0)  # the preset's seed
    for i, start in enumerate(starts[:3]):
        assert f"[{i + 1}] data.source = '{tmp_path / 'corpus.txt'}', tokens {start:,} to {start + 31:,}: " \
               f"{data[start:start + 32].decode()!r}" in out
    assert "[4]" not in out
    for none in ("0", "-1"):  # the summary alone: it was numpy's 'need at least one array to stack'
        out = _shown(capsys, f"--data.source={tmp_path / 'corpus.txt'}", "--windows", none)
        assert "training tokens" in out and "[1]" not in out and "windows, as the tokenizer" not in out


def test_a_blend_shows_each_corpus_with_its_share_and_a_held_out_corpus(tmp_path, capsys, corpus_cache):
    (tmp_path / "code.txt").write_text("def f(x):\n    return x\n" * 200)
    (tmp_path / "val.txt").write_text("held out text. " * 40)
    out = _shown(capsys, f"--data.cache_dir={corpus_cache}", "--data.max_bytes=400000",
                 f"--data.blend={tmp_path / 'code.txt'}=0.25", f"--data.val_source={tmp_path / 'val.txt'}")
    assert "data.source = 'stdlib'" in out and "share 0.75" in out
    assert f"data.blend's {tmp_path / 'code.txt'}: 4,600 training tokens; share 0.25" in out
    assert f"data.val_source = '{tmp_path / 'val.txt'}': 600 held-out tokens" in out


def test_what_it_cannot_show_is_said_in_one_line(tmp_path, capsys):
    (tmp_path / "empty").mkdir()
    assert main(["data", "--preset", "tiny", f"--data.source={tmp_path / 'empty'}"]) == 2
    err = capsys.readouterr().err
    assert "data.source" in err and "no text files" in err and "Traceback" not in err
    assert main(["data", "--preset", "dlrm-tiny"]) == 1
    assert "reads data of its own" in capsys.readouterr().err


def test_pre_tokenized_ids_the_tokenizer_cannot_write_are_shown_as_ids(tmp_path, capsys):
    ids = tmp_path / "ids.npy"
    np.save(ids, (np.arange(5000) % 1000).astype(np.uint16))
    out = _shown(capsys, f"--data.source={ids}", "--model.vocab_size=1000", "--windows", "1")
    start = TokenSampler(np.load(ids), 32, 8, seed=1234).starts(0)[0]
    assert f"tokens {start:,} to {start + 31:,}: ids " + " ".join(str(i % 1000) for i in range(start, start + 32)) in out
