"""bigtrain DataParallel vs torch DistributedDataParallel: step time on the same ranks, in one run.

Both data-parallel wrappers live in the same Gloo ranks (forked by ``bigtrain.testing.run_ranks``,
one thread per rank), over the same process group, on two copies of the same bigtrain Llama (fp32,
CPU, same init), fed the same tokens, with the same bucket size and the same AdamW. A timed step is
forward + backward + gradient sync + AdamW step + zeroing the grads, over every micro-batch of the
step, measured on every rank after an (untimed) barrier; a step's time is the slowest rank's.

DDP is configured the way bigtrain works (``gradient_as_bucket_view=True``; no per-forward buffer
broadcast, since the only buffers are the rotary tables, which are constants) and with
``bucket_cap_mb=--bucket-mb``; ``--ddp-defaults`` runs it out of the box instead. Both then put the
default 4.95 M-parameter model (18.9 MiB of fp32 gradients) in a single 25 MB bucket.

Conventions. bigtrain sums gradients over ranks and normalizes the loss by the *global* token count;
DDP averages gradients over ranks, so its loss is normalized by the *local* token count (the mean
over this rank's tokens). Both then compute the gradient of the global mean loss. Before any timing
the benchmark runs one step of each and exits with an error unless the synchronized gradients and
the updated parameters agree within ``--rtol`` (1e-5, relative, per tensor). Gradients are compared
because AdamW's first step is nearly scale-free and would hide a factor-of-N mistake in the
parameters; parameter entries whose gradient is fp32 rounding noise are left out of the parameter
comparison (and counted), see ``_verify``.

Drift and other processes' load are cancelled by alternating the two, A B B A A B B A ..., after
``--warmup`` untimed steps of each. The report gives the median step time of each, a per-phase
breakdown, the CPU time per step, the bytes all-reduced per step, and the ratio ours/DDP: the median
over the adjacent pairs of steps of (our step / DDP's step), which is far steadier on a shared
machine than the ratio of the two medians (also printed).

    python benchmarks/bench_data_parallel.py --ranks 2 --steps 20 --warmup 5 --json out.json
"""

from __future__ import annotations

import argparse
import inspect
import os
import platform
import statistics
import sys
import time
from contextlib import nullcontext

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # the sibling benchmarks, run from anywhere
from common import run_and_report  # noqa: E402  (before bigtrain: this checkout's, not an installed one)

from bigtrain.config import ModelConfig, OptimConfig
from bigtrain.distributed.mesh import Mesh
from bigtrain.models.llama import build_model, count_parameters
from bigtrain.optim import build_adamw
from bigtrain.parallel.data import DataParallel
from bigtrain.parallel.build import token_loss_sum


OURS, PEER = "bigtrain DataParallel", "torch DDP"
NOISE_FLOOR = 1e-6  # |grad| below this fraction of the tensor's largest |grad| is fp32 rounding noise
PHASES = ("forward", "backward", "sync", "optimizer", "zero_grad")


# torch >= 2.13 renamed DDP's broadcast_buffers (per-forward buffer sync) to forward_sync_buffers.
_SYNC_BUFFERS = ("forward_sync_buffers" if "forward_sync_buffers" in inspect.signature(DDP.__init__).parameters
                 else "broadcast_buffers")


class VerificationError(RuntimeError):
    pass


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--ranks", type=int, default=2, help="Gloo ranks (forked, one thread each)")
    p.add_argument("--steps", type=int, default=20, help="timed steps of each implementation")
    p.add_argument("--warmup", type=int, default=5, help="untimed steps of each (the first is the check)")
    p.add_argument("--layers", type=int, default=6)
    p.add_argument("--dim", type=int, default=256)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--vocab", type=int, default=256)
    p.add_argument("--seq", type=int, default=128)
    p.add_argument("--micro-batch", type=int, default=8, help="sequences per rank per micro-batch")
    p.add_argument("--accum", type=int, default=1, help="micro-batches per step (no_sync on all but the last)")
    p.add_argument("--bucket-mb", type=float, default=25.0, help="bucket size of both (DDP: bucket_cap_mb)")
    p.add_argument("--ddp-defaults", action="store_true",
                   help="DDP out of the box (gradient_as_bucket_view=False: grads copied into and out of the "
                        "buckets; broadcast_buffers=True: the rotary tables broadcast every forward); default: "
                        "configured like bigtrain (grads are bucket views, buffers not synchronized)")
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--rtol", type=float, default=1e-5, help="relative tolerance of the equivalence check")
    p.add_argument("--timeout", type=float, default=900.0, help="seconds before the ranks are killed")
    p.add_argument("--json", metavar="PATH", help="also write the numbers here")
    args = p.parse_args(argv)
    if args.ranks < 2:
        p.error("--ranks must be at least 2 (with one rank there is nothing to synchronize)")
    if args.steps < 1 or args.warmup < 1 or args.accum < 1:
        p.error("--steps, --warmup and --accum must be at least 1")
    return args


# -- inside each rank -------------------------------------------------------------------------------

def _batch(args, step: int, rank: int, micro: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Deterministic random tokens for (step, rank, micro-batch): the same for both implementations."""
    gen = torch.Generator().manual_seed(((args.seed * 1_000_003 + step) * 1009 + rank) * 101 + micro)
    tokens = torch.randint(0, args.vocab, (args.micro_batch, args.seq + 1), generator=gen)
    return tokens[:, :-1], tokens[:, 1:]


def _relative_error(a: torch.Tensor, b: torch.Tensor) -> float:
    scale = b.double().norm().item()
    diff = (a.double() - b.double()).norm().item()
    return diff / scale if scale > 0 else diff


class Runner:
    """One implementation on one rank: a model, its data-parallel wrapper, its optimizer, its step."""

    def __init__(self, name: str, args, mesh: Mesh, model_cfg: ModelConfig, optim_cfg: OptimConfig):
        self.name, self.args, self.mesh = name, args, mesh
        self.model = build_model(model_cfg)
        self.model.to_empty(device="cpu")
        self.model.init_weights(args.seed)
        local_tokens = args.accum * args.micro_batch * args.seq
        if name == OURS:
            self.comm = mesh.comm("dp")
            self.dp = DataParallel(self.model, self.comm, args.bucket_mb)
            self.forward = self.model
            self.loss_scale = 1.0 / (local_tokens * mesh.size("dp"))  # global token count: grads summed
            self.no_sync = self.dp.no_sync
        else:
            options = {} if args.ddp_defaults else {"gradient_as_bucket_view": True, _SYNC_BUFFERS: False}
            self.dp = DDP(self.model, process_group=mesh.groups["dp"], bucket_cap_mb=args.bucket_mb, **options)
            self.forward = self.dp
            self.loss_scale = 1.0 / local_tokens  # local mean: DDP averages the grads over ranks
            self.no_sync = self.dp.no_sync
        self.optimizer = build_adamw(self.model, optim_cfg, args.lr)
        self.times: list[float] = []
        self.cpu_times: list[float] = []
        self.phases: dict[str, list[float]] = {k: [] for k in PHASES}

    def step(self, step: int, record: bool, before_optimizer=None) -> float:
        """One optimizer step; returns the loss (global mean, from this rank's share)."""
        args, rank = self.args, self.mesh.rank
        batches = [_batch(args, step, rank, i) for i in range(args.accum)]
        dist.barrier()  # every rank starts the step together; not timed
        clock = time.perf_counter
        spent = dict.fromkeys(PHASES, 0.0)
        loss_total = 0.0
        cpu_start = time.process_time()  # this rank's CPU time, its Gloo threads included
        start = clock()
        for i, (tokens, targets) in enumerate(batches):
            context = self.no_sync() if i < args.accum - 1 else nullcontext()
            with context:
                t0 = clock()
                loss = token_loss_sum(self.forward(tokens), targets) * self.loss_scale
                t1 = clock()
                loss.backward()  # DDP waits for its all-reduces at the end of the last backward
                t2 = clock()
            spent["forward"] += t1 - t0
            spent["backward"] += t2 - t1
            loss_total += loss.item()
        t0 = clock()
        if self.name == OURS:
            self.dp.finish_grad_sync()
        t1 = clock()
        spent["sync"] += t1 - t0
        if before_optimizer is not None:  # the equivalence check; never in a timed step
            before_optimizer(self)
            t1 = clock()
        self.optimizer.step()
        t2 = clock()
        if self.name == OURS:
            self.dp.zero_grad()
        else:
            self.optimizer.zero_grad(set_to_none=True)
        end = clock()
        cpu = time.process_time() - cpu_start
        spent["optimizer"] += t2 - t1
        spent["zero_grad"] += end - t2
        if record:
            self.times.append(end - start)
            self.cpu_times.append(cpu)
            for k, v in spent.items():
                self.phases[k].append(v)
        return loss_total

    def _ddp_bucket_sizes(self) -> list[int]:
        """DDP's bucket sizes in bytes, as rebuilt in gradient-ready order after the first iteration."""
        try:
            data = self.dp._get_ddp_logging_data()  # private; absent or different in other releases
        except Exception:  # noqa: BLE001 - fall back to the parameter bytes
            return []
        sizes = str(data.get("rebuilt_bucket_sizes") or data.get("bucket_sizes", ""))
        return [int(s) for s in sizes.split(",") if s.strip()]

    def grad_bytes_per_step(self) -> int:
        """Payload bytes all-reduced per step (one sync per step, whatever --accum)."""
        if self.name == OURS:
            return self.dp.grad_bytes()
        return sum(self._ddp_bucket_sizes()) or sum(
            p.numel() * p.element_size() for p in self.model.parameters() if p.requires_grad)

    def num_buckets(self) -> int:
        return len(self.dp.buckets) if self.name == OURS else len(self._ddp_bucket_sizes())


def _verify(ours: Runner, peer: Runner, args) -> dict:
    """Step 0 of both from the same init on the same data: gradients, losses and parameters must agree."""
    grads: dict[str, torch.Tensor] = {}

    def keep_grads(runner: Runner) -> None:
        grads[runner.name] = {n: p.grad.detach().clone() for n, p in runner.model.named_parameters()}

    loss_ours = ours.step(0, record=False, before_optimizer=keep_grads)
    loss_peer = peer.step(0, record=False, before_optimizer=keep_grads)
    worst = {"grad": (0.0, ""), "param": (0.0, ""), "param_raw": (0.0, "")}
    unresolved = 0
    params_peer = dict(peer.model.named_parameters())
    for name, p in ours.model.named_parameters():
        g_ours, g_peer = grads[OURS][name], grads[PEER][name]
        a, b = p.detach(), params_peer[name].detach()
        # AdamW's first update is lr * g / (|g| + eps), about lr * sign(g): for an entry whose gradient
        # is below fp32 resolution (a cancellation, so its value is rounding noise), a 1-ulp change in
        # a partial sum moves that parameter by up to 2 lr. With a power-of-two rank count both sides
        # round identically; otherwise DDP's division by N and our loss scaling round differently, so
        # such entries are left out of the parameter comparison (and counted).
        resolved = (g_peer.abs() > NOISE_FLOOR * g_peer.abs().max()) | ((g_peer == 0) & (g_ours == 0))
        unresolved += int((~resolved).sum())
        for kind, err in (("grad", _relative_error(g_ours, g_peer)),
                          ("param", _relative_error(torch.where(resolved, a, b), b)),
                          ("param_raw", _relative_error(a, b))):
            if err > worst[kind][0]:
                worst[kind] = (err, name)
    # The loss each computed for this rank's share, in its own convention.
    loss_err = abs(loss_ours * args.ranks - loss_peer) / abs(loss_peer)
    report = {"max_grad_rel_err": worst["grad"][0], "worst_grad": worst["grad"][1],
              "max_param_rel_err": worst["param"][0], "worst_param": worst["param"][1],
              "max_param_rel_err_all_entries": worst["param_raw"][0], "worst_param_all_entries": worst["param_raw"][1],
              "unresolved_grad_entries": unresolved, "loss_rel_err": loss_err}
    if worst["grad"][0] > args.rtol or worst["param"][0] > args.rtol or loss_err > args.rtol:
        raise VerificationError(f"{OURS} and {PEER} disagree after the first step: {report}")
    return report


def _rank_main(rank: int, world_size: int, args) -> dict:
    mesh = Mesh({"dp": world_size}, rank)
    model_cfg = ModelConfig(vocab_size=args.vocab, dim=args.dim, n_layers=args.layers, n_heads=args.heads,
                            max_seq_len=args.seq)
    optim_cfg = OptimConfig(lr=args.lr)
    ours = Runner(OURS, args, mesh, model_cfg, optim_cfg)
    peer = Runner(PEER, args, mesh, model_cfg, optim_cfg)
    check = _verify(ours, peer, args)

    before = mesh.stats.snapshot()
    for step in range(1, args.warmup):
        ours.step(step, record=False)
        peer.step(step, record=False)
    ours_stats = mesh.stats.since(before)
    steps_ours = max(args.warmup - 1, 1)
    for i in range(args.steps):  # A B B A A B B A ...
        step = args.warmup + i
        order = (ours, peer) if i % 2 == 0 else (peer, ours)
        for runner in order:
            runner.step(step, record=True)
    grads_payload = ours_stats.payload.get(("dp", "all_reduce:grads"), 0)
    return {
        "rank": rank,
        "params": count_parameters(ours.model),
        "check": check,
        "times": {r.name: r.times for r in (ours, peer)},
        "cpu_times": {r.name: r.cpu_times for r in (ours, peer)},
        "phases": {r.name: r.phases for r in (ours, peer)},
        "bytes": {OURS: grads_payload // steps_ours if args.warmup > 1 else ours.grad_bytes_per_step(),
                  PEER: peer.grad_bytes_per_step()},
        "buckets": {OURS: ours.num_buckets(), PEER: peer.num_buckets()},
        "calls": {OURS: ours_stats.calls.get(("dp", "all_reduce:grads"), 0) // steps_ours, PEER: peer.num_buckets()},
    }


# -- in the parent ----------------------------------------------------------------------------------

def summarize(args, results: list[dict], wall_s: float) -> dict:
    n = args.ranks
    ring = 2 * (n - 1) / n
    out = {"config": {k: v for k, v in vars(args).items() if k not in ("json", "timeout")},
           "machine": {"cpus": os.cpu_count(), "torch": torch.__version__, "python": platform.python_version(),
                       "platform": platform.platform(), "threads_per_rank": 1, "backend": "gloo"},
           "params": results[0]["params"], "check": results[0]["check"], "wall_s": wall_s, "impl": {}}
    slowest = {}
    for name in (OURS, PEER):
        per_step = [max(r["times"][name][i] for r in results) for i in range(args.steps)]
        slowest[name] = per_step
        phases = {k: statistics.median(statistics.mean(r["phases"][name][k][i] for r in results)
                                       for i in range(args.steps)) for k in PHASES}
        payload = results[0]["bytes"][name]
        out["impl"][name] = {
            "median_s": statistics.median(per_step), "min_s": min(per_step), "max_s": max(per_step),
            "mean_s": statistics.mean(per_step), "step_times_s": per_step, "phase_median_s": phases,
            "cpu_median_s": statistics.median(statistics.mean(r["cpu_times"][name][i] for r in results)
                                              for i in range(args.steps)),
            "buckets": results[0]["buckets"][name], "ddp_config": None if name == OURS else
            {"gradient_as_bucket_view": not args.ddp_defaults, "sync_buffers_every_forward": args.ddp_defaults,
             "bucket_cap_mb": args.bucket_mb},
            "allreduce_payload_bytes_per_step": payload, "sent_bytes_per_rank_per_step": payload * ring,
            "allreduce_calls_per_step": results[0]["calls"].get(name),
        }
    ours, peer = out["impl"][OURS], out["impl"][PEER]
    out["ratio_ours_over_ddp"] = ours["median_s"] / peer["median_s"]
    pairs = sorted(a / b for a, b in zip(slowest[OURS], slowest[PEER]))
    out["paired_ratio_median"] = statistics.median(pairs)
    out["paired_ratio_quartiles"] = [pairs[len(pairs) // 4], pairs[(3 * len(pairs)) // 4]]
    # The headline: each timed step of ours is paired with the adjacent step of DDP, so drift and
    # other processes' load (which move both) cancel in the per-pair ratio; its median is robust.
    out["ratio"] = out["paired_ratio_median"]
    return out


def print_report(args, out: dict) -> None:
    cfg = out["config"]
    print(f"data parallel, {args.ranks} Gloo ranks x 1 thread on {out['machine']['cpus']} CPUs, torch "
          f"{out['machine']['torch']}; Llama {cfg['layers']} layers d{cfg['dim']} ({out['params'] / 1e6:.2f} M params, "
          f"fp32), seq {cfg['seq']}, micro-batch {cfg['micro_batch']} x accum {cfg['accum']} per rank, "
          f"bucket {cfg['bucket_mb']:g} MB; {cfg['steps']} timed steps each after {cfg['warmup']} warm-up, alternated")
    c = out["check"]
    print(f"check after step 1: grads rel err {c['max_grad_rel_err']:.1e}, params rel err "
          f"{c['max_param_rel_err']:.1e} ({c['max_param_rel_err_all_entries']:.1e} counting the "
          f"{c['unresolved_grad_entries']} entries whose grad is rounding noise), loss rel err "
          f"{c['loss_rel_err']:.1e}; tolerance {cfg['rtol']:g}: ok")
    header = (f"{'':22} {'median ms':>9} {'min ms':>7} {'max ms':>7} {'cpu ms':>6} | {'fwd':>6} {'bwd':>6} {'sync':>6} "
              f"{'adamw':>6} {'zero':>5} | {'buckets':>7} {'all-reduced/step':>16} {'sent/rank':>10}")
    print(header)
    print("-" * len(header))
    for name, r in out["impl"].items():
        ph = r["phase_median_s"]
        print(f"{name:22} {r['median_s'] * 1e3:9.1f} {r['min_s'] * 1e3:7.1f} {r['max_s'] * 1e3:7.1f} {r['cpu_median_s'] * 1e3:6.1f} | "
              f"{ph['forward'] * 1e3:6.1f} {ph['backward'] * 1e3:6.1f} {ph['sync'] * 1e3:6.1f} "
              f"{ph['optimizer'] * 1e3:6.1f} {ph['zero_grad'] * 1e3:5.1f} | {r['buckets']:7d} "
              f"{r['allreduce_payload_bytes_per_step'] / 2**20:13.2f} MiB {r['sent_bytes_per_rank_per_step'] / 2**20:6.2f} MiB")
    print("(step: slowest rank; cpu: CPU time a rank spent in the step, its Gloo threads included; phases: "
          "per-rank medians; DDP waits for its all-reduces inside backward, bigtrain in sync)")
    load = out["machine"]["loadavg_1min_before_after"]
    q = out["paired_ratio_quartiles"]
    print(f"wall {out['wall_s']:.0f} s; 1-min load average {load[0]:.1f} before, {load[1]:.1f} after "
          f"(the ranks themselves add {args.ranks}); ratio of the medians {out['ratio_ours_over_ddp']:.2f}; "
          f"per-pair ratios: quartiles {q[0]:.2f}-{q[1]:.2f}")
    print(f"ratio ours/ddp = {out['ratio']:.2f} (median over the {args.steps} adjacent pairs of steps)")


def main(argv=None) -> int:
    return run_and_report(_rank_main, parse_args(argv), summarize, print_report)


if __name__ == "__main__":
    sys.exit(main())
