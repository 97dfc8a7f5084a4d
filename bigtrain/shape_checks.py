"""The layout against the model's shapes: tensor and sequence parallelism against its heads and MLP
size, expert parallelism against its experts, the pipeline against its blocks. The shapes are the
[model] fields, or, for a family described by a file of its own (a Hugging Face config.json), those
of the bigtrain Llama of that description, and the messages then name where they come from.

Rules of :func:`bigtrain.validation.validate`; imports no torch (as :mod:`bigtrain.validation`).
"""

from __future__ import annotations

from bigtrain.config import Config
from bigtrain.context_checks import divisor_near as _divisor_near, head_split_problems  # imports no torch
from bigtrain.families import registered_family
from bigtrain.field_checks import one_of


def described_model(cfg: Config):
    """For a family described by its own file (a Hugging Face config.json), the bigtrain Llama
    [model] of its shapes (``Family.planner_config``); None for the others, and for a description
    that cannot be read (its family's check names it)."""
    family = registered_family(cfg.model.family)
    if family is None or family.planner_config is None:
        return None
    try:
        return family.planner_config(cfg).model
    except (OSError, ValueError, KeyError, TypeError, ImportError):
        return None


def model_experts(cfg: Config) -> tuple[int, str]:
    """(the experts of each MoE block, the field that says so), as :func:`model_layers` reads the
    layers: ``model.moe_experts``, or the count in a family's own description (a config.json)."""
    described = described_model(cfg)
    if described is None:
        return cfg.model.moe_experts, "model.moe_experts"
    return described.moe_experts, f"the expert count of its model.family = '{cfg.model.family}' description"


def model_shapes(cfg: Config) -> tuple:
    """(the [model] whose shapes the layout cuts, a note naming where they come from): ``cfg.model``,
    or a family's own description's (:func:`described_model`), whose fields the messages then name."""
    described = described_model(cfg)
    if described is None:
        return cfg.model, ""
    return described, f"; the shapes of model.family = '{cfg.model.family}' description"


def check_expert_parallel(cfg: Config) -> list[str]:
    """ep shards experts over part of the dp x cp x sp replicas (distributed/mesh.py): it must divide them."""
    p, problems = cfg.parallel, []
    if p.ep < 1 or p.dp < 1 or p.sp < 1 or p.cp < 1:
        return problems  # named by validation's positive rules
    axes = [("parallel.dp", p.dp)] + [(f"parallel.{a}", n) for a, n in (("cp", p.cp), ("sp", p.sp)) if n > 1]
    replicas = p.dp * p.cp * p.sp
    if replicas % p.ep:
        over = " x ".join(name for name, _ in axes)
        value = f"{p.dp}" if len(axes) == 1 else " x ".join(str(n) for _, n in axes) + f" = {replicas}"
        problems.append(f"parallel.ep = {p.ep} does not divide {over} = {value}: experts are sharded over ep of "
                        f"the data-parallel ranks (ep adds no ranks); use parallel.ep = "
                        f"{_divisor_near(replicas, p.ep)} or make {over} a multiple of {p.ep}")
    experts, field = model_experts(cfg)
    if p.ep > 1 and experts <= 0:
        problems.append(f"parallel.ep = {p.ep}: expert parallelism needs a mixture-of-experts model, and "
                        f"{field} = {experts} makes every block dense; set {field} to a "
                        f"multiple of {p.ep} (e.g. {2 * p.ep}) or parallel.ep = 1")
    elif p.ep > 1 and experts % p.ep:
        problems.append(f"parallel.ep = {p.ep} does not divide {field} = {experts}: each ep rank holds "
                        f"E / ep whole experts (ep is the number of ranks the experts are spread over, not the "
                        f"number of experts); use parallel.ep = {_divisor_near(experts, p.ep)} or "
                        f"{field} = {-(-experts // p.ep) * p.ep}")
    return problems


def check_model_split(cfg: Config) -> list[str]:
    """Tensor and sequence parallelism against the model's shapes (the [model] decoder fields, for a
    family they describe; another family checks its own shapes)."""
    m, p, seq = cfg.model, cfg.parallel, cfg.data.seq_len
    family = registered_family(m.family)
    if family is None or not family.model_fields:
        return []
    if p.tp <= 0 or p.sp <= 0 or m.n_heads <= 0 or m.dim <= 0 or m.n_heads % max(1, m.kv_heads):
        return []
    problems = []
    if m.n_heads % p.tp:
        problems.append(f"parallel.tp = {p.tp} does not divide model.n_heads = {m.n_heads}; "
                        f"use tp = {_divisor_near(m.n_heads, p.tp)}")
    elif m.kv_heads % p.tp and p.tp % m.kv_heads:
        problems.append(f"parallel.tp = {p.tp}: model.n_kv_heads = {m.kv_heads} must divide by tp (split) or divide "
                        f"tp (replicated); use tp = {_divisor_near(m.kv_heads, p.tp)}")
    if m.ffn_dim % p.tp:
        problems.append(f"parallel.tp = {p.tp} does not divide the MLP size {m.ffn_dim} (model.ffn_hidden); "
                        f"use tp = {_divisor_near(m.ffn_dim, p.tp)}")
    if p.sp > 1:
        # Ulysses gives each sp rank whole query heads; key/value heads are split the same way, or,
        # fewer than sp, replicated (each rank is sent the one its query heads attend to).
        local_q, local_kv = m.n_heads // max(1, p.tp), max(1, m.kv_heads // max(1, p.tp))
        problems += head_split_problems(f"parallel.sp = {p.sp} (Ulysses)", p.sp, local_q, local_kv, "")
        if seq % p.sp:
            problems.append(f"data.seq_len = {seq} does not divide by parallel.sp = {p.sp}")
    if p.sequence_parallel and p.tp > 1 and (seq // p.sp) % p.tp:
        problems.append(f"parallel.sequence_parallel: data.seq_len / sp = {seq // p.sp} does not divide by "
                        f"parallel.tp = {p.tp}; change data.seq_len or turn sequence_parallel off")
    return problems


def model_layers(cfg: Config) -> tuple[int, str]:
    """(the model's blocks, the field that says so): ``model.n_layers``, or, for a family described
    by its own file (a Hugging Face config.json), the count of the bigtrain Llama of its shapes
    (``Family.planner_config``)."""
    described = described_model(cfg)
    if described is None:
        return cfg.model.n_layers, "model.n_layers"
    return described.n_layers, f"the layer count of its model.family = '{cfg.model.family}' description"


def check_pipeline(cfg: Config) -> list[str]:
    p, t = cfg.parallel, cfg.train
    n_layers, layers_field = model_layers(cfg)
    if p.pp < 1 or p.dp < 1 or p.pp_virtual < 1 or t.micro_batch < 1 or n_layers < 1:
        return [] if p.pp_virtual >= 1 else [f"parallel.pp_virtual = {p.pp_virtual}: must be >= 1"]
    problems = one_of("parallel.pp_balance", p.pp_balance, ("layers", "params"))
    try:
        split_points = p.split_points
    except ValueError:
        return problems + [f"parallel.pp_split = '{p.pp_split}': write layer indices like '2,4,6'"]
    default = type(p)()
    if split_points and p.pp_balance != default.pp_balance and not problems:
        problems.append(f"parallel.pp_split = '{p.pp_split}' with parallel.pp_balance = '{p.pp_balance}': the split "
                        f"decides where the stages start, so the balance would be ignored; remove one of them "
                        f"(parallel.pp_balance = '{default.pp_balance}' is its default, parallel.pp_split = '' "
                        f"balances by it)")
    if p.pp == 1 and p.pp_virtual == 1 and not split_points and p.pp_schedule == "1f1b":
        return problems
    from bigtrain.parallel.pipeline.partition import check_pipeline_layout  # imports torch: only when needed

    ignored = one_stage_problems(p) if p.pp == 1 else []
    if ignored:
        return problems + ignored

    return problems + check_pipeline_layout(n_layers, p.pp, p.pp_virtual, t.grad_accum(p.dp),
                                            p.pp_schedule, split_points,
                                            m_field="train.global_batch / (train.micro_batch x parallel.dp)",
                                            layers_field=layers_field)


def one_stage_problems(p) -> list[str]:
    """What ``parallel.pp = 1`` would ignore: one stage runs no pipeline (parallel/build.py builds
    none), so a schedule or stages per rank other than the defaults did nothing, silently. The
    defaults pass (the planner's layouts of one stage write them); an asynchronous kind is named by
    async_checks, an unknown one by check_pipeline_layout."""
    from bigtrain.parallel.pipeline.schedules import ASYNC_KINDS, SCHEDULE_KINDS

    default, problems = type(p)(), []
    kind = p.pp_schedule
    if kind != default.pp_schedule and kind in SCHEDULE_KINDS and kind not in ASYNC_KINDS:
        problems.append(f"parallel.pp_schedule = '{kind}' with parallel.pp = 1: one stage runs no pipeline "
                        f"schedule, so it would be ignored; set parallel.pp >= 2, or remove parallel.pp_schedule "
                        f"(its default '{default.pp_schedule}')")
    if p.pp_virtual != default.pp_virtual:
        problems.append(f"parallel.pp_virtual = {p.pp_virtual} with parallel.pp = 1: one stage runs no pipeline, "
                        f"so its stages per rank would be ignored; set parallel.pp >= 2, or remove "
                        f"parallel.pp_virtual (its default {default.pp_virtual})")
    return problems
