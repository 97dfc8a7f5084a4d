"""bigtrain's pipeline executor vs torch.distributed.pipelining: step time on the same ranks, in one run.

For every pipeline size in ``--ranks``, schedule in ``--schedules`` and micro-batch count in
``--microbatches``, both implementations run in the same forked Gloo ranks (one thread each), over
the same pp process group, on two copies of the same stages of the bigtrain Llama (fp32, CPU, same
init, same split, same placement), fed the same tokens: ours is ``PipelineExecutor`` on
``build_schedule(kind, p, m, v)``; the peer is ``torch.distributed.pipelining.PipelineStage``
driven by the torch schedule of the same kind (``scale_grads=False`` and the same loss, the summed
token loss over the global token count, so both sum gradients over micro-batches;
``return_outputs=False``, since ours does not gather the logits either):

  gpipe        ours "gpipe"                vs ``ScheduleGPipe``                 (v = 1 stage per rank)
  1f1b         ours "1f1b"                 vs ``Schedule1F1B``                  (v = 1)
  interleaved  ours "interleaved", v = 2   vs ``ScheduleInterleaved1F1B``       (v = 2; stage s on rank
                                                                                 s % p on both sides)
  zb-h1        ours "zb-h1"                vs ``ScheduleInterleavedZeroBubble`` (v = 1; torch's ZB1P
               (1F1B, backward split into     with one stage per rank is ZB-H1: each rank r delays
               I and W)                       r weight-gradient passes into the cool-down)

Both zero-bubble sides split the backward into an input-gradient pass (I) and a weight-gradient
pass (W) that starts from the gradients I kept at each weight's matmul (torch's
``stage_backward_weight``; ours since the executor's W stopped walking the input-gradient part
again), so zb-h1 measures how each implements that split. To refresh only those rows:
``python benchmarks/bench_pipeline.py --schedules zb-h1`` (or ``benchmarks/run_all.sh runs/bench zb-h1``).

A timed step is one pipeline step (every micro-batch's forward and backward, with the transfers)
plus dropping the gradients, measured on every rank after a barrier; a step's time is the slowest
rank's. Before any timing, one step of each from the same weights must agree: the loss and every
parameter gradient within ``--rtol`` (relative, per tensor), or the benchmark aborts. Drift (other
processes, thermal) is cancelled by alternating the two, A B B A ..., after ``--warmup`` untimed
steps of each (they include both sides' one-off shape exchange). The report gives the median step
time of each, the ratio ours/torch of the medians and the median of the per-pair ratios.

    python benchmarks/bench_pipeline.py --ranks 2,4 --microbatches 4,8 --steps 20 --json out.json
    python benchmarks/bench_pipeline.py --schedules zb-h1 --steps 20 --json zb.json   # one schedule
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time

import torch
import torch.distributed as dist
from torch.distributed.pipelining import PipelineStage as TorchStage
from torch.distributed.pipelining import (Schedule1F1B, ScheduleGPipe, ScheduleInterleaved1F1B,
                                          ScheduleInterleavedZeroBubble)
from torch.distributed.pipelining.schedules import PipelineScheduleSingle

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # the sibling benchmarks, run from anywhere
from common import checkout  # noqa: E402  (before bigtrain: this checkout's, not an installed one)

from bigtrain.config import ModelConfig
from bigtrain.distributed.mesh import Mesh
from bigtrain.models.llama import build_model, count_parameters
from bigtrain.parallel.pipeline import PipelineExecutor, build_schedule, stages_for_rank
from bigtrain.testing import run_ranks
from bigtrain.parallel.build import token_loss_sum

OURS, PEER = "bigtrain PipelineExecutor", "torch.distributed.pipelining"
# kind -> (torch's schedule class, stages per rank v); v = 1 classes derived from PipelineScheduleSingle
# take one stage, the others (PipelineScheduleMulti) a list of this rank's stages.
TORCH_SCHEDULES = {"gpipe": (ScheduleGPipe, 1), "1f1b": (Schedule1F1B, 1),
                   "interleaved": (ScheduleInterleaved1F1B, 2), "zb-h1": (ScheduleInterleavedZeroBubble, 1)}


class VerificationError(RuntimeError):
    pass


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--ranks", default="2,4", help="pipeline sizes, comma-separated (Gloo ranks, one thread each)")
    p.add_argument("--microbatches", default="4,8", help="micro-batches per step, comma-separated")
    p.add_argument("--schedules", default=",".join(TORCH_SCHEDULES),
                   help=f"comma-separated, of {', '.join(TORCH_SCHEDULES)}")
    p.add_argument("--steps", type=int, default=12, help="timed steps of each implementation")
    p.add_argument("--warmup", type=int, default=3, help="untimed steps of each (the first is the check)")
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--dim", type=int, default=256)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--vocab", type=int, default=256)
    p.add_argument("--seq", type=int, default=128)
    p.add_argument("--batch", type=int, default=8, help="sequences per step (split into the micro-batches)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--rtol", type=float, default=1e-5, help="relative tolerance of the equivalence check")
    p.add_argument("--timeout", type=float, default=1800.0, help="seconds before the ranks are killed")
    p.add_argument("--json", metavar="PATH", help="also write the numbers here")
    args = p.parse_args(argv)
    args.ranks = [int(r) for r in args.ranks.split(",")]
    args.microbatches = [int(m) for m in args.microbatches.split(",")]
    args.schedules = args.schedules.split(",")
    if set(args.schedules) - set(TORCH_SCHEDULES):
        p.error(f"--schedules from {', '.join(TORCH_SCHEDULES)}")
    stages = {r * TORCH_SCHEDULES[k][1] for r in args.ranks for k in args.schedules}
    if min(args.ranks) < 2 or any(args.layers % n for n in stages):
        p.error(f"every --ranks value must be >= 2, and --layers divisible by every stage count ({sorted(stages)}: "
                "ranks x stages per rank)")
    if any(args.batch % m for m in args.microbatches):
        p.error("every --microbatches value must divide --batch")
    if "interleaved" in args.schedules and any(m % r for r in args.ranks for m in args.microbatches):
        p.error("interleaved needs every --microbatches value to be a multiple of every --ranks value")
    if args.steps < 1 or args.warmup < 1:
        p.error("--steps and --warmup must be at least 1")
    return args


# -- inside each rank -------------------------------------------------------------------------------

def _batch(args, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The step's global batch: the same tokens on every rank and for both implementations."""
    gen = torch.Generator().manual_seed(args.seed * 1_000_003 + step)
    tokens = torch.randint(0, args.vocab, (args.batch, args.seq + 1), generator=gen)
    return tokens[:, :-1], tokens[:, 1:]


def _stages(args, mesh: Mesh, v: int) -> dict:
    """This rank's stages (global index -> module), stage s on rank s % p, as torch places them."""
    cfg = ModelConfig(vocab_size=args.vocab, dim=args.dim, n_layers=args.layers, n_heads=args.heads,
                      max_seq_len=args.seq)
    stages = stages_for_rank(build_model(cfg), mesh.size("pp"), mesh.rank, v=v)
    for stage in stages.values():
        stage.to_empty(device="cpu")
        stage.init_weights(args.seed)
    return stages


class Runner:
    """One implementation on one rank: its copy of the rank's stages and its schedule."""

    def __init__(self, name: str, args, mesh: Mesh, kind: str, m: int):
        self.name, self.args, self.mesh, self.m = name, args, mesh, m
        p = mesh.size("pp")
        schedule_class, v = TORCH_SCHEDULES[kind]
        stages = _stages(args, mesh, v)
        self.modules = {s: stages[s] for s in sorted(stages)}
        tokens = args.batch * args.seq

        def loss_fn(logits, targets):
            return token_loss_sum(logits, targets) / tokens  # global token count: grads summed over micro-batches

        if name == OURS:
            self.plan = build_schedule(kind, p, m, v)
            self.executor = PipelineExecutor(stages, self.plan, mesh.comm("pp"), loss_fn)
        else:
            torch_stages = [TorchStage(module, s, p * v, torch.device("cpu"), group=mesh.groups["pp"])
                            for s, module in self.modules.items()]
            single = issubclass(schedule_class, PipelineScheduleSingle)
            self.schedule = schedule_class(torch_stages[0] if single else torch_stages, m, loss_fn=loss_fn,
                                           scale_grads=False)
        self.times: list[float] = []
        self.cpu_times: list[float] = []

    def _run(self, inputs: torch.Tensor, targets: torch.Tensor) -> float | None:
        if self.name == OURS:
            loss = self.executor.run(list(zip(inputs.chunk(self.m), targets.chunk(self.m))))
            return None if loss is None else float(loss)
        rank, last = self.mesh.rank, self.mesh.size("pp") - 1
        if rank == 0:
            self.schedule.step(inputs, return_outputs=False)
        elif rank == last:
            losses: list[torch.Tensor] = []
            self.schedule.step(target=targets, losses=losses, return_outputs=False)
            return float(torch.stack([loss.detach() for loss in losses]).sum())
        else:
            self.schedule.step(return_outputs=False)
        return None

    def step(self, step: int, record: bool) -> float | None:
        inputs, targets = _batch(self.args, step)
        dist.barrier(group=self.mesh.groups["pp"])  # every rank starts together; not timed
        cpu_start, start = time.process_time(), time.perf_counter()
        loss = self._run(inputs, targets)
        self._drop_grads()
        if record:
            self.times.append(time.perf_counter() - start)
            self.cpu_times.append(time.process_time() - cpu_start)  # less sensitive to other load
        return loss

    def _drop_grads(self) -> None:
        for module in self.modules.values():
            for p in module.parameters():
                p.grad = None

    def grads_after_first_step(self) -> tuple[float | None, dict[str, torch.Tensor]]:
        loss = self._run(*_batch(self.args, 0))
        grads = {f"stage{s}.{n}": p.grad.detach().clone()
                 for s, module in self.modules.items() for n, p in module.named_parameters()}
        self._drop_grads()
        return loss, grads


def _relative_error(a: torch.Tensor, b: torch.Tensor) -> float:
    scale = b.double().norm().item()
    diff = (a.double() - b.double()).norm().item()
    return diff / scale if scale > 0 else diff


def _compute_order(runner: Runner) -> list[tuple[int, str, int]] | None:
    """This rank's compute actions in order, as (stage, F/B/I/W, micro-batch); None for torch's
    single-stage schedules (GPipe, 1F1B), whose ``step`` runs a loop of its own: their
    ``pipeline_order`` only describes it (and in torch 2.13 describes 1F1B's last rank wrongly,
    from F1 to F4 at m = 4), while the multi-stage ones execute theirs."""
    rank = runner.mesh.rank
    if runner.name == OURS:
        return [(a.stage, a.kind.value, a.microbatch) for a in runner.plan.compute_actions(rank)]
    if isinstance(runner.schedule, PipelineScheduleSingle):
        return None
    order = runner.schedule.pipeline_order
    return [(a.stage_index, a.computation_type.value, a.microbatch_index) for a in order[rank]
            if a is not None and a.computation_type.value in ("F", "B", "I", "W")]


def _verify(ours: Runner, peer: Runner, args) -> dict:
    loss_ours, grads_ours = ours.grads_after_first_step()
    loss_peer, grads_peer = peer.grads_after_first_step()
    worst = max(((_relative_error(g, grads_peer[n]), n) for n, g in grads_ours.items()), default=(0.0, ""))
    loss_err = None if loss_ours is None else abs(loss_ours - loss_peer) / abs(loss_peer)
    peer_order = _compute_order(peer)
    same_order = None if peer_order is None else peer_order == _compute_order(ours)
    report = {"max_grad_rel_err": worst[0], "worst_grad": worst[1], "loss_rel_err": loss_err, "loss": loss_ours,
              "same_compute_order": same_order}
    if worst[0] > args.rtol or (loss_err is not None and loss_err > args.rtol):
        raise VerificationError(f"rank {ours.mesh.rank}: {OURS} and {PEER} disagree after one step: {report}")
    return report


def _compare(args, mesh: Mesh, kind: str, m: int) -> dict:
    ours, peer = Runner(OURS, args, mesh, kind, m), Runner(PEER, args, mesh, kind, m)
    check = _verify(ours, peer, args)
    for step in range(1, args.warmup):
        ours.step(step, record=False)
        peer.step(step, record=False)
    for i in range(args.steps):  # A B B A A B B A ...
        for runner in ((ours, peer) if i % 2 == 0 else (peer, ours)):
            runner.step(args.warmup + i, record=True)
    return {"check": check, "times": {OURS: ours.times, PEER: peer.times},
            "cpu_times": {OURS: ours.cpu_times, PEER: peer.cpu_times},
            "params": sum(count_parameters(module) for module in ours.modules.values())}


def _rank_main(rank: int, world_size: int, args) -> dict:
    mesh = Mesh({"pp": world_size}, rank)
    return {f"{kind} m={m}": _compare(args, mesh, kind, m) for kind in args.schedules for m in args.microbatches}


# -- in the parent ----------------------------------------------------------------------------------

def summarize(args, p: int, results: list[dict]) -> list[dict]:
    rows = []
    for case in results[0]:
        kind, m = case.split(" m=")
        slowest = {name: [max(r[case]["times"][name][i] for r in results) for i in range(args.steps)]
                   for name in (OURS, PEER)}
        ours, peer = statistics.median(slowest[OURS]), statistics.median(slowest[PEER])
        # CPU time of the busiest rank (its Gloo threads included): what the step costs without the waiting.
        cpu = {name: statistics.median(max(r[case]["cpu_times"][name][i] for r in results) for i in range(args.steps))
               for name in (OURS, PEER)}
        checks = [r[case]["check"] for r in results]
        rows.append({
            "ranks": p, "schedule": kind, "microbatches": int(m), "ours_median_s": ours, "torch_median_s": peer,
            "ratio_ours_over_torch": ours / peer,
            "paired_ratio_median": statistics.median(a / b for a, b in zip(slowest[OURS], slowest[PEER])),
            "ours_cpu_median_s": cpu[OURS], "torch_cpu_median_s": cpu[PEER],
            "cpu_ratio_ours_over_torch": cpu[OURS] / cpu[PEER],
            "step_times_s": slowest, "loss": checks[-1]["loss"],
            "max_grad_rel_err": max(c["max_grad_rel_err"] for c in checks),
            "loss_rel_err": checks[-1]["loss_rel_err"],
            "params_per_rank": [r[case]["params"] for r in results],
            # True: torch runs the same F/B/I/W actions in the same order on every rank as ours.
            "same_compute_order": (None if any(c["same_compute_order"] is None for c in checks)
                                   else all(c["same_compute_order"] for c in checks)),
        })
    return rows


def print_report(args, rows: list[dict], machine: dict) -> None:
    print(f"pipeline parallel, Gloo ranks x 1 thread on {machine['cpus']} CPUs, torch {machine['torch']}; "
          f"Llama {args.layers} layers d{args.dim} (fp32), seq {args.seq}, {args.batch} sequences per step; "
          f"{args.steps} timed steps each after {args.warmup} warm-up, alternated; step = slowest rank")
    header = (f"{'ranks':>5} {'schedule':>11} {'m':>3} | {'ours ms':>8} {'torch ms':>8} {'ours/torch':>10} "
              f"{'paired':>6} | {'cpu ratio':>9} | {'grad err':>8} {'loss err':>8} {'same order':>10}")
    print(header)
    print("-" * len(header))
    for r in rows:
        print(f"{r['ranks']:5d} {r['schedule']:>11} {r['microbatches']:3d} | {r['ours_median_s'] * 1e3:8.1f} "
              f"{r['torch_median_s'] * 1e3:8.1f} {r['ratio_ours_over_torch']:10.2f} {r['paired_ratio_median']:6.2f} | "
              f"{r['cpu_ratio_ours_over_torch']:9.2f} | "
              f"{r['max_grad_rel_err']:8.1e} {r['loss_rel_err']:8.1e} "
              f"{ {True: 'yes', False: 'no', None: 'n/a'}[r['same_compute_order']]:>10}")
    load = machine["loadavg_1min_before_after"]
    print(f"(paired: median of per-step ratios; cpu ratio: of the median CPU seconds of the busiest rank; "
          f"errors: after one step from the same weights, tolerance {args.rtol:g}; same order: torch's "
          f"schedule runs the same compute actions in the same order on every rank; 1-min load average "
          f"{load[0]:.1f} before, {load[1]:.1f} after)")


def main(argv=None) -> int:
    args = parse_args(argv)
    torch.set_num_threads(1)  # the parent stays idle; each forked rank runs one thread
    build_model(ModelConfig(n_layers=1))  # load the meta kernels once, before forking
    machine = {"cpus": os.cpu_count(), "torch": torch.__version__, "python": platform.python_version(),
               "platform": platform.platform(), "threads_per_rank": 1, "backend": "gloo"}
    load_before, start, rows = os.getloadavg(), time.perf_counter(), []
    try:
        for p in args.ranks:
            rows += summarize(args, p, run_ranks(_rank_main, p, args, timeout=args.timeout))
    except Exception as exc:  # noqa: BLE001 - a rank's traceback, a verification failure, a timeout
        print(f"benchmark failed: {exc}", file=sys.stderr)
        return 1
    machine["loadavg_1min_before_after"] = [load_before[0], os.getloadavg()[0]]
    machine["checkout"] = code = checkout()
    print(f"bigtrain from {code['bigtrain']} at {code['commit']}{' (modified)' if code['dirty'] else ''}")
    print_report(args, rows, machine)
    if args.json:
        os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
        with open(args.json, "w") as f:
            json.dump({"config": {k: v for k, v in vars(args).items() if k not in ("json", "timeout")},
                       "machine": machine, "wall_s": time.perf_counter() - start, "rows": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
