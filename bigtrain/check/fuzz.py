"""The layout fuzzer: seeded samples of the whole composition space, each proved or rejected.

A sample draws every degree of freedom bigtrain composes (dp, tp, pp, Ulysses sp, Megatron
sequence parallel, ZeRO stage, pipeline schedule, virtual stages and split points, activation
checkpointing (full, every k-th, selective), activation offload, the fused loss, accumulation,
tied embeddings, grouped and replicated key/value heads, a vocabulary that tp does not divide,
masked targets, fp32/bf16/fp16, ZeRO-3 prefetch and resharding, the asynchronous pipelines 2BW and PipeDream
with vertical sync, local SGD at K = 1, the memory-efficient optimizers, mixture of experts with its ep
degree, capacity, router, balance loss, shared expert and grouped GEMM, offload's tiers and its delayed
update, float8 linears emulated); and the DLRM recommender (:func:`sample_dlrm_layout`: its tables sharded table-, row-,
column-wise, replicated, per table or by the planner under a memory budget, row-wise Adagrad or SGD
in backward, the dense part's optimizer, 1 to 4 ranks); Hugging Face decoders (:func:`sample_hf_layout`:
Llama, Mistral, Qwen2 and Qwen3 config.json files drawn tiny, under dp, ZeRO, tp with or without
sequence parallelism, pp and recomputation, against their own reference); on top of a decoder sample, int8
activation compression, against the reference that quantizes the same linear inputs by the same
rule, and regional compilation (``compile.enabled``), each from a generator of its own so the rest of
a sample is what it was before it joined (:func:`draw_sample`). Each sample must either be rejected by validation before any rank
starts, with every problem naming a field, or train like the independent reference
(:func:`bigtrain.check.run.check_layout`). Anything else (a divergence, a crash after launch, a hang) is
a bug.

A share of the decoder samples resume then step (:func:`resume_choice`): the run stops at a
checkpoint after 1 or 2 steps, resumes (at the same or another layout) with any of the four
optimizers, must load exactly what it saved, and is compared with the reference over the steps
after the resume. A share of them compress saved activations to int8, compared with a reference
that quantizes the same rows.

``python -m bigtrain.check.fuzz N SEED [--dlrm-share F] [--hf-share H] [--resume-share R] [--int8-share G]``
(``scripts/fuzz-layouts.sh``) runs N samples, a share F of them DLRMs, a share H of the rest Hugging
Face decoders, a share G of the others with
int8 compression and a share R of them resumed (:func:`draw_sample`; a share of 0 draws the samples
of the seeds recorded before that draw joined). New techniques add their keys to
:func:`sample_layout` (or :func:`sample_dlrm_layout`) when they land.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from bigtrain.config import Config, ConfigError, load_config
from bigtrain.families import family_of
from bigtrain.validation import validate

BASE = ["--logging.progress=false", "--logging.report=false", "--checkpoint.save_final=false",
        "--data.max_bytes=400000"]
FIELD = re.compile(r"\b[a-z_]+\.[a-z_0-9]+\b")
DLRM = "--model.family=dlrm"  # a sample holding it is overrides of the dlrm-tiny preset, not of tiny
DLRM_SHARE = 0.2
HF = "--model.family=hf"  # a Hugging Face decoder, its config.json written from the next override
HF_TINY = "--model.hf_config=tiny:"  # tiny:ARCH:LAYERS:KV_HEADS:TIED, made into a file by _config
HF_ARCHS = ("llama", "mistral", "qwen2", "qwen3")
HF_SHARE = 0.1
RESUME_SHARE = 0.25
INT8_SHARE = 0.2
INT8 = "--memory.activation_compression=int8"
COMPILE_SHARE = 0.25
COMPILED = "--compile.enabled=true"
CP_SHARE = 0.15
CP = "--parallel.cp="


def draw_sample(seed: int, index: int, max_world: int = 8, dlrm_share: float = DLRM_SHARE,
                resume_share: float = RESUME_SHARE, int8_share: float = INT8_SHARE,
                compile_share: float = COMPILE_SHARE, hf_share: float = HF_SHARE,
                cp_share: float = CP_SHARE) -> list[str]:
    """Sample ``index`` of ``seed``: a DLRM with probability ``dlrm_share``, else a decoder layout,
    with context parallelism (cp 2 or 4, where the world allows) added with probability ``cp_share``,
    int8 activation compression with probability ``int8_share``, compiled
    (``compile.enabled``) with probability ``compile_share``, resumed then stepped with probability
    ``resume_share``. The model, int8, compilation and the resume are drawn from generators of their
    own, so a decoder sample with none of them is the one :func:`sample_layout` drew for
    (seed, index) before DLRMs, int8, compilation and resumes joined, whatever the shares."""
    rng = random.Random(f"{seed}:{index}")
    if random.Random(f"{seed}:{index}:model").random() < dlrm_share:
        return sample_dlrm_layout(rng, max_world)
    if random.Random(f"{seed}:{index}:hf").random() < hf_share:  # 0: the samples drawn before it joined
        return sample_hf_layout(rng, max_world)
    out = sample_layout(rng, max_world)
    cp = random.Random(f"{seed}:{index}:cp")
    if cp.random() < cp_share:
        out += context_parallel_choice(cp, out, max_world)
    if random.Random(f"{seed}:{index}:int8").random() < int8_share:
        out.append(INT8)
    if random.Random(f"{seed}:{index}:compile").random() < compile_share:
        out.append(COMPILED)
    resume = random.Random(f"{seed}:{index}:resume")
    return resume_choice(resume, out, max_world) if resume.random() < resume_share else out


def context_parallel_choice(rng: random.Random, out: list[str], max_world: int) -> list[str]:
    """cp and its mode for a decoder layout ``out``, within ``max_world`` ranks (none if it has no
    room): hybrid where the layout has Ulysses (sp > 1), ring or all-to-all otherwise."""
    sizes = {a: int(o.split("=")[1]) for o in out for a in ("dp", "tp", "pp", "sp") if o.startswith(f"--parallel.{a}=")}
    world = sizes["dp"] * sizes["tp"] * sizes["pp"] * sizes["sp"]
    cps = [c for c in (2, 2, 4) if world * c <= max_world]
    if not cps:
        return []
    mode = "hybrid" if sizes["sp"] > 1 else rng.choice(["ring", "ring", "all-to-all"])
    return [f"{CP}{rng.choice(cps)}", f"--parallel.cp_mode={mode}"]


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


def sample_hf_layout(rng: random.Random, max_world: int = 8) -> list[str]:
    """One Hugging Face layout (bigtrain/families/hf.py) as overrides of the tiny preset: a tiny
    config.json of each architecture (blocks, key/value heads, tied head drawn), dp, ZeRO, tp with
    or without sequence parallelism, pp, recomputation; now and then a field it does not support or
    a shape tp does not divide, which validation must reject by name."""
    while True:
        dp, tp, pp = (rng.choice(c) for c in ([1, 1, 2, 4], [1, 1, 2, 4], [1, 1, 2]))
        if dp * tp * pp <= max_world:
            break
    micro = rng.choice([1, 2])
    accum = rng.choice([1, 2]) if pp == 1 else rng.choice([2, 4])
    spec = f"{rng.choice(HF_ARCHS)}:{rng.choice([2, 3, 4])}:{rng.choice([1, 2, 2, 4])}:{rng.random() < 0.25}"
    out = [HF, HF_TINY + spec, f"--parallel.dp={dp}", f"--parallel.tp={tp}", f"--parallel.pp={pp}",
           f"--parallel.zero={rng.choice([0, 1, 2, 3])}", f"--train.micro_batch={micro}",
           f"--train.global_batch={micro * accum * dp}", f"--data.ignore_target={rng.choice([-1, -1, 32])}",
           f"--optim.grad_clip={rng.choice([1.0, 0.5, 0.0])}", f"--optim.warmup_steps={rng.choice([1, 2, 20])}"]
    if tp > 1:
        out.append(f"--parallel.sequence_parallel={pp == 1 and rng.random() < 0.6}")
    if pp > 1:
        out.append(f"--parallel.pp_schedule={rng.choice(['1f1b', 'gpipe'])}")
    checkpointing = rng.choice(["none", "none", "full", "every"])
    out.append(f"--memory.checkpointing={checkpointing}")
    if checkpointing == "every":
        out.append("--memory.checkpoint_every=2")
    if rng.random() < 0.1:
        out.append(rng.choice(["--precision.mode=bf16", "--parallel.sp=2", "--model.fused_loss=true",
                               "--memory.checkpointing=selective", "--optim.name=lion", "--parallel.pp_virtual=2"]))
    return out


def tiny_hf_config(spec: str, folder: Path) -> Path:
    """The config.json a sample's ``tiny:ARCH:LAYERS:KV_HEADS:TIED`` names, written under ``folder``
    (hidden 64, 4 heads, vocabulary 256, as tests/fixtures/hf)."""
    arch, layers, kv, tied = spec.split(":")
    fields = {"architectures": [{"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM",
                                 "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM"}[arch]],
              "model_type": arch, "vocab_size": 256, "hidden_size": 64, "intermediate_size": 128,
              "num_hidden_layers": int(layers), "num_attention_heads": 4, "num_key_value_heads": int(kv),
              "max_position_embeddings": 128, "rms_norm_eps": 1e-6, "initializer_range": 0.02,
              "tie_word_embeddings": tied == "True", "rope_theta": 10000.0}
    if arch == "qwen3":
        fields["head_dim"] = 16
    if arch == "mistral":
        fields["sliding_window"] = None
    path = folder / f"{arch}-L{layers}-kv{kv}-tied{tied}" / "config.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    if not path.exists():
        tmp = path.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(json.dumps(fields, indent=1))
        tmp.replace(path)  # atomic: forked ranks of another sample may read it
    return path


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
    # Float8 linears, emulated (compared at the bf16 bounds: check/compare.py); drawn last, and not
    # with fp16, which validation refuses with them (the fp16 samples keep training).
    if "--precision.mode=fp16" not in out and rng.random() < 0.2:
        out += [f"--precision.fp8={rng.choice(['tensorwise', 'rowwise'])}", "--precision.fp8_emulate=true"]
    return out + _hybrid_choice(rng, out)


def _hybrid_choice(rng: random.Random, out: list[str]) -> list[str]:
    """HSDP (parallel.dp_replicate) for half the samples it applies to (ZeRO 1-3 over dp >= 2,
    no experts or offload, which validation refuses with it): drawn from a generator seeded by
    rng's state, which draws nothing from rng, so every seed's samples stay as they were besides."""
    last = {o.split("=", 1)[0]: o.split("=", 1)[1] for o in out if "=" in o}
    dp, zero = int(last.get("--parallel.dp", 1)), int(last.get("--parallel.zero", 0))
    plain = last.get("--parallel.ep", "1") == "1" and last.get("--offload.optimizer", "none") == "none"
    side = random.Random(repr(rng.getstate()) + "dp_replicate")
    if dp < 2 or zero < 1 or not plain or side.random() >= 0.5:
        return []
    return [f"--parallel.dp_replicate={side.choice([r for r in (2, 4) if dp % r == 0 and r < dp] or [dp])}"]


def _offload_choice(rng: random.Random, fp32: bool) -> list[str]:
    """ZeRO-Offload / -Infinity tiers (validation rejects them without the ZeRO engine's units), and
    in fp32, where the reference can delay the weights, sometimes the one-step delayed update."""
    out = [f"--offload.optimizer={rng.choice(['cpu', 'nvme'])}",
           f"--offload.params={rng.choice(['none', 'cpu', 'nvme'])}"]
    if fp32 and rng.random() < 0.5:
        out.append("--offload.delayed_update=true")
    # The split (masters on the host, the state in files), half the time with the NVMe tier: from a
    # generator seeded by rng's state, which draws nothing from rng (the seeds' samples stay as they were).
    if out[0] == "--offload.optimizer=nvme" and random.Random(repr(rng.getstate())).random() < 0.5:
        out.append("--offload.masters=cpu")
    return out


# What the pipelines without flush run on (async_checks.check_async): one replica of the replicated
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


def _optimizer_choice(rng: random.Random, names: tuple[str, ...] = ("adamw",) * 4 + ("adamw8bit", "adafactor", "lion")
                      ) -> list[str]:
    """AdamW most often; otherwise a memory-efficient optimizer (8-bit AdamW with a block size that
    tp may have to reject, Adafactor, Lion at its own learning rate)."""
    name = rng.choice(names)
    if name == "adamw8bit":
        return [f"--optim.name={name}", f"--optim.block_size={rng.choice([32, 64, 256])}"]
    if name == "lion":
        return [f"--optim.name={name}", "--optim.lr=3e-4", "--optim.beta2=0.99"]
    return [f"--optim.name={name}"] if name != "adamw" else []


def _with_experts(rng: random.Random, out: list[str], dp: int) -> list[str]:
    """A mixture-of-experts variant of sample ``out``: experts, top-k, MoE blocks, capacity, router,
    balance loss, shared expert, grouped GEMM, and an ep degree. Mostly a valid one: ep a divisor of
    dp and of E; the rest of the time whatever was drawn, which validation must reject by name.
    Ulysses and Megatron sequence parallelism, as ``out`` drew them (parallel/sequence_moe.py)."""
    experts = rng.choice([2, 4, 4, 8, 6])
    top_k = rng.choice([1, 2, 2, 3])
    valid_ep = [d for d in (1, 2, 4) if dp % d == 0 and experts % d == 0]
    ep = rng.choice(valid_ep[1:] or valid_ep) if rng.random() < 0.85 else rng.choice([2, 3, 4])
    # Drawn and unused: 80% of samples dropped sp and sequence parallelism here while MoE rejected
    # them; the draw stays so that the rest of each seed's sample is drawn as before.
    rng.random()
    return out + [f"--model.moe_experts={experts}", f"--model.moe_top_k={top_k}", f"--parallel.ep={ep}",
                  f"--model.moe_every={rng.choice([1, 1, 2])}",
                  f"--model.moe_capacity_factor={rng.choice([0.0, 0.0, 1.0, 1.25, 0.5])}",
                  f"--model.moe_router={rng.choice(['softmax', 'softmax', 'sigmoid-bias'])}",
                  f"--model.moe_aux_loss_coef={rng.choice([0.0, 0.01, 0.1])}",
                  f"--model.moe_ffn_hidden={rng.choice([0, 0, 48])}",
                  f"--model.moe_shared_expert={rng.random() < 0.25}",
                  f"--parallel.moe_grouped_mm={rng.random() < 0.3}"]


# -- resume then step ----------------------------------------------------------------------------
# A resumed sample is the saved run's overrides, then RESUME_AFTER<k> (steps before the checkpoint),
# then THEN<override> for each field the resumed run changes (its layout): printable, and replayed
# by run_sample as it is.
RESUME_AFTER, THEN = "resume-after=", "then:"
OPTIMIZERS = ("adamw", "adamw8bit", "adafactor", "lion")
_OPTIMIZER_KEYS = ("--optim.name=", "--optim.block_size=", "--optim.lr=", "--optim.beta2=")
_LAYOUT_KEYS = ("--parallel.dp=", "--parallel.tp=", "--parallel.pp=", "--parallel.sp=", "--parallel.zero=",
                "--train.micro_batch=", "--parallel.sequence_parallel=")


def resume_choice(rng: random.Random, out: list[str], max_world: int = 8, tries: int = 20) -> list[str]:
    """Sample ``out`` with any of the four optimizers (each alike), stopped at a checkpoint after 1
    or 2 steps and resumed: a third of the time at its own layout, else at another (dp, tp, pp, sp,
    ZeRO stage and micro-batch drawn again for the same global batch) that validation accepts, drawn
    up to ``tries`` times (most random layouts break a constraint of the rest of the sample: the
    resume would hardly ever run); the sample's own layout when none is accepted or the sample
    itself is not (it is rejected before anything resumes)."""
    out = [o for o in out if not o.startswith(_OPTIMIZER_KEYS)] + _optimizer_choice(rng, OPTIMIZERS)
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
        if _valid(out + then):
            return out + after + [THEN + o for o in then]
    return out + after


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
    verdict: str  # agree | rejected | diverged | crashed | hung | bad-rejection
    detail: str = ""
    seconds: float = 0.0

    @property
    def ok(self) -> bool:
        return self.verdict in ("agree", "rejected")


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
    resumed sample: run its first part and save, then check the resumed part). A compiled sample
    gets 3x the time (each rank compiles its blocks in its first step, 6-25 s a graph on a loaded
    2-core machine), and its ranks wait that long for each other in a collective."""
    from bigtrain.check.run import check_on_rank, save_on_rank
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
        try:
            saved = None
            if resume_after:
                a = configs[0]
                saved = run_ranks(save_on_rank, a.parallel.world_size, a, run_dir, resume_after, timeout=timeout,
                                  group_timeout=timeout)[0]
            cfg = configs[-1]
            report = run_ranks(check_on_rank, cfg.parallel.world_size, cfg, run_dir, steps, saved,
                               timeout=timeout, group_timeout=timeout)[0]
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
    parser.add_argument("--hf-share", type=float, default=HF_SHARE,
                        help=f"share of the other samples that are Hugging Face decoders, 0 to 1 (default {HF_SHARE}; "
                             f"0: as before they joined)")
    parser.add_argument("--resume-share", type=float, default=RESUME_SHARE,
                        help=f"share of the decoder samples resumed then stepped, 0 to 1 (default {RESUME_SHARE}; "
                             f"0: the samples of seeds recorded before resumes joined)")
    parser.add_argument("--int8-share", type=float, default=INT8_SHARE,
                        help=f"share of the decoder samples with int8 activation compression, 0 to 1 (default "
                             f"{INT8_SHARE}; 0: none, as before int8 joined)")
    parser.add_argument("--cp-share", type=float, default=CP_SHARE,
                        help=f"share of the decoder samples with context parallelism, 0 to 1 (default {CP_SHARE}; "
                             f"0: as before cp joined)")
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
        sample = draw_sample(args.seed, i, args.max_world, args.dlrm_share, args.resume_share, args.int8_share,
                             args.compile_share, args.hf_share, args.cp_share)
        outcome = run_sample(sample, args.cache_dir, args.steps)
        counts[outcome.verdict] = counts.get(outcome.verdict, 0) + 1
        outcomes.append(outcome)
        print(f"[{i + 1}/{args.count}] {outcome.verdict:9s} {outcome.seconds:5.1f}s {' '.join(outcome.overrides)}",
              flush=True)
        if not outcome.ok:
            bad.append(outcome)
            print("    " + outcome.detail.replace("\n", "\n    "), flush=True)
        elif outcome.verdict == "rejected":  # why, on one line: what validation named (its start)
            print("    " + " ".join(outcome.detail.split())[:300], flush=True)
    summary = ", ".join(f"{v} {k}" for k, v in sorted(counts.items()))
    for label, group in (("DLRM", [o for o in outcomes if DLRM in o.overrides]),
                         ("hf", [o for o in outcomes if HF in o.overrides]),
                         ("resumed", [o for o in outcomes if split_resume(o.overrides)[1]]),
                         ("int8", [o for o in outcomes if INT8 in o.overrides]),
                         ("cp", [o for o in outcomes if any(x.startswith(CP) for x in o.overrides)]),
                         ("compiled", [o for o in outcomes if COMPILED in o.overrides])):
        if group:
            by_verdict = {v: sum(o.verdict == v for o in group) for v in sorted({o.verdict for o in group})}
            summary += f" ({label}: {len(group)}, " + ", ".join(f"{n} {v}" for v, n in by_verdict.items()) + ")"
    print(f"fuzz-layouts: {args.count} layouts, seed {args.seed}: {summary}")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
