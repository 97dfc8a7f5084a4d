"""bigtrain ZeRO vs torch FSDP2 and ZeroRedundancyOptimizer: step time and model-state bytes, in one run.

Two comparisons run side by side in the same Gloo ranks (forked by ``bigtrain.testing.run_ranks``,
one thread per rank), over the same process group, on copies of the same bigtrain Llama (same
init, same tokens, the same AdamW hyper-parameters and gradient clipping):

  (a) bigtrain ``ZeroEngine`` stage 3 (``reshard_after_forward=True``, prefetch on) vs torch FSDP2
      with its defaults: ``fully_shard`` on every transformer block and on the root, with no
      ``reshard_after_forward`` argument (FSDP2's default: True for the blocks, False for the root,
      which stays gathered from forward to backward; bigtrain has one setting for all its units, so
      it re-gathers its root unit, the embedding, final norm and head, in backward) and no
      explicit prefetch (FSDP2's default: implicit forward prefetch, which on CPU waits for each
      all-gather as it is issued because there is no separate stream for it to run ahead on,
      and backward prefetch of the previous block). ``--fsdp2-prefetch`` adds explicit
      ``set_modules_to_forward_prefetch`` / ``set_modules_to_backward_prefetch`` of the
      neighbouring block, a variant;
  (b) bigtrain ``ZeroEngine`` stage 1 vs ``torch.distributed.optim.ZeroRedundancyOptimizer``
      wrapping AdamW with ``parameters_as_bucket_view=True`` (its parameters in one bucket per
      rank and dtype, so the step broadcasts once per rank, not once per parameter; the default
      ``False`` is ``--zro-per-param``), with DDP (configured like ``bench_data_parallel.py``:
      gradients as bucket views, no per-forward buffer broadcast) reducing the gradients.

A timed step is forward + backward + gradient sync + clipping + AdamW step + zeroing the grads,
measured on every rank after a barrier; a step's time is the slowest rank's.

Precision. fp32 (the default): everything in fp32 on both sides. ``--precision bf16``: each pair
runs one recipe on both of its sides (the report states it):

  (a) bf16 parameters for compute (all-gathered in bf16), bf16 gradients reduce-scattered in fp32,
      fp32 master shards and AdamW: bigtrain ``Precision(compute=bf16, reduce=fp32)``, FSDP2
      ``MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32)``;
  (b) ``torch.autocast("cpu", bf16)`` around the forward on fp32 parameters (fp32 gradients,
      reduced in fp32, fp32 AdamW): bigtrain's engine with ``Precision(compute=fp32)``, DDP + ZRO
      as they are. ZRO has no mixed-precision mode, and DDP's (``mixed_precision=_MixedPrecision``,
      which would match bigtrain's bf16 ZeRO-1 with bf16 parameters) fails on CPU with "cpu
      backend doesn't support events" in torch 2.13, so bigtrain's native bf16 ZeRO-1 has no
      runnable peer here; comparing it with ZRO + autocast (as this benchmark once did) pits bf16
      parameters and gradients against fp32 ones.

Model-state bytes are measured, not computed: the distinct live storages behind the parameters (a
DTensor's local shard), the gradients and the optimizer state (bigtrain's fp32 masters included),
taken after the gradient sync and again after the optimizer step of one untimed step; the larger
of the two, on the worst rank, is reported. bigtrain's numbers come from ``engine.state_bytes()``,
the peers' from ``bigtrain.memory.accounting.model_state_bytes`` (the same storage-counting code).

Conventions. bigtrain sums gradients over ranks and normalizes the loss by the *global* token
count; FSDP2 and DDP average gradients over ranks, so their loss is normalized by the *local* token
count. Before any timing the benchmark runs two steps of each and aborts unless, on every rank, the
loss of step 0 (same init), the gradient norm of step 0 and the loss of step 1 (after one update)
agree within ``--rtol`` (relative; 1e-5 in fp32; 1e-3 in bf16, where the two sides round the
same values in bf16 but reduce and accumulate them in different orders).

Drift is cancelled by alternating the members of each pair, A B B A A B B A ..., after
``--warmup`` untimed steps; the report gives the median step time of each, the ratios ours/peer of
the medians (with the median of the per-step ratios, and the ratios of the fastest steps and of the
CPU time per step, which other processes' load disturbs less), a per-phase breakdown and the state
bytes.

    python benchmarks/bench_zero.py --ranks 2 --steps 20 --warmup 3 --json out.json
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import sys
import time
from contextlib import nullcontext

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.distributed.optim import ZeroRedundancyOptimizer
from torch.nn.parallel import DistributedDataParallel as DDP

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # the sibling benchmarks, run from anywhere
from common import run_and_report  # noqa: E402  (before bigtrain: this checkout's, not an installed one)

from bigtrain.config import ModelConfig, OptimConfig
from bigtrain.distributed.mesh import Mesh
from bigtrain.memory.accounting import model_state_bytes
from bigtrain.models.llama import build_model, count_parameters, init_value
from bigtrain.optim import build_adamw
from bigtrain.parallel.build import token_loss_sum
from bigtrain.parallel.zero import ZeroEngine
from bigtrain.precision import Precision

from bench_data_parallel import _SYNC_BUFFERS, PHASES, VerificationError, _batch  # noqa: E402

Z3, FSDP2, Z1, ZRO = "bigtrain ZeRO-3", "torch FSDP2", "bigtrain ZeRO-1", "torch ZeRO-1 (ZRO+DDP)"
PAIRS = {"fsdp2": (Z3, FSDP2), "zero1": (Z1, ZRO)}
STATE_KEYS = ("params", "grads", "optimizer")
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--ranks", type=int, default=2, help="Gloo ranks (forked, one thread each)")
    p.add_argument("--steps", type=int, default=20, help="timed steps of each implementation")
    p.add_argument("--warmup", type=int, default=3, help="untimed steps of each (the first two are the check)")
    p.add_argument("--compare", choices=("both", *PAIRS), default="both",
                   help="which comparison(s): (a) fsdp2 = ZeRO-3 vs FSDP2, "
                        "(b) zero1 = ZeRO-1 vs ZeroRedundancyOptimizer")
    p.add_argument("--precision", choices=tuple(DTYPES), default="fp32",
                   help="bf16: ZeRO-3 and FSDP2 with bf16 parameters, fp32 masters and fp32 reduction; ZeRO-1 and "
                        "ZRO+DDP under autocast on fp32 parameters (the same recipe within each pair)")
    p.add_argument("--layers", type=int, default=6)
    p.add_argument("--dim", type=int, default=256)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--vocab", type=int, default=256)
    p.add_argument("--seq", type=int, default=128)
    p.add_argument("--micro-batch", type=int, default=8, help="sequences per rank per step")
    p.add_argument("--no-prefetch", action="store_true", help="bigtrain ZeRO-3 without gather prefetch")
    p.add_argument("--fsdp2-prefetch", action="store_true",
                   help="a variant: FSDP2 with explicit prefetch of the neighbouring block "
                        "(set_modules_to_forward/backward_prefetch); by default FSDP2 prefetches implicitly, which "
                        "on CPU leaves its forward waiting for each all-gather")
    p.add_argument("--bucket-mb", type=float, default=25.0, help="DDP bucket_cap_mb (comparison b)")
    p.add_argument("--zro-per-param", action="store_true",
                   help="ZeroRedundancyOptimizer(parameters_as_bucket_view=False), its default: one broadcast per "
                        "parameter after the step instead of one per rank (a variant)")
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--clip", type=float, default=1.0, help="gradient-norm clip of both (0: off)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--rtol", type=float, default=None, help="check tolerance (default 1e-5 fp32, 1e-3 bf16)")
    p.add_argument("--timeout", type=float, default=900.0, help="seconds before the ranks are killed")
    p.add_argument("--json", metavar="PATH", help="also write the numbers here")
    args = p.parse_args(argv)
    if args.ranks < 2:
        p.error("--ranks must be at least 2 (with one rank nothing is sharded)")
    if args.steps < 1 or args.warmup < 2:
        p.error("--steps must be at least 1 and --warmup at least 2 (steps 0 and 1 are the check)")
    if args.rtol is None:
        args.rtol = 1e-5 if args.precision == "fp32" else 1e-3
    return args


# -- inside each rank -------------------------------------------------------------------------------

def precision_recipe(name: str, precision: str) -> str:
    """What each side of a pair computes, stores and reduces in (the same within a pair)."""
    if precision == "fp32":
        return "fp32 compute, parameters, gradients, reduction and AdamW"
    if name in (Z3, FSDP2):
        return "bf16 parameters and compute, bf16 gradients reduced in fp32, fp32 master shards and AdamW"
    return "autocast bf16 compute on fp32 parameters, fp32 gradients, reduction and AdamW"


def _rel(a: float, b: float) -> float:
    return abs(a - b) / abs(b) if b else abs(a - b)


class Runner:
    """One implementation on one rank: its model, its step, its state bytes."""

    def __init__(self, name: str, args, mesh: Mesh, model_cfg: ModelConfig, optim_cfg: OptimConfig):
        self.name, self.args, self.mesh, self.optim_cfg = name, args, mesh, optim_cfg
        compute = DTYPES[args.precision]
        local_tokens = args.micro_batch * args.seq
        self.engine = self.optimizer = None
        self.autocast = nullcontext
        self.times: list[float] = []
        self.cpu_times: list[float] = []
        self.phases: dict[str, list[float]] = {k: [] for k in PHASES}
        self.model = build_model(model_cfg)  # meta
        if name in (Z1, ZRO) and args.precision != "fp32":  # recipe (b): autocast on fp32 parameters
            self.autocast = lambda dtype=compute: torch.autocast("cpu", dtype=dtype)
            compute = torch.float32  # the engine's parameters (bigtrain) stay fp32, as ZRO's do
        if name in (Z3, Z1):
            self.model.init_buffers("cpu")
            self.engine = ZeroEngine(
                self.model, mesh.comm("dp"), 3 if name == Z3 else 1, Precision(compute=compute, reduce=torch.float32),
                optim_cfg, init_fn=lambda n, shape: init_value(n, shape, args.seed, model_cfg), device="cpu",
                reshard_after_forward=True, prefetch=not args.no_prefetch)
            self.forward = self.model
            self.loss_scale = 1.0 / (local_tokens * mesh.size("dp"))  # global token count: grads summed
            return
        self.model.to_empty(device="cpu")
        self.model.init_weights(args.seed)
        self.loss_scale = 1.0 / local_tokens  # local mean: FSDP2 and DDP average the grads over ranks
        if name == FSDP2:
            device_mesh = DeviceMesh.from_group(mesh.groups["dp"], "cpu")
            policy = MixedPrecisionPolicy() if args.precision == "fp32" else \
                MixedPrecisionPolicy(param_dtype=compute, reduce_dtype=torch.float32)
            for layer in self.model.layers:  # FSDP2's defaults: reshard_after_forward True here, False for the root
                fully_shard(layer, mesh=device_mesh, mp_policy=policy)
            fully_shard(self.model, mesh=device_mesh, mp_policy=policy)
            if args.fsdp2_prefetch:
                blocks = list(self.model.layers)
                for i, block in enumerate(blocks):
                    block.set_modules_to_forward_prefetch(blocks[i + 1:i + 2])
                    block.set_modules_to_backward_prefetch(blocks[max(i - 1, 0):i])
            self.forward = self.model
            self.optimizer = build_adamw(self.model, optim_cfg, args.lr)
        else:
            self.forward = DDP(self.model, process_group=mesh.groups["dp"], bucket_cap_mb=args.bucket_mb,
                               gradient_as_bucket_view=True, **{_SYNC_BUFFERS: False})
            groups = build_adamw(self.model, optim_cfg, args.lr).param_groups  # decay on matrices only
            self.optimizer = ZeroRedundancyOptimizer(
                [{"params": g["params"], "weight_decay": g["weight_decay"]} for g in groups],
                optimizer_class=torch.optim.AdamW, process_group=mesh.groups["dp"],
                parameters_as_bucket_view=not args.zro_per_param, lr=args.lr,
                betas=(optim_cfg.beta1, optim_cfg.beta2), eps=optim_cfg.eps, fused=True)  # as bigtrain's AdamW

    def state_bytes(self) -> dict[str, int]:
        if self.engine is not None:
            return self.engine.state_bytes()
        local_optim = self.optimizer.optim if isinstance(self.optimizer, ZeroRedundancyOptimizer) else self.optimizer
        return model_state_bytes(self.model, local_optim)

    def step(self, step: int, record: bool) -> dict:
        """One optimizer step; returns this rank's summed token loss, the grad norm and (untimed
        steps only) the state bytes measured after the sync and after the optimizer step."""
        args = self.args
        tokens, targets = _batch(args, step, self.mesh.rank, 0)
        measure = not record
        states = []
        dist.barrier()  # every rank starts the step together; not timed
        clock = time.perf_counter
        cpu_start = time.process_time()  # this rank's CPU time, its Gloo threads included
        t0 = clock()
        with self.autocast():
            loss_sum = token_loss_sum(self.forward(tokens), targets)
        t1 = clock()
        if self.engine is not None:
            self.engine.backward(loss_sum * self.loss_scale)
        else:
            (loss_sum * self.loss_scale).backward()  # FSDP2 and DDP wait for their reductions in here
        t2 = clock()
        if self.engine is not None:
            self.engine.finish_grad_sync()
        t3 = clock()
        if measure:
            states.append(self.state_bytes())
            t3 = clock()
        if self.engine is not None:
            norm, _ = self.engine.step(args.lr, args.clip)
        else:
            norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), args.clip if args.clip > 0 else float("inf"))
            norm = float(norm.full_tensor() if hasattr(norm, "full_tensor") else norm)
            self.optimizer.step()
        t4 = clock()
        if measure:
            states.append(self.state_bytes())
            t4 = clock()
        if self.engine is not None:
            self.engine.zero_grad()
        else:
            self.optimizer.zero_grad(set_to_none=True)
        end = clock()
        if record:
            self.times.append(end - t0)
            self.cpu_times.append(time.process_time() - cpu_start)
            for k, v in zip(PHASES, (t1 - t0, t2 - t1, t3 - t2, t4 - t3, end - t4)):
                self.phases[k].append(v)
        peak = max(states, key=lambda s: sum(s.values())) if states else None
        return {"loss_sum": float(loss_sum.detach()), "grad_norm": float(norm), "state": peak}


def _verify(ours: Runner, peer: Runner, args) -> dict:
    """Steps 0 and 1 of both: same loss before and after one update, same gradient norm."""
    first = {r.name: r.step(0, record=False) for r in (ours, peer)}
    second = {r.name: r.step(1, record=False) for r in (ours, peer)}
    errors = torch.tensor([_rel(first[ours.name]["loss_sum"], first[peer.name]["loss_sum"]),
                           _rel(first[ours.name]["grad_norm"], first[peer.name]["grad_norm"]),
                           _rel(second[ours.name]["loss_sum"], second[peer.name]["loss_sum"])], dtype=torch.float64)
    dist.all_reduce(errors, op=dist.ReduceOp.MAX)  # every rank takes the same decision
    report = {"loss_step0_rel_err": float(errors[0]), "grad_norm_step0_rel_err": float(errors[1]),
              "loss_step1_rel_err": float(errors[2]), "rtol": args.rtol,
              "loss_step1": {r: second[r]["loss_sum"] / (args.micro_batch * args.seq) for r in second},
              "state": {r: second[r]["state"] for r in second}}
    if float(errors.max()) > args.rtol:
        raise VerificationError(f"{ours.name} and {peer.name} disagree in the first steps: {report}")
    return report


def _rank_main(rank: int, world_size: int, args) -> dict:
    mesh = Mesh({"dp": world_size}, rank)
    model_cfg = ModelConfig(vocab_size=args.vocab, dim=args.dim, n_layers=args.layers, n_heads=args.heads,
                            max_seq_len=args.seq)
    optim_cfg = OptimConfig(lr=args.lr)
    pairs = [PAIRS[k] for k in PAIRS if args.compare in ("both", k)]
    runners = {name: Runner(name, args, mesh, model_cfg, optim_cfg) for pair in pairs for name in pair}
    checks = {ours: _verify(runners[ours], runners[peer], args) for ours, peer in pairs}
    for step in range(2, args.warmup):
        for runner in runners.values():
            runner.step(step, record=False)
    last_loss = {}
    for i in range(args.steps):  # within each pair: A B B A A B B A ...
        step = args.warmup + i
        for ours, peer in pairs:
            for name in ((ours, peer) if i % 2 == 0 else (peer, ours)):
                last_loss[name] = runners[name].step(step, record=True)["loss_sum"]
    return {
        "rank": rank,
        "params": count_parameters(runners[pairs[0][0]].model),
        "checks": checks,
        "final_loss_rel_err": {ours: _rel(last_loss[ours], last_loss[peer]) for ours, peer in pairs},
        "times": {n: r.times for n, r in runners.items()},
        "cpu_times": {n: r.cpu_times for n, r in runners.items()},
        "phases": {n: r.phases for n, r in runners.items()},
    }


# -- in the parent ----------------------------------------------------------------------------------

def summarize(args, results: list[dict], wall_s: float) -> dict:
    pairs = [PAIRS[k] for k in PAIRS if args.compare in ("both", k)]
    out = {"config": {k: v for k, v in vars(args).items() if k not in ("json", "timeout")},
           "machine": {"cpus": os.cpu_count(), "torch": torch.__version__, "python": platform.python_version(),
                       "platform": platform.platform(), "threads_per_rank": 1, "backend": "gloo"},
           "params": results[0]["params"], "wall_s": wall_s, "impl": {}, "comparisons": {}}
    slowest = {}
    for ours, peer in pairs:
        for name in (ours, peer):
            per_step = [max(r["times"][name][i] for r in results) for i in range(args.steps)]
            slowest[name] = per_step
            # Worst rank's model state (ranks differ only by padding and uneven ZeRO partitions).
            states = [r["checks"][ours]["state"][name] for r in results]
            worst = max(states, key=lambda s: sum(s.values()))
            out["impl"][name] = {
                "median_s": statistics.median(per_step), "min_s": min(per_step), "max_s": max(per_step),
                "step_times_s": per_step,
                "phase_median_s": {k: statistics.median(statistics.mean(r["phases"][name][k][i] for r in results)
                                                        for i in range(args.steps)) for k in PHASES},
                "cpu_median_s": statistics.median(statistics.mean(r["cpu_times"][name][i] for r in results)
                                                  for i in range(args.steps)),
                "state_bytes": {**{k: worst[k] for k in STATE_KEYS}, "total": sum(worst[k] for k in STATE_KEYS)},
            }
        a, b = out["impl"][ours], out["impl"][peer]
        check = {k: v for k, v in results[0]["checks"][ours].items() if k != "state"}
        check["final_loss_rel_err_max_rank"] = max(r["final_loss_rel_err"][ours] for r in results)
        out["comparisons"][f"{ours} / {peer}"] = {
            "ours": ours, "peer": peer, "check": check, "precision": precision_recipe(ours, args.precision),
            "ratio_step_time": a["median_s"] / b["median_s"],
            "paired_ratio_median": statistics.median(x / y for x, y in zip(slowest[ours], slowest[peer])),
            # Less sensitive to other processes on a shared machine than the medians:
            "ratio_min_step_time": a["min_s"] / b["min_s"],
            "ratio_cpu_time": a["cpu_median_s"] / b["cpu_median_s"],
            "ratio_state_bytes": a["state_bytes"]["total"] / b["state_bytes"]["total"],
        }
    return out


SHORT = {Z3: "fsdp2", Z1: "zero1"}  # for the ratio lines


def print_report(args, out: dict) -> None:
    cfg, mib = out["config"], 2**20
    print(f"ZeRO, {args.ranks} Gloo ranks x 1 thread on {out['machine']['cpus']} CPUs, "
          f"torch {out['machine']['torch']}; "
          f"Llama {cfg['layers']} layers d{cfg['dim']} ({out['params'] / 1e6:.2f} M params, {cfg['precision']}), "
          f"seq {cfg['seq']}, micro-batch {cfg['micro_batch']} per rank; {cfg['steps']} timed steps each after "
          f"{cfg['warmup']} warm-up, alternated within each pair")
    for c in out["comparisons"].values():
        k = c["check"]
        print(f"check {c['ours']} vs {c['peer']}: loss rel err {k['loss_step0_rel_err']:.1e} at step 0, "
              f"{k['loss_step1_rel_err']:.1e} after one update; grad norm rel err {k['grad_norm_step0_rel_err']:.1e}; "
              f"tolerance {k['rtol']:g}: ok (after {cfg['warmup'] + cfg['steps']} steps: "
              f"{k['final_loss_rel_err_max_rank']:.1e})")
        print(f"  precision of both: {c['precision']}")
    flags = {"--fsdp2-prefetch": cfg["fsdp2_prefetch"], "--zro-per-param": cfg["zro_per_param"],
             "--no-prefetch": cfg["no_prefetch"]}
    variants = " ".join(flag for flag, on in flags.items() if on)
    print(f"FSDP2: fully_shard defaults{' + explicit prefetch' if cfg['fsdp2_prefetch'] else ''}; ZRO: "
          f"parameters_as_bucket_view={not cfg['zro_per_param']}" + (f"; variants: {variants}" if variants else ""))
    header = (f"{'':24} {'median ms':>9} {'min ms':>7} {'max ms':>7} {'cpu ms':>6} | {'fwd':>6} {'bwd':>6} "
              f"{'sync':>5} {'step':>6} {'zero':>5} | {'params':>7} {'grads':>7} {'optim':>7} {'state MiB':>9}")
    print(header)
    print("-" * len(header))
    for name, r in out["impl"].items():
        ph, s = r["phase_median_s"], r["state_bytes"]
        print(f"{name:24} {r['median_s'] * 1e3:9.1f} {r['min_s'] * 1e3:7.1f} {r['max_s'] * 1e3:7.1f} "
              f"{r['cpu_median_s'] * 1e3:6.1f} | {ph['forward'] * 1e3:6.1f} {ph['backward'] * 1e3:6.1f} "
              f"{ph['sync'] * 1e3:5.1f} {ph['optimizer'] * 1e3:6.1f} {ph['zero_grad'] * 1e3:5.1f} | "
              f"{s['params'] / mib:7.2f} {s['grads'] / mib:7.2f} {s['optimizer'] / mib:7.2f} {s['total'] / mib:9.2f}")
    print("(step: slowest rank; cpu: CPU time a rank spent in the step, its Gloo threads included; phases: per-rank "
          "medians, 'step' = clip + optimizer (+ ZRO's parameter broadcast); FSDP2 and DDP wait for their gradient "
          "reductions inside backward, bigtrain in sync; state: worst rank, largest of after-sync and after-step)")
    load = out["machine"]["loadavg_1min_before_after"]
    print(f"wall {out['wall_s']:.0f} s; 1-min load average {load[0]:.1f} before, {load[1]:.1f} after "
          f"(the ranks themselves add {args.ranks})")
    for c in out["comparisons"].values():
        peer = SHORT[c["ours"]]
        print(f"ratio ours/{peer} step time = {c['ratio_step_time']:.2f} "
              f"(paired median {c['paired_ratio_median']:.2f}, min {c['ratio_min_step_time']:.2f}, "
              f"cpu {c['ratio_cpu_time']:.2f})")
        print(f"ratio ours/{peer} state bytes = {c['ratio_state_bytes']:.3f}")


def main(argv=None) -> int:
    return run_and_report(_rank_main, parse_args(argv), summarize, print_report)


if __name__ == "__main__":
    sys.exit(main())
