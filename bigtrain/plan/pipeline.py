"""Pipeline terms for the planner: step makespan, bubble and peak in-flight micro-batches.

The numbers come from the schedule simulator (``bigtrain.parallel.pipeline.simulate``), which
builds the real per-rank action lists and times them. Simulating costs O(actions x p), too slow
for thousands of micro-batches on 64 stages inside a layout search, so:

* up to m = 3p micro-batches (and at most ``max_actions`` compute actions) it is simulated as is;
* more micro-batches are simulated at m1 = 2p and m2 = 3p and extrapolated linearly in m (after
  warm-up a schedule repeats with a fixed period; peak in-flight saturates by m = 2p);
* when even that is too big, closed forms are used. With no transfer cost they equal the
  simulator exactly (tests/test_plan.py checks it on a grid):
      naive       m p (f + b)                       peak 1
      gpipe       (m + p - 1)(f + b)                peak m
      1f1b        (m + p - 1)(f + b)                peak min(p - r, m) on rank r
      interleaved m (f + b) + (p - 1)(f + b) / v    peak min(2(p - r - 1) + (v - 1)p + 1, m v)
      zb-h1       m (f + b) + (p - 1)(f + b - w)    peak min(p, m)
                    - (min(m, p) - 1) min(w, b - w, f)
                  (each of the first min(m, p) - 1 micro-batches' W fills a gap no longer than
                  the F and I around it; (p - 1)(f + b - 2w) when m >= p and w <= f, b - w)
      pipedream-2bw, pipedream (no flush; a step in the steady state)
                  m (f + b)                         peak p - r
  (the asynchronous kinds always use their closed form: their simulated lists unroll several steps),
  and a transfer cost c adds 2(p - 1)c (one fill and one drain), a slight underestimate for
  1f1b, whose steady state also waits on transfers.
"""

from __future__ import annotations

from dataclasses import dataclass

from bigtrain.parallel.pipeline import build_schedule, simulate
from bigtrain.parallel.pipeline.schedules import Op
from bigtrain.parallel.pipeline.schedules import ASYNC_KINDS


@dataclass(frozen=True)
class PipelineTerms:
    makespan: float  # seconds from the first forward to the last backward on the slowest rank
    busy: float  # compute seconds of one rank: m (f + b)
    peak_inflight: tuple[int, ...]  # per pipeline rank, stage-chunks of micro-batches held at once
    source: str

    @property
    def bubble(self) -> float:
        return self.makespan - self.busy

    @property
    def bubble_fraction(self) -> float:
        return self.bubble / self.makespan if self.makespan > 0 else 0.0


def closed_form(kind: str, p: int, m: int, v: int, f: float, b: float, w: float = 0.0,
                comm: float = 0.0) -> PipelineTerms:
    """The formulas of the module docstring."""
    busy = m * (f + b)
    fill = 2 * (p - 1) * comm
    if kind == "naive":
        return PipelineTerms(m * p * (f + b) + m * fill, busy, (1,) * p, "closed form")
    if kind in ("gpipe", "1f1b"):
        makespan = (m + p - 1) * (f + b) + fill
        peaks = (m,) * p if kind == "gpipe" else tuple(min(p - r, m) for r in range(p))
        return PipelineTerms(makespan, busy, peaks, "closed form")
    if kind == "interleaved":
        peaks = tuple(min(2 * (p - r - 1) + (v - 1) * p + 1, m * v) for r in range(p))
        return PipelineTerms(busy + (p - 1) * (f + b) / v + fill, busy, peaks, "closed form")
    if kind == "zb-h1":
        bubble = (p - 1) * (f + b - w) - (min(m, p) - 1) * min(w, b - w, f)
        return PipelineTerms(busy + bubble + fill, busy, (min(p, m),) * p, "closed form")
    if kind in ASYNC_KINDS:  # the next step's forwards fill this one's drain: no bubble once steady
        return PipelineTerms(busy, busy, tuple(p - r for r in range(p)), "closed form (steady state)")
    raise ValueError(f"unknown schedule kind {kind!r}")


class PipelineModel:
    """Pipeline terms with a cache, so repeated layouts simulate each schedule shape once.

    ``max_actions = 0`` uses the closed forms only (the layout search does, then re-times its
    best candidates with a simulating model)."""

    def __init__(self, max_actions: int = 3000):
        self.max_actions = max_actions
        self._cache: dict[tuple, tuple[float, tuple[int, ...]]] = {}
        self._held: dict[tuple, tuple] = {}  # (kind, p, m, v) -> per rank, (compute op, chunk) in order

    def _simulate(self, kind: str, p: int, m: int, v: int, f: float, b: float, w: float, comm: float
                  ) -> tuple[float, tuple[int, ...]]:
        """Makespan and peaks (the makespan scales with the costs, so the cache keys on ratios)."""
        key = (kind, p, m, v, round(b / f, 3), round(w / f, 3), round(comm / f, 4))
        if key not in self._cache:
            result = simulate(build_schedule(kind, p, m, v), 1.0, key[4], key[5], key[6])
            self._cache[key] = (result.makespan, tuple(result.peak_inflight))
        makespan, peaks = self._cache[key]
        return makespan * f, peaks

    def terms(self, kind: str, p: int, m: int, v: int, f: float, b: float, w: float = 0.0,
              comm: float = 0.0) -> PipelineTerms:
        """Makespan and peak in-flight of ``m`` micro-batches on ``p`` ranks, F costing ``f``
        and B ``b`` seconds per micro-batch on one rank (all its ``v`` chunks together)."""
        busy = m * (f + b)
        if p == 1:  # no pipeline: the runtime runs each micro-batch's forward and backward in turn
            return PipelineTerms(busy, busy, (1,), "no pipeline")
        if f <= 0 or self.max_actions <= 0 or kind in ASYNC_KINDS:
            return closed_form(kind, p, m, v, f, b, w, comm)
        m1, m2 = 2 * p, 3 * p
        if m <= m2 and 2 * p * m * v <= self.max_actions:
            makespan, peaks = self._simulate(kind, p, m, v, f, b, w, comm)
            return PipelineTerms(makespan, busy, peaks, "simulator")
        if m > m2 and 2 * p * m2 * v <= self.max_actions:
            t1, _ = self._simulate(kind, p, m1, v, f, b, w, comm)
            t2, peaks = self._simulate(kind, p, m2, v, f, b, w, comm)
            makespan = t2 + (m - m2) * (t2 - t1) / (m2 - m1)
            if kind == "gpipe":  # gpipe holds every micro-batch: its peak grows with m
                peaks = (m,) * p
            return PipelineTerms(makespan, busy, peaks, f"simulator at m={m1},{m2}, extrapolated to {m}")
        return closed_form(kind, p, m, v, f, b, w, comm)

    def peak_held_bytes(self, kind: str, p: int, m: int, v: int, rank: int, chunk_bytes: tuple[float, ...],
                        deferred_bytes: tuple[float, ...] = ()) -> float | None:
        """The most bytes of saved activations pipeline rank ``rank`` holds at once, its chunk ``j``
        (stage ``rank + j p``) holding ``chunk_bytes[j]`` a micro-batch, walked in the schedule's
        order as :func:`~bigtrain.parallel.pipeline.peak_inflight` counts (held from F to B, or W).
        Chunks differ under interleaving: the last stage's carries the loss's logits, and it holds
        one micro-batch where the rank's other chunks hold several. ``deferred_bytes[j]``: what the
        split backward's W keeps of a micro-batch from its I on besides (plan/deferred_grads.py).
        None where the schedule is not simulated (the caller bounds it by the count times the
        largest chunk)."""
        if p == 1 or self.max_actions <= 0 or kind in ASYNC_KINDS:
            return None
        if m > 3 * p:  # the peak saturates by m = 2p; gpipe's grows with m (all of each chunk held)
            if kind == "gpipe":
                return m * sum(chunk_bytes)
            m = 3 * p
        if 2 * p * m * v > self.max_actions:
            return None
        key = (kind, p, m, v)
        if key not in self._held:
            schedule = build_schedule(kind, p, m, v)
            self._held[key] = tuple(tuple((a.kind, a.stage // p) for a in schedule.compute_actions(r))
                                    for r in range(p))
        held = peak = 0.0
        for op, chunk in self._held[key][rank]:
            deferred = deferred_bytes[chunk] if deferred_bytes else 0.0
            if op is Op.FORWARD:
                held += chunk_bytes[chunk]
            elif op is Op.BACKWARD_INPUT:
                held += deferred
            elif op is Op.BACKWARD_WEIGHT:
                held -= chunk_bytes[chunk] + deferred
            elif op is Op.BACKWARD:
                held -= chunk_bytes[chunk]
            peak = max(peak, held)
        return peak


def weight_versions(kind: str, p: int, rank: int, vertical_sync: bool = False) -> int:
    """Copies of its stage's weights pipeline rank ``rank`` keeps for micro-batches in flight, besides
    the live parameters (:mod:`bigtrain.parallel.pipeline.versions`): 2 for 2BW (the step finishing
    and the next one's early forwards), one per micro-batch in flight for PipeDream (p - rank; p on
    every rank with vertical sync, which keeps the first stage's versions), none for a flush."""
    if kind == "pipedream-2bw":
        return 2
    if kind == "pipedream":
        return p if vertical_sync else p - rank
    return 0
