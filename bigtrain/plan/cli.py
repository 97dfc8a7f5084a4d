"""``bigtrain plan`` and ``bigtrain bench --calibrate`` / ``--split-backward``.

Wire into ``bigtrain/cli.py`` with ``add_plan_parser(sub)`` and ``add_bench_parser(sub)`` in
``_parser()``; each sets ``args.run`` to its command, which returns the exit status: 0 when a
layout fits, 1 when none does, 2 for invalid input (a ConfigError naming the field).
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import sys

from bigtrain.cli_help import BENCH_HELP, PLAN_HELP
from bigtrain.config import Config, ConfigError, ModelConfig, load_config, preset_names
from bigtrain.core.attention_kind import attention_kind
from bigtrain.families import Family, family_of
from bigtrain.families.own import none_for, own_step_unpriced
from bigtrain.from_config import compiles
from bigtrain.optim import optimizer_names
from bigtrain.plan.auto import runnable_plans
from bigtrain.plan.fit import stage_split
from bigtrain.plan.hardware import HardwareProfile, calibrate, get_profile, load_profile
from bigtrain.plan.layout import LAYOUT_KEYS, Cluster, parse_layout
from bigtrain.plan.model import MLP_KINDS, ModelSpec, moe_fields
from bigtrain.plan.report import json_report, text_report, write_png
from bigtrain.plan.search import explain_offload_fit, offload_fit, search
from bigtrain.plan.weight_grad import measure_backward_split

DEFAULT_BATCH_TOKENS = 2**22  # Llama's 4 M tokens per step, when neither a preset nor a flag says
# The dense search's flags that have a default: the parser leaves them None (given or not is then
# known: a family's own planner refuses them by name) and the search takes these.
DENSE_DEFAULTS = {"hardware": "h100-80g", "hw": [], "precision": "bf16", "optim": "adamw", "block_size": 256,
                  "layout": "auto", "top": 5}
# What a family's own planner (Family.plan_command) reads besides the config: --gpus, --json, and
# --global-batch / --micro-batch, which reach it as the config's train.global_batch / micro_batch.
# The other flags (the dense search's) would be ignored by it.
DENSE_ONLY = ("layers", "hidden", "heads", "kv_heads", "vocab", "seq", "ffn_hidden", "mlp", "tie_embeddings",
              "hardware", "hardware_file", "hw", "gpus_per_node", "precision", "optim", "block_size", "layout",
              "top", "png")


def add_plan_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    p = subparsers.add_parser("plan", help=PLAN_HELP,
                              description="Will it fit, and which layout is fastest? Memory on the worst rank and "
                                          "step time for a model, a batch and a cluster, before launch.")
    source = p.add_mutually_exclusive_group()
    source.add_argument("--preset", help=f"model and batch from a shipped preset: {', '.join(preset_names())}")
    source.add_argument("--config", metavar="PATH",
                        help="model and batch from a TOML config of any model family (a Hugging Face config.json's "
                             "model too: model.family = 'hf', priced as bigtrain's Llama of its shapes)")
    dims = p.add_argument_group("model dimensions (override the preset's)")
    for flag, text in (("--layers", "transformer blocks L"), ("--hidden", "hidden size h"),
                       ("--heads", "attention heads"), ("--kv-heads", "key/value heads (0: = heads)"),
                       ("--vocab", "vocabulary size"), ("--seq", "sequence length s"),
                       ("--ffn-hidden", "MLP inner size (0: 8h/3 rounded to 64 for swiglu, 4h for gelu)")):
        dims.add_argument(flag, type=int, help=text)
    dims.add_argument("--mlp", choices=MLP_KINDS, help="swiglu: Llama-style; gelu: GPT-style with learned positions")
    dims.add_argument("--tie-embeddings", action=argparse.BooleanOptionalAction, default=None,
                      help="share the embedding with the output layer (default: gelu yes, swiglu no)")
    hw = p.add_argument_group("cluster")
    hw.add_argument("--hardware", help="a100-40g, a100-80g, h100-80g, h200-141g or cpu (default h100-80g)")
    hw.add_argument("--hardware-file", help="a TOML/JSON profile (e.g. from bigtrain bench --calibrate)")
    hw.add_argument("--hw", action="append", metavar="KEY=VALUE",
                    help="override one profile field, e.g. --hw achievable_fraction=0.5")
    hw.add_argument("--gpus", type=int, default=1, help="accelerators in the job (default 1)")
    hw.add_argument("--gpus-per-node", type=int, help="default: the profile's (8)")
    run = p.add_argument_group("batch and layout")
    run.add_argument("--global-batch", type=int, help="sequences per optimizer step (default: the preset's, or ~4M tokens)")
    run.add_argument("--micro-batch", type=int, help="sequences per forward/backward (default: searched)")
    run.add_argument("--precision", choices=("bf16", "fp16", "fp32"), help="default bf16")
    run.add_argument("--optim", choices=optimizer_names(),
                     help="the optimizer whose declared state is counted (optim.name; default adamw)")
    run.add_argument("--block-size", type=int, help="adamw8bit's optim.block_size (default 256)")
    run.add_argument("--layout",
                     help=f"'auto' (the default) or keys {','.join(LAYOUT_KEYS)}, e.g. dp=8,tp=4,pp=2,zero=1,"
                          "schedule=interleaved,v=2,recompute=selective,offload=on; missing keys are chosen by the "
                          "planner (offload, compression and fused_loss default to off; compiled to what "
                          "compile.enabled = 'auto' does on the hardware: on for a GPU and --mlp swiglu, off on a CPU)")
    out = p.add_argument_group("output")
    out.add_argument("--top", type=int, help="how many ranked layouts to show (default 5)")
    out.add_argument("--json", action="store_true", help="print JSON instead of the table")
    out.add_argument("--png", metavar="PATH", help="write a PNG of the memory breakdown and the ranked layouts")
    p.set_defaults(run=cmd_plan)
    return p


def _config_from_args(args: argparse.Namespace) -> Config | None:
    """The config ``--preset`` or ``--config`` names (None for neither)."""
    if args.config:
        return load_config(path=args.config)
    return load_config(preset=args.preset) if args.preset else None


def _model_from_args(args: argparse.Namespace) -> tuple[ModelSpec, int | None]:
    """The model, and the preset's or config's global batch (None without either)."""
    base, batch = {}, None
    cfg = _config_from_args(args)
    if cfg is not None:
        m = _priced_model(cfg)
        base = dict(layers=m.n_layers, hidden=m.dim, heads=m.n_heads, kv_heads=m.n_kv_heads, vocab=m.vocab_size,
                    seq=cfg.data.seq_len, ffn_hidden=m.ffn_hidden, tie_embeddings=m.tie_embeddings,
                    head_size=m.attention_head_dim, qkv_bias=m.q_bias, out_bias=m.attention_bias, qk_norm=m.qk_norm,
                    mlp_bias=m.mlp_bias, **moe_fields(m))
        batch = cfg.train.global_batch
    given = {k: getattr(args, k) for k in ("layers", "hidden", "heads", "kv_heads", "vocab", "seq", "ffn_hidden",
                                          "tie_embeddings") if getattr(args, k) is not None}
    values = {**base, **given}
    missing = [f"--{k}" for k in ("layers", "hidden", "heads", "vocab", "seq") if k not in values]
    if missing:
        raise ConfigError(f"{', '.join(missing)}: required without --preset or --config")
    mlp = args.mlp or "swiglu"
    name = args.preset or args.config or ""
    return ModelSpec.build(mlp=mlp, name=name, **values), batch


def _stage_split_of(cfg: Config | None, args: argparse.Namespace):
    """Where the config's run cuts pp x v pipeline stages (parallel.pp_split, or pp_balance =
    'params'), as ``--parallel auto`` prices them (fit.stage_split); None (an even cut) without a
    config or where a dimension flag (--layers ...) makes the model another than the config's. The
    plan of a config with parallel.pp_split priced an even cut: its worst rank's memory was that of
    stages the run does not have."""
    if cfg is None or any(getattr(args, k) is not None for k in ("layers", "hidden", "heads", "kv_heads", "vocab",
                                                                    "seq", "ffn_hidden", "tie_embeddings")):
        return None
    return functools.lru_cache(maxsize=None)(lambda pp, v: stage_split(cfg, pp, v))


def _family(cfg: Config) -> Family:
    try:
        return family_of(cfg)
    except KeyError as e:
        raise ConfigError(e.args[0]) from None


def _priced_model(cfg: Config) -> ModelConfig:
    """The [model] the dense planner prices for ``cfg``: its family's planner config (a Hugging Face
    config.json's shapes as bigtrain's Llama), else its own."""
    family = _family(cfg)
    if family.own_step is not None:  # its own step and data: no decoder of its shapes prices it
        raise ConfigError(own_step_unpriced(family, "bigtrain plan"))
    if family.planner_config is None and not family.llama_fallbacks:
        raise ConfigError(none_for(family, "planner_config", "bigtrain plan prices a model as bigtrain's Llama of "
                                   "its shapes", "give the shapes by hand (--layers, --hidden, --heads, --vocab, "
                                   "--seq, --mlp gelu) instead of --config"))
    if family.planner_config is None:
        return cfg.model
    try:
        return family.planner_config(cfg).model
    except (OSError, ValueError, ImportError) as e:  # an unreadable config.json, transformers missing
        raise ConfigError(f"model.family = '{cfg.model.family}': cannot read the model to price ({type(e).__name__}: "
                          f"{e}); {family.summary}") from None


def _hardware_from_args(args: argparse.Namespace) -> HardwareProfile:
    profile = load_profile(args.hardware_file) if args.hardware_file else get_profile(args.hardware)
    overrides = {}
    for item in args.hw:
        if "=" not in item:
            raise ConfigError(f"--hw {item}: write it as KEY=VALUE, e.g. --hw achievable_fraction=0.5")
        key, value = item.split("=", 1)
        overrides[key.strip()] = value.strip()
    return profile.with_values(**overrides) if overrides else profile


def _global_batch(args: argparse.Namespace, preset_batch: int | None, model: ModelSpec, gpus: int) -> int:
    if args.global_batch is not None:
        if args.global_batch < 1:
            raise ConfigError(f"--global-batch = {args.global_batch}: must be a positive integer")
        return args.global_batch
    if preset_batch is not None:
        return preset_batch
    sequences = max(1, DEFAULT_BATCH_TOKENS // model.seq)
    return max(gpus, -(-sequences // gpus) * gpus)


def _with_batch(cfg: Config, args: argparse.Namespace) -> Config:
    """``cfg`` with --global-batch and --micro-batch as its train.global_batch and train.micro_batch,
    as the dense search takes them (a family's own planner read the config's and ignored the flags)."""
    given = {}
    for flag, name in (("--global-batch", "global_batch"), ("--micro-batch", "micro_batch")):
        value = getattr(args, name, None)
        if value is not None and value < 1:
            raise ConfigError(f"{flag} = {value}: must be a positive integer")
        if value is not None:
            given[name] = value
    return dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, **given)) if given else cfg


def _not_read(args: argparse.Namespace) -> list[str]:
    """The flags given that a family's own planner does not read (:data:`DENSE_ONLY`)."""
    return [f"--{name.replace('_', '-')}" for name in DENSE_ONLY if getattr(args, name, None) not in (None, [])]


def _with_dense_defaults(args: argparse.Namespace) -> None:
    """The dense search's defaults (:data:`DENSE_DEFAULTS`) on ``args`` for the flags not given."""
    for name, value in DENSE_DEFAULTS.items():
        if getattr(args, name, None) is None:
            setattr(args, name, list(value) if isinstance(value, list) else value)


def resolve(args: argparse.Namespace):
    """(model, cluster, global batch, fixed layout keys) from the command line; raises ConfigError."""
    _with_dense_defaults(args)
    model, preset_batch = _model_from_args(args)
    cluster = Cluster.build(args.gpus, _hardware_from_args(args), args.gpus_per_node)
    fixed = parse_layout(args.layout)
    if args.micro_batch is not None:
        if args.micro_batch < 1:
            raise ConfigError(f"--micro-batch = {args.micro_batch}: must be a positive integer")
        fixed.setdefault("micro_batch", args.micro_batch)
    fixed.setdefault("precision", args.precision)
    # compile.enabled's default ('auto') on this hardware, as the runtime resolves it (bigtrain's Llama
    # is the swiglu model; the GPT-style block is not one of the runtime's)
    fixed.setdefault("compiled", compiles("auto", cluster.hardware.device, model.mlp == "swiglu"))
    cfg = _config_from_args(args)
    if cfg is not None and (m := _priced_model(cfg)).attn_mask == "block_causal":
        # the config's document mask, as its run resolves model.attention on this hardware (sdpa's
        # (seq, seq) mask, a BlockMask, or the ring's ids): left out, a block-causal run was priced causal
        model = dataclasses.replace(model, document_mask=attention_kind(m.attention, m.attn_mask,
                                                                        cluster.hardware.device))
    if cfg is not None:  # what the run of this config does, unless --layout says otherwise
        fixed.setdefault("fp8", cfg.precision.fp8)
        fixed.setdefault("grad_clip", cfg.optim.grad_clip > 0)
    if args.top < 1:
        raise ConfigError(f"--top = {args.top}: must be >= 1")
    return model, cluster, _global_batch(args, preset_batch, model, cluster.gpus), fixed


def cmd_plan(args: argparse.Namespace) -> int:
    """Run ``bigtrain plan``; ConfigError propagates (the main CLI prints it and exits 2)."""
    cfg = _config_from_args(args)
    if cfg is not None:  # a family with a planner of its own (a recommender: its tables' placement)
        family = _family(cfg)
        if family.plan_command is not None:
            if ignored := _not_read(args):  # it priced the config's model and said nothing of them
                print(f"bigtrain plan: {', '.join(ignored)}: model.family = '{cfg.model.family}' has a planner of "
                      f"its own, which takes the model from the config and reads only --gpus, --global-batch, "
                      f"--micro-batch and --json; leave {'them' if len(ignored) > 1 else 'it'} out (to change the "
                      f"model, change the config)", file=sys.stderr)
                return 2
            return family.plan_command(_with_batch(cfg, args), args.gpus, args.json)
    model, cluster, global_batch, fixed = resolve(args)
    if args.block_size < 1:
        raise ConfigError(f"--block-size = {args.block_size}: must be a positive integer")
    # A family priced as another model (a Hugging Face config.json as bigtrain's Llama) runs fewer
    # layouts than the planner models: only those its own validation accepts are ranked or proposed.
    priced_as = cfg is not None and _family(cfg).planner_config is not None
    runnable = (lambda found: runnable_plans(cfg, found)) if priced_as else (lambda found: found)
    split_of = _stage_split_of(cfg, args)
    if split_of is not None and "pp" in fixed and ("v" in fixed or fixed.get("schedule") != "interleaved"):
        stages = fixed["pp"] * fixed.get("v", 1)
        if stages > 1 and split_of(fixed["pp"], fixed.get("v", 1)) is None:
            starts = len(cfg.parallel.split_points or ()) + 1
            raise ConfigError(f"--layout: pp x v = {stages} stages, but the config's parallel.pp_split = "
                              f"'{cfg.parallel.pp_split}' cuts {starts}; use pp x v = {starts}, or a "
                              f"parallel.pp_split of {stages - 1} points")
    result = search(model, cluster, global_batch, fixed, precision=fixed["precision"], optimizer=args.optim,
                    block=args.block_size, split_of=split_of)
    fitting = len(result.ranked)
    result = runnable(result)
    if fitting and result.best is None:
        print(f"bigtrain plan: {fitting} layouts fit this model on {cluster.gpus} x {cluster.hardware.name}, and "
              f"none is one model.family = '{cfg.model.family}' runs; choose the layout by hand (--layout) or "
              f"change the cluster", file=sys.stderr)
        return 1
    # Nothing fits on the device: would offloading model states to the host or NVMe make it fit?
    fit = offload_fit(model, cluster, global_batch, fixed, fixed["precision"], args.optim, args.block_size, split_of) \
        if result.best is None else None
    if fit is not None and fit.best is not None:
        fit = runnable(fit)
        fit = fit if fit.best is not None else None  # an offload the family cannot run is no proposal
    if args.json:
        report = json_report(model, cluster, global_batch, result, args.top)
        if fit is not None and fit.best is not None:
            report["offload_fit"] = {**fit.best.to_dict(), "optimizer": fit.optimizer,
                                     "explanation": explain_offload_fit(fit, cluster)}
        elif fit is not None and fit.off_device is not None:
            report["offload_closest"] = {**fit.off_device.to_dict(), "explanation": explain_offload_fit(fit, cluster)}
        print(json.dumps(report, indent=1))
    else:
        print(text_report(model, cluster, global_batch, result, args.top))
        if fit is not None:
            print("\n".join(explain_offload_fit(fit, cluster)))
    if args.png:
        path = write_png(args.png, result)
        print(f"wrote {path}", file=sys.stderr)
    return 0 if result.best is not None else 1


# -- bench ---------------------------------------------------------------------------------------
def add_bench_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    p = subparsers.add_parser("bench", help=BENCH_HELP)
    p.add_argument("--calibrate", action="store_true",
                   help="measure matmul rate, the collectives (bandwidth, latency, overlap) and the split "
                        "backward's weight_grad_fraction")
    p.add_argument("--split-backward", action="store_true",
                   help="time F, B, I and W of zb-h1's split backward on a middle pipeline stage")
    p.add_argument("--output", default="hardware.json", help="where to write the profile (default hardware.json)")
    p.add_argument("--ranks", type=int, default=2, help="local Gloo ranks for the all-reduce (1: skip it)")
    p.add_argument("--matmul-size", type=int, default=1024, help="n of the n x n x n fp32 matmul")
    p.add_argument("--threads", type=int, default=1,
                   help="CPU: intra-op threads of the measurement, i.e. of one rank (default 1, as torchrun's ranks; "
                        "0: torch's current setting)")
    stage = p.add_argument_group("the stage of the split-backward measurement (default: the 5M-parameter Llama)")
    for name, default in (("layers", 6), ("dim", 256), ("heads", 4), ("seq", 128), ("batch", 8), ("repeats", 5)):
        stage.add_argument(f"--{name}", type=int, default=default, help=f"default {default}")
    p.set_defaults(run=cmd_bench)
    return p


def cmd_bench(args: argparse.Namespace) -> int:
    if not (args.calibrate or args.split_backward):
        print("bigtrain bench: nothing to do; use --calibrate [--output PATH] or --split-backward", file=sys.stderr)
        return 2
    split_stage = {k: getattr(args, k) for k in ("layers", "dim", "heads", "seq", "batch", "repeats")}
    if args.ranks < 1 or args.matmul_size < 1 or args.threads < 0 or min(split_stage.values()) < 1:
        raise ConfigError("--ranks, --matmul-size and the stage sizes must be positive integers (--threads >= 0)")
    if args.split_backward:
        print(f"split backward, stage of {args.layers} blocks: {measure_backward_split(**split_stage).describe()}")
    if not args.calibrate:
        return 0
    profile = calibrate(args.output, matmul_size=args.matmul_size, comm_ranks=args.ranks,
                        measure_comm=args.ranks > 1, split_stage=split_stage, threads=args.threads or None)
    print(f"matmul fp32 {profile.peak_flops_fp32 / 1e9:,.1f} GFLOP/s, bf16 {profile.peak_flops_bf16 / 1e9:,.1f} "
          f"GFLOP/s; all-reduce {profile.intra_node_bandwidth / 1e9:.2f} GB/s (reduce-scatter "
          f"x{profile.reduce_scatter_efficiency:.2f}, all-gather x{profile.all_gather_efficiency:.2f}), latency "
          f"{profile.intra_node_latency_s * 1e3:.2f} ms, overlap {profile.comm_overlap:.2f}; memory {profile.hbm_bandwidth / 1e9:.1f} GB/s; "
          f"weight_grad_fraction {profile.weight_grad_fraction:.3f}; "
          f"wrote {args.output} (use: bigtrain plan --hardware-file {args.output})")
    return 0
