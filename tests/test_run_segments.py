"""A run over several launches: a finished run's resume changes nothing, and the report adds up
every segment (steps, tokens, wall time) and names each segment's layout (issue 32)."""

import hashlib

from bigtrain.cli import main
from bigtrain.metrics import read_metrics
from bigtrain.run_segments import read_segments, totals


def _args(cache, out, *extra):
    return ["train", "--preset", "tiny", "--output-dir", str(out), "--logging.progress=false",
            f"--data.cache_dir={cache}", "--data.max_bytes=400000", "--logging.log_every=1", *extra]


def _files(folder):
    return {str(p.relative_to(folder)): (p.stat().st_mtime_ns, hashlib.sha256(p.read_bytes()).hexdigest())
            for p in sorted(folder.rglob("*")) if p.is_file()}


def test_resuming_a_finished_run_prints_one_line_and_changes_no_file(corpus_cache, tmp_path, capsys):
    out = tmp_path / "run"
    assert main(_args(corpus_cache, out, "--train.steps=3")) == 0
    before = _files(out)
    capsys.readouterr()
    assert main(["train", "--output-dir", str(out), "--resume"]) == 0
    printed = capsys.readouterr()
    assert printed.out.splitlines() == [
        f"bigtrain: {out} is finished: step_00000003 holds step 3 of train.steps = 3; nothing to do "
        f"(to train further: --resume --train.steps=N with N > 3)"], printed
    assert _files(out) == before


def test_a_run_resumed_at_another_layout_reports_both_segments(corpus_cache, tmp_path):
    out = tmp_path / "run"
    assert main(_args(corpus_cache, out, "--train.steps=4", "--checkpoint.every=2")) == 0
    assert main(["train", "--output-dir", str(out), "--resume", "--train.steps=6", "--parallel.zero=1"]) == 0
    segments = read_segments(out)
    assert [(s["first_step"], s["last_step"]) for s in segments] == [(0, 4), (4, 6)]
    assert "zero=0" in segments[0]["layout"] and "zero=1" in segments[1]["layout"]
    assert all(s["wall_time_s"] > 0 for s in segments)
    whole = totals(segments)
    assert whole["steps"] == 6 and whole["tokens"] == 6 * 8 * 32  # tiny: global batch 8 x 32 tokens
    report = (out / "report.md").read_text()
    wall = sum(s["wall_time_s"] for s in segments)
    assert f"- tokens seen: {6 * 8 * 32:,}; wall time" in report and f"({wall:.1f} s) over 2 segments" in report
    assert f"  - steps 1-4: {segments[0]['layout']}" in report and f"  - steps 5-6: {segments[1]['layout']}" in report
    assert [r["step"] for r in read_metrics(out)] == [1, 2, 3, 4, 5, 6]


def test_a_resume_from_an_earlier_checkpoint_cuts_the_segments_it_rolls_back(tmp_path):
    from bigtrain.run_segments import open_segment, update_segment

    open_segment(tmp_path, 0, 10, "a", None)
    update_segment(tmp_path, 8, 5.0)
    open_segment(tmp_path, 6, 10, "b", None)  # resumed from step_00000006: steps 7-8 are trained again
    update_segment(tmp_path, 9, 2.0)
    assert [(s["first_step"], s["last_step"], s["layout"]) for s in read_segments(tmp_path)] == [(0, 6, "a"), (6, 9, "b")]
    assert totals(read_segments(tmp_path)) == {"steps": 9, "tokens": 90, "wall_time_s": 7.0}
    open_segment(tmp_path, 0, 10, "c", None)  # started over from nothing
    assert [s["layout"] for s in read_segments(tmp_path)] == ["c"]


def test_summary_json_counts_the_tokens_of_every_segment(corpus_cache, tmp_path):
    """A resume that changes train.global_batch (a warned change) trains its steps with the new
    batch: summary.json said step x the new batch's tokens for the whole run (3,072 here), the
    report the segments' sum (2,048)."""
    import json

    out = tmp_path / "run"
    assert main(_args(corpus_cache, out, "--train.steps=4", "--logging.report=false")) == 0
    assert main(["train", "--output-dir", str(out), "--resume", "--train.steps=6", "--train.global_batch=16"]) == 0
    assert totals(read_segments(out))["tokens"] == 4 * 8 * 32 + 2 * 16 * 32
    assert json.loads((out / "summary.json").read_text())["tokens_seen"] == 4 * 8 * 32 + 2 * 16 * 32
