"""A layout (how a run is cut over GPUs), the cluster it runs on, parsing and validation.

Axes follow bigtrain's mesh (``distributed/mesh.py``): tp innermost (adjacent ranks, inside a
node), then sp, cp, dp, and pp outermost. ``sp`` is the Ulysses sequence-parallel degree; ``cp``
context parallelism (the sequence in 2 x cp chunks, attention over a ring or an all-to-all);
``tp_sp`` is Megatron's sequence parallelism inside the tp group (norms and residuals sharded
along the sequence). ZeRO shards over the replicas of a weight, dp x cp x sp.
"""

from __future__ import annotations

import dataclasses
import difflib
import functools
from dataclasses import dataclass

from bigtrain.config import ConfigError
from bigtrain.parallel.pipeline import SCHEDULE_KINDS
from bigtrain.plan.engine import BIGTRAIN, Engine
from bigtrain.plan.hardware import HardwareProfile
from bigtrain.plan.model import ModelSpec, kv_heads_held

RECOMPUTE = ("none", "full", "every", "selective")
COMPRESSIONS = ("none", "int8")
FP8 = ("none", "tensorwise", "rowwise")  # precision.fp8
PRECISIONS = ("fp32", "bf16", "fp16")
CP_MODES = ("ring", "all-to-all", "hybrid")
BYTES = {"fp32": 4, "bf16": 2, "fp16": 2}


@dataclass(frozen=True)
class Layout:
    dp: int = 1
    tp: int = 1
    pp: int = 1
    sp: int = 1
    zero: int = 0
    micro_batch: int = 1
    schedule: str = "1f1b"
    v: int = 1
    recompute: str = "none"
    every: int = 2
    tp_sp: bool = False
    precision: str = "bf16"
    offload: bool = False  # memory.activation_offload
    compression: str = "none"  # memory.activation_compression
    fused_loss: bool = False  # model.fused_loss
    ep: int = 1  # parallel.ep: experts sharded over ep of the dp x sp ranks (adds no ranks)
    offload_optimizer: str = "none"  # offload.optimizer: none | cpu | nvme
    offload_params: str = "none"  # offload.params: none | cpu | nvme (ZeRO-3)
    offload_masters: str = "auto"  # offload.masters: auto (with the state) | cpu (host, the state in files)
    delayed_update: bool = False  # offload.delayed_update: the host step overlaps the next step
    fp8: str = "none"  # precision.fp8: the blocks' linears in float8 (gemm.py times them, memory.py their copies)
    cp: int = 1  # parallel.cp: the sequence cut over cp ranks, attention over all of it
    cp_mode: str = "ring"  # parallel.cp_mode: ring | all-to-all | hybrid (Ulysses over sp inside)
    # parallel.dp_replicate (HSDP): dp is dp_replicate groups of dp_shard ranks; ZeRO cuts within a
    # group (dp_shard x cp x sp) and all-reduces the reduced shards across the groups.
    dp_replicate: int = 1
    # compile.enabled, resolved for the run's device: each block compiled regionally (inductor). The
    # blocks keep fewer activations (plan/activations.py) and move fewer element-wise bytes in fewer
    # kernels (plan/gemm.py).
    compiled: bool = False
    # ZeRO-3's gathers (parallel.reshard_after_forward, parallel.prefetch): off, a unit gathered for
    # the forward stays gathered until its backward reduced it (every unit at the forward's end);
    # prefetch gathers the next unit while one runs (two blocks gathered at once, else one)
    reshard_after_forward: bool = True
    prefetch: bool = True
    # Where the pipeline's stages start (parallel.pp_split, or the cut parallel.pp_balance = 'params'
    # makes: fit._layout): the first block of stages 1 .. pp x v - 1; () cuts them evenly
    split: tuple[int, ...] = ()
    # checkpoint.async: a save snapshots the states the rank writes into host memory, held while the
    # write overlaps training (tiers.checkpoint_snapshot_bytes); the run's to choose, not the search's
    checkpoint_async: bool = False
    # optim.grad_clip > 0: the step may scale every gradient by the clip factor (plan/dp_cost.py); the
    # run's to choose, not the search's
    grad_clip: bool = True

    @property
    def gpus(self) -> int:
        return self.dp * self.tp * self.pp * self.sp * self.cp

    @property
    def seq_shards(self) -> int:
        """How many ways each sequence is cut between the blocks' linears: Ulysses x cp."""
        return self.sp * self.cp

    @property
    def head_exchange(self) -> int:
        """The degree of the all-to-all that trades sequence shards for head shards around attention:
        Ulysses' sp, times cp when cp's attention is an all-to-all too."""
        return self.sp * (self.cp if self.cp_mode == "all-to-all" else 1)

    @property
    def ring(self) -> int:
        """The ranks attention passes keys and values around (cp, unless cp's mode is the all-to-all)."""
        return self.cp if self.cp_mode != "all-to-all" else 1

    @property
    def dp_shard(self) -> int:
        return max(1, self.dp // max(1, self.dp_replicate))

    def size(self, axis: str) -> int:
        """The ranks of a mesh axis, named as the runtime's mesh and placement record name them
        (``dp_sp``: the replicas of a dense weight, dp x cp x sp; ``dp_shard_sp``: one ZeRO group under
        HSDP; ``pp_ends``: the two ends of the pipeline)."""
        return self._axis_sizes[axis]

    @functools.cached_property  # a search asks millions of times; the layout is frozen
    def _axis_sizes(self) -> dict[str, int]:
        replicas = self.dp * self.cp * self.sp
        return {"dp": self.dp, "tp": self.tp, "pp": self.pp, "sp": self.sp, "cp": self.cp, "dp_sp": replicas,
                "pp_ends": min(2, self.pp), "ep": self.ep, "edp": replicas // self.ep,
                "dp_replicate": self.dp_replicate, "dp_shard": self.dp_shard,
                "dp_shard_sp": self.dp_shard * self.cp * self.sp,
                "edp_shard": self.dp_shard * self.cp * self.sp // self.ep}

    def gradient_axes(self) -> tuple[str, tuple[str, ...]]:
        """As the runtime's ``Mesh.gradient_axes``: the axis a dense weight's gradient is reduced
        (and its ZeRO unit cut) over, and the axes the reduced shard is then all-reduced over."""
        return ("dp_sp", ()) if self.dp_replicate == 1 else ("dp_shard_sp", ("dp_replicate",))

    def expert_gradient_axes(self) -> tuple[str, tuple[str, ...]]:
        """As ``Mesh.expert_gradient_axes``: edp, or under HSDP edp_shard then dp_replicate."""
        return ("edp", ()) if self.dp_replicate == 1 else ("edp_shard", ("dp_replicate",))

    @property
    def compute_bytes(self) -> int:
        return BYTES[self.precision]

    def micro_batches(self, global_batch: int) -> int:
        """Micro-batches each pipeline (each dp replica) runs per step."""
        return global_batch // (self.dp * self.micro_batch)

    def describe(self) -> str:
        parts = [f"dp={self.dp}", f"tp={self.tp}", f"pp={self.pp}", f"sp={self.sp}", f"zero={self.zero}",
                 f"mb={self.micro_batch}"] + ([f"ep={self.ep}"] if self.ep > 1 else [])
        if self.cp > 1:
            parts.insert(4, f"cp={self.cp},cp_mode={self.cp_mode}")
        parts[1:1] = [f"dp_replicate={self.dp_replicate}"] if self.dp_replicate > 1 else []
        if self.pp > 1:
            parts.append(f"schedule={self.schedule}" + (f",v={self.v}" if self.v > 1 else ""))
            if self.split:
                parts.append(f"split={'/'.join(map(str, self.split))}")
        parts.append(f"recompute={self.recompute}" + (f",every={self.every}" if self.recompute == "every" else ""))
        if self.tp > 1:
            parts.append(f"tp_sp={'on' if self.tp_sp else 'off'}")
        parts.append(self.precision + (f",fp8={self.fp8}" if self.fp8 != "none" else ""))
        parts += [k for k, on in (("offload", self.offload), ("int8", self.compression == "int8"),
                                  ("fused_loss", self.fused_loss), ("compiled", self.compiled)) if on]
        if self.zero == 3:
            parts += [k for k, off in (("reshard_after_forward=off", not self.reshard_after_forward),
                                       ("prefetch=off", not self.prefetch)) if off]
        if self.offload_optimizer != "none":
            parts.append(f"offload_optimizer={self.offload_optimizer}")
        if self.offload_params != "none":
            parts.append(f"offload_params={self.offload_params}")
        if self.offload_masters != "auto":
            parts.append(f"offload_masters={self.offload_masters}")
        if self.delayed_update:
            parts.append("delayed_update")
        if self.checkpoint_async:
            parts.append("checkpoint_async")
        if not self.grad_clip:
            parts.append("grad_clip=off")
        return ",".join(parts)

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    def to_overrides(self) -> list[str]:
        """The layout as ``bigtrain train`` overrides (``--parallel.dp=8`` ...), for ``--parallel auto``."""
        # Every axis, at 1 too: a config that set cp or dp_replicate (or dp_shard) must not keep
        # it under a layout without it (the run would launch more ranks than planned, or cut ZeRO
        # differently from the planner's memory; dp_shard = 0 follows as dp / dp_replicate).
        out = [f"--parallel.{k}={getattr(self, k)}" for k in ("dp", "tp", "pp", "sp", "zero", "ep", "dp_replicate")]
        out += ["--parallel.dp_shard=0"]
        # One stage runs no schedule (the planner prices every kind alike there) and the run refuses
        # one that is not the default: a fixed --layout schedule=gpipe reaches pp = 1 layouts too.
        schedule, v = (self.schedule, self.v) if self.pp > 1 else ("1f1b", 1)
        out += [f"--parallel.pp_schedule={schedule}", f"--parallel.pp_virtual={v}"]
        out += [f"--parallel.cp={self.cp}", f"--parallel.cp_mode={self.cp_mode}"]
        out += [f"--parallel.sequence_parallel={str(self.tp_sp).lower()}", f"--precision.mode={self.precision}",
                f"--memory.checkpointing={self.recompute}", f"--memory.checkpoint_every={self.every}",
                f"--train.micro_batch={self.micro_batch}",
                f"--memory.activation_offload={str(self.offload).lower()}",
                f"--memory.activation_compression={self.compression}",
                f"--model.fused_loss={str(self.fused_loss).lower()}",
                f"--parallel.reshard_after_forward={str(self.reshard_after_forward).lower()}",
                f"--parallel.prefetch={str(self.prefetch).lower()}"]
        if self.split:  # where the stages start (else the run's own pp_split / pp_balance decide)
            # The cut may be the one the config's pp_balance = 'params' makes (fit.stage_split): the
            # run refuses a balance beside a split, so the split states it alone.
            out += [f"--parallel.pp_split={','.join(map(str, self.split))}", "--parallel.pp_balance=layers"]
        if self.fp8 != "none":
            out.append(f"--precision.fp8={self.fp8}")
        if self.compiled:  # not compiled: the run's own compile.enabled decides ('auto': on CUDA only)
            out.append("--compile.enabled=true")
        out += [f"--offload.optimizer={self.offload_optimizer}", f"--offload.params={self.offload_params}",
                f"--offload.delayed_update={str(self.delayed_update).lower()}", f"--offload.masters={self.offload_masters}"]
        return out


MAX_GPUS = 2**20


@dataclass(frozen=True)
class Cluster:
    gpus: int
    hardware: HardwareProfile
    gpus_per_node: int = 8
    engine: Engine = BIGTRAIN  # what the training software overlaps (plan/engine.py)

    @classmethod
    def build(cls, gpus: int, hardware: HardwareProfile, gpus_per_node: int | None = None,
              engine: Engine = BIGTRAIN) -> "Cluster":
        per_node = hardware.gpus_per_node if gpus_per_node is None else gpus_per_node
        problems = []
        if not isinstance(gpus, int) or gpus < 1:
            problems.append(f"--gpus = {gpus}: must be a positive integer")
        elif gpus > MAX_GPUS:  # beyond any cluster built; the search enumerates layouts over the divisors
            problems.append(f"--gpus = {gpus}: at most {MAX_GPUS} (2**20) accelerators can be planned for")
        if not isinstance(per_node, int) or per_node < 1:
            problems.append(f"--gpus-per-node = {per_node}: must be a positive integer")
        elif not problems and gpus > per_node and gpus % per_node:
            problems.append(f"--gpus = {gpus} is not a whole number of nodes of --gpus-per-node = {per_node}; "
                            f"use {gpus // per_node * per_node} or {(gpus // per_node + 1) * per_node}")
        if problems:
            raise ConfigError(problems)
        return cls(gpus, hardware, per_node, engine)

    @property
    def nodes(self) -> int:
        return max(1, -(-self.gpus // self.gpus_per_node))


_INT_KEYS = ("dp", "tp", "pp", "sp", "zero", "micro_batch", "v", "every", "ep", "cp", "dp_replicate")
_ALIASES = {"mb": "micro_batch", "micro-batch": "micro_batch", "checkpointing": "recompute", "tpsp": "tp_sp",
            "sequence_parallel": "tp_sp", "zero_stage": "zero", "checkpoint_every": "every",
            "activation_offload": "offload", "activation_compression": "compression",
            "optimizer_offload": "offload_optimizer", "params_offload": "offload_params",
            "masters_offload": "offload_masters", "compile": "compiled"}
_BOOL_KEYS = ("tp_sp", "offload", "fused_loss", "delayed_update", "compiled", "reshard_after_forward", "prefetch",
              "checkpoint_async", "grad_clip")
LAYOUT_KEYS = _INT_KEYS + ("schedule", "recompute", "tp_sp", "precision", "offload", "compression", "fused_loss",
                           "offload_optimizer", "offload_params", "offload_masters", "delayed_update", "fp8",
                           "cp_mode", "compiled", "reshard_after_forward", "prefetch", "checkpoint_async",
                           "grad_clip")
OFFLOAD_TIERS = {"offload_optimizer": ("none", "cpu", "nvme"), "offload_params": ("none", "cpu", "nvme"),
                 "offload_masters": ("auto", "cpu")}


def parse_layout(text: str) -> dict:
    """``'dp=8,tp=4,recompute=full'`` -> ``{'dp': 8, 'tp': 4, 'recompute': 'full'}``; 'auto' -> {}."""
    text = (text or "auto").strip()
    if text == "auto":
        return {}
    out, problems, given_as = {}, [], {}
    for item in filter(None, (p.strip() for p in text.split(","))):
        if "=" not in item:
            problems.append(f"--layout: '{item}' must look like key=value (e.g. dp=8)")
            continue
        key, value = (s.strip() for s in item.split("=", 1))
        key = _ALIASES.get(key.lower(), key.lower())  # 'DP=8' is dp
        if key in given_as:  # the later one would win unseen (an alias names the same setting)
            problems.append(f"--layout: {key} is given twice ('{given_as[key]}' and '{item}'); keep one")
            continue
        given_as[key] = item
        if key not in LAYOUT_KEYS:
            # (cutoff 0.5: a two-letter key one letter off, 'dq', is half alike)
            close = difflib.get_close_matches(key, LAYOUT_KEYS, n=len(LAYOUT_KEYS), cutoff=0.5 if len(key) <= 2 else 0.6)
            best = [c for c in close if difflib.SequenceMatcher(None, key, c).ratio()
                    == difflib.SequenceMatcher(None, key, close[0]).ratio()]  # every one as close: 'pq', tp or pp
            hint = ("; did you mean " + " or ".join(f"'{c}'" for c in best) + "?") if 0 < len(best) <= 2 \
                else f"; keys: {', '.join(LAYOUT_KEYS)}"  # ('pq' is as near tp, sp, pp, ep, dp and cp: no guess)
            problems.append(f"--layout: unknown key '{key}'{hint}")
            continue
        if ";" in value or " " in value:  # 'dp=8;tp=2', 'dp=8 tp=2': one key's value holding the next key
            problems.append(f"--layout: {key} = '{value}': separate the keys with commas, e.g. "
                            f"'{item.replace(';', ',').replace(' ', ',')}'")
            continue
        try:
            out[key] = _parse_value(key, value)
        except ValueError as e:
            problems.append(f"--layout: {key} = '{value}': {e}")
    if problems:
        raise ConfigError(problems)
    return out


def _parse_value(key: str, value: str):
    if key in _INT_KEYS:
        try:
            number = int(value)
        except ValueError:
            raise ValueError("must be a whole number") from None
        if number < (0 if key == "zero" else 1) or (key == "zero" and number > 3):
            raise ValueError("must be >= 1" if key != "zero" else "must be 0, 1, 2 or 3")
        return number
    if key in _BOOL_KEYS:
        if value.lower() in ("1", "on", "true", "yes"):
            return True
        if value.lower() in ("0", "off", "false", "no"):
            return False
        raise ValueError("use on or off")
    choices = {"schedule": SCHEDULE_KINDS, "recompute": RECOMPUTE, "precision": PRECISIONS,
               "compression": COMPRESSIONS, "fp8": FP8, "cp_mode": CP_MODES, **OFFLOAD_TIERS}[key]
    if value not in choices:
        raise ValueError(f"must be one of {', '.join(choices)}")
    return value


def layout_problems(layout: Layout, model: ModelSpec, cluster: Cluster, global_batch: int) -> list[str]:
    """Why a layout cannot run this model on this cluster (empty when it can), naming each key."""
    problems = []
    if layout.gpus != cluster.gpus:
        cp = (" x cp", f" x {layout.cp}") if layout.cp > 1 else ("", "")
        problems.append(f"dp x tp x pp x sp{cp[0]} = {layout.dp} x {layout.tp} x {layout.pp} x {layout.sp}{cp[1]} = "
                        f"{layout.gpus} != --gpus = {cluster.gpus}")
    if layout.zero not in (0, 1, 2, 3):
        problems.append(f"zero = {layout.zero}: must be 0, 1, 2 or 3")
    for key, divides in (("tp", [("--heads", model.heads), ("--ffn-hidden", model.ffn_hidden)]),
                         ("sp", [("--heads", model.heads // layout.tp), ("--seq", model.seq)])):
        degree = getattr(layout, key)
        for flag, value in divides:
            if value % degree:
                per_tp = " / tp" if key == "sp" and flag == "--heads" and layout.tp > 1 else ""
                problems.append(f"{key} = {degree} must divide {flag}{per_tp} = {value}")
    # Key/value heads (the runtime's rule, validation.py): split over tp where tp divides them, else
    # replicated (tp a multiple of them: each rank holds the whole wk and wv); then each tp rank's
    # share split over sp, or replicated where sp is a multiple of it.
    held = kv_heads_held(model.kv_heads, layout.tp)
    if model.kv_heads % layout.tp and layout.tp % model.kv_heads:
        problems.append(f"tp = {layout.tp} must divide --kv-heads = {model.kv_heads} (split) or be a multiple of "
                        f"it (replicated)")
    elif held % layout.sp and layout.sp % held:
        problems.append(f"sp = {layout.sp} must divide the {held} key/value heads per tp rank (split) or be a "
                        f"multiple of them (replicated)")
    if layout.tp_sp and layout.tp == 1:
        problems.append("tp_sp = on needs tp > 1 (it shards along the sequence inside the tp group)")
    if layout.compiled and model.mlp != "swiglu":
        problems.append("compiled = on compiles bigtrain's Llama blocks (--mlp swiglu); the GPT-style block "
                        "(--mlp gelu) is priced with Megatron's fused kernels already: use compiled = off")
    if layout.pp > model.layers:
        problems.append(f"pp = {layout.pp} exceeds --layers = {model.layers}")
    if layout.pp * layout.v > model.layers:
        problems.append(f"pp x v = {layout.pp * layout.v} stages exceed --layers = {model.layers}")
    problems += _batch_problems(layout, global_batch)
    problems += _context_problems(layout, model)
    problems += _expert_problems(layout, model)
    problems += _offload_problems(layout)
    problems += _hybrid_problems(layout)
    return problems


def _hybrid_problems(layout: Layout) -> list[str]:
    """HSDP (the runtime's rules, hsdp_checks.py): dp_replicate equal groups of dp, ZeRO 1-3, ep
    inside one group."""
    if layout.dp_replicate == 1:
        return []
    if layout.dp % layout.dp_replicate:
        return [f"dp_replicate = {layout.dp_replicate} must divide dp = {layout.dp}"]
    problems = []
    if layout.zero == 0:
        problems.append(f"dp_replicate = {layout.dp_replicate} needs zero >= 1 (it says where ZeRO cuts)")
    if layout.size("dp_shard_sp") % layout.ep:
        problems.append(f"ep = {layout.ep} must divide dp_shard x cp x sp = {layout.size('dp_shard_sp')} under "
                        f"dp_replicate = {layout.dp_replicate} (an ep group inside one replica group)")
    return problems


def _offload_problems(layout: Layout) -> list[str]:
    """The runtime's rules (validation.py): the host step needs the ZeRO engine's units, parameter
    files ZeRO-3's shards, the delayed update a host step and no pipeline."""
    problems = []
    if layout.offload_optimizer != "none" and layout.zero < 1:
        problems.append(f"offload_optimizer = {layout.offload_optimizer} needs zero >= 1 (the ZeRO engine's units)")
    if layout.offload_params != "none" and layout.zero != 3:
        problems.append(f"offload_params = {layout.offload_params} needs zero = 3")
    if layout.delayed_update and (layout.offload_optimizer == "none" or layout.pp > 1):
        problems.append("delayed_update needs offload_optimizer = cpu or nvme and pp = 1")
    if layout.offload_masters == "cpu" and layout.offload_optimizer != "nvme":
        problems.append("offload_masters = cpu keeps the masters in host memory while the state is in files: "
                        "it needs offload_optimizer = nvme")
    return problems


def _context_problems(layout: Layout, model: ModelSpec) -> list[str]:
    """cp (the runtime's rules, context_checks.py): 2 x cp equal chunks, hybrid with sp and the
    others without, each cut further by sp and Megatron's tp_sp."""
    if layout.cp == 1:
        return []
    problems, seq = [], model.seq
    if seq % (2 * layout.cp):
        problems.append(f"cp = {layout.cp}: --seq = {seq} must split into 2 x cp = {2 * layout.cp} equal chunks")
    elif (seq // layout.cp) % layout.sp:
        problems.append(f"cp = {layout.cp} x sp = {layout.sp}: --seq / cp = {seq // layout.cp} must divide by sp "
                        f"(Ulysses cuts each cp rank's part)")
    elif (seq // layout.seq_shards) % (layout.tp if layout.tp_sp else 1):
        problems.append(f"tp_sp = on: --seq / (cp x sp) = {seq // layout.seq_shards} must divide by tp = {layout.tp}")
    if (layout.cp_mode == "hybrid") != (layout.sp > 1):
        problems.append(f"cp_mode = {layout.cp_mode} with sp = {layout.sp}: hybrid is Ulysses (sp > 1) inside "
                        f"the ring, ring and all-to-all need sp = 1")
    local_kv = kv_heads_held(model.kv_heads, layout.tp)  # fewer than tp: one replicated head a tp rank
    if layout.cp_mode == "all-to-all" and (model.heads // layout.tp) % layout.cp:
        problems.append(f"cp_mode = all-to-all: cp = {layout.cp} must divide the {model.heads // layout.tp} "
                        f"query heads per tp rank (or use cp_mode = ring)")
    elif layout.cp_mode == "all-to-all" and local_kv % layout.cp and layout.cp % local_kv:
        problems.append(f"cp_mode = all-to-all: the {local_kv} key/value heads per tp rank must divide by cp = "
                        f"{layout.cp} (split) or divide it (replicated) (or use cp_mode = ring)")
    if model.experts and layout.sp > 1:
        problems.append(f"cp = {layout.cp} x sp = {layout.sp} with experts: not built (use sp = 1)")
    return problems


def _expert_problems(layout: Layout, model: ModelSpec) -> list[str]:
    """Experts and ep (the runtime's rules, validation.py): ep part of the dp x cp x sp ranks and
    dividing the experts."""
    problems = []
    if layout.ep == 1:
        return problems
    if not model.experts:
        return [f"ep = {layout.ep} needs a mixture-of-experts model (--preset with model.moe_experts > 0)"]
    if layout.size("dp_sp") % layout.ep:
        problems.append(f"ep = {layout.ep} must divide dp x cp x sp = {layout.size('dp_sp')}")
    if model.experts % layout.ep:
        problems.append(f"ep = {layout.ep} must divide the {model.experts} experts")
    return problems


def _batch_problems(layout: Layout, global_batch: int) -> list[str]:
    problems = []
    per_step = layout.dp * layout.micro_batch
    if global_batch % per_step:
        problems.append(f"--global-batch = {global_batch} is not divisible by dp x micro_batch = {layout.dp} x "
                        f"{layout.micro_batch}")
        return problems
    m = global_batch // per_step
    if layout.schedule == "interleaved":
        if layout.v < 2:
            problems.append("schedule = interleaved needs v >= 2")
        if m < layout.pp or m % layout.pp:
            problems.append(f"schedule = interleaved needs the micro-batches per step ({m}) to be a multiple of "
                            f"pp = {layout.pp}")
    elif layout.v != 1:
        problems.append(f"v = {layout.v} needs schedule = interleaved")
    if layout.v > 1 and layout.pp == 1:
        problems.append(f"v = {layout.v} needs pp > 1 (stages per pipeline rank)")
    return problems
