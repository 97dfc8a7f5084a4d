"""One layout drawn from the composition space, as ``--section.key=value`` overrides: a decoder
(:func:`sample_layout`: every degree of freedom bigtrain composes), a DLRM recommender
(:func:`sample_dlrm_layout`), a Hugging Face decoder (:func:`sample_hf_layout`, its tiny config.json
written by :func:`tiny_hf_config`), and context parallelism on top of a decoder
(:func:`context_parallel_choice`). :mod:`bigtrain.check.fuzz` composes them into samples (int8,
compilation, resumes) and runs each.

A seed's layouts stay what they were when a technique joins: each new choice is drawn last, or from
a generator of its own.
"""

from __future__ import annotations

import json
import os
import random
from pathlib import Path

DLRM = "--model.family=dlrm"  # a sample holding it is overrides of the dlrm-tiny preset, not of tiny
HF = "--model.family=hf"  # a Hugging Face decoder, its config.json written from the next override
HF_TINY = "--model.hf_config=tiny:"  # tiny:ARCH:LAYERS:KV_HEADS:TIED[:W<window>], made into a file by tiny_hf_config
INT8 = "--memory.activation_compression=int8"  # int8 compression of the block linears' saved inputs
HF_ARCHS = ("llama", "mistral", "qwen2", "qwen3")
HF_MOE_ARCHS = ("mixtral", "qwen3_moe", "qwen2_moe")  # 4 experts, top-2 (families/hf_moe.py)
CP = "--parallel.cp="


def context_parallel_choice(rng: random.Random, out: list[str], max_world: int) -> list[str]:
    """cp and its mode for a decoder layout ``out`` (bigtrain's or a Hugging Face one, which sets sp
    only when it draws Ulysses), within ``max_world`` ranks (none if it has no room): hybrid where the
    layout has Ulysses (sp > 1), ring or all-to-all otherwise."""
    sizes = {"dp": 1, "tp": 1, "pp": 1, "sp": 1}
    sizes.update({a: int(o.split("=")[1]) for o in out for a in sizes if o.startswith(f"--parallel.{a}=")})
    world = sizes["dp"] * sizes["tp"] * sizes["pp"] * sizes["sp"]
    cps = [c for c in (2, 2, 4) if world * c <= max_world]
    if not cps:
        return []
    mode = "hybrid" if sizes["sp"] > 1 else rng.choice(["ring", "ring", "all-to-all"])
    return [f"{CP}{rng.choice(cps)}", f"--parallel.cp_mode={mode}"]


def context_shape_choice(rng: random.Random, out: list[str]) -> list[str]:
    """For a sample with cp (:func:`context_parallel_choice`), a sequence of 2 x cp chunks of 1, 3, 5
    or 7 tokens: chunks of one token, and odd ones that Ulysses' sp under hybrid or Megatron's tp may
    not cut evenly (validation must refuse those by name). At most 2 x 4 x 7 = 56 tokens, within the
    tiny preset's and the tiny Hugging Face configs' rotary tables. None for a sample without cp."""
    cp = int(last_values(out).get(CP[:-1], 1))
    return [f"--data.seq_len={2 * cp * rng.choice([1, 3, 5, 7])}"] if cp > 1 else []


def context_resume_choice(rng: random.Random, cp: int, sp: int, world: int, max_world: int) -> list[str]:
    """The cp of a resumed layout (``cp`` its saved layout's, ``sp`` and ``world`` the resumed
    layout's before cp): another of 1, 2 and 4 that fits ``max_world``, in a mode the resumed sp
    allows, as ``--parallel.cp=`` and ``--parallel.cp_mode=`` overrides; none when nothing fits."""
    options = [c for c in (1, 2, 4) if c != cp and world * c <= max_world]
    if not options:
        return []
    mode = "hybrid" if sp > 1 else rng.choice(["ring", "all-to-all"])
    return [f"{CP}{rng.choice(options)}", f"--parallel.cp_mode={mode}"]


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
    out += optimizer_choice(rng)
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
    or without sequence parallelism, Ulysses sp, pp, recomputation, activation offload, the fused
    loss or emulated float8 linears, optimizer and parameter offload; now and then a field it does
    not support or a shape tp or sp does not divide, which validation must reject by name."""
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
        out.append(rng.choice(["--precision.mode=bf16", "--parallel.ep=2", "--model.fused_loss=true",
                               "--memory.checkpointing=selective", "--optim.name=lion", "--parallel.pp_virtual=2"]))
    # activation offload of the layers' saved tensors, from a generator of its own (it draws nothing
    # from rng: every seed's samples stay as they were besides)
    if random.Random(repr(rng.getstate()) + "activation_offload").random() < 0.25:
        out += ["--memory.activation_offload=true", "--memory.offload_min_bytes=0"]
    # Ulysses (sp 2, now and then 4: key/value heads replicated, or query heads per tp rank it does
    # not divide, which validation must refuse) where the world allows, from a generator of its own
    ulysses = random.Random(repr(rng.getstate()) + "ulysses")
    sp = ulysses.choice([2, 2, 4])
    if ulysses.random() < 0.3 and dp * tp * pp * sp <= max_world:
        out.append(f"--parallel.sp={sp}")
    # the head and the block linears' transforms, from a generator of their own too
    linears = random.Random(repr(rng.getstate()) + "linears")
    if linears.random() < 0.2:
        out += ["--model.fused_loss=true", f"--model.fused_loss_chunk={linears.choice([7, 32, 1024])}"]
    if linears.random() < 0.15:  # int8 compression instead: drawn by check.fuzz.draw_sample (int8_share)
        out += [f"--precision.fp8={linears.choice(['tensorwise', 'rowwise'])}", "--precision.fp8_emulate=true"]
    # a mixture-of-experts architecture in the same shapes, and its experts cut over ep where dp
    # allows, from a generator of its own (a sample that draws none stays as it was)
    experts = random.Random(repr(rng.getstate()) + "experts")
    if experts.random() < 0.3:
        arch = experts.choice(HF_MOE_ARCHS)
        out[1] = HF_TINY + ":".join([arch, *spec.split(":")[1:]])
        # float8 would take the router and not the stacked experts: refused (families/hf_moe.py), so
        # a drawn one only wastes the sample (as int8 would: check.fuzz.draw_sample leaves it out)
        out = [o for o in out if not o.startswith(("--precision.fp8=", "--precision.fp8_emulate="))]
        if dp % 2 == 0 and experts.random() < 0.6 and "--parallel.ep=2" not in out:
            out.append("--parallel.ep=2")
        if experts.random() < 0.3:
            out.append("--parallel.moe_grouped_mm=true")
    # a sliding window of 8 tokens (of data.seq_len's 32) where the architecture has one, from a
    # generator of its own: the layers it windows are the ones transformers' config rule picks
    window = random.Random(repr(rng.getstate()) + "window")
    if not out[1].startswith(HF_TINY + "llama:") and window.random() < 0.2:
        out[1] += ":W8"
    # ZeRO-Offload / -Infinity tiers (and in fp32 half the time the delayed update) under the
    # family's own units, from a generator of its own; where the ZeRO stage takes them (the
    # refusals of the others are drawn by sample_layout), parameters off the device at ZeRO-3 only
    offload = random.Random(repr(rng.getstate()) + "offload")
    zero = int(last_values(out)["--parallel.zero"])
    if zero > 0 and offload.random() < 0.3:
        tiers = _offload_choice(offload, "--precision.mode=bf16" not in out)
        out += tiers if zero == 3 else [t if not t.startswith("--offload.params=") else "--offload.params=none"
                                        for t in tiers]
    return out


def is_hf_moe(sample: list[str]) -> bool:
    """Whether ``sample`` (from :func:`sample_hf_layout`) is a mixture-of-experts architecture."""
    return any(o.startswith(HF_TINY + arch + ":") for o in sample for arch in HF_MOE_ARCHS)


def tiny_hf_config(spec: str, folder: Path) -> Path:
    """The config.json a sample's ``tiny:ARCH:LAYERS:KV_HEADS:TIED[:W<window>]`` names, written under
    ``folder`` (hidden 64, 4 heads, vocabulary 256, as tests/fixtures/hf; the MoE ones 4 experts of
    32, top-2; a sliding window of that many tokens where the spec gives one)."""
    arch, layers, kv, tied, *window = spec.split(":")
    fields = {"architectures": [{"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM",
                                 "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM",
                                 "mixtral": "MixtralForCausalLM", "qwen3_moe": "Qwen3MoeForCausalLM",
                                 "qwen2_moe": "Qwen2MoeForCausalLM"}[arch]],
              "model_type": arch, "vocab_size": 256, "hidden_size": 64, "intermediate_size": 128,
              "num_hidden_layers": int(layers), "num_attention_heads": 4, "num_key_value_heads": int(kv),
              "max_position_embeddings": 128, "rms_norm_eps": 1e-6, "initializer_range": 0.02,
              "tie_word_embeddings": tied == "True", "rope_theta": 10000.0}
    if arch in ("qwen3", "qwen3_moe"):
        fields["head_dim"] = 16
    if arch in ("mistral", "mixtral"):
        fields["sliding_window"] = None
    if arch == "mixtral":  # every layer sparse, top-k renormalized
        fields.update(intermediate_size=32, num_local_experts=4, num_experts_per_tok=2)
    if arch == "qwen3_moe":  # every second layer sparse, top-k weights as the softmax gave them
        fields.update(moe_intermediate_size=32, num_experts=4, num_experts_per_tok=2, decoder_sparse_step=2,
                      mlp_only_layers=[], norm_topk_prob=False)
    if arch == "qwen2_moe":  # every layer sparse, with a gated shared expert of 48; q, k, v biased
        fields.update(moe_intermediate_size=32, shared_expert_intermediate_size=48, num_experts=4,
                      num_experts_per_tok=2, decoder_sparse_step=1, mlp_only_layers=[], norm_topk_prob=False,
                      qkv_bias=True, use_sliding_window=False)
    if window and arch in ("mistral", "mixtral"):  # every layer windowed
        fields["sliding_window"] = int(window[0][1:])
    elif window:  # Qwen's: the layers from (dense), or every other one below (Qwen2-MoE), max_window_layers
        fields.update(use_sliding_window=True, sliding_window=int(window[0][1:]), max_window_layers=1)
    path = folder / f"{arch}-L{layers}-kv{kv}-tied{tied}{'-' + window[0] if window else ''}" / "config.json"
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
    out += optimizer_choice(rng)
    out, dp = _asynchronous_choice(rng, out, dp, pp, micro * accum)  # last: earlier seeds keep the draws above
    if rng.random() < 0.4:  # drawn last: the draws above, and so the samples without experts, stay as they were
        out = _with_experts(rng, out, dp)
    if rng.random() < 0.2:  # after the experts, for the same reason
        out += _offload_choice(rng, "--precision.mode=fp32" in out)
    # Float8 linears, emulated (compared at the bf16 bounds: check/compare.py); drawn last, and not
    # with fp16, which validation refuses with them (the fp16 samples keep training).
    if "--precision.mode=fp16" not in out and rng.random() < 0.2:
        out += [f"--precision.fp8={rng.choice(['tensorwise', 'rowwise'])}", "--precision.fp8_emulate=true"]
    return out + _hybrid_choice(rng, out) + _overflow_choice(rng, out) + _split_choice(rng, out)


def _overflow_choice(rng: random.Random, out: list[str]) -> list[str]:
    """For half the fp16 samples, a loss scale the tiny model's gradients overflow at: the first
    step or two are skipped on every rank, the scale backs off, then grows every clean step (at the
    default 65536 they never overflow, and the skip, backoff and growth against the reference's went
    unsampled). From a generator seeded by rng's state, which draws nothing from rng."""
    mode = [o for o in out if o.startswith("--precision.mode=")][-1]  # the last one counts (2BW makes it fp32)
    if mode != "--precision.mode=fp16" or random.Random(repr(rng.getstate()) + "overflow").random() >= 0.5:
        return []
    return list(FP16_OVERFLOW)


FP16_OVERFLOW = ("--precision.loss_scale=1e9", "--precision.scale_backoff=0.001", "--precision.scale_growth_interval=1")


def last_values(out: list[str]) -> dict[str, str]:
    """``--key=value`` overrides as {key: value}, the last of each key winning (as the config reads them)."""
    return {o.split("=", 1)[0]: o.split("=", 1)[1] for o in out if "=" in o}


def _split_choice(rng: random.Random, out: list[str]) -> list[str]:
    """Explicit pipeline cut points (parallel.pp_split: the first layer of each stage after the
    first) for a quarter of the pipelined samples without a virtual stage or params balancing, from
    a generator of its own (every seed's samples stay as they were besides): pp - 1 increasing
    points in 1 .. layers - 1 where the layers allow, else points validation must refuse by name."""
    last = last_values(out)
    pp, layers = int(last.get("--parallel.pp", 1)), int(last.get("--model.n_layers", 2))
    side = random.Random(repr(rng.getstate()) + "pp_split")
    if pp < 2 or "--parallel.pp_virtual" in last or "--parallel.pp_balance" in last or side.random() >= 0.25:
        return []
    points = sorted(side.sample(range(1, layers), pp - 1)) if layers > pp - 1 else list(range(1, pp))
    return [f"--parallel.pp_split={','.join(map(str, points))}"]


def _hybrid_choice(rng: random.Random, out: list[str]) -> list[str]:
    """HSDP (parallel.dp_replicate) for half the samples it applies to (ZeRO 1-3 over dp >= 2; with
    experts, a number of groups that leaves ep inside one, which validation refuses otherwise):
    drawn from a generator seeded by rng's state, which draws nothing from rng, so every seed's
    samples stay as they were besides."""
    last = last_values(out)
    dp, zero = int(last.get("--parallel.dp", 1)), int(last.get("--parallel.zero", 0))
    ep = int(last.get("--parallel.ep", 1))
    sequence = int(last.get("--parallel.cp", 1)) * int(last.get("--parallel.sp", 1))
    side = random.Random(repr(rng.getstate()) + "dp_replicate")
    if dp < 2 or zero < 1 or side.random() >= 0.5:
        return []
    fits = [r for r in (2, 4, dp) if dp % r == 0 and (dp // r * sequence) % ep == 0]
    groups = [r for r in fits if r < dp] or fits[-1:]  # dp groups of one rank only when nothing smaller fits
    return [f"--parallel.dp_replicate={side.choice(groups)}"] if groups else []


def _offload_choice(rng: random.Random, fp32: bool) -> list[str]:
    """ZeRO-Offload / -Infinity tiers (validation rejects them without the ZeRO engine's units), and
    in fp32 half the time the one-step delayed update, whatever the layout (validation's refusals
    are checked too). bf16/fp16 samples draw it in :func:`bigtrain.check.fuzz.delayed_update_choice`
    (fuzz.py's ``--delayed-share``), from a generator of its own after the resume, where validation
    accepts it: drawn here from rng it would change every later draw of those samples."""
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


def optimizer_choice(rng: random.Random, names: tuple[str, ...] = ("adamw",) * 4 + ("adamw8bit", "adafactor", "lion")
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
    """A mixture-of-experts variant of sample ``out``: experts, top-k, MoE blocks (the first one now
    and then kept dense), capacity, router, balance loss, shared expert (gated, of its own size),
    grouped GEMM, and an ep degree. Mostly a valid one: ep a divisor of
    dp and of E; the rest of the time whatever was drawn, which validation must reject by name.
    Ulysses and Megatron sequence parallelism, as ``out`` drew them (parallel/sequence_moe.py)."""
    experts = rng.choice([2, 4, 4, 8, 6])
    top_k = rng.choice([1, 2, 2, 3])
    valid_ep = [d for d in (1, 2, 4) if dp % d == 0 and experts % d == 0]
    ep = rng.choice(valid_ep[1:] or valid_ep) if rng.random() < 0.85 else rng.choice([2, 3, 4])
    # Drawn and unused: 80% of samples dropped sp and sequence parallelism here while MoE rejected
    # them; the draw stays so that the rest of each seed's sample is drawn as before.
    rng.random()
    drawn = [f"--model.moe_experts={experts}", f"--model.moe_top_k={top_k}", f"--parallel.ep={ep}",
             f"--model.moe_every={rng.choice([1, 1, 2])}",
             f"--model.moe_capacity_factor={rng.choice([0.0, 0.0, 1.0, 1.25, 0.5])}",
             f"--model.moe_router={rng.choice(['softmax', 'softmax', 'sigmoid-bias'])}",
             f"--model.moe_aux_loss_coef={rng.choice([0.0, 0.01, 0.1])}",
             f"--model.moe_ffn_hidden={rng.choice([0, 0, 48])}"]
    # One draw decides the shared expert and its shape (so a seed's other draws stay as they were):
    # a quarter have one; of those, half gated (Qwen2-MoE's), half of their own size.
    shared = rng.random()
    if shared < 0.25:
        drawn += ["--model.moe_shared_expert=True", f"--model.moe_shared_expert_gate={shared < 0.125}",
                  f"--model.moe_shared_expert_hidden={40 if 0.0625 <= shared < 0.1875 else 0}"]
    else:
        drawn.append("--model.moe_shared_expert=False")
    if random.Random(repr(rng.getstate()) + "dense_layers").random() < 0.15:  # the first block dense (Qwen-MoE's
        drawn.append("--model.moe_dense_layers=0")  # mlp_only_layers), from a generator of its own
    return out + drawn + [f"--parallel.moe_grouped_mm={rng.random() < 0.3}"]

