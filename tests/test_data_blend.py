"""data.blend: training windows from several corpora by share, each window inside one corpus, drawn
the same in every layout; each corpus's held-out tail, evaluation windows shared out by share; the
field checked before launch, naming the corpus."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from bigtrain.check.run import check_on_rank
from bigtrain.config import ConfigError
from bigtrain.data.blend import BlendedSampler
from bigtrain.data.blend_spec import blend_problems, parse_blend
from bigtrain.data.sampler import TokenSampler
from bigtrain.preflight import preflight
from bigtrain.testing import run_ranks
from helpers import tiny_config

SEQ, BATCH = 16, 8


def _three(val_fraction: float = 0.0) -> BlendedSampler:
    """Corpora of ids 0-9999, 10000-12999 and 20000-20999: a window's ids say which it came from."""
    parts = [TokenSampler(np.arange(start, start + n), SEQ, BATCH, seed=5, val_fraction=val_fraction)
             for start, n in ((0, 10_000), (10_000, 3_000), (20_000, 1_000))]
    return BlendedSampler(parts, [0.5, 0.3, 0.2])


def _corpus_of(window: torch.Tensor) -> int:
    return int(window.min()) // 10_000


def test_each_window_lies_in_one_corpus_drawn_by_its_share():
    """4,000 windows (500 steps x 8): each corpus's count is within four binomial standard deviations
    of its share (sqrt(n p (1 - p)) <= 32 here), so a corpus drawn by the wrong share fails."""
    sampler, counts = _three(), np.zeros(3)
    for step in range(500):
        x, y = sampler.batch(step, 0, BATCH)
        for window, target in zip(x, y):
            corpus = _corpus_of(window)
            assert _corpus_of(torch.cat([window, target[-1:]])) == corpus == int(window.max()) // 10_000
            assert torch.equal(window[1:], target[:-1])
            counts[corpus] += 1
    for count, share in zip(counts, (0.5, 0.3, 0.2)):
        assert abs(count - 4000 * share) <= 4 * (4000 * share * (1 - share)) ** 0.5, counts


def test_every_layout_reads_the_same_windows_and_a_step_needs_nothing_but_its_number():
    sampler = _three()
    whole = sampler.batch(7, 0, BATCH)
    for dp, micro in ((2, 2), (4, 1), (1, 8)):
        rows = [torch.cat([x for x, _ in sampler.micro_batches(7, r, dp, micro)]) for r in range(dp)]
        assert torch.equal(torch.cat(rows), whole[0])
    assert torch.equal(_three().batch(7, 0, BATCH)[0], whole[0])  # another sampler, same step: same windows
    assert not torch.equal(sampler.batch(8, 0, BATCH)[0], whole[0])


def test_each_corpus_keeps_its_held_out_tail_and_evaluation_shares_out_its_windows():
    sampler = _three(val_fraction=0.1)
    first_held_out = {0: 9_000, 1: 12_700, 2: 20_900}
    for step in range(100):
        x, y = sampler.batch(step, 0, BATCH)
        for window, target in zip(x, y):
            assert int(target.max()) < first_held_out[_corpus_of(window)]
    which, _ = sampler.eval_picks(3)  # 24 windows: 12, 7.2 -> 7, 4.8 -> 5 (largest remainders)
    assert np.bincount(which).tolist() == [12, 7, 5]
    windows = torch.cat([sampler.eval_batch(b, 3, 0, BATCH)[0] for b in range(3)])
    assert all(int(w.min()) >= first_held_out[_corpus_of(w)] for w in windows)
    assert sampler.token_counts() == (9_000 + 2_700 + 900, 1_000 + 300 + 100)


def test_the_field_is_read_and_refused_naming_the_entry_and_the_fix(corpus_cache, tmp_path):
    assert parse_blend(" a.txt=0.25, /x/b c.jsonl=0.5 ") == [("a.txt", 0.25), ("/x/b c.jsonl", 0.5)]
    assert "cannot read 'a.txt'" in blend_problems("a.txt")[0]
    assert "cannot read 'b.txt=abc'" in blend_problems("b.txt=abc")[0]
    assert "a share must be in (0, 1)" in blend_problems("a.txt=1.5")[0]
    assert "add up to 1.1" in blend_problems("a.txt=0.6, b.txt=0.5")[0]
    assert "names a.txt twice" in blend_problems("a.txt=0.2, a.txt=0.1")[0]
    with pytest.raises(ConfigError, match="data.blend's /nonexistent/b.txt: no such file or folder"):
        tiny_config(corpus_cache, "--data.blend=/nonexistent/b.txt=0.2")
    ids = tmp_path / "ids.npy"
    np.save(ids, np.array([1, 2, 300] * 100, dtype=np.int64))  # 300: past the tiny model's 256 ids
    with pytest.raises(ConfigError) as err:
        preflight(tiny_config(corpus_cache, f"--data.blend={ids}=0.2"), tmp_path / "run", check_size=False)
    assert f"data.blend's {ids} holds token id 300" in str(err.value), str(err.value)


def test_a_blended_run_trains_in_a_layout_as_the_reference_does(corpus_cache, tmp_path):
    text = tmp_path / "code.txt"
    text.write_text("".join(f"def f{i}(x):\n    return x * {i}\n" for i in range(400)))
    cfg = tiny_config(corpus_cache, f"--data.blend={text}=0.5", "--parallel.dp=2", "--parallel.zero=2")
    report = run_ranks(check_on_rank, 2, cfg, str(tmp_path / "run"), 3)[0]
    assert report.agree, report.text()


def test_data_source_s_warnings_name_a_blended_corpus_too(corpus_cache, tmp_path, capsys):
    """data.max_bytes cuts every corpus (16 MB by default): a blended one cut short is said as
    data.source is, by its name."""
    from bigtrain.data.load import prepare_run_data

    text = tmp_path / "long.txt"
    text.write_text("def f(x):\n    return x\n" * 400)
    cfg = tiny_config(corpus_cache, f"--data.blend={text}=0.2", "--data.max_bytes=2000")
    prepare_run_data(cfg, tmp_path / "run", main=True)
    assert f"data.max_bytes = 2000 cut data.blend's {text} short" in capsys.readouterr().err
