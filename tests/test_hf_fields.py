"""config.json fields of a Hugging Face decoder that some layouts cannot honour
(bigtrain/families/hf_fields.py): refused before launch, naming the field and the fix, exactly where
the layout would train something else than transformers in one process. Each was accepted before and
trained silently apart from the reference (measured sizes in hf_fields' docstring)."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest

from bigtrain.config import ConfigError
from bigtrain.testing import run_ranks
from tests.test_hf_family import FIXTURES, hf_config

transformers = pytest.importorskip("transformers")

# Llama with longrope: long factors past position 16 (transformers reads the config's top-level
# original_max_position_embeddings); at initializer_range 0.2 positions matter (test_hf_ulysses).
LONGROPE = {"initializer_range": 0.2, "original_max_position_embeddings": 16,
            "rope_scaling": {"rope_type": "longrope", "factor": 8.0, "short_factor": [1.0] * 8,
                             "long_factor": [1.0, 2.0, 4.0, 8.0, 16.0, 32.0, 64.0, 128.0],
                             "original_max_position_embeddings": 16}}


def fixture_with(tmp_path, arch: str, **fields) -> str:
    base = json.loads((FIXTURES / arch / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**base, **fields}))
    return str(tmp_path)


def problems_of(cache: str, folder: str, *overrides: str) -> list[str]:
    try:
        hf_config(cache, "llama", f"--model.hf_config={folder}", *overrides)
    except ConfigError as e:
        return e.problems
    return []


def test_attention_dropout_is_refused(corpus_cache, tmp_path):
    """Accepted before: the layout's loss 8e-4 off its reference at step 0 (its own dropout masks)."""
    problems = problems_of(corpus_cache, fixture_with(tmp_path, "llama", attention_dropout=0.1))
    assert any("attention_dropout = 0.1" in p and '"attention_dropout": 0.0' in p for p in problems), problems
    assert problems_of(corpus_cache, fixture_with(tmp_path, "llama", attention_dropout=0.0)) == []


@pytest.mark.parametrize("original, layout, refused", [
    (16, ["--parallel.sp=2"], True),  # the first Ulysses rank's tokens end at position 16: short factors
    (8, ["--parallel.sp=2"], False),  # every rank's reach past 8
    (16, [], False),  # one process sees the whole sequence
    (16, ["--parallel.pp=2", "--train.micro_batch=1"], False),  # stages see every position
    (16, ["--parallel.cp=2", "--parallel.cp_mode=all-to-all"], False),  # cp rank 1 holds chunks 1 and 2: to 24
    (24, ["--parallel.cp=2", "--parallel.cp_mode=all-to-all"], True),  # ... which is not past 24
    (48, ["--parallel.sp=2"], False),  # 32 tokens: short factors everywhere
])
def test_longrope_is_refused_where_a_rank_would_pick_other_factors(corpus_cache, tmp_path, original, layout, refused):
    folder = fixture_with(tmp_path, "llama", **{**LONGROPE, "original_max_position_embeddings": original})
    problems = problems_of(corpus_cache, folder, *layout)
    assert any("rope_scaling 'longrope'" in p and "use a data.seq_len of at most" in p for p in problems) == refused, \
        problems


def _check(cfg, run_dir):
    from bigtrain.check.run import check_on_rank

    return run_ranks(check_on_rank, cfg.parallel.world_size, cfg, run_dir, 3, timeout=300)[0]


def test_the_refused_longrope_layout_trains_apart_and_the_accepted_one_agrees(corpus_cache, tmp_path, monkeypatch):
    """Why the rule: at sp 2 with the long factors starting past 16 of 32 tokens, the first rank
    rotates with the short ones (the first loss 1e-2 off, measured); past 8 every rank takes the
    long ones and the layout agrees with the reference within fp32's bounds."""
    import bigtrain.train

    refused = hf_config(corpus_cache, "llama", f"--model.hf_config={fixture_with(tmp_path, 'llama', **LONGROPE)}")
    with monkeypatch.context() as unvalidated:  # the Trainer validates: the refused layout trains here only
        unvalidated.setattr(bigtrain.train, "validate", lambda *args, **kwargs: None)
        report = _check(replace(refused, parallel=replace(refused.parallel, sp=2)), str(tmp_path / "refused"))
    assert not report.agree and report.first_step == 0, report.text()
    (tmp_path / "ok").mkdir()
    folder = fixture_with(tmp_path / "ok", "llama", **{**LONGROPE, "original_max_position_embeddings": 8})
    report = _check(hf_config(corpus_cache, "llama", f"--model.hf_config={folder}", "--parallel.sp=2"),
                    str(tmp_path / "accepted"))
    assert report.agree, report.text()
