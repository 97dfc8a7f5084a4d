"""A fixed sample of the layout fuzzer (``bigtrain.check.fuzz``): each layout is rejected by
validation before launch with every problem naming a field, or trains like the independent
reference (fp32: 1e-5 relative; bf16/fp16: 1e-3 on the loss and gradient norm, 1e-2 per tensor).
``scripts/fuzz-layouts.sh N SEED`` samples more."""

import random

import pytest

from bigtrain.check.fuzz import run_sample
from bigtrain.check.fuzz_layouts import sample_layout

SEED, COUNT, MAX_WORLD = 20261123, 48, 8
LAYOUTS = [sample_layout(random.Random(f"{SEED}:{i}"), MAX_WORLD) for i in range(COUNT)]


def _short(overrides: list[str]) -> str:
    return " ".join(o.split(".", 1)[1] for o in overrides if not o.endswith(("=1", "=False", "=none", "=-1", "=0")))


@pytest.mark.parametrize("overrides", LAYOUTS, ids=[_short(o) for o in LAYOUTS])
def test_sampled_layout_is_rejected_or_matches_the_reference(overrides, corpus_cache):
    outcome = run_sample(overrides, corpus_cache, steps=3)
    assert outcome.ok, f"{outcome.verdict}: {' '.join(overrides)}\n{outcome.detail}"


def test_the_sample_spans_the_composition_space():
    seen = {o.split("=")[0] + ("" if o.endswith(("=1", "=False", "=none", "=-1", "=0", "=fp32")) else "*")
            for layout in LAYOUTS for o in layout}
    for key in ("dp", "tp", "pp", "sp", "zero", "sequence_parallel", "pp_virtual", "tie_embeddings",
                "checkpointing", "ignore_target", "mode", "activation_offload", "fused_loss", "moe_experts", "ep",
                "moe_capacity_factor", "offload.optimizer", "offload.params", "delayed_update", "fp8", "dp_replicate"):
        assert any(k.endswith(key + "*") for k in seen), f"no sampled layout sets {key}"


def test_half_the_fp16_samples_overflow_and_skip_as_the_reference_does(corpus_cache):
    """fp16's skip, backoff and growth are sampled: the drawn loss scale overflows the tiny model's
    first step (the reference skips it) and the run recovers within the steps compared."""
    from bigtrain.check.fuzz_layouts import FP16_OVERFLOW
    from bigtrain.check.reference import ReferenceRun
    from helpers import tiny_config

    modes = [[o for o in layout if o.startswith("--precision.mode=")][-1] for layout in LAYOUTS]  # the last counts
    fp16 = [layout for layout, mode in zip(LAYOUTS, modes) if mode.endswith("fp16")]
    overflowing = [layout for layout in fp16 if FP16_OVERFLOW[0] in layout]
    assert 0 < len(overflowing) < len(fp16)
    assert all(FP16_OVERFLOW[0] not in layout for layout in LAYOUTS if layout not in fp16)
    run = ReferenceRun(tiny_config(corpus_cache, "--precision.mode=fp16", *FP16_OVERFLOW))
    skipped = [run.train_step().skipped for _ in range(3)]
    assert skipped[0] and not skipped[-1], skipped


def test_context_parallel_draws_fit_the_world_and_leave_other_samples_as_they_were():
    from bigtrain.check.fuzz import draw_sample
    from bigtrain.check.fuzz_layouts import CP

    drawn = [draw_sample(SEED, i, MAX_WORLD, dlrm_share=0.0, hf_share=0.0, cp_share=1.0) for i in range(60)]
    with_cp = [d for d in drawn if any(o.startswith(CP) for o in d)]
    assert len(with_cp) > 20
    for sample in with_cp:
        first = sample[:sample.index(next(o for o in sample if o.startswith("resume-after=")))] \
            if any(o.startswith("resume-after=") for o in sample) else sample
        sizes = {k: 1 for k in ("dp", "tp", "pp", "sp", "cp")}
        sizes.update({o.split("=")[0][11:]: int(o.split("=")[1]) for o in first
                      if o.split("=")[0][11:] in sizes and o.startswith("--parallel.")})
        assert sizes["dp"] * sizes["tp"] * sizes["pp"] * sizes["sp"] * sizes["cp"] <= MAX_WORLD, sample
        mode = next(o.split("=")[1] for o in sample if o.startswith("--parallel.cp_mode="))
        assert (mode == "hybrid") == (sizes["sp"] > 1), sample
    assert {next(o.split("=")[1] for o in d if o.startswith("--parallel.cp_mode=")) for d in with_cp} >= {"ring", "all-to-all"}
    # cp_share 0: the sample drawn before cp joined
    assert all(draw_sample(SEED, i, MAX_WORLD, cp_share=0.0) == [o for o in draw_sample(SEED, i, MAX_WORLD, cp_share=1.0)
                                                                 if not o.startswith((CP, "--parallel.cp_mode="))]
               for i in range(20) if not any(o.startswith("then:") for o in draw_sample(SEED, i, MAX_WORLD, cp_share=1.0)))


def test_cp_shapes_and_resumed_cp_are_drawn_on_cp_samples_only_and_share_0_leaves_them():
    """--cp-shape-share: a sample with cp takes a sequence of 2 x cp chunks of 1, 3, 5 or 7 tokens,
    and a resumed one another cp after its checkpoint (validated with the resumed layout); the
    default 0 draws every seed's samples as before (tests pin some), a sample without cp never
    changes."""
    from bigtrain.check.fuzz import THEN, _valid, draw_sample, split_resume
    from bigtrain.check.fuzz_layouts import CP, last_values

    shares = dict(dlrm_share=0.0, compile_share=0.0, resume_share=0.5)
    for i in range(40):
        assert draw_sample(SEED, i, MAX_WORLD, **shares) == draw_sample(SEED, i, MAX_WORLD, **shares, cp_shape_share=0.0)
    plain = [draw_sample(SEED, i, MAX_WORLD, **shares, cp_share=1.0) for i in range(60)]
    shaped = [draw_sample(SEED, i, MAX_WORLD, **shares, cp_share=1.0, cp_shape_share=1.0) for i in range(60)]
    changed_cp, valid = 0, 0
    for old, new in zip(plain, shaped):
        saved, after, resumed = split_resume(new)
        cp = int(last_values(saved).get(CP[:-1], 1))
        seq = [int(o.split("=")[1]) for o in new if o.startswith("--data.seq_len=")]
        assert (seq != []) == (cp > 1), new
        if cp == 1:
            assert new == old
            continue
        assert len(seq) == 1 and seq[0] % (2 * cp) == 0 and seq[0] // (2 * cp) in (1, 3, 5, 7), new
        if any(o.startswith(THEN + CP) for o in new):
            changed_cp += 1
            assert after and _valid(resumed) and int(last_values(resumed)[CP[:-1]]) != cp, new
        valid += _valid(saved)
    assert changed_cp >= 5 and valid >= 10, (changed_cp, valid)


# -- the delayed update in bf16/fp16 ------------------------------------------------------------
# sha256 of the JSON of draw_sample(SEED, i, 4) for i < 200, as drawn before the mixed-precision
# delayed update joined (main 089d238). A new draw passes its share 0 here: the seeds' samples stay.
# A change of validation may move a resumed sample (resume_choice keeps the first valid layout): while
# compiled float8 under Ulysses was refused (8be8389 to its fix), sample 104 resumed at sp 1, ZeRO-2.
# Since Hugging Face samples draw the offload tiers and resumes too, 4 of the 200 (all hf, the rest
# as they were: test_hugging_face_samples_draw_offload_and_resumes) took them. Since parallel.pp = 1
# refuses a schedule it would ignore, the 3 resumed at pp 1 from a pipeline (samples 74, 119, 125)
# reset pp_schedule / pp_virtual to their defaults (then:, drawn from nothing; the layouts as they were).
SAMPLES_BEFORE_MIXED_DELAYED = "2e273e85f046a9f534a56460c7990a546a1f80001a7b6bddb47cbc1c4ab38f1c"


def test_mixed_precision_delayed_update_is_drawn_where_valid_and_leaves_other_samples_as_they_were():
    import hashlib
    import json

    from bigtrain.check.fuzz import DELAYED, _valid, draw_sample, split_resume

    # (block-causal attention joined after the delayed update, drawn last: its share 0 here)
    before = [draw_sample(SEED, i, 4, delayed_share=0.0, documents_share=0.0) for i in range(200)]
    assert hashlib.sha256(json.dumps(before).encode()).hexdigest() == SAMPLES_BEFORE_MIXED_DELAYED
    drawn = [draw_sample(SEED, i, 4, documents_share=0.0) for i in range(200)]
    gained = [new for old, new in zip(before, drawn) if new != old]
    # the default share changes nothing but the flag, on bf16/fp16 samples only, each still valid
    for old, new in zip(before, drawn):
        assert new == old or (new[:new.index(DELAYED)] + new[new.index(DELAYED) + 1:] == old and DELAYED not in old)
    assert len(gained) >= 2, gained  # samples 103 (resumed) and 180 of this seed
    for sample in gained:
        saved, after, resumed = split_resume(sample)
        assert sample.count(DELAYED) == 1 and DELAYED in saved
        assert [o for o in saved if o.startswith("--precision.mode=")][-1] in ("--precision.mode=bf16",
                                                                               "--precision.mode=fp16")
        assert _valid(saved) and (not after or _valid(resumed)), sample
    # share 1: every eligible one takes it (fp16 too), none where validation refuses it (pp > 1, ...)
    every = [draw_sample(77, i, 8, delayed_share=1.0) for i in range(300)]
    mode = {id(s): ([o for o in s if o.startswith("--precision.mode=")] or ["--precision.mode=fp32"])[-1] for s in every}
    mixed = [s for s in every if DELAYED in s and mode[id(s)] != "--precision.mode=fp32"]
    assert {mode[id(s)] for s in mixed} == {"--precision.mode=bf16", "--precision.mode=fp16"}
    assert all(_valid(split_resume(s)[0]) for s in mixed)


def test_hugging_face_samples_draw_offload_and_resumes():
    """Hugging Face decoders draw the optimizer/parameter offload tiers (in fp32 half the time with
    the delayed update, which their reference states: families/hf_reference.py) and resumes at
    AdamW, the one optimizer their reference steps with; a sample that draws neither is as before."""
    from bigtrain.check.fuzz import DELAYED, HF, draw_sample

    hf = [s for s in (draw_sample(SEED, i, MAX_WORLD, hf_share=1.0, dlrm_share=0.0) for i in range(120))]
    offloaded = [s for s in hf if any(o.startswith("--offload.optimizer=") for o in s)]
    resumed = [s for s in hf if any(o.startswith("resume-after=") for o in s)]
    assert all(HF in s for s in hf) and len(offloaded) >= 10 and len(resumed) >= 15
    assert any(DELAYED in s for s in offloaded)
    assert not any(o.startswith("--optim.name=") and o != "--optim.name=adamw" for s in resumed for o in s)
    plain = [draw_sample(SEED, i, MAX_WORLD, hf_share=1.0, dlrm_share=0.0, resume_share=0.0) for i in range(40)]
    assert all(s == [o for o in t if not o.startswith("resume-after=") and not o.startswith("then:")]
               for s, t in zip(plain, hf) if not any(o.startswith("--optim.name=") for o in s))


# -- resume then step ----------------------------------------------------------------------------
def test_resume_draws_cover_every_optimizer_and_other_layouts():
    from bigtrain.check.fuzz import OPTIMIZERS, draw_sample, split_resume

    resumed = [split_resume(draw_sample(SEED, i, MAX_WORLD, dlrm_share=0.0, resume_share=1.0, hf_share=0.0))
               for i in range(40)]
    assert all(after in (1, 2) for _, after, _ in resumed)
    names = {next((o.split("=")[1] for o in first if o.startswith("--optim.name=")), "adamw") for first, _, _ in resumed}
    assert names == set(OPTIMIZERS)
    assert any(first != then for first, _, then in resumed) and any(first == then for first, _, then in resumed)
    assert draw_sample(SEED, 3, MAX_WORLD, resume_share=0.0) == draw_sample(SEED, 3, MAX_WORLD, resume_share=0.0)


@pytest.mark.parametrize("sample,verdict", [
    (["--optim.name=adamw8bit", "--optim.block_size=32", "--parallel.dp=2", "--parallel.zero=3",
      "--train.global_batch=4", "--train.micro_batch=1", "resume-after=2", "then:--parallel.dp=1",
      "then:--parallel.tp=2", "then:--parallel.zero=1"], "agree"),
    (["--optim.name=adamw8bit", "--parallel.dp=2", "--train.global_batch=4", "--train.micro_batch=1",
      "resume-after=1", "then:--parallel.dp=1", "then:--parallel.tp=2"], "rejected"),  # block 256 > 64 / 2
], ids=["8bit-zero3-to-tp2", "resumed-layout-rejected"])
def test_a_resumed_sample_is_checked_after_its_checkpoint(sample, verdict, corpus_cache):
    outcome = run_sample(sample, corpus_cache, steps=2)
    assert outcome.verdict == verdict, outcome.detail
    if verdict == "agree":
        assert "step 3: loss" in outcome.detail and "replayed" in outcome.detail  # 1st update after 2
    else:
        assert "optim.block_size" in outcome.detail


def test_block_causal_is_drawn_last_on_decoder_samples_and_share_0_leaves_them():
    """The documents draw (fuzz.py document_mask_choice) only adds its three flags at the end of a
    decoder sample (bigtrain's or a Hugging Face one), under any cp mode (the ring masks its pairs by
    the documents' ids); a share of 0 leaves every sample as it was; each drawn sample validates as
    its layout did without them (no refusal it brings)."""
    from bigtrain.check.fuzz import BLOCK_CAUSAL, DLRM, _valid, draw_sample, split_resume

    gained = 0
    for i in range(80):
        old, new = draw_sample(SEED, i, 4, documents_share=0.0), draw_sample(SEED, i, 4, documents_share=1.0)
        if new == old:
            assert DLRM in old, old
            continue
        assert new[:len(old)] == old and new[len(old)] == BLOCK_CAUSAL and len(new) == len(old) + 3, new
        gained += 1
        if gained <= 12:
            saved, _, _ = split_resume(new)
            assert _valid(saved) == _valid(split_resume(old)[0]), new
    assert gained >= 30, gained


def test_the_fuzzers_arguments_are_whole_numbers_in_range_refused_in_one_line_before_anything_runs(capsys,
                                                                                                 monkeypatch):
    """``scripts/fuzz-layouts.sh N SEED --steps K`` took --steps 10**20 (a run that never ends) and
    N or SEED of 1e20 or 2.5 answered with argparse's usage block. Each is one line naming the argument
    and its range now; --steps is held to `bigtrain check --steps`'s bound (bigtrain.check.bounds)."""
    import bigtrain.check.fuzz as fuzz
    from bigtrain.check.bounds import STEPS_MAX

    monkeypatch.setattr(fuzz, "run_sample", lambda *a, **k: pytest.fail("a sample ran"))
    for argv, line in ((["x", "7"], "N = 'x': give a whole number of layouts from 1 to 100,000"),
                       (["2.5", "7"], "N = '2.5': give a whole number of layouts from 1 to 100,000"),
                       (["0", "7"], "N = '0': give a whole number of layouts from 1 to 100,000"),
                       (["3", "1e20"], "SEED = '1e20': give a whole number from 0 to 9,223,372,036,854,775,807"),
                       (["3", "-1"], "SEED = '-1': give a whole number from 0 to 9,223,372,036,854,775,807"),
                       (["3", "7", "--steps", "2.5"], f"--steps = '2.5': give a whole number of steps from 1 to "
                                                      f"{STEPS_MAX:,}"),
                       (["3", "7", "--steps", str(10**20)], f"--steps = '{10**20}': give a whole number of steps "
                                                            f"from 1 to 10,000"),
                       (["3", "7", "--max-world", "0"], "--max-world = '0': give a whole number of ranks from 1 to 64")):
        assert fuzz.main(argv) == 2, argv
        assert capsys.readouterr().err == f"fuzz-layouts: {line}\n"


@pytest.mark.parametrize("flag", ["--dlrm-share", "--hf-share", "--resume-share", "--int8-share", "--cp-share",
                                  "--cp-shape-share", "--compile-share", "--delayed-share", "--documents-share"])
def test_the_fuzzers_shares_are_probabilities_refused_in_one_line_outside_0_to_1(flag, capsys, monkeypatch):
    """Each --*-share is the probability a sample takes a choice: argparse's float() took 1.5, -0.2
    and nan (a share that is never or always drawn, silently). Outside 0..1 it is one line naming
    the flag; 0 and 1 themselves stay valid."""
    import bigtrain.check.fuzz as fuzz

    monkeypatch.setattr(fuzz, "run_sample", lambda *a, **k: pytest.fail("a sample ran"))
    for bad in ("1.5", "-0.2", "nan", "x"):
        assert fuzz.main(["3", "7", flag, bad]) == 2, bad
        assert capsys.readouterr().err == f"fuzz-layouts: {flag} = '{bad}': give a share from 0 to 1 (the " \
                                          f"probability a sample takes it)\n"
    monkeypatch.setattr(fuzz, "draw_sample", lambda *a, **k: pytest.fail("drawn"))
    for good in ("0", "1"):
        with pytest.raises(pytest.fail.Exception, match="drawn"):
            fuzz.main(["3", "7", flag, good])
