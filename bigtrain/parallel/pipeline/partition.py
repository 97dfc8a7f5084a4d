"""Split a plain model into pipeline stages, and check a pipeline layout before launch.

A stage is a :class:`PipelineStage` holding a contiguous chunk of the model: the *same* module
objects as the plain model, registered under the *same* names (``layers.3.attention.wq.weight``
stays ``layers.3.attention.wq.weight``), so initialization by name, checkpoints and parity
comparisons with one process work unchanged. Build the plain model on the meta device, split it,
and materialize only the stages this rank owns.

A weight tied between the embedding and the head (``model.tie_embeddings``) is then held by the
first stage as ``tok_embeddings.weight`` and by the last as ``output.weight``: two copies, which
must start equal (``init_weights`` initializes the head's copy as the embedding) and have their
gradients summed after backward (``bigtrain.parallel.tied``).

For the reference Llama the embedding goes to the first stage and the final norm and output head
to the last (the executor applies the loss there); the transformer blocks are divided by count,
by parameter count (embedding and head included in the balance), or at given split points. A
user's ``nn.Sequential`` is divided the same way over its children.

Split points are the indices of the layers (children) that *start* stages 1..S-1: with 4 layers
and 2 stages, ``[1]`` gives stage 0 layer 0 and stage 1 layers 1-3.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import torch
from torch import nn

from bigtrain.models.llama import Llama, documents_mask, init_value
from bigtrain.models.moe import init_router_biases
from bigtrain.models.rope import rotary_tables_for
from bigtrain.parallel.pipeline.schedules import SCHEDULE_KINDS
from bigtrain.parallel.tied import shared_parameter_names

BALANCE_MODES = ("layers", "params")


# ------------------------------------------------------------------ layout checks (no torch work)

def check_split_points(split_points: Sequence[int], n_layers: int, num_stages: int,
                       layers_field: str = "model.n_layers") -> list[str]:
    """Problems with explicit split points, each naming ``parallel.pp_split`` (and ``layers_field``,
    where the model's layer count comes from)."""
    points = list(split_points)
    if num_stages == 1 and points:  # (it said "1 stages need 0 split points ..., e.g. []")
        return [f"parallel.pp_split = {points}: one stage (parallel.pp x parallel.pp_virtual = 1) has no split "
                f"points; clear it (parallel.pp_split = '') or raise parallel.pp"]
    if len(points) != num_stages - 1:
        return [f"parallel.pp_split = {points}: {num_stages} stages need {num_stages - 1} split points "
                f"(the first layer of stages 1..{num_stages - 1}), e.g. {even_split_points(n_layers, num_stages)}"]
    missing = [p for p in points if isinstance(p, bool) or not isinstance(p, int) or not 0 < p < n_layers]
    if missing:
        return [f"parallel.pp_split = {points}: split point(s) {missing} do not exist; a split point is the "
                f"index of a layer that starts a stage, 1..{n_layers - 1} for {layers_field} = {n_layers}"]
    if any(b <= a for a, b in zip(points, points[1:])):
        return [f"parallel.pp_split = {points}: split points must be strictly increasing (no empty stage)"]
    return []


def check_pipeline_layout(n_layers: int, pp: int, v: int, m: int, kind: str,
                          split_points: Sequence[int] | None = None,
                          m_field: str = "parallel.pp_microbatches", layers_field: str = "model.n_layers") -> list[str]:
    """Every problem with a pipeline layout, as strings naming the config field and a fix.

    ``pp`` ranks with ``v`` stages each (``parallel.pp_virtual``), ``m`` micro-batches per step
    (named ``m_field``, in case the config derives m from another field), schedule ``kind``
    (``parallel.pp_schedule``) and optional ``split_points`` (``parallel.pp_split``). Returns
    ``[]`` when the layout can run.
    """
    problems = []
    if kind not in SCHEDULE_KINDS:
        problems.append(f"parallel.pp_schedule = '{kind}': must be one of {', '.join(map(repr, SCHEDULE_KINDS))}")
    if kind == "interleaved":
        if v < 2:
            problems.append(f"parallel.pp_virtual = {v}: the 'interleaved' schedule needs >= 2 stages per rank; use 2")
        if m < pp or m % pp:
            fixed = max(pp, -(-m // pp) * pp)
            problems.append(f"{m_field} = {m}: the 'interleaved' schedule needs a multiple of "
                            f"parallel.pp = {pp} micro-batches (at least {pp}); use {fixed}")
    elif v != 1:
        problems.append(f"parallel.pp_virtual = {v}: only the 'interleaved' schedule holds several stages per "
                        f"rank; use 1, or parallel.pp_schedule = 'interleaved'")
    if kind == "pipedream" and m != 1:
        problems.append(f"{m_field} = {m}: the 'pipedream' schedule updates the weights after every micro-batch, "
                        f"so a step has one; make train.micro_batch = train.global_batch / parallel.dp, or use "
                        f"parallel.pp_schedule = 'pipedream-2bw' (one update per step of m micro-batches)")
    if m < 1:
        problems.append(f"{m_field} = {m}: must be >= 1; use {pp} or more to fill the pipeline")
    num_stages = pp * max(v, 1)
    if num_stages > n_layers:
        times_v = f" x parallel.pp_virtual = {v}" if v > 1 else ""
        problems.append(f"parallel.pp = {pp}{times_v} gives {num_stages} stages but {layers_field} = {n_layers}: "
                        f"every stage needs at least one layer; use parallel.pp <= {max(n_layers // max(v, 1), 1)}")
    elif split_points:
        problems += check_split_points(split_points, n_layers, num_stages, layers_field)
    return problems


def even_split_points(n_items: int, num_stages: int) -> list[int]:
    """Split points giving stages of equal count, earlier stages one larger when it does not divide."""
    sizes = [n_items // num_stages + (1 if s < n_items % num_stages else 0) for s in range(num_stages)]
    return [sum(sizes[:s]) for s in range(1, num_stages)]


def balanced_split_points(costs: Sequence[float], num_stages: int,
                          first_extra: float = 0.0, last_extra: float = 0.0) -> list[int]:
    """Split points minimizing the costliest stage (contiguous stages, at least one item each).

    ``first_extra``/``last_extra`` are costs that always sit on the first/last stage (embedding,
    head). Exact dynamic programme over (stage, end item): O(stages x items^2), fine for hundreds
    of layers.
    """
    n = len(costs)
    if not 1 <= num_stages <= n:
        raise ValueError(f"num_stages={num_stages} must be between 1 and the {n} items to split")
    prefix = [0.0]
    for c in costs:
        prefix.append(prefix[-1] + c)

    def stage_cost(begin: int, end: int, stage: int) -> float:
        extra = (first_extra if stage == 0 else 0.0) + (last_extra if stage == num_stages - 1 else 0.0)
        return prefix[end] - prefix[begin] + extra

    inf = float("inf")
    # best[k][j]: smallest possible max stage cost putting items[:j] on stages 0..k; start[k][j]: where stage k begins.
    best = [[inf] * (n + 1) for _ in range(num_stages)]
    start = [[0] * (n + 1) for _ in range(num_stages)]
    for j in range(1, n + 1):
        best[0][j] = stage_cost(0, j, 0)
    for k in range(1, num_stages):
        for j in range(k + 1, n + 1):
            for i in range(k, j):
                value = max(best[k - 1][i], stage_cost(i, j, k))
                if value < best[k][j]:
                    best[k][j], start[k][j] = value, i
    points, end = [], n
    for k in range(num_stages - 1, 0, -1):
        end = start[k][end]
        points.append(end)
    return points[::-1]


def stage_ranges(n_items: int, num_stages: int, split_points: Sequence[int]) -> list[range]:
    bounds = [0, *split_points, n_items]
    return [range(bounds[s], bounds[s + 1]) for s in range(num_stages)]


# ------------------------------------------------------------------ stages

class PipelineStage(nn.Module):
    """One contiguous chunk of a model; ``forward(x, **kwargs)`` takes the previous stage's output
    (the model's input on the first stage) and returns this chunk's output."""

    def __init__(self, index: int, num_stages: int):
        super().__init__()
        self.index, self.num_stages = index, num_stages

    @property
    def is_first(self) -> bool:
        return self.index == 0

    @property
    def is_last(self) -> bool:
        return self.index == self.num_stages - 1

    def blocks(self) -> list[nn.Module]:
        """This chunk's blocks (ZeRO's units, one at a time), in order: its ``layers`` (a ModuleDict,
        as Llama's and the Hugging Face stages keep them); a stage of another shape says its own."""
        layers = getattr(self, "layers", None)
        if not isinstance(layers, nn.ModuleDict):
            raise TypeError(f"{type(self).__name__}.blocks(): the stage has no 'layers' ModuleDict; a PipelineStage "
                            f"of one's own (PipelinePlan.split) must define blocks(), the modules ZeRO gathers "
                            f"and reduces one at a time")
        return list(layers.values())


class LlamaStage(PipelineStage):
    """A chunk of :class:`Llama`: embedding (first stage), blocks ``layer_ids``, norm + head (last)."""

    def __init__(self, model: Llama, index: int, num_stages: int, layer_ids: range):
        super().__init__(index, num_stages)
        self.cfg = model.cfg
        self.tied_names = shared_parameter_names(model)  # alias -> the name a tied copy is initialized as
        if self.is_first:
            self.tok_embeddings = model.tok_embeddings
        # A ModuleDict keyed by the layer index keeps the plain model's parameter names.
        self.layers = nn.ModuleDict({str(i): model.layers[i] for i in layer_ids})
        if self.is_last:
            self.norm, self.output = model.norm, model.output
        self.register_buffer("rope_cos", model.rope_cos, persistent=False)
        self.register_buffer("rope_sin", model.rope_sin, persistent=False)

    def forward(self, x: torch.Tensor, start_pos: int = 0, with_head: bool = True,
                positions: torch.Tensor | None = None, documents: torch.Tensor | None = None) -> torch.Tensor:
        """``x``: tokens on the first stage, hidden states after; ``start_pos``, ``with_head``,
        ``positions`` and ``documents`` as in ``Llama.forward`` (every stage is given its micro-batch's).
        The rotary tables go from ``start_pos`` to the end: attention takes as many positions as its
        queries have, which under Megatron sequence parallelism is more than ``x`` (a sequence shard)."""
        if positions is not None:
            cos, sin = self.rope_cos[positions], self.rope_sin[positions]
        else:
            cos, sin = self.rope_cos[start_pos:], self.rope_sin[start_pos:]
        h = self.tok_embeddings(x) if self.is_first else x
        mask = None if documents is None else documents_mask(self.cfg, documents, h.dtype)  # one for the stage
        for layer in self.layers.values():
            h = layer(h, cos, sin) if mask is None else layer(h, cos, sin, mask)
        if not self.is_last:
            return h
        h = self.norm(h)
        return self.output(h) if with_head else h

    @torch.no_grad()
    def init_buffers(self, device: torch.device | str | None = None) -> None:
        device = self.rope_cos.device if device is None else torch.device(device)
        self.rope_cos, self.rope_sin = rotary_tables_for(self.cfg, device)
        init_router_biases(self, device)

    @torch.no_grad()
    def init_weights(self, seed: int) -> None:
        """The same values as ``Llama.init_weights`` gives these parameters (they depend on the name
        only; the last stage's copy of a tied head takes the embedding's)."""
        self.init_buffers(next(self.parameters()).device)  # the buffers may still be on meta
        for name, param in self.named_parameters():
            param.copy_(init_value(self.tied_names.get(name, name), tuple(param.shape), seed, self.cfg))


class SequentialStage(PipelineStage):
    """A run of an ``nn.Sequential``'s children, registered under their names in the Sequential."""

    def __init__(self, model: nn.Sequential, index: int, num_stages: int, child_ids: range):
        super().__init__(index, num_stages)
        names = list(model._modules)
        for i in child_ids:
            self.add_module(names[i], model._modules[names[i]])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for child in self.children():
            x = child(x)
        return x

    def blocks(self) -> list[nn.Module]:
        """The children holding parameters (parallelize's ZeRO units; it called the base class's,
        which looked for a Llama's ``layers`` and failed on every Sequential)."""
        return [child for child in self.children() if any(True for _ in child.parameters())]


# ------------------------------------------------------------------ splitting

def _param_count(module: nn.Module | None) -> int:
    return 0 if module is None else sum(p.numel() for p in module.parameters())


def _split_points(items: Sequence[nn.Module], num_stages: int, balance: str, split_points: Sequence[int] | None,
                  first_extra: int = 0, last_extra: int = 0) -> list[int]:
    if num_stages > len(items):
        raise ValueError(f"parallel.pp: {num_stages} stages but only {len(items)} layers to split; "
                         f"use at most {len(items)} stages")
    if split_points is not None:
        problems = check_split_points(split_points, len(items), num_stages)
        if problems:
            raise ValueError(problems[0])
        return list(split_points)
    if balance == "layers":
        return even_split_points(len(items), num_stages)
    if balance == "params":
        return balanced_split_points([_param_count(m) for m in items], num_stages, first_extra, last_extra)
    raise ValueError(f"balance = '{balance}': must be one of {', '.join(map(repr, BALANCE_MODES))}")


def split_llama(model: Llama, num_stages: int, balance: str = "layers",
                split_points: Sequence[int] | None = None) -> list[LlamaStage]:
    """All ``num_stages`` stages of ``model`` (sharing its modules); see the module docstring."""
    head = _param_count(model.norm) + _param_count(model.output)
    points = _split_points(list(model.layers), num_stages, balance, split_points,
                           _param_count(model.tok_embeddings), head)
    return [LlamaStage(model, s, num_stages, ids) for s, ids in
            enumerate(stage_ranges(len(model.layers), num_stages, points))]


def split_sequential(model: nn.Sequential, num_stages: int, balance: str = "layers",
                     split_points: Sequence[int] | None = None) -> list[SequentialStage]:
    """All ``num_stages`` stages of a user's ``nn.Sequential``, split over its children."""
    points = _split_points(list(model.children()), num_stages, balance, split_points)
    return [SequentialStage(model, s, num_stages, ids) for s, ids in
            enumerate(stage_ranges(len(model), num_stages, points))]


def split_model(model: nn.Module, num_stages: int, balance: str = "layers",
                split_points: Sequence[int] | None = None) -> list[PipelineStage]:
    """Stages of the reference Llama or of an ``nn.Sequential``."""
    if isinstance(model, Llama):
        return split_llama(model, num_stages, balance, split_points)
    if isinstance(model, nn.Sequential):
        return split_sequential(model, num_stages, balance, split_points)
    raise TypeError(f"cannot split a {type(model).__name__} into pipeline stages; use bigtrain's Llama or "
                    f"an nn.Sequential (split over its children), or give PipelinePlan(split=your_split), "
                    f"(model, stages, balance, split_points) -> a list of PipelineStage")


def stages_for_rank(model: nn.Module, pp: int, pp_rank: int, v: int = 1, balance: str = "layers",
                    split_points: Sequence[int] | None = None, split=None) -> dict[int, PipelineStage]:
    """The stages pipeline rank ``pp_rank`` runs: global stage ``s`` lives on rank ``s % pp``.
    ``split``: the model family's own split (same arguments as :func:`split_model`, its default)."""
    if not 0 <= pp_rank < pp:
        raise ValueError(f"pp_rank={pp_rank} is outside 0..{pp - 1}")
    stages = (split or split_model)(model, pp * v, balance, split_points)
    return {s: stages[s] for s in range(pp_rank, pp * v, pp)}


class StageGroup(nn.Module):
    """The stages of one rank as one module, with the plain model's parameter names, so that a
    single gradient engine (data parallel, ZeRO) and one optimizer can own all of them."""

    def __init__(self, stages: Iterable[PipelineStage]):
        super().__init__()
        for stage in stages:
            for name, child in stage.named_children():
                mine = self._modules.get(name)
                if isinstance(child, nn.ModuleDict):
                    if mine is None:  # a new dict: updating the stage's own would change its forward
                        mine = self._modules[name] = nn.ModuleDict()
                    mine.update(child)  # the blocks of several chunks share the "layers" prefix
                elif mine is None:
                    self.add_module(name, child)
                elif mine is not child:
                    raise ValueError(f"two stages hold different modules named {name!r}")
