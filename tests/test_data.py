"""Token corpora (text folders, .npy, .bin, the stdlib) and layout-independent sampling."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from bigtrain.data import TokenSampler, load_tokens, stdlib_files
from bigtrain.testing import RankFailure, run_ranks
from tests.helpers import tiny_config, trainer_on_rank

N_TOKENS = 5000


def _arange_sampler(seq_len=16, global_batch=8, seed=7, n=N_TOKENS):
    # Token i has value i, so a window's values say exactly where it came from.
    return TokenSampler(np.arange(n, dtype=np.int64), seq_len=seq_len, global_batch=global_batch, seed=seed)


# --------------------------------------------------------------------------- TokenSampler

LAYOUTS = [(dp, micro) for dp in (1, 2, 4) for micro in (1, 2, 4, 8) if micro <= 8 // dp and (8 // dp) % micro == 0]


def test_layouts_cover_dp_1_2_4():
    assert {dp for dp, _ in LAYOUTS} == {1, 2, 4}
    assert len(LAYOUTS) == 9


@pytest.mark.parametrize("step", [0, 1, 17])
@pytest.mark.parametrize("dp, micro", LAYOUTS)
def test_global_batch_is_the_same_for_every_layout(step, dp, micro):
    sampler = _arange_sampler()
    ref_x, ref_y = sampler.batch(step, 0, 8)
    assert ref_x.shape == ref_y.shape == (8, 16)
    xs, ys = [], []
    for rank in range(dp):
        micro_batches = list(sampler.micro_batches(step, rank, dp, micro))
        assert len(micro_batches) == 8 // dp // micro
        for x, y in micro_batches:
            assert x.shape == y.shape == (micro, 16)
            xs.append(x)
            ys.append(y)
    assert torch.equal(torch.cat(xs), ref_x)
    assert torch.equal(torch.cat(ys), ref_y)


def test_batch_depends_only_on_seed_step_and_global_batch():
    a = _arange_sampler()
    b = _arange_sampler()
    # Asking for steps out of order (as a resumed run does) changes nothing: there is no hidden state.
    later = b.batch(9, 0, 8)
    earlier = b.batch(3, 0, 8)
    assert torch.equal(a.batch(3, 0, 8)[0], earlier[0])
    assert torch.equal(a.batch(9, 0, 8)[0], later[0])
    assert np.array_equal(a.starts(3), b.starts(3))
    assert len(a.starts(3)) == 8


def test_targets_are_inputs_shifted_by_one():
    sampler = _arange_sampler()
    x, y = sampler.batch(5, 0, 8)
    assert x.dtype == y.dtype == torch.int64
    assert torch.equal(y[:, :-1], x[:, 1:])
    # On an arange corpus each input window is consecutive and each target is the next token.
    starts = torch.from_numpy(sampler.starts(5))
    assert torch.equal(x, starts[:, None] + torch.arange(16))
    assert torch.equal(y, x + 1)


def test_windows_stay_inside_the_corpus():
    sampler = _arange_sampler(seq_len=16, global_batch=64, n=100)
    for step in range(50):
        starts = sampler.starts(step)
        assert starts.min() >= 0
        assert starts.max() + 16 + 1 <= 100
        x, y = sampler.batch(step, 0, 64)
        assert int(y.max()) <= 99


def test_different_step_or_seed_gives_a_different_batch():
    sampler = _arange_sampler()
    x0, _ = sampler.batch(0, 0, 8)
    x1, _ = sampler.batch(1, 0, 8)
    assert not torch.equal(x0, x1)
    other_seed, _ = _arange_sampler(seed=8).batch(0, 0, 8)
    assert not torch.equal(x0, other_seed)


def test_slices_of_the_global_batch():
    sampler = _arange_sampler()
    x, _ = sampler.batch(4, 0, 8)
    part, _ = sampler.batch(4, 3, 2)
    assert torch.equal(part, x[3:5])


def test_a_window_holding_an_id_past_the_vocabulary_is_named():
    """The sampler's own guard (a Trainer made directly has no launcher to check the file): the id,
    where it is in the corpus, and the field; in the held-out windows too."""
    sampler = TokenSampler(np.full(1000, 300), seq_len=16, global_batch=4, seed=0, vocab_size=256, val_fraction=0.1)
    with pytest.raises(ValueError, match=r"^data.source: token id 300 at position \d+ of the corpus, outside 0 \.\. "
                                         r"model.vocab_size - 1 = 255; set model.vocab_size to at least 301, or "
                                         r"re-tokenize$"):
        sampler.batch(0, 0, 4)
    with pytest.raises(ValueError, match=r"token id 300 at position \d+ of the held-out slice"):
        sampler.eval_batch(0, 1, 0, 4)
    fine = TokenSampler(np.full(1000, 255), seq_len=16, global_batch=4, seed=0, vocab_size=256)
    assert int(fine.batch(0, 0, 4)[0].max()) == 255


def _first_step(rank, world_size, cfg, run_dir):
    trainer_on_rank(rank, world_size, cfg, run_dir).train_step()


def test_ids_past_the_models_vocabulary_stop_a_tensor_parallel_trainer(corpus_cache, tmp_path):
    """At tp=2 an id >= model.vocab_size trained without a word (the vocabulary-parallel embedding
    gives an id no shard holds a zero row, its loss a target no shard holds), where tp=1 crashed in
    torch.embedding. bigtrain train refuses such a file before launch; a Trainer made directly stops
    at the first window holding one, naming it, in every layout."""
    ids = tmp_path / "ids.npy"
    np.save(ids, np.random.default_rng(0).integers(0, 300, 20_000).astype(np.int32))
    cfg = tiny_config(corpus_cache, f"--data.source={ids}", "--parallel.tp=2")
    with pytest.raises(RankFailure, match=r"token id 2\d\d at position \d+ of the corpus, outside 0 \.\. "
                                          r"model.vocab_size - 1 = 255"):
        run_ranks(_first_step, 2, cfg, str(tmp_path / "run"))


def test_a_corpus_shorter_than_seq_len_plus_2_is_a_value_error():
    with pytest.raises(ValueError, match=r"corpus has 17 tokens, fewer than data.seq_len \+ 2 = 18"):
        TokenSampler(np.arange(17), seq_len=16, global_batch=2, seed=0)
    with pytest.raises(ValueError, match="data.seq_len"):
        TokenSampler(np.arange(0), seq_len=16, global_batch=2, seed=0)
    # Exactly seq_len + 2 tokens is enough: one window, starting at 0.
    sampler = TokenSampler(np.arange(18), seq_len=16, global_batch=2, seed=0)
    x, y = sampler.batch(0, 0, 2)
    assert torch.equal(x, torch.arange(16).repeat(2, 1))
    assert torch.equal(y, torch.arange(1, 17).repeat(2, 1))


# --------------------------------------------------------------------------- load_tokens: text


@pytest.fixture
def text_folder(tmp_path):
    src = tmp_path / "src"
    (src / "sub").mkdir(parents=True)
    files = {
        "b_second.py": "print('second')\n",
        "a_first.txt": "first caf\u00e9\n",  # non-ASCII: tokens are UTF-8 bytes, not characters
        "sub/c_third.txt": "third\n",
        "ignored.csv": "not,a,text,suffix\n",
        "ignored.bin": "binary\n",
    }
    for name, text in files.items():
        (src / name).write_text(text, encoding="utf-8")
    expected = "first caf\u00e9\n".encode() + b"print('second')\n" + b"third\n"
    return src, expected


def test_text_folder_gives_bytes_in_sorted_file_order(tmp_path, text_folder):
    src, expected = text_folder
    tokens = load_tokens(str(src), cache_dir=str(tmp_path / "cache"))
    assert tokens.dtype == np.uint8
    assert tokens.ndim == 1
    assert bytes(tokens) == expected
    assert len(tokens) == len(expected) == 34


def test_a_linked_folder_of_a_text_folder_is_read_once_and_a_link_to_an_ancestor_ends(tmp_path, text_folder):
    """Path.rglob does not enter a linked folder: a corpus made of links (ln -s /data/wiki corpus/wiki)
    trained on none of their files, without a word."""
    src, expected = text_folder
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "linked.txt").write_text("linked\n")
    (src / "sub" / "z_link").symlink_to(outside, target_is_directory=True)
    (src / "sub" / "loop").symlink_to(src, target_is_directory=True)
    tokens = load_tokens(str(src), cache_dir=str(tmp_path / "cache"))
    assert bytes(tokens) == expected + b"linked\n"


def test_single_text_file(tmp_path):
    path = tmp_path / "notes.log"  # a file is read whatever its suffix
    path.write_bytes(b"\x00\x01hello\xff")
    tokens = load_tokens(str(path), cache_dir=str(tmp_path / "cache"))
    assert tokens.tolist() == [0, 1, *b"hello", 255]


def test_text_corpus_is_cached_and_reused(tmp_path, text_folder, monkeypatch):
    src, expected = text_folder
    cache = tmp_path / "cache"
    first = load_tokens(str(src), cache_dir=str(cache))
    cached = list(cache.iterdir())
    assert len(cached) == 1 and cached[0].suffix == ".u8"
    assert Path(first.filename) == cached[0]
    mtime = cached[0].stat().st_mtime_ns

    # The second call must not read the sources again.
    def no_reading(self):
        raise AssertionError(f"read {self} again instead of using the cache")

    monkeypatch.setattr(Path, "read_bytes", no_reading)
    second = load_tokens(str(src), cache_dir=str(cache))
    assert Path(second.filename) == cached[0]
    assert cached[0].stat().st_mtime_ns == mtime
    assert list(cache.iterdir()) == cached
    assert bytes(second) == expected


def test_max_bytes_caps_the_corpus_and_has_its_own_cache_entry(tmp_path, text_folder):
    src, expected = text_folder
    cache = tmp_path / "cache"
    full = load_tokens(str(src), cache_dir=str(cache))
    capped = load_tokens(str(src), cache_dir=str(cache), max_bytes=20)
    assert bytes(capped) == expected[:20]
    assert bytes(full) == expected
    assert len(list(cache.iterdir())) == 2


def test_a_byte_corpus_is_built_without_holding_its_files_in_memory(tmp_path):
    """The byte corpus of a folder is copied into its cache file a block at a time: its files were
    read whole and joined, twice the corpus in memory (a 256 MB folder peaked at 541 MB, data.max_bytes
    = 0 on 20 GB wanted 40). Measured: the peak RSS a build adds, in a fresh process, stays under a
    quarter of the 48 MB corpus; the bytes are the files' in order, cut at data.max_bytes mid-file."""
    import subprocess
    import sys

    rng = np.random.default_rng(0)
    src = tmp_path / "corpus"
    src.mkdir()
    parts = [rng.integers(0, 256, size=16 << 20, dtype=np.uint8).tobytes() for _ in range(3)]
    for i, data in enumerate(parts):
        (src / f"part{i}.txt").write_bytes(data)
    # The process's own peak (VmHWM, reset by exec), not ru_maxrss: a child of this large process
    # inherits its maximum across exec, and a build of twice the corpus measured 0 bytes added.
    code = ("import re, sys\n"
            "from bigtrain.data.corpus import load_byte_corpus\n"
            "peak = lambda: int(re.search(r'VmHWM:\\s+(\\d+)', open('/proc/self/status').read()).group(1)) * 1024\n"
            "before = peak()\n"
            "tokens = load_byte_corpus(sys.argv[1], sys.argv[2], int(sys.argv[3]))\n"
            "print(len(tokens), peak() - before)\n")
    root = Path(__file__).resolve().parents[1]
    for cap in (0, (16 << 20) + 12_345):
        done = subprocess.run([sys.executable, "-c", code, str(src), str(tmp_path / "cache"), str(cap)],
                              capture_output=True, text=True, env={"PYTHONPATH": str(root)}, timeout=120)
        assert done.returncode == 0, done.stderr
        length, added = (int(x) for x in done.stdout.split())
        assert length == (cap or 48 << 20) and added < (12 << 20), (cap, added)
        assert bytes(load_tokens(str(src), cache_dir=str(tmp_path / "cache"), max_bytes=cap)) == b"".join(parts)[:length]
    assert not [f for f in (tmp_path / "cache").iterdir() if ".tmp-" in f.name]


def test_a_file_name_that_is_not_utf8_is_read_as_any_other(tmp_path):
    """A folder holding 'caf\\xe9.txt' (a Latin-1 name from an old archive): its bytes corpus failed
    with a traceback (UnicodeEncodeError in the cache name), its tokenized one with "'utf-8' codec
    can't encode character" naming no file. Both read it, in sorted order, as any other file."""
    import os

    from bigtrain.config import DataConfig
    from bigtrain.data.load import load_corpus, prepare_corpus

    src = tmp_path / "corpus"
    src.mkdir()
    odd = os.fsdecode(os.path.join(os.fsencode(src), b"caf\xe9.txt"))
    Path(odd).write_bytes(b"latin name ")
    (src / "a.txt").write_bytes(b"plain name ")
    cache = str(tmp_path / "cache")
    assert bytes(load_tokens(str(src), cache_dir=cache)) == b"plain name latin name "
    ended = DataConfig(source=str(src), cache_dir=cache, max_bytes=0, document_end="\n")
    prepare_corpus(ended)
    assert bytes(np.asarray(load_corpus(ended))) == b"plain name \nlatin name \n"


def test_a_changed_file_is_not_served_from_a_stale_cache(tmp_path, text_folder):
    src, _ = text_folder
    cache = tmp_path / "cache"
    load_tokens(str(src), cache_dir=str(cache))
    (src / "sub" / "c_third.txt").write_text("fourth\n")  # a different size
    assert bytes(load_tokens(str(src), cache_dir=str(cache))).endswith(b"fourth\n")


def test_a_same_size_edit_is_not_served_from_a_stale_cache(tmp_path, text_folder):
    src, _ = text_folder
    cache = tmp_path / "cache"
    load_tokens(str(src), cache_dir=str(cache))
    (src / "sub" / "c_third.txt").write_text("THIRD\n")  # same size, new content
    assert bytes(load_tokens(str(src), cache_dir=str(cache))).endswith(b"THIRD\n")


def test_a_folder_without_text_files_names_data_source(tmp_path):
    src = tmp_path / "csv_only"
    src.mkdir()
    (src / "table.csv").write_text("a,b\n")
    with pytest.raises(ValueError, match="data.source"):
        load_tokens(str(src), cache_dir=str(tmp_path / "cache"))


def _mixed_folder(root: Path) -> Path:
    """Three .md documents, one .py, JSON Lines, and files bigtrain does not read: .csv (also in a
    subfolder), .js, a suffix-less LICENSE, and hidden ones (.git's, .DS_Store) that are nobody's corpus."""
    src = root / "mixed"
    (src / "sub").mkdir(parents=True)
    (src / ".git").mkdir()
    for i in range(3):
        (src / f"a{i}.md").write_text("hello world " * 300)
    (src / "b.py").write_text("x = 1\n")
    (src / "c.jsonl").write_text('{"text": "hi"}\n')
    for name in ("d.csv", "sub/e.csv", "f.js", "LICENSE", ".git/config", ".DS_Store"):
        (src / name).write_text("a,b\n")
    return src


def test_files_a_folder_source_does_not_read_are_counted_by_suffix_before_launch(tmp_path, capsys):
    """A folder of .md, .py and .jsonl beside .csv, .js and LICENSE trained on the first three alone,
    without a word: the launcher now says which files it leaves out, by suffix, and how to include them."""
    from bigtrain.data.load import prepare_run_data

    src = _mixed_folder(tmp_path)
    cfg = tiny_config(str(tmp_path / "cache"), f"--data.source={src}", "--data.seq_len=16")
    prepare_run_data(cfg, tmp_path / "run", main=True)
    err = capsys.readouterr().err
    assert (f"bigtrain: warning: data.source = '{src}': 4 files in this folder are not read: 2 .csv, 1 .js, "
            f"1 without a suffix (LICENSE). The run reads only the 5 ending in .py, .txt,") in err
    assert "give them one of these suffixes" in err and ".git" not in err and "DS_Store" not in err
    for quiet in (src / "a0.md", tmp_path / "only_text"):  # a file source, a folder it reads whole: nothing said
        if quiet.name == "only_text":
            quiet.mkdir()
            (quiet / "a.txt").write_text("hello world " * 300)
        cfg = tiny_config(str(tmp_path / "cache"), f"--data.source={quiet}", "--data.seq_len=16")
        prepare_run_data(cfg, tmp_path / "run", main=True)
        assert "not read" not in capsys.readouterr().err, quiet


def test_a_corpus_smaller_than_one_batch_is_said_before_launch(tmp_path, capsys):
    """181 bytes of text at 8 windows of 32 a step trained without a word (windows are drawn with
    replacement); said now, with how often the run reads each token. A corpus of one batch or more,
    a text file or ids, says nothing."""
    from bigtrain.data.load import prepare_run_data

    short = tmp_path / "short.txt"
    short.write_text("the quick brown fox jumps over the lazy dog. " * 4 + "\n")  # 181 bytes
    ids = tmp_path / "ids.npy"
    np.save(ids, np.arange(256, dtype=np.uint16) % 200)
    for source, said in ((short, True), (ids, False)):
        cfg = tiny_config(str(tmp_path / "cache"), f"--data.source={source}", "--data.seq_len=32",
                          "--train.global_batch=8", "--train.micro_batch=8", "--train.steps=200")
        prepare_run_data(cfg, tmp_path / "run", main=True)
        err = capsys.readouterr().err
        assert ("has 181 training tokens, fewer than one step's batch (train.global_batch x data.seq_len = 8 x 32 = "
                "256 tokens)" in err and "the run's 200 steps read each about 283 times" in err) == said, source
    # The demo corpus cut by data.max_bytes too (its bytes up to the cap), and not at its default cap.
    for cap, said in ((200, True), (400_000, False)):
        cfg = tiny_config(str(tmp_path / "cache"), f"--data.max_bytes={cap}", "--data.seq_len=32",
                          "--train.global_batch=8", "--train.micro_batch=8", "--train.steps=200")
        prepare_run_data(cfg, tmp_path / "run", main=True)
        err = capsys.readouterr().err
        assert ("data.source = 'stdlib' has 200 training tokens, fewer than one step's batch" in err) == said, cap


def test_a_utf16_text_file_is_said_with_the_conversion_that_fits_it(tmp_path, capsys):
    """Windows' "Unicode" .txt (UTF-16, a BOM) in a byte-level folder trained on a NUL beside every
    letter without a word; alone it was "binary", and tokenized the fix named was iconv -f latin1."""
    from dataclasses import replace

    from bigtrain.data.load import encoding_warning, prepare_run_data

    src = tmp_path / "src"
    src.mkdir()
    (src / "a.txt").write_text("hello world " * 20, encoding="utf-16")
    (src / "b.txt").write_text("plain text " * 20)
    for source in (src, src / "a.txt"):
        prepare_run_data(tiny_config(str(tmp_path / "cache"), f"--data.source={source}"), tmp_path / "run", main=True)
        err = capsys.readouterr().err
        assert f"1 text file is UTF-16 ({src / 'a.txt'}): a byte-level run trains on its bytes as they are" in err
        assert "iconv -f utf-16 -t utf-8" in err and "binary" not in err, err
    d = replace(tiny_config(str(tmp_path / "cache"), f"--data.source={src}").data, tokenizer="t.json")
    said = encoding_warning(d, {"not_utf8_files": 1, "not_utf8": [str(src / "a.txt")]})
    assert "iconv -f utf-16 -t utf-8" in said, said
    (src / "a.txt").write_text("hello world " * 20)
    assert encoding_warning(tiny_config(str(tmp_path / "cache"), f"--data.source={src}").data, None) is None


def test_a_single_table_or_binary_file_read_as_text_is_said_and_a_torch_file_refused(tmp_path, capsys):
    """A .csv given as data.source trained on its header and commas, a binary file on its bytes, both
    without a word; a torch.save'd tensor of ids was 'a zip-compressed file ... unzip it'."""
    from bigtrain.config import ConfigError
    from bigtrain.data.load import prepare_run_data

    table, blob, text = tmp_path / "rows.csv", tmp_path / "x.arrow", tmp_path / "a.txt"
    table.write_text("text,label\n" + "".join(f'"sentence {i}",{i % 2}\n' for i in range(100)))
    blob.write_bytes(b"ARROW1\x00\x00" + bytes(range(256)) * 4)
    text.write_text("hello world " * 100)
    for source, said in ((table, "is read as one plain-text document: its header, commas and quotes"),
                         (blob, "holds NUL bytes: it looks binary"), (text, None)):
        cfg = tiny_config(str(tmp_path / "cache"), f"--data.source={source}", "--data.seq_len=16")
        prepare_run_data(cfg, tmp_path / "run", main=True)
        err = capsys.readouterr().err
        assert (said in err) if said else "warning" not in err, source
    ids = tmp_path / "ids.pt"
    torch.save(torch.arange(500), ids)
    with pytest.raises(ConfigError) as refused:
        tiny_config(str(tmp_path / "cache"), f"--data.source={ids}")
    assert "is a PyTorch file (torch.save)" in str(refused.value) and "unzip" not in str(refused.value)


def test_a_hugging_face_save_to_disk_folder_is_refused_by_what_it_is(tmp_path):
    """datasets' save_to_disk folder: its state.json and dataset_info.json (read as text) were the
    whole corpus, its .arrow records left out."""
    from bigtrain.config import ConfigError

    saved = tmp_path / "saved"
    saved.mkdir()
    (saved / "data-00000-of-00001.arrow").write_bytes(b"\xff\xff\xff\xff" + b"\x00" * 4000)
    (saved / "state.json").write_text('{"_data_files": [{"filename": "data-00000-of-00001.arrow"}]}' * 20)
    (saved / "dataset_info.json").write_text('{"features": {"text": {"dtype": "string"}}}' * 20)
    with pytest.raises(ConfigError, match="is a Hugging Face datasets folder .save_to_disk's .arrow files."):
        tiny_config(str(tmp_path / "cache"), f"--data.source={saved}")


def test_a_project_folder_whose_environment_would_be_read_is_said(tmp_path, capsys):
    """A project folder as data.source read its .venv's and node_modules' .py / .json files with its
    docs, without a word."""
    from bigtrain.data.load import prepare_run_data

    project = tmp_path / "project"
    for name in (".venv/lib/site-packages/pkg/a.py", ".venv/lib/site-packages/pkg/b.py", "node_modules/x/package.json",
                 "docs/guide.md"):
        (project / name).parent.mkdir(parents=True, exist_ok=True)
        (project / name).write_text("text of the file " * 40)
    for source, said in ((project, True), (project / "docs", False)):
        cfg = tiny_config(str(tmp_path / "cache"), f"--data.source={source}", "--data.seq_len=16")
        prepare_run_data(cfg, tmp_path / "run", main=True)
        assert (f"data.source = '{source}' reads 3 files under hidden or tool folders (.venv/: 2, node_modules/: 1)"
                in capsys.readouterr().err) == said, source


def test_a_folder_with_nothing_to_read_says_what_it_holds(tmp_path):
    """'no text files in this folder' of a folder of .js files left its owner guessing why."""
    from bigtrain.preflight import data_problems

    src = tmp_path / "js"
    src.mkdir()
    (src / "a.js").write_text("var x = 1;\n" * 100)
    (src / "b.js").write_text("var y = 1;\n" * 100)
    problems = data_problems(tiny_config(str(tmp_path / "cache"), f"--data.source={src}"))
    assert len(problems) == 1 and "no text files in this folder" in problems[0] and "it holds 2 .js)" in problems[0]
    from bigtrain.data.fields import records_problem  # the same words where a tokenizer reads the folder

    assert "it holds 2 .js)" in records_problem(tiny_config(str(tmp_path / "cache"), f"--data.source={src}"))


# --------------------------------------------------------------------------- load_tokens: pre-tokenized


def test_npy_tokens_are_mapped_flat_with_their_values(tmp_path):
    values = np.array([[0, 1, 255, 256], [31999, 65535, 70000, 7]], dtype=np.int32)
    path = tmp_path / "tokens.npy"
    np.save(path, values)
    tokens = load_tokens(str(path))
    assert isinstance(tokens, np.memmap)
    assert tokens.dtype == np.int32
    assert tokens.tolist() == [0, 1, 255, 256, 31999, 65535, 70000, 7]


def test_bin_tokens_are_uint16(tmp_path):
    values = [0, 1, 255, 256, 1000, 31999, 65535]
    path = tmp_path / "tokens.bin"
    np.array(values, dtype=np.uint16).tofile(path)
    assert path.stat().st_size == 2 * len(values)
    tokens = load_tokens(str(path))
    assert isinstance(tokens, np.memmap)
    assert tokens.dtype == np.uint16
    assert tokens.tolist() == values


def test_sampler_over_uint16_tokens_keeps_values_above_255(tmp_path):
    values = np.arange(60000, 60000 + 40, dtype=np.uint16)
    path = tmp_path / "tokens.bin"
    values.tofile(path)
    sampler = TokenSampler(load_tokens(str(path)), seq_len=8, global_batch=4, seed=1)
    x, y = sampler.batch(0, 0, 4)
    assert x.dtype == torch.int64
    assert int(x.min()) >= 60000 and int(y.max()) <= 60039
    assert torch.equal(y, x + 1)


# --------------------------------------------------------------------------- the stdlib corpus


def test_the_stdlib_walk_leaves_out_site_packages_and_the_test_suite_below_the_library_only(tmp_path,
                                                                                            monkeypatch):
    """Folders named site-packages or test inside the library are not walked; the folders above it
    do not count (a Python installed under /home/test kept no file before)."""
    import bigtrain.data.corpus as corpus

    root = tmp_path / "test" / "lib" / "python3.11"  # the install itself under a folder named test
    for name in ("os.py", "json/decoder.py", "site-packages/torch/nn.py", "test/test_os.py",
                 "json/tests/test_json.py", "lib2to3/fixer.txt"):
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text("x = 1\n")
    monkeypatch.setattr(corpus.sysconfig, "get_paths", lambda: {"stdlib": str(root)})
    assert stdlib_files() == [root / "json" / "decoder.py", root / "json" / "tests" / "test_json.py", root / "os.py"]


def test_stdlib_corpus_is_the_standard_library_bytes(tmp_path):
    tokens = load_tokens("stdlib", cache_dir=str(tmp_path), max_bytes=200_000)
    assert tokens.dtype == np.uint8
    assert len(tokens) == 200_000
    files = stdlib_files()
    assert files == sorted(files)
    assert all(f.suffix == ".py" and "site-packages" not in f.parts and "test" not in f.parts for f in files)
    expected, total = [], 0
    for f in files:
        expected.append(f.read_bytes())
        total += len(expected[-1])
        if total >= 200_000:
            break
    assert bytes(tokens) == b"".join(expected)[:200_000]
    # Python source: mostly printable ASCII and newlines.
    counts = np.bincount(np.asarray(tokens), minlength=256)
    assert counts[ord("\n")] > 1000
    printable = counts[32:127].sum() + counts[ord("\n")] + counts[ord("\t")]
    assert printable / len(tokens) > 0.95
