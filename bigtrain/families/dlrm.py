"""The recommender (:mod:`bigtrain.models.dlrm`): bottom MLP, the [embedding] tables sharded over
the dp ranks, dot interaction, top MLP, binary cross-entropy. It trains on dp only, in the Trainer
every family shares, with a step of its own (:class:`bigtrain.recsys.train.DlrmStep`), and its
planner places tables, not layers.
The only module that names it (``model.family = "dlrm"``)."""

from __future__ import annotations

from bigtrain.config import Config
from bigtrain.core.tables import ROW_STATE_OPTIMIZERS, SHARDINGS, check_layout, parse_sizes, requested_kinds
from bigtrain.families.spec import Family
from bigtrain.families.tokens import data_parallel_named
from bigtrain.field_checks import path_exists
from bigtrain.recsys.placement import cmd_plan_embedding
from bigtrain.recsys.checkpoint import FORMAT
from bigtrain.recsys.train import DlrmStep, layout_for

NAME = "dlrm"


def batch_problems(cfg: Config) -> list[str]:
    t, dp = cfg.train, cfg.parallel.dp
    if t.global_batch <= 0 or dp <= 0:  # validation's own rules name those
        return []
    if t.global_batch % dp:
        named, field = data_parallel_named(cfg)
        other = "" if field == "parallel.dp" else f" or change {field}"
        return [f"train.global_batch = {t.global_batch} is not divisible by {named} = {dp} (each rank takes "
                f"global_batch / dp samples); use train.global_batch = {max(dp, t.global_batch // dp * dp)}{other}"]
    return []


def data_problems(cfg: Config) -> list[str]:
    source = cfg.data.source
    if source != "synthetic" and not path_exists(source):
        return [f"data.source = '{source}': the DLRM reads 'synthetic' (the Criteo-like generator) or a Criteo TSV "
                f"file; no such file"]
    if source != "synthetic" and cfg.embedding.hotness != 1:  # the file would be read one-hot all the same
        return [f"embedding.hotness = {cfg.embedding.hotness}: a Criteo TSV file (data.source = '{source}') holds one "
                f"id per sparse feature; set embedding.hotness = 1"]
    return []


def layout_problems(cfg: Config) -> list[str]:
    """Whether its tables can be placed as embedding.sharding says on parallel.dp ranks, and what the
    DLRM trainer supports (the [embedding] fields' own domains are validation's, for any model)."""
    e, p = cfg.embedding, cfg.parallel
    try:
        rows = parse_sizes(e.tables)
    except ValueError:  # validation's domain rules name a malformed field
        return []
    unknown = {k.strip() for k in e.sharding.split(",")} - set(SHARDINGS)
    if not rows or any(n < 1 for n in rows) or unknown or e.dim < 1 or p.dp < 1:
        return []
    try:
        kinds = requested_kinds(e.sharding, len(rows))
    except ValueError as err:
        return [str(err)]
    problems = check_layout(rows, e.dim, p.dp, ["table" if k == "auto" else k for k in kinds])
    if p.tp * p.pp * p.sp * p.ep != 1:
        problems.append(f"model.family = '{NAME}' runs over parallel.dp only (tables sharded over the dp ranks); "
                        f"set parallel.tp, pp, sp and ep to 1")
    if p.dp_replicate > 1:
        problems.append(f"parallel.dp_replicate = {p.dp_replicate}: the DLRM shards its tables over every data-parallel "
                        f"rank, in no replica groups; set parallel.dp_replicate = 1")
    if cfg.precision.mode != "fp32":
        problems.append(f"precision.mode = '{cfg.precision.mode}': the DLRM trains in fp32; set it to 'fp32'")
    if p.zero:
        problems.append(f"parallel.zero = {p.zero}: the DLRM's dense part trains replicated (ZeRO is not wired to it "
                        f"yet); set parallel.zero = 0")
    return problems


def check_dlrm(cfg: Config) -> list[str]:
    problems = batch_problems(cfg) + data_problems(cfg) + layout_problems(cfg)
    if cfg.model.init_from:
        problems.append(f"model.init_from = {cfg.model.init_from!r}: the DLRM starts from its random init only; "
                        f"set model.init_from = ''")
    return problems


def tables_fit_problems(cfg: Config) -> list[str]:
    """Whether the planner places its tables on parallel.dp ranks within embedding.budget_gb."""
    try:
        layout_for(cfg, cfg.parallel.dp)
    except ValueError as e:
        return [str(e)]
    return []


def size_problems(cfg: Config, local_ranks: int = 1, cuda: bool = False, machine: tuple[int, str] = (0, ""),
                  **_) -> tuple[list[str], list[str]]:
    """Preflight's size check: the planner's placement within embedding.budget_gb, and the tables
    (weights and sparse optimizer state, the planner's bytes of the fullest rank) against this
    machine's memory: each GPU's, or on CPUs the host's, which its local ranks share (a 90 GiB
    dlrm-criteo passed on a 23 GiB host before, to be killed allocating its tables). ``machine``:
    (bytes, what has them) as preflight measured them; (0, ...) checks the budget only."""
    problems = tables_fit_problems(cfg)
    if problems:
        return problems, []
    layout, e = layout_for(cfg, cfg.parallel.dp), cfg.embedding
    state = 4 if e.optimizer in ROW_STATE_OPTIMIZERS else 0
    worst = max(layout.rank_bytes(r, state) for r in range(layout.world))
    sharing = 1 if cuda else max(1, min(local_ranks, layout.world))
    capacity, has = machine
    if capacity and worst * sharing > capacity:
        on_machine = f" x {sharing} ranks on this machine" if sharing > 1 else ""
        return [f"embedding.tables ({len(layout.rows)} tables, {sum(layout.rows):,} rows) x embedding.dim = {e.dim}: "
                f"a rank holds up to {worst / 2**30:.3f} "
                f"GiB of tables and {e.optimizer} state (the planner's layout on parallel.dp = {layout.world}, "
                f"embedding.sharding = '{e.sharding}'){on_machine}, and {has} {capacity / 2**30:.3f} GiB; use more "
                f"machines, or fewer or smaller tables"], []
    return [], []


DLRM = Family(
    name=NAME,
    summary="a recommender: bottom MLP, the [embedding] tables, dot interaction, top MLP, binary cross-entropy",
    check_config=check_dlrm,
    reads_tokens=False,
    placement_problems=tables_fit_problems,
    size_problems=size_problems,
    plan_command=cmd_plan_embedding,
    own_step=DlrmStep,
    checkpoint_format=FORMAT,
    full_optimizer_state=False,  # its parallel model gathers no full optimizer state
    model_keys=("family", "init_from", "dlrm_dense_features", "dlrm_bottom_mlp", "dlrm_top_mlp"),
)
