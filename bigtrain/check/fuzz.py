"""The layout fuzzer: seeded samples of the whole composition space, each proved or rejected.

A sample draws every degree of freedom bigtrain composes (dp, tp, pp, Ulysses sp, Megatron
sequence parallel, ZeRO stage, pipeline schedule, virtual stages and split points, activation
checkpointing (full, every k-th, selective), activation offload, the fused loss, accumulation,
tied embeddings, grouped and replicated key/value heads, a vocabulary that tp does not divide,
masked targets, fp32/bf16/fp16, ZeRO-3 prefetch and resharding, the asynchronous pipelines 2BW and PipeDream
with vertical sync, local SGD at K = 1, the memory-efficient optimizers, mixture of experts with its ep
degree, capacity, router, balance loss, shared expert and grouped GEMM, offload's tiers and its delayed
update); and the DLRM recommender (:func:`sample_dlrm_layout`: its tables sharded table-, row-,
column-wise, replicated, per table or by the planner under a memory budget, row-wise Adagrad or SGD
in backward, the dense part's optimizer, 1 to 4 ranks); and, for a decoder, regional compilation
(``compile.enabled``, a share ``--compile-share`` of the samples, from a generator of its own so the
rest of a sample is what it was before compilation joined). int8 activation compression is not drawn:
it changes the weight gradients on purpose (tests/test_activation_memory.py). Each sample must either be rejected by validation before any rank
starts, with every problem naming a field, or train like the independent reference
(:func:`bigtrain.check.run.check_layout`). Anything else (a divergence, a crash after launch, a hang) is
a bug.

``python -m bigtrain.check.fuzz N SEED [--dlrm-share F]`` (``scripts/fuzz-layouts.sh``) runs N
samples, a share F of them DLRMs (:func:`draw_sample`). New techniques add their keys to
:func:`sample_layout` (or :func:`sample_dlrm_layout`) when they land.
"""

from __future__ import annotations

import argparse
import random
import re
import sys
import tempfile
import time
from dataclasses import dataclass

from bigtrain.config import Config, ConfigError, load_config
from bigtrain.validation import validate

BASE = ["--logging.progress=false", "--logging.report=false", "--checkpoint.save_final=false",
        "--data.max_bytes=400000"]
FIELD = re.compile(r"\b[a-z_]+\.[a-z_0-9]+\b")
DLRM = "--model.name=dlrm"  # a sample holding it is overrides of the dlrm-tiny preset, not of tiny
DLRM_SHARE = 0.2
COMPILE_SHARE = 0.25
COMPILED = "--compile.enabled=true"


def draw_sample(seed: int, index: int, max_world: int = 8, dlrm_share: float = DLRM_SHARE,
                compile_share: float = COMPILE_SHARE) -> list[str]:
    """Sample ``index`` of ``seed``: a DLRM with probability ``dlrm_share``, else a decoder layout,
    compiled (``compile.enabled``) with probability ``compile_share``. The model and compilation are
    drawn from generators of their own, so a decoder sample is the one :func:`sample_layout` drew for
    (seed, index) before DLRMs and compilation joined, whatever the shares."""
    rng = random.Random(f"{seed}:{index}")
    if random.Random(f"{seed}:{index}:model").random() < dlrm_share:
        return sample_dlrm_layout(rng, max_world)
    sample = sample_layout(rng, max_world)
    if random.Random(f"{seed}:{index}:compile").random() < compile_share:
        sample.append(COMPILED)
    return sample


def sample_dlrm_layout(rng: random.Random, max_world: int = 8) -> list[str]:
    """One DLRM layout as overrides of the dlrm-tiny preset: a few small tables (some row counts or
    dimensions the ranks do not divide, which validation must reject by name), one sharding or one
    per table, the sparse and the dense optimizers, sometimes a budget that forces the planner to cut
    or that nothing meets; now and then a field the DLRM does not support."""
    dp = rng.choice([d for d in (1, 2, 2, 4, 4) if d <= max_world])
    rows = [rng.choice([8, 12, 16, 24, 30, 64]) for _ in range(rng.choice([1, 2, 3, 4, 6]))]
    dim = rng.choice([4, 6, 8, 8, 16])
    kinds = ["table", "row", "column", "data", "auto"]
    if len(rows) > 1 and rng.random() < 0.3:
        count = len(rows) if rng.random() < 0.9 else len(rows) + 1  # a list of the wrong length: rejected
        sharding = ",".join(rng.choice(kinds) for _ in range(count))
    else:
        sharding = rng.choice(kinds)
    optimizer = rng.choice(["rowwise_adagrad", "rowwise_adagrad", "sgd"])
    batch = dp * rng.choice([2, 4, 8]) + (1 if dp > 1 and rng.random() < 0.1 else 0)
    out = [DLRM, f"--parallel.dp={dp}", f"--embedding.tables={','.join(map(str, rows))}", f"--embedding.dim={dim}",
           f"--embedding.sharding={sharding}", f"--embedding.hotness={rng.choice([1, 2, 3])}",
           f"--embedding.optimizer={optimizer}", f"--embedding.lr={rng.choice([0.01, 0.05, 0.1])}",
           f"--train.global_batch={batch}", f"--model.dlrm_dense_features={rng.choice([13, 3])}",
           f"--model.dlrm_bottom_mlp={rng.choice(['32', '16,8', '8'])}",
           f"--model.dlrm_top_mlp={rng.choice(['32', '16,8', '4'])}",
           f"--optim.grad_clip={rng.choice([1.0, 0.5, 0.0])}", f"--optim.warmup_steps={rng.choice([1, 2, 20])}",
           f"--optim.weight_decay={rng.choice([0.0, 0.01])}"]  # AdamW without decay is Adam
    out += _optimizer_choice(rng)
    if rng.random() < (0.4 if sharding == "auto" else 0.1):
        # A budget of a share of the tables' bytes on one rank: 1.3 / dp fits once cut, 0.5 / dp never.
        state = 4 if optimizer == "rowwise_adagrad" else 0
        total = sum(r * (dim * 4 + state) for r in rows)
        out.append(f"--embedding.budget_gb={total * rng.choice([1.3, 0.5]) / dp / 2**30:.12f}")
    if rng.random() < 0.1:
        out.append(rng.choice(["--parallel.tp=2", "--precision.mode=bf16", "--parallel.zero=1"]))
    return out


def sample_layout(rng: random.Random, max_world: int = 8) -> list[str]:
    """One layout as ``--section.key=value`` overrides of the tiny preset."""
    while True:
        dp, tp, pp, sp = (rng.choice(choices) for choices in ([1, 1, 2, 4], [1, 1, 2, 4], [1, 1, 2, 3, 4], [1, 1, 2]))
        if dp * tp * pp * sp <= max_world:
            break
    micro = rng.choice([1, 1, 2, 4])
    accum = rng.choice([1, 2, 4]) if pp == 1 else rng.choice([2, 4, 4])
    layers = rng.choice([2, 3, 4, 6])
    schedule = rng.choice(["1f1b", "gpipe", "interleaved", "zb-h1", "naive"]) if pp > 1 else None
    virtual = rng.choice([2, 3]) if schedule == "interleaved" else 1
    if schedule == "interleaved":
        # Most random draws break interleaving's constraints (a layer per chunk, micro-batches in
        # multiples of pp): draw those two from what it accepts, or it would hardly ever run.
        layers, accum = pp * virtual * rng.choice([1, 1, 2]), pp * rng.choice([1, 2])
    out = [f"--parallel.dp={dp}", f"--parallel.tp={tp}", f"--parallel.pp={pp}", f"--parallel.sp={sp}",
           f"--parallel.zero={rng.choice([0, 1, 2, 3])}", f"--model.n_layers={layers}",
           f"--train.micro_batch={micro}", f"--train.global_batch={micro * accum * dp}",
           f"--model.n_kv_heads={rng.choice([0, 2, 1])}", f"--model.vocab_size={rng.choice([256, 256, 257, 258, 260])}",
           f"--model.tie_embeddings={rng.random() < 0.25}",
           f"--data.ignore_target={rng.choice([-1, -1, 32, 10])}",
           f"--precision.mode={rng.choice(['fp32'] * 6 + ['bf16', 'fp16'])}",
           f"--optim.grad_clip={rng.choice([1.0, 0.5, 0.0])}"]
    if tp > 1:
        out.append(f"--parallel.sequence_parallel={rng.random() < 0.5}")
    if pp > 1:
        out.append(f"--parallel.pp_schedule={schedule}")
        if schedule == "interleaved":
            out.append(f"--parallel.pp_virtual={virtual}")
        if rng.random() < 0.3:
            out.append("--parallel.pp_balance=params")
    policy = rng.choice(["none", "none", "full", "every", "selective"])
    out.append(f"--memory.checkpointing={policy}")
    if policy == "every":
        out.append(f"--memory.checkpoint_every={rng.choice([1, 2])}")
    if policy == "selective" and rng.random() < 0.5:
        out.append("--memory.selective_attention=true")
    if rng.random() < 0.3:  # a low threshold: the tiny model's tensors are small
        out += ["--memory.activation_offload=true", f"--memory.offload_min_bytes={rng.choice([0, 256, 4096])}"]
    if rng.random() < 0.3:
        out += ["--model.fused_loss=true", f"--model.fused_loss_chunk={rng.choice([7, 32, 1024])}"]
    if rng.random() < 0.3:
        out += [f"--parallel.reshard_after_forward={rng.random() < 0.5}", f"--parallel.prefetch={rng.random() < 0.5}"]
    out += _optimizer_choice(rng)
    out, dp = _asynchronous_choice(rng, out, dp, pp, micro * accum)  # last: earlier seeds keep the draws above
    if rng.random() < 0.4:  # drawn last: the draws above, and so the samples without experts, stay as they were
        out = _with_experts(rng, out, dp)
    if rng.random() < 0.2:  # after the experts, for the same reason
        out += _offload_choice(rng, "--precision.mode=fp32" in out)
    return out


def _offload_choice(rng: random.Random, fp32: bool) -> list[str]:
    """ZeRO-Offload / -Infinity tiers (validation rejects them without the ZeRO engine's units), and
    in fp32, where the reference can delay the weights, sometimes the one-step delayed update."""
    out = [f"--offload.optimizer={rng.choice(['cpu', 'nvme'])}",
           f"--offload.params={rng.choice(['none', 'cpu', 'nvme'])}"]
    if fp32 and rng.random() < 0.5:
        out.append("--offload.delayed_update=true")
    return out


# What the pipelines without flush run on (validation.check_async): one replica of the replicated
# fp32 engine, no recomputation or fused head (both would read the live weights, not the stashed
# version).
_NO_FLUSH_DROPS = ("--parallel.reshard_after_forward=", "--parallel.prefetch=", "--parallel.sequence_parallel=",
                 "--parallel.pp_virtual=", "--memory.checkpoint_every=", "--memory.selective_attention=",
                 "--model.fused_loss_chunk=")


def _asynchronous_choice(rng: random.Random, out: list[str], dp: int, pp: int,
                         per_replica_batch: int) -> tuple[list[str], int]:
    """Sometimes a pipeline without flush (2BW, or PipeDream with vertical sync: delays the reference
    expresses for every weight alike), sometimes local SGD at K = 1 (synchronous by definition).
    Such a pipeline is made one they run (one replica, fp32, ZeRO 0, no recomputation): drawn on
    top of the rest, 2BW was rejected 59 times in 60, so its deferred boundary was hardly ever
    checked. Returns the sample and its dp (1 for such a pipeline: what the experts' ep divides)."""
    if pp > 1 and rng.random() < 0.2:
        out = [o for o in out if not o.startswith(_NO_FLUSH_DROPS)]
        out += ["--parallel.dp=1", "--parallel.tp=1", "--parallel.sp=1", "--parallel.zero=0", "--precision.mode=fp32",
                "--memory.checkpointing=none", "--model.fused_loss=false", f"--train.global_batch={per_replica_batch}"]
        dp = 1
        if rng.random() < 0.5:
            out.append("--parallel.pp_schedule=pipedream-2bw")
        else:  # one micro-batch per step
            out += ["--parallel.pp_schedule=pipedream", "--parallel.pp_vertical_sync=true",
                    f"--train.micro_batch={per_replica_batch}"]
    if dp > 1 and rng.random() < 0.15:
        out += ["--parallel.dp_sync=local-sgd", "--parallel.local_sgd_every=1"]
    return out, dp


def _optimizer_choice(rng: random.Random) -> list[str]:
    """AdamW most often; otherwise a memory-efficient optimizer (8-bit AdamW with a block size that
    tp may have to reject, Adafactor, Lion at its own learning rate)."""
    name = rng.choice(["adamw"] * 4 + ["adamw8bit", "adafactor", "lion"])
    if name == "adamw8bit":
        return [f"--optim.name={name}", f"--optim.block_size={rng.choice([32, 64, 256])}"]
    if name == "lion":
        return [f"--optim.name={name}", "--optim.lr=3e-4", "--optim.beta2=0.99"]
    return [f"--optim.name={name}"] if name != "adamw" else []


def _with_experts(rng: random.Random, out: list[str], dp: int) -> list[str]:
    """A mixture-of-experts variant of sample ``out``: experts, top-k, MoE blocks, capacity, router,
    balance loss, shared expert, grouped GEMM, and an ep degree. Mostly a valid one: ep a divisor of
    dp and of E, and, as MoE rejects Ulysses and Megatron sequence parallelism, usually without
    them; the rest of the time whatever was drawn, which validation must reject by name."""
    experts = rng.choice([2, 4, 4, 8, 6])
    top_k = rng.choice([1, 2, 2, 3])
    valid_ep = [d for d in (1, 2, 4) if dp % d == 0 and experts % d == 0]
    ep = rng.choice(valid_ep[1:] or valid_ep) if rng.random() < 0.85 else rng.choice([2, 3, 4])
    if rng.random() < 0.8:
        out = [o for o in out if not o.startswith("--parallel.sequence_parallel=")]
        out = ["--parallel.sp=1" if o.startswith("--parallel.sp=") else o for o in out]
    return out + [f"--model.moe_experts={experts}", f"--model.moe_top_k={top_k}", f"--parallel.ep={ep}",
                  f"--model.moe_every={rng.choice([1, 1, 2])}",
                  f"--model.moe_capacity_factor={rng.choice([0.0, 0.0, 1.0, 1.25, 0.5])}",
                  f"--model.moe_router={rng.choice(['softmax', 'softmax', 'sigmoid-bias'])}",
                  f"--model.moe_aux_loss_coef={rng.choice([0.0, 0.01, 0.1])}",
                  f"--model.moe_ffn_hidden={rng.choice([0, 0, 48])}",
                  f"--model.moe_shared_expert={rng.random() < 0.25}",
                  f"--parallel.moe_grouped_mm={rng.random() < 0.3}"]


@dataclass
class Outcome:
    overrides: list[str]
    verdict: str  # agree | rejected | diverged | crashed | hung | bad-rejection
    detail: str = ""
    seconds: float = 0.0

    @property
    def ok(self) -> bool:
        return self.verdict in ("agree", "rejected")


def _config(overrides: list[str], cache_dir: str) -> Config:
    preset = "dlrm-tiny" if DLRM in overrides else "tiny"
    return load_config(preset=preset, overrides=BASE + [f"--data.cache_dir={cache_dir}"] + overrides)


def _validate(cfg: Config) -> None:
    """What ``bigtrain check`` rejects before any rank starts: validation, and for a DLRM the
    planner's placement of its tables within embedding.budget_gb (the pre-launch check)."""
    validate(cfg)
    if cfg.model.name == "dlrm":
        from bigtrain.preflight import tables_fit_problems

        problems = tables_fit_problems(cfg)
        if problems:
            raise ConfigError(problems)


def run_sample(overrides: list[str], cache_dir: str, steps: int = 3, timeout: float = 240.0) -> Outcome:
    """Validate one sample; if valid, check it on forked Gloo ranks against the reference. A compiled
    sample gets 3x the time (each rank compiles its blocks in its first step, 6-25 s a graph on a
    loaded 2-core machine), and its ranks wait that long for each other in a collective."""
    from bigtrain.check.run import check_on_rank
    from bigtrain.testing import RankFailure, run_ranks

    start = time.perf_counter()
    cfg = _config(overrides, cache_dir)
    try:
        _validate(cfg)
    except ConfigError as e:
        unnamed = [p for p in e.problems if not FIELD.search(p)]
        verdict = "bad-rejection" if unnamed else "rejected"
        return Outcome(overrides, verdict, "; ".join(unnamed or e.problems), time.perf_counter() - start)
    if COMPILED in overrides:
        timeout *= 3
    with tempfile.TemporaryDirectory(prefix="bigtrain-fuzz-") as run_dir:
        try:
            report = run_ranks(check_on_rank, cfg.parallel.world_size, cfg, run_dir, steps, timeout=timeout,
                               group_timeout=timeout)[0]
        except RankFailure as e:
            verdict = "hung" if "did not finish" in str(e) else "crashed"
            return Outcome(overrides, verdict, str(e)[-3000:], time.perf_counter() - start)
    verdict = "agree" if report.agree else "diverged"
    return Outcome(overrides, verdict, report.text(), time.perf_counter() - start)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bigtrain.check.fuzz", description=__doc__.split("\n")[0])
    parser.add_argument("count", type=int, help="layouts to sample")
    parser.add_argument("seed", type=int, help="the sampler's seed (same seed, same layouts)")
    parser.add_argument("--max-world", type=int, default=8, help="most ranks a layout may use (default 8)")
    parser.add_argument("--steps", type=int, default=3, help="steps compared per layout (default 3)")
    parser.add_argument("--cache-dir", default="", help="corpus cache (default ~/.cache/bigtrain)")
    parser.add_argument("--dlrm-share", type=float, default=DLRM_SHARE,
                        help=f"share of the samples that are DLRMs, 0 to 1 (default {DLRM_SHARE}; 0: decoders only, "
                             f"as before DLRMs joined)")
    parser.add_argument("--compile-share", type=float, default=COMPILE_SHARE,
                        help=f"share of the decoder samples compiled (compile.enabled = true), 0 to 1 (default "
                             f"{COMPILE_SHARE}; 0: as before compilation joined; 1: every decoder sample)")
    args = parser.parse_args(argv)
    import torch

    torch.set_num_threads(1)  # forked ranks must not inherit a busy thread pool
    counts: dict[str, int] = {}
    bad, outcomes = [], []
    for i in range(args.count):
        # One generator per sample: sample i of a seed is the same whatever the count.
        outcome = run_sample(draw_sample(args.seed, i, args.max_world, args.dlrm_share, args.compile_share),
                             args.cache_dir, args.steps)
        counts[outcome.verdict] = counts.get(outcome.verdict, 0) + 1
        outcomes.append(outcome)
        print(f"[{i + 1}/{args.count}] {outcome.verdict:9s} {outcome.seconds:5.1f}s {' '.join(outcome.overrides)}",
              flush=True)
        if not outcome.ok:
            bad.append(outcome)
            print("    " + outcome.detail.replace("\n", "\n    "), flush=True)
    summary = ", ".join(f"{v} {k}" for k, v in sorted(counts.items()))
    compiled = [o for o in outcomes if COMPILED in o.overrides]
    if compiled:
        summary += f" (compiled: {len(compiled)}, " + ", ".join(
            f"{sum(o.verdict == v for o in compiled)} {v}" for v in sorted({o.verdict for o in compiled})) + ")"
    dlrm = [o for o in outcomes if DLRM in o.overrides]
    if dlrm:
        by_verdict = {v: sum(o.verdict == v for o in dlrm) for v in sorted({o.verdict for o in dlrm})}
        summary += f" (DLRM: {len(dlrm)}, " + ", ".join(f"{n} {v}" for v, n in by_verdict.items()) + ")"
    print(f"fuzz-layouts: {args.count} layouts, seed {args.seed}: {summary}")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
