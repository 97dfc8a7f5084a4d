"""The layout fuzzer: seeded samples of the whole composition space, each proved or rejected.

A sample draws every degree of freedom bigtrain composes (dp, tp, pp, Ulysses sp, Megatron
sequence parallel, ZeRO stage, pipeline schedule, virtual stages and split points, activation
checkpointing (full, every k-th, selective), activation offload, the fused loss, accumulation,
tied embeddings, grouped and replicated key/value heads, a vocabulary that tp does not divide,
masked targets, fp32/bf16/fp16, ZeRO-3 prefetch and resharding, the asynchronous pipelines 2BW and PipeDream
with vertical sync, local SGD at K = 1, the memory-efficient optimizers, mixture of experts with its ep
degree, capacity, router, balance loss, shared expert and grouped GEMM, offload's tiers and its delayed
update (fp32, and bf16/fp16 where validation accepts it: :func:`delayed_update_choice`), float8
linears emulated); and the DLRM recommender (:func:`sample_dlrm_layout`: its tables sharded table-, row-,
column-wise, replicated, per table or by the planner under a memory budget, row-wise Adagrad or SGD
in backward, the dense part's optimizer, 1 to 4 ranks); Hugging Face decoders (:func:`sample_hf_layout`:
Llama, Mistral, Qwen2 and Qwen3 config.json files drawn tiny, under dp, ZeRO, tp with or without
sequence parallelism, pp, recomputation and the offload tiers, resumed too, against their own
reference); on top of a decoder sample, int8 activation compression, against the reference that quantizes the same linear inputs by the same
rule, and regional compilation (``compile.enabled``), each from a generator of its own so the rest of
a sample is what it was before it joined (:func:`draw_sample`). Each sample must either be rejected by validation before any rank
starts, with every problem naming a field, or train like the independent reference
(:func:`bigtrain.check.run.check_layout`). Anything else (a divergence, a crash after launch, a hang) is
a bug.

A share of the decoder samples (bigtrain's and Hugging Face's) resume then step
(:func:`resume_choice`): the run stops at a checkpoint after 1 or 2 steps, resumes (at the same or another layout) with any of the four
optimizers, must load exactly what it saved, and is compared with the reference over the steps
after the resume. A share of them compress saved activations to int8, compared with a reference
that quantizes the same rows.

``python -m bigtrain.check.fuzz N SEED [--dlrm-share F] [--hf-share H] [--resume-share R] [--int8-share G]``
(``scripts/fuzz-layouts.sh``) runs N samples, a share F of them DLRMs, a share H of the rest Hugging
Face decoders, a share G of the others with
int8 compression and a share R of them resumed (:func:`draw_sample`; a share of 0 draws the samples
of the seeds recorded before that draw joined). New techniques add their keys to
:func:`sample_layout` (or :func:`sample_dlrm_layout`; both in :mod:`.fuzz_layouts`) when they land.
"""

from __future__ import annotations

import argparse
import random
import re
import sys
import tempfile
import time
from dataclasses import dataclass
from functools import partial
from pathlib import Path

from bigtrain.check.bounds import COUNT_MAX, SEED_MAX, STEPS_MAX, WORLD_MAX, check_steps, share, whole_number
from bigtrain.check.fuzz_layouts import (CP, DLRM, HF, HF_TINY, INT8, context_parallel_choice, context_resume_choice,
                                         context_shape_choice, is_hf_moe, last_values, optimizer_choice,
                                         sample_dlrm_layout, sample_hf_layout, sample_layout, tiny_hf_config)
from bigtrain.config import Config, ConfigError, load_config
from bigtrain.families import family_of
from bigtrain.validation import validate

BASE = ["--logging.progress=false", "--logging.report=false", "--checkpoint.save_final=false",
        "--data.max_bytes=400000"]
FIELD = re.compile(r"\b[a-z_]+\.[a-z_0-9]+\b")
DLRM_SHARE = 0.2
HF_SHARE = 0.1
RESUME_SHARE = 0.25
INT8_SHARE = 0.2
COMPILE_SHARE = 0.25
COMPILED = "--compile.enabled=true"
BLOCK_CAUSAL = "--model.attn_mask=block_causal"
# Of the decoder samples: block-causal attention over the corpus's lines (document_mask_choice), under any cp mode.
DOCUMENTS_SHARE = 0.15
CP_SHARE = 0.15
# Of the samples with cp: a sequence of odd or one-token chunks, and a resume that changes cp
# (context_shape_choice, context_resume_choice). 0 by default: the seeds' samples, which tests pin,
# stay as they were; a campaign over cp passes --cp-shape-share.
CP_SHAPE_SHARE = 0.0
DELAYED_SHARE = 0.5
DELAYED = "--offload.delayed_update=true"


def draw_sample(seed: int, index: int, max_world: int = 8, dlrm_share: float = DLRM_SHARE,
                resume_share: float = RESUME_SHARE, int8_share: float = INT8_SHARE,
                compile_share: float = COMPILE_SHARE, hf_share: float = HF_SHARE,
                cp_share: float = CP_SHARE, delayed_share: float = DELAYED_SHARE,
                cp_shape_share: float = CP_SHAPE_SHARE, documents_share: float = DOCUMENTS_SHARE) -> list[str]:
    """Sample ``index`` of ``seed``: a DLRM with probability ``dlrm_share``, else a decoder layout
    (bigtrain's or a Hugging Face one), with context parallelism (cp 2 or 4, where the world allows)
    added with probability ``cp_share``,
    int8 activation compression (a Hugging Face decoder too; never on a sample that drew float8) with
    probability ``int8_share``, compiled (``compile.enabled``; a Hugging Face decoder too) with probability
    ``compile_share``, resumed then stepped with probability ``resume_share`` (a Hugging Face decoder
    too), and a bf16/fp16
    sample with offloaded optimizer the one-step delayed update with probability ``delayed_share``
    where validation accepts it (:func:`delayed_update_choice`); a sample with cp, with probability
    ``cp_shape_share``, a sequence of odd or one-token chunks and, when resumed, another cp after the
    resume (:func:`context_shape_choice`, :func:`context_resume_choice`). The model, int8, compilation, the
    resume and that delayed update are drawn from generators of their own, so a decoder sample
    with none of them is the one :func:`sample_layout` drew for (seed, index) before DLRMs, int8,
    compilation, resumes and mixed-precision delayed updates joined, whatever the shares.
    Last, with probability ``documents_share``, a decoder sample attends block-causally
    (:func:`document_mask_choice`, from a generator of its own: a share of 0 leaves every sample as it was)."""
    rng = random.Random(f"{seed}:{index}")
    if random.Random(f"{seed}:{index}:model").random() < dlrm_share:
        return sample_dlrm_layout(rng, max_world)
    out = _decoder_sample(seed, index, rng, max_world, resume_share, int8_share, compile_share, hf_share, cp_share,
                          delayed_share, cp_shape_share)
    documents = random.Random(f"{seed}:{index}:documents")
    return out + (document_mask_choice(documents) if documents.random() < documents_share else [])


def document_mask_choice(rng: random.Random) -> list[str]:
    """Block-causal attention (model.attn_mask) over the corpus cut at each ':' (data.document_end: the
    byte corpus has no other boundary; a printable byte keeps the sample's overrides one line; in the
    standard library's sources it ends a line or two, so a window holds several documents), half the
    time with positions reset at each document; under any cp mode (the ring masks its pairs by the
    documents' ids: docs/context-parallel.md)."""
    return [BLOCK_CAUSAL, "--data.document_end=:", f"--model.reset_positions={rng.random() < 0.5}"]


def _decoder_sample(seed: int, index: int, rng: random.Random, max_world: int, resume_share: float,
                    int8_share: float, compile_share: float, hf_share: float, cp_share: float, delayed_share: float,
                    cp_shape_share: float) -> list[str]:
    """A decoder sample of :func:`draw_sample` (bigtrain's or a Hugging Face one), before its documents."""
    compiled = random.Random(f"{seed}:{index}:compile").random() < compile_share
    int8 = random.Random(f"{seed}:{index}:int8").random() < int8_share
    if random.Random(f"{seed}:{index}:hf").random() < hf_share:  # 0: the samples drawn before it joined
        out = sample_hf_layout(rng, max_world)
        cp = random.Random(f"{seed}:{index}:cp")  # its own generator: cp_share 0 leaves the samples as they were
        if cp.random() < cp_share:
            out += context_parallel_choice(cp, out, max_world)
        shaped = _context_shaped(seed, index, out, cp_shape_share)
        out += context_shape_choice(random.Random(f"{seed}:{index}:cp_shape"), out) if shaped else []
        int8 = int8 and not _float8(out) and not is_hf_moe(out)  # int8 on an HF MoE is refused (families/hf_moe.py)
        return _resumed_and_delayed(seed, index, out + ([INT8] if int8 else []) + ([COMPILED] if compiled else []),
                                    max_world, resume_share, delayed_share, shaped)
    out = sample_layout(rng, max_world)
    cp = random.Random(f"{seed}:{index}:cp")
    if cp.random() < cp_share:
        out += context_parallel_choice(cp, out, max_world)
    shaped = _context_shaped(seed, index, out, cp_shape_share)
    out += context_shape_choice(random.Random(f"{seed}:{index}:cp_shape"), out) if shaped else []
    if int8 and not _float8(out):  # both would be refused: the float8 sample would never train
        out.append(INT8)
    if compiled:
        out.append(COMPILED)
    return _resumed_and_delayed(seed, index, out, max_world, resume_share, delayed_share, shaped)


def _context_shaped(seed: int, index: int, out: list[str], share: float) -> bool:
    """Whether sample ``out`` (with cp) takes :func:`context_shape_choice` and, resumed, a cp change:
    drawn from a generator of its own, so a share of 0 leaves every sample as it was."""
    return any(o.startswith(CP) for o in out) and random.Random(f"{seed}:{index}:cp_shaped").random() < share


def _resumed_and_delayed(seed: int, index: int, out: list[str], max_world: int, resume_share: float,
                         delayed_share: float, cp_resumed: bool = False) -> list[str]:
    """The sample resumed then stepped, and in bf16/fp16 with the delayed update, each drawn from a
    generator of its own (a Hugging Face sample draws both too since they were drawn for bigtrain's).
    ``cp_resumed``: a resumed sample's layout after the checkpoint takes another cp
    (:func:`context_resume_choice`) where validation accepts it."""
    resume = random.Random(f"{seed}:{index}:resume")
    if resume.random() < resume_share:
        # AdamW alone for a Hugging Face decoder: its reference steps with nothing else (hf_reference.py)
        out = resume_choice(resume, out, max_world, optimizers=("adamw",) if HF in out else OPTIMIZERS)
        if cp_resumed:
            out = _with_resumed_cp(random.Random(f"{seed}:{index}:cp_resume"), out, max_world)
    # Last, after the resume: resume_choice validates the layouts it draws, so a flag added before
    # it would change which one it keeps (the seeds' resumed samples would not stay as they were).
    if random.Random(f"{seed}:{index}:delayed_update").random() < delayed_share:
        out = delayed_update_choice(out)
    return out


def _with_resumed_cp(rng: random.Random, sample: list[str], max_world: int) -> list[str]:
    """Resumed ``sample`` with another cp after its checkpoint (1, 2 or 4: the checkpoint moves
    between cp and plain layouts, and between cp degrees), when the resumed layout fits
    ``max_world`` and validation accepts it; else ``sample`` as it is."""
    saved, after, resumed = split_resume(sample)
    last = last_values(resumed)
    sizes = {a: int(last.get(f"--parallel.{a}", 1)) for a in ("dp", "tp", "pp", "sp", "cp")}
    then = context_resume_choice(rng, sizes["cp"], sizes["sp"], sizes["dp"] * sizes["tp"] * sizes["pp"] * sizes["sp"],
                                 max_world)
    if not after or not then or not _valid(resumed + then):
        return sample
    return sample + [THEN + o for o in then]


def delayed_update_choice(sample: list[str]) -> list[str]:
    """Sample ``sample`` with ZeRO-Offload's one-step delayed update, where it offloads the
    optimizer in bf16 or fp16 and validation accepts the delayed update in the saved run and in the
    resumed one (not with pp > 1, local SGD, or Adafactor at world > 1: bigtrain/offload_checks.py);
    else ``sample`` as it is. The flag goes beside the offload tiers, in the saved run's overrides
    (the resumed run inherits it). fp32 samples draw it in :func:`sample_layout`, before this
    joined (also where validation refuses it); the reference delays bf16/fp16 weights in their
    precision (check/reference.py, tests/test_offload.py)."""
    saved, after, resumed = split_resume(sample)
    last = last_values(saved)
    if last.get("--offload.optimizer", "none") == "none" or DELAYED in saved \
            or last.get("--precision.mode", "fp32") not in ("bf16", "fp16"):
        return sample
    if not _valid(saved + [DELAYED]) or (after and not _valid(resumed + [DELAYED])):
        return sample
    at = max(i for i, o in enumerate(sample) if o.startswith("--offload.")) + 1
    return sample[:at] + [DELAYED] + sample[at:]


def _float8(out: list[str]) -> bool:
    """Whether a sample drew float8 linears: int8 compression and float8 exclude each other
    (validation refuses both together, bigtrain/fp8/checks.py), so int8 is not added to it."""
    return any(o.startswith("--precision.fp8=") for o in out)


# -- resume then step ----------------------------------------------------------------------------
# A resumed sample is the saved run's overrides, then RESUME_AFTER<k> (steps before the checkpoint),
# then THEN<override> for each field the resumed run changes (its layout): printable, and replayed
# by run_sample as it is.
RESUME_AFTER, THEN = "resume-after=", "then:"
OPTIMIZERS = ("adamw", "adamw8bit", "adafactor", "lion")
_OPTIMIZER_KEYS = ("--optim.name=", "--optim.block_size=", "--optim.lr=", "--optim.beta2=")
_LAYOUT_KEYS = ("--parallel.dp=", "--parallel.tp=", "--parallel.pp=", "--parallel.sp=", "--parallel.zero=",
                "--train.micro_batch=", "--parallel.sequence_parallel=")


def resume_choice(rng: random.Random, out: list[str], max_world: int = 8, tries: int = 20,
                  optimizers: tuple[str, ...] = OPTIMIZERS) -> list[str]:
    """Sample ``out`` with any of ``optimizers`` (each alike; the four by default), stopped at a
    checkpoint after 1 or 2 steps and resumed: a third of the time at its own layout, else at another (dp, tp, pp, sp,
    ZeRO stage and micro-batch drawn again for the same global batch) that validation accepts, drawn
    up to ``tries`` times (most random layouts break a constraint of the rest of the sample: the
    resume would hardly ever run); the sample's own layout when none is accepted or the sample
    itself is not (it is rejected before anything resumes)."""
    out = [o for o in out if not o.startswith(_OPTIMIZER_KEYS)] + optimizer_choice(rng, optimizers)
    after = [f"{RESUME_AFTER}{rng.choice([1, 2])}"]
    # An asynchronous pipeline resumes at its own layout: the reference replays the steps before
    # the checkpoint with the resumed run's gradient delay.
    schedule = [o.split("=", 1)[1] for o in out if o.startswith("--parallel.pp_schedule=")]
    if rng.random() < 1 / 3 or not _valid(out) or schedule[-1:] in (["pipedream-2bw"], ["pipedream"]):
        return out + after
    batch = int(next(o for o in out if o.startswith("--train.global_batch=")).split("=")[1])
    cp = int(next((o[len(CP):] for o in out if o.startswith(CP)), 1))  # kept: the resumed layout's too
    for _ in range(tries):
        dp, tp, pp, sp = (rng.choice(c) for c in ([1, 1, 2, 4], [1, 1, 2, 4], [1, 1, 2, 4], [1, 1, 2]))
        if dp * tp * pp * sp * cp > max_world or batch % dp:
            continue
        then = [f"--parallel.dp={dp}", f"--parallel.tp={tp}", f"--parallel.pp={pp}", f"--parallel.sp={sp}",
                f"--parallel.zero={rng.choice([0, 1, 2, 3])}",
                f"--train.micro_batch={rng.choice([m for m in (1, 2, 4) if (batch // dp) % m == 0])}"]
        if tp > 1:
            then.append(f"--parallel.sequence_parallel={rng.random() < 0.5}")
        if pp == 1:  # one stage: the run refuses a schedule that is not the default (shape_checks.one_stage_problems)
            then += _one_stage_pipeline(out)
        if _valid(out + then):
            return out + after + [THEN + o for o in then]
    return out + after


def _one_stage_pipeline(out: list[str]) -> list[str]:
    """The defaults of the schedule fields ``out`` sets otherwise, for a resume at pp = 1; drawing
    nothing, so each seed's resumed layouts stay those drawn before the run refused them there."""
    last = last_values(out)
    return [f"--parallel.{key}={value}" for key, value in (("pp_schedule", "1f1b"), ("pp_virtual", "1"))
            if last.get(f"--parallel.{key}", value) != value]


def _valid(overrides: list[str]) -> bool:
    try:
        _validate(_config(overrides, ""))
    except ConfigError:
        return False
    return True


def split_resume(sample: list[str]) -> tuple[list[str], int, list[str]]:
    """(the saved run's overrides, steps before its checkpoint (0: not resumed), the resumed run's)."""
    saved = [o for o in sample if not o.startswith((RESUME_AFTER, THEN))]
    after = next((int(o[len(RESUME_AFTER):]) for o in sample if o.startswith(RESUME_AFTER)), 0)
    return saved, after, saved + [o[len(THEN):] for o in sample if o.startswith(THEN)]


@dataclass
class Outcome:
    overrides: list[str]
    verdict: str  # agree | boundary | rejected | diverged | crashed | hung | bad-rejection
    detail: str = ""
    seconds: float = 0.0

    @property
    def ok(self) -> bool:
        # boundary: agreed up to fp16's overflow boundary, where the runs part by design
        # (bigtrain/check/fp16_boundary.py); printed with its reason, as a divergence is.
        return self.verdict in ("agree", "boundary", "rejected")


def _config(overrides: list[str], cache_dir: str) -> Config:
    preset = "dlrm-tiny" if DLRM in overrides else "tiny"
    folder = Path(cache_dir or tempfile.gettempdir()) / "bigtrain-fuzz-hf"
    overrides = [f"--model.hf_config={tiny_hf_config(o[len(HF_TINY):], folder)}" if o.startswith(HF_TINY) else o
                 for o in overrides]
    return load_config(preset=preset, overrides=BASE + [f"--data.cache_dir={cache_dir}"] + overrides)


def _validate(cfg: Config) -> None:
    """What ``bigtrain check`` rejects before any rank starts: validation, and whether the family's
    planner can place the model at all (a DLRM's tables within embedding.budget_gb)."""
    from bigtrain.check.run import reference_problems  # imports torch: only where a sample is checked

    validate(cfg)
    problems = family_of(cfg).placement_problems(cfg) + reference_problems(cfg)
    if problems:
        raise ConfigError(problems)


def run_sample(overrides: list[str], cache_dir: str, steps: int = 3, timeout: float = 240.0) -> Outcome:
    """Validate one sample; if valid, check it on forked Gloo ranks against the reference (a
    resumed sample: check its first part and save, then check the resumed part, which continues
    the first part's chain of replayed updates: :func:`bigtrain.check.run.check_layout`). A compiled sample
    gets 3x the time (each rank compiles its blocks in its first step, 6-25 s a graph on a loaded
    2-core machine), and its ranks wait that long for each other in a collective."""
    from bigtrain.check.run import check_compiled_on_rank, check_on_rank
    from bigtrain.testing import RankFailure, run_ranks

    start = time.perf_counter()
    first, resume_after, resumed = split_resume(overrides)
    configs = [_config(first, cache_dir)] + ([_config(resumed, cache_dir)] if resume_after else [])
    try:
        for cfg in configs:
            _validate(cfg)
    except ConfigError as e:
        unnamed = [p for p in e.problems if not FIELD.search(p)]
        verdict = "bad-rejection" if unnamed else "rejected"
        return Outcome(overrides, verdict, "; ".join(unnamed or e.problems), time.perf_counter() - start)
    if COMPILED in overrides:
        timeout *= 3
    with tempfile.TemporaryDirectory(prefix="bigtrain-fuzz-") as run_dir:
        check = check_compiled_on_rank if COMPILED in overrides else check_on_rank  # a fallback: crashed
        try:
            saved, anchored = None, False
            if resume_after:
                a = configs[0]
                before = run_ranks(partial(check, save=True), a.parallel.world_size, a, run_dir, resume_after,
                                   timeout=timeout, group_timeout=timeout)[0]
                if not before.agree or before.boundary:
                    return Outcome(overrides, _verdict(before), f"before the checkpoint:\n{before.text()}",
                                   time.perf_counter() - start)
                saved, anchored = before.saved, before.anchored
            cfg = configs[-1]
            report = run_ranks(partial(check, saved=saved, saved_anchored=anchored, saved_delay=_saved_delay(configs)),
                               cfg.parallel.world_size, cfg, run_dir, steps, timeout=timeout, group_timeout=timeout)[0]
        except RankFailure as e:
            verdict = "hung" if "did not finish" in str(e) else "crashed"
            return Outcome(overrides, verdict, str(e)[-3000:], time.perf_counter() - start)
    return Outcome(overrides, _verdict(report), report.text(), time.perf_counter() - start)


def _verdict(report) -> str:
    return "diverged" if not report.agree else "boundary" if report.boundary else "agree"


def _saved_delay(configs: list[Config]) -> int | None:
    """The gradient delay of a resumed sample's saved run where the resumed run's differs (a change of
    schedule at the resume: the reference replays the steps before the checkpoint with it); else None."""
    from bigtrain.check.reference import config_gradient_delay

    if len(configs) < 2:
        return None
    saved, resumed = (config_gradient_delay(c) for c in configs)
    return saved if saved != resumed else None


SHARES = ("dlrm_share", "hf_share", "resume_share", "int8_share", "cp_share", "cp_shape_share", "compile_share",
          "delayed_share", "documents_share")  # held to 0..1 by bigtrain.check.bounds.share


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bigtrain.check.fuzz", description=__doc__.split("\n")[0])
    # read as text and held to their ranges by bigtrain.check.bounds (as `bigtrain check --steps`):
    # argparse's int() took 10**20 and answered 1e20 with its usage block; its float() took a share of 1.5
    parser.add_argument("count", metavar="N", help=f"layouts to sample, 1 to {COUNT_MAX:,}")
    parser.add_argument("seed", metavar="SEED",
                        help="the sampler's seed, a whole number from 0 (same seed, same layouts)")
    parser.add_argument("--max-world", default="8",
                        help=f"most ranks a layout may use, 1 to {WORLD_MAX} (default 8)")
    parser.add_argument("--steps", default="3", help=f"steps compared per layout, 1 to {STEPS_MAX:,} (default 3)")
    parser.add_argument("--cache-dir", default="", help="corpus cache (default ~/.cache/bigtrain)")
    parser.add_argument("--dlrm-share", default=DLRM_SHARE,
                        help=f"share of the samples that are DLRMs, 0 to 1 (default {DLRM_SHARE}; 0: decoders only, "
                             f"as before DLRMs joined)")
    parser.add_argument("--hf-share", default=HF_SHARE,
                        help=f"share of the other samples that are Hugging Face decoders, 0 to 1 (default {HF_SHARE}; "
                             f"0: as before they joined)")
    parser.add_argument("--resume-share", default=RESUME_SHARE,
                        help=f"share of the decoder samples resumed then stepped, 0 to 1 (default {RESUME_SHARE}; "
                             f"0: the samples of seeds recorded before resumes joined)")
    parser.add_argument("--int8-share", default=INT8_SHARE,
                        help=f"share of the decoder samples with int8 activation compression, 0 to 1 (default "
                             f"{INT8_SHARE}; 0: none, as before int8 joined)")
    parser.add_argument("--cp-share", default=CP_SHARE,
                        help=f"share of the decoder samples with context parallelism, 0 to 1 (default {CP_SHARE}; "
                             f"0: as before cp joined)")
    parser.add_argument("--cp-shape-share", default=CP_SHAPE_SHARE,
                        help=f"share of the samples with cp that take a sequence of odd or one-token chunks and, "
                             f"resumed, another cp after the checkpoint, 0 to 1 (default {CP_SHAPE_SHARE}: the "
                             f"seeds' samples as before it joined)")
    parser.add_argument("--compile-share", default=COMPILE_SHARE,
                        help=f"share of the decoder samples compiled (compile.enabled = true), 0 to 1 (default "
                             f"{COMPILE_SHARE}; 0: as before compilation joined; 1: every decoder sample)")
    parser.add_argument("--delayed-share", default=DELAYED_SHARE,
                        help=f"share of the bf16/fp16 decoder samples with an offloaded optimizer that take the "
                             f"one-step delayed update where validation accepts it, 0 to 1 (default {DELAYED_SHARE}, "
                             f"as fp32's; 0: as before it joined, fp32 samples only)")
    parser.add_argument("--documents-share", default=DOCUMENTS_SHARE,
                        help=f"share of the decoder samples that attend block-causally over the "
                             f"corpus's lines (model.attn_mask, model.reset_positions), 0 to 1 (default "
                             f"{DOCUMENTS_SHARE}; 0: as before it joined)")
    args = parser.parse_args(argv)
    try:
        args.count = whole_number(args.count, "N", 1, COUNT_MAX, "layouts")
        args.seed = whole_number(args.seed, "SEED", 0, SEED_MAX)
        args.max_world = whole_number(args.max_world, "--max-world", 1, WORLD_MAX, "ranks")
        args.steps = check_steps(args.steps)
        for name in SHARES:
            setattr(args, name, share(getattr(args, name), f"--{name.replace('_', '-')}"))
    except ValueError as e:
        print(f"fuzz-layouts: {e}", file=sys.stderr)
        return 2
    import torch

    torch.set_num_threads(1)  # forked ranks must not inherit a busy thread pool
    counts: dict[str, int] = {}
    bad, outcomes = [], []
    for i in range(args.count):
        # One generator per sample: sample i of a seed is the same whatever the count.
        sample = draw_sample(args.seed, i, args.max_world, args.dlrm_share, args.resume_share, args.int8_share,
                             args.compile_share, args.hf_share, args.cp_share, args.delayed_share,
                             args.cp_shape_share, args.documents_share)
        outcome = run_sample(sample, args.cache_dir, args.steps)
        counts[outcome.verdict] = counts.get(outcome.verdict, 0) + 1
        outcomes.append(outcome)
        print(f"[{i + 1}/{args.count}] {outcome.verdict:9s} {outcome.seconds:5.1f}s {' '.join(outcome.overrides)}",
              flush=True)
        if not outcome.ok:
            bad.append(outcome)
        if not outcome.ok or outcome.verdict == "boundary":
            print("    " + outcome.detail.replace("\n", "\n    "), flush=True)
        elif outcome.verdict == "rejected":  # why, on one line: what validation named (its start)
            print("    " + " ".join(outcome.detail.split())[:300], flush=True)
    summary = ", ".join(f"{v} {k}" for k, v in sorted(counts.items()))
    for label, group in (("DLRM", [o for o in outcomes if DLRM in o.overrides]),
                         ("hf", [o for o in outcomes if HF in o.overrides]),
                         ("resumed", [o for o in outcomes if split_resume(o.overrides)[1]]),
                         ("int8", [o for o in outcomes if INT8 in o.overrides]),
                         ("cp", [o for o in outcomes if any(x.startswith(CP) for x in o.overrides)]),
                         ("compiled", [o for o in outcomes if COMPILED in o.overrides]),
                         ("delayed update", [o for o in outcomes if DELAYED in o.overrides]),
                         ("block_causal", [o for o in outcomes if BLOCK_CAUSAL in o.overrides])):
        if group:
            by_verdict = {v: sum(o.verdict == v for o in group) for v in sorted({o.verdict for o in group})}
            summary += f" ({label}: {len(group)}, " + ", ".join(f"{n} {v}" for v, n in by_verdict.items()) + ")"
    print(f"fuzz-layouts: {args.count} layouts, seed {args.seed}: {summary}")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
