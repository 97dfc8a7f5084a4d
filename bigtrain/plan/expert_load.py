"""How many routed rows one rank's experts take: what the planner prices for an MoE layout, and the
most a routing can send there.

A rank routes its own tokens (N a micro-batch: micro_batch x seq / seq_shards); each token's top_k
routings go to the ep rank holding their expert (bigtrain/parallel/experts.py), whose experts run
them and send them back in the combine. The rows a rank's experts take set its experts' saved
activations (their input, SwiGLU products and the permutation to expert order) and what it sends
in the combine and receives in the dispatch (forward and backward). Per token of the rank:

- an even split: top_k (every rank's experts get as many routings as its own tokens made);
- no routing sends a rank's experts more than ep x min(top_k, E / ep): every token of the ep
  group choosing this rank's experts, each expert at most once per token;
- with a capacity factor, an expert keeps at most C = ceil(factor x seq x top_k / E) routings of a
  sequence, and the ep group's ranks hold parts of at most ep x micro_batch sequences: a rank's
  E / ep experts take at most E x C x micro_batch rows, E x C x seq_shards / seq per token
  (factor x top_k, rounded up per expert, for whole sequences).

What is priced (:attr:`ExpertLoad.priced`), as users of the peers expect it:

- **with a capacity factor, the bound**, the smaller of the two: DeepSpeed sizes its dispatch at
  the capacity, as Megatron does with --moe-pad-expert-input-to-capacity. The activations are an
  upper bound whatever the router does (below it when routings are dropped or spread evenly);
- **dropless (factor 0), the even split**, as Megatron's and torchtitan's estimates assume. A
  skewed router can exceed it (an untrained one at initialization: +6% of the activations on the
  busier of 2 ranks, docs/moe.md); the report gives the worst case beside it, what a fully skewed
  router would hold (:attr:`ExpertLoad.worst`), and whether that still fits. A capacity factor is
  what bounds it.

Without expert parallelism the rank's experts take its own routings: top_k a token, fewer with a
capacity factor below 1. Step time prices the even split in both cases (a throughput estimate:
on a skewed step the busiest rank's exchanges and experts take up to ``worst / even`` longer).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from bigtrain.plan.layout import BYTES, Layout
from bigtrain.plan.model import ModelSpec


@dataclass(frozen=True)
class ExpertLoad:
    """Routed rows a rank's experts take per token of the rank, in each MoE block."""

    even: float  # an even split: top_k
    worst: float  # the most any routing sends (the capacity's bound where there is one)
    capacity_factor: float  # 0: dropless
    skewed: bool = False  # ModelSpec.skewed_routing: the worst case priced, dropless too

    @property
    def bounded(self) -> bool:
        """Whether a capacity factor bounds the rows (then the priced figure is that bound)."""
        return self.capacity_factor > 0

    @property
    def priced(self) -> float:
        return self.worst if self.bounded or self.skewed else self.even


def expert_load(model: ModelSpec, ep: int, seq_shards: int = 1) -> ExpertLoad:
    """The routed rows per token of a rank whose tokens are ``seq / seq_shards`` of each sequence
    (Ulysses and cp cut it), its experts cut over ``ep`` (the module docstring)."""
    k, e = model.top_k, model.experts
    most = ep * min(k, e // ep) if ep > 1 else k
    factor = model.capacity_factor
    if factor > 0:
        capacity = math.ceil(factor * model.seq * k / e)  # models/moe.py MoEFeedForward.capacity
        most = min(most, e * capacity * seq_shards / model.seq)
    return ExpertLoad(even=float(k), worst=float(most), capacity_factor=factor, skewed=model.skewed_routing)


def exchange_payload(model: ModelSpec, layout: Layout, rows: float) -> tuple[float, float]:
    """Bytes one rank hands to one MoE block's (dispatch, combine) for one micro-batch, as the comm
    layer counts a payload (its input; (ep-1)/ep of it leaves the rank): its tokens' top_k
    routings out (fewer when a capacity drops some), and back the ``rows`` a token its experts took
    (:func:`expert_load`). The backward runs both again, swapped: the combine's gradient carries
    the dispatch's bytes and the dispatch's the combine's."""
    tokens = layout.micro_batch * model.seq / layout.seq_shards  # a rank routes its own part (Ulysses, cp)
    row = model.hidden * BYTES[layout.precision]
    return tokens * model.top_k * row, tokens * rows * row
