"""``data.val_fraction`` and ``train.eval_every``: a held-out slice that training never reads, and its
loss, equal in every layout to a plain PyTorch loop's and without effect on training."""

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from bigtrain.check.reference import ReferenceRun
from bigtrain.config import ConfigError, load_config
from bigtrain.data import TokenSampler, load_tokens
from bigtrain.models.llama import build_model
from bigtrain.testing import run_ranks
from bigtrain.validation import validate
from tests.helpers import assert_rel_close, params_of, tiny_config, trainer_on_rank

HELD_OUT = ("--data.val_fraction=0.05", "--train.eval_batches=2", "--model.n_layers=4")  # 4 stages at pp 2 x v 2


def test_held_out_windows_never_share_a_token_with_training_windows():
    n, seq = 10_000, 16
    sampler = TokenSampler(np.arange(n), seq_len=seq, global_batch=8, seed=3, val_fraction=0.1)
    first_held_out = n - 1000
    for step in range(200):
        x, y = sampler.batch(step, 0, 8)
        assert int(y.max()) < first_held_out  # inputs and targets alike
    windows = [sampler.eval_batch(b, 3, 0, 8) for b in range(3)]
    assert all(int(x.min()) >= first_held_out and int(y.max()) < n for x, y in windows)
    starts = np.concatenate([sampler.eval_starts(b, 3) for b in range(3)])
    assert starts[0] == 0 and starts[-1] == 1000 - seq - 1 and (np.diff(starts) > 0).all()  # spread evenly
    # Each data-parallel rank's micro-batches are its rows of the same windows, whatever dp and micro_batch.
    whole = torch.cat([x for x, _ in windows])
    for dp, micro in ((1, 8), (2, 2), (4, 1)):
        per_rank = [list(sampler.eval_micro_batches(3, r, dp, micro)) for r in range(dp)]
        rows = [torch.cat([x for x, _ in per_rank[r][b * (8 // dp // micro):(b + 1) * (8 // dp // micro)]])
                for b in range(3) for r in range(dp)]
        assert torch.equal(torch.cat(rows), whole)
    # Without a held-out slice, training draws exactly what it drew before val_fraction existed.
    plain, none = TokenSampler(np.arange(n), seq, 8, 3), TokenSampler(np.arange(n), seq, 8, 3, val_fraction=0.0)
    assert np.array_equal(plain.starts(7), none.starts(7)) and len(none.val_tokens) == 0


def test_a_held_out_slice_shorter_than_a_window_is_refused():
    with pytest.raises(ValueError, match="holds out 10 tokens, fewer than one window"):
        TokenSampler(np.arange(1000), seq_len=16, global_batch=2, seed=0, val_fraction=0.01)


def test_resuming_with_another_val_fraction_says_what_it_changes():
    """data.val_fraction moves the line between the training part and the held-out slice: a resumed
    run with a smaller one trains on tokens its earlier evaluations held out (and its eval_loss is no
    longer comparable), so it is named with the other fields that change the data."""
    from bigtrain.checkpoint.compat import compare_configs

    saved = load_config(preset="tiny", overrides=["--data.val_fraction=0.05"]).to_dict()
    errors, changes = compare_configs(saved, load_config(preset="tiny", overrides=["--data.val_fraction=0.01"]), "C")
    assert errors == [] and changes == [
        "data.val_fraction = 0.01 differs from the checkpoint's 0.05: this changes the training part and the held-out "
        "slice (a smaller one trains on tokens earlier evaluations held out; eval_loss before and after differ) and "
        "the order of the data from here on"]


def test_settings_are_checked_before_launch():
    with pytest.raises(ConfigError) as e:
        validate(load_config(preset="tiny", overrides=["--train.eval_every=10"]))
    assert "needs held-out data: set data.val_fraction" in str(e.value)
    with pytest.raises(ConfigError) as e:
        validate(load_config(preset="tiny", overrides=["--data.val_fraction=1", "--train.eval_batches=0",
                                                       "--train.eval_every=-1"]))
    text = str(e.value)
    assert "data.val_fraction = 1: must be in [0, 1)" in text and "train.eval_batches" in text
    assert "train.eval_every" in text


def _plain_loss(cfg) -> float:
    """The held-out loss of the initial weights, by a plain model and torch's cross-entropy."""
    model = build_model(cfg.model, device="cpu")
    model.init_weights(cfg.train.seed)
    d = cfg.data
    sampler = TokenSampler(load_tokens(d.source, d.cache_dir, d.max_bytes), d.seq_len, cfg.train.global_batch,
                           cfg.train.seed, val_fraction=d.val_fraction)
    return _plain_held_out_loss(cfg, model, sampler)


def _plain_held_out_loss(cfg, model, sampler) -> float:
    """The held-out loss of ``model``'s weights: the whole validation batches through the plain model,
    summed by torch's cross-entropy over every target."""
    losses = []
    with torch.no_grad():
        for b in range(cfg.train.eval_batches):
            x, y = sampler.eval_batch(b, cfg.train.eval_batches, 0, cfg.train.global_batch)
            logits = model(x)
            losses.append(F.cross_entropy(logits.flatten(0, 1), y.flatten(), reduction="sum"))
    return float(sum(losses)) / (cfg.train.eval_batches * cfg.train.global_batch * cfg.data.seq_len)


def _eval_around_steps(rank, world_size, cfg, run_dir):
    """[eval at init, loss 1, eval, loss 2, eval], and the two losses of a trainer that never evaluates."""
    trainer = trainer_on_rank(rank, world_size, cfg, run_dir)
    seen = [trainer.evaluate()]
    for _ in range(2):
        seen += [trainer.train_step().loss, trainer.evaluate()]
    untouched = trainer_on_rank(rank, world_size, cfg, run_dir)
    return seen, [untouched.train_step().loss for _ in range(2)]


@pytest.fixture(scope="module")
def one_rank(corpus_cache, tmp_path_factory):
    cfg = tiny_config(corpus_cache, *HELD_OUT)
    return cfg, run_ranks(_eval_around_steps, 1, cfg, str(tmp_path_factory.mktemp("one")))[0]


def test_one_rank_equals_a_plain_loop_and_evaluation_changes_nothing(one_rank):
    cfg, (seen, untouched) = one_rank
    assert seen[0] == pytest.approx(_plain_loss(cfg), rel=1e-5)
    assert [seen[1], seen[3]] == untouched  # bit for bit: evaluating leaves the training alone
    assert seen[4] < seen[0]


@pytest.mark.parametrize("layout", [
    ("--parallel.dp=2", "--parallel.zero=3"),
    ("--parallel.tp=2", "--parallel.sequence_parallel=true"),
    ("--parallel.pp=2", "--parallel.pp_schedule=interleaved", "--parallel.pp_virtual=2", "--train.micro_batch=2"),
    ("--parallel.sp=2",),
    ("--parallel.cp=2",),
    ("--parallel.cp=2", "--parallel.cp_mode=all-to-all"),
], ids=["dp2-zero3", "tp2-megatron-sp", "pp2-interleaved", "ulysses-sp2", "cp2-ring", "cp2-all-to-all"])
def test_every_layout_gives_one_process_eval_loss(corpus_cache, tmp_path, one_rank, layout):
    _, (expected, expected_untouched) = one_rank
    cfg = tiny_config(corpus_cache, *HELD_OUT, *layout)
    seen, untouched = run_ranks(_eval_around_steps, 2, cfg, str(tmp_path))[0]
    assert seen == pytest.approx(expected, rel=1e-5)
    assert [seen[1], seen[3]] == untouched


def _routing_loads(rank, world_size, cfg, run_dir, evaluate):
    trainer = trainer_on_rank(rank, world_size, cfg, run_dir)
    loads = []
    for _ in range(2):
        if evaluate:
            trainer.evaluate()
        loads.append(trainer.train_step().moe)
    return loads


def test_evaluation_leaves_moe_routing_statistics_alone(corpus_cache, tmp_path):
    # Routers count the loads of the step's forwards (sigmoid-bias routers move their biases by
    # them): an evaluation's forwards must not count.
    cfg = tiny_config(corpus_cache, *HELD_OUT, "--model.moe_experts=4", "--model.moe_router=sigmoid-bias")
    evaluated = run_ranks(_routing_loads, 1, cfg, str(tmp_path), True)[0]
    assert evaluated == run_ranks(_routing_loads, 1, cfg, str(tmp_path), False)[0]
    assert sum(evaluated[0]["layers.0.feed_forward"]["load"]) == 8 * 32 * 2  # tokens x top_k of one batch


def _evaluate(rank, world_size, cfg, run_dir):
    return trainer_on_rank(rank, world_size, cfg, run_dir).evaluate()


@pytest.mark.parametrize("layout", [("--parallel.tp=2", "--parallel.pp=2"), ("--parallel.sp=2", "--parallel.pp=2")],
                         ids=["tp2-pp2", "ulysses-sp2-pp2"])
def test_hugging_face_stages_give_the_transformers_models_eval_loss(corpus_cache, tmp_path, layout):
    """The held-out loss through a Hugging Face decoder's pipeline stages (families/hf_stages.py) with
    a tied head whose vocabulary tp does not divide (padded rows masked) and masked targets equals
    transformers' own model's, summed by torch's cross-entropy over the counted targets."""
    import json

    from bigtrain.check.fuzz_layouts import tiny_hf_config
    from bigtrain.core.targets import IGNORE_INDEX
    from bigtrain.families.hf_reference import HFReference

    fields = json.loads(tiny_hf_config("qwen3:2:1:True", tmp_path).read_text())
    fields["vocab_size"] = 257
    (tmp_path / "v257").mkdir()
    (tmp_path / "v257" / "config.json").write_text(json.dumps(fields))
    cfg = tiny_config(corpus_cache, "--model.family=hf", f"--model.hf_config={tmp_path / 'v257'}",
                      "--data.val_fraction=0.05", "--train.eval_batches=2", "--data.ignore_target=10", *layout)
    plain, total, counted = HFReference(cfg), 0.0, 0
    with torch.no_grad():
        for b in range(2):
            x, y = plain.sampler.eval_batch(b, 2, 0, cfg.train.global_batch)
            logits = plain.model(input_ids=x).logits
            total += float(F.cross_entropy(logits.flatten(0, 1), y.flatten(), ignore_index=IGNORE_INDEX,
                                           reduction="sum"))
            counted += int((y != IGNORE_INDEX).sum())
    losses = run_ranks(_evaluate, 4, cfg, str(tmp_path / "run"))
    assert losses == pytest.approx([total / counted] * 4, rel=1e-5)


# -- evaluation between the steps of a pipeline schedule -------------------------------------------------
# Evaluation sends its activations between the pipeline ranks with blocking transfers on the same
# channels as the training step's. A synchronous schedule has waited for all of its transfers when the
# step ends; an asynchronous one (no flush) leaves transfers posted across the step boundary, which
# evaluation (and a checkpoint's save) then runs between: ``validate`` proves that each of those is
# paired within its step (``_check_step_boundaries``), so no evaluation message can be matched to a
# training receive. Here the whole run says so: a fit that evaluates after every step and saves every
# two gives, at every step, the loss, the held-out loss and in the end the weights of the one-process
# reference (with the schedule's gradient delay), fp32 within 1e-5.
def _first_stage_delay_pp2(name: str) -> int:
    """PipeDream's per-stage delay at pp 2 (stage versions): the first stage (embedding and blocks 0-1
    of 4) computes a micro-batch with the weights of one update before, the last with the newest."""
    return 1 if name.startswith(("tok_embeddings", "layers.0.", "layers.1.")) else 0


PIPELINE_SCHEDULES = {  # id: (overrides, the reference's gradient delay)
    "1f1b": (("--parallel.pp_schedule=1f1b",), 0),
    "interleaved": (("--parallel.pp_schedule=interleaved", "--parallel.pp_virtual=2", "--train.micro_batch=2"), 0),
    "zb-h1": (("--parallel.pp_schedule=zb-h1",), 0),
    "pipedream-2bw": (("--parallel.pp_schedule=pipedream-2bw",), 1),  # the deferred boundary: flushed to evaluate
    # Weights tied across the pipeline's ends: the synchronous 2BW boundary (not deferrable).
    "pipedream-2bw-tied": (("--parallel.pp_schedule=pipedream-2bw", "--model.tie_embeddings=true"), 1),
    "pipedream": (("--parallel.pp_schedule=pipedream", "--train.micro_batch=8"), _first_stage_delay_pp2),
}
EVAL_STEPS = 4


def _fit_evaluating(rank, world_size, cfg, run_dir):
    """(losses, held-out losses, weights) of a fit, and at each evaluation the training receives this
    rank had posted and not yet consumed (an asynchronous pipeline's, carried to the next step)."""
    trainer = trainer_on_rank(rank, world_size, cfg, run_dir)
    pending, evaluate = [], trainer.evaluate

    def evaluate_counting():
        carried = trainer.executor._carry
        pending.append(0 if carried is None else len(carried.recvs))
        return evaluate()

    trainer.evaluate = evaluate_counting
    history = sorted(trainer.fit(), key=lambda r: r.step)
    return [r.loss for r in history], [r.eval_loss for r in history], params_of(trainer), pending


@pytest.mark.slow
@pytest.mark.parametrize("schedule", list(PIPELINE_SCHEDULES))
def test_evaluation_between_pipeline_steps_gives_the_reference_losses_and_weights(corpus_cache, tmp_path, schedule):
    overrides, delay = PIPELINE_SCHEDULES[schedule]
    cfg = tiny_config(corpus_cache, *HELD_OUT, "--parallel.pp=2", *overrides, f"--train.steps={EVAL_STEPS}",
                      "--train.eval_every=1", "--checkpoint.every=2")
    reference = ReferenceRun(cfg, gradient_delay=delay)
    ref_losses, ref_evals = [], []
    for _ in range(EVAL_STEPS):
        ref_losses.append(reference.train_step().loss)
        ref_evals.append(_plain_held_out_loss(cfg, reference.master, reference.sampler))
    ref_weights = dict(reference.master.named_parameters(remove_duplicate=False))  # a tied weight by both names
    compared = set()
    results = run_ranks(_fit_evaluating, 2, cfg, str(tmp_path), timeout=240)
    pending = [sum(counts) for counts in zip(*(r[3] for r in results))]  # per evaluation, over the ranks
    assert len(pending) == EVAL_STEPS
    if schedule.startswith("pipedream"):  # every evaluation ran beside training receives still posted
        assert all(pending), pending
    for losses, evals, weights, _ in results:
        assert losses == pytest.approx(ref_losses, rel=1e-5)
        assert evals == pytest.approx(ref_evals, rel=1e-5)
        for name, value in weights.items():
            assert_rel_close(value, ref_weights[name], 1e-5, name)
            compared.add(name)
    assert compared == set(ref_weights), "some weights were not compared"
    if delay:  # the delayed reference differs from the synchronous one: the comparison could fail
        assert ref_evals[-1] != pytest.approx(_synchronous_evals(cfg)[-1], rel=1e-4)


def _synchronous_evals(cfg) -> list[float]:
    reference = ReferenceRun(cfg, gradient_delay=0)
    evals = []
    for _ in range(EVAL_STEPS):
        reference.train_step()
        evals.append(_plain_held_out_loss(cfg, reference.master, reference.sampler))
    return evals


# -- a held-out corpus of its own (data.val_source) ----------------------------------------------------
def _val_text(tmp_path) -> str:
    """A held-out text file: bytes the training corpus (the stdlib) never reads in this order."""
    path = tmp_path / "val.txt"
    path.write_text("".join(f"line {i}: the held-out corpus says {i * i % 97} things.\n" for i in range(300)))
    return str(path)


def test_a_held_out_corpus_is_evaluated_in_every_layout_as_a_plain_loop_reads_it(corpus_cache, tmp_path):
    """dp=2 under ZeRO-3 at the initial weights: the held-out loss is the plain model's over windows cut
    from the file's bytes at starts spread evenly over it (written out here, not the sampler's)."""
    val = _val_text(tmp_path)
    cfg = tiny_config(corpus_cache, f"--data.val_source={val}", "--train.eval_batches=2", "--parallel.dp=2",
                      "--parallel.zero=3")
    data = np.frombuffer(open(val, "rb").read(), dtype=np.uint8).astype(np.int64)
    seq, windows = cfg.data.seq_len, 2 * cfg.train.global_batch
    starts = np.linspace(0, len(data) - seq - 1, windows).round().astype(np.int64)
    x = torch.from_numpy(np.stack([data[s:s + seq] for s in starts]))
    y = torch.from_numpy(np.stack([data[s + 1:s + seq + 1] for s in starts]))
    model = build_model(cfg.model, device="cpu")
    model.init_weights(cfg.train.seed)
    with torch.no_grad():
        expected = float(F.cross_entropy(model(x).flatten(0, 1), y.flatten(), reduction="sum")) / y.numel()
    losses = run_ranks(_evaluate, 2, cfg, str(tmp_path / "run"))
    assert losses == pytest.approx([expected] * 2, rel=1e-5)


def test_a_held_out_corpus_is_checked_before_launch_naming_its_field(corpus_cache, tmp_path):
    from bigtrain.preflight import preflight

    with pytest.raises(ConfigError, match="data.val_source = .* and data.val_fraction = 0.05 both give held-out data"):
        tiny_config(corpus_cache, f"--data.val_source={_val_text(tmp_path)}", "--data.val_fraction=0.05")
    with pytest.raises(ConfigError, match="data.val_source = '/nonexistent/val.bin': no such file or folder"):
        tiny_config(corpus_cache, "--data.val_source=/nonexistent/val.bin")
    ids = tmp_path / "val.npy"
    np.save(ids, np.array([1, 2, 300] * 100, dtype=np.int64))  # 300: past the tiny model's 256 ids
    cfg = tiny_config(corpus_cache, f"--data.val_source={ids}", "--train.eval_every=5")
    with pytest.raises(ConfigError) as err:
        preflight(cfg, tmp_path / "run", check_size=False)
    assert "data.val_source" in str(err.value) and "300" in str(err.value), str(err.value)
    assert "data.source" not in str(err.value).replace("data.val_source", ""), str(err.value)
    never = tiny_config(corpus_cache, f"--data.val_source={_val_text(tmp_path)}")
    assert any("data.val_source" in w and "train.eval_every = 0" in w
               for w in preflight(never, tmp_path / "run", check_size=False))


def test_a_held_out_corpus_shorter_than_a_window_is_refused():
    with pytest.raises(ValueError, match="data.val_source has 10 tokens, fewer than one window"):
        TokenSampler(np.arange(1000), seq_len=16, global_batch=2, seed=0, val_tokens=np.arange(10))
