"""bigtrain tensor parallel vs torch DTensor tensor parallel: step time on the same ranks, in one run.

Both implementations live in the same Gloo ranks (forked by ``bigtrain.testing.run_ranks``, one
thread per rank), over the same tp process group, on the same bigtrain Llama (fp32, CPU, the same
initial values), fed the same tokens (every tp rank sees the whole micro-batch), with the same AdamW
hyper-parameters and gradient clipping:

  ours    ``bigtrain.parallel.build.parallelize`` on a config with ``parallel.tp = --ranks`` (and
          ``parallel.sequence_parallel``): Megatron column/row-parallel layers, vocab-parallel
          embedding, output head and cross-entropy, all through our differentiable collectives,
          and the ``ReplicatedEngine`` (AdamW, global-norm clipping over tp);
  DTensor ``torch.distributed.tensor.parallel.parallelize_module`` on the plain bigtrain Llama:
          ``ColwiseParallel`` for wq/wk/wv/w1/w3, ``RowwiseParallel`` for wo/w2, the embedding
          vocab-parallel (``RowwiseParallel(input_layouts=Replicate())``), the output head
          ``ColwiseParallel(use_local_output=False)`` with the loss under ``loss_parallel()``;
          torchtitan's ``PrepareModuleInput`` on attention and the feed-forward, so each block's
          input becomes a DTensor once and its input gradient is reduced once (plain tp:
          Replicate -> Replicate; without it, ``ColwiseParallel`` converts the input of each of
          wq/wk/wv/w1/w3 on its own and backward all-reduces once per linear, 48 collectives a
          step instead of 30 at 6 layers). With sequence parallelism the plan is torchtitan's
          ``apply_tp``: the norms are ``SequenceParallel()``, attention and the feed-forward
          all-gather their input (``PrepareModuleInput``: Shard(1) -> Replicate), wo/w2 and the
          embedding reduce-scatter (``output_layouts=Shard(1)``) and the head all-gathers
          (``input_layouts=Shard(1)``). AdamW (``build_adamw``, foreach) on the DTensor
          parameters; clipping by the global norm (DTensor gradients' norm is a DTensor; without
          sequence parallelism the norms' weights stay plain tensors, so the two kinds are normed
          separately and combined). ``--dtensor-reduce-grads`` (a variant, not torchtitan's loop)
          reduces DTensor's ``Partial`` gradients once after backward.

The bigtrain attention reshapes with ``view(b, s, -1, head_dim)``, so the local head counts that
``ColwiseParallel``'s default ``use_local_output=True`` hands it work unchanged.

A timed step is forward + loss + backward + gradient sync + clipping + AdamW step + zeroing the
grads, measured on every rank after an (untimed) barrier; a step's time is the slowest rank's.
Before any timing the benchmark runs two steps of each and exits with an error unless, on every
rank, the loss of step 0 (same init), every gradient of step 0 (this rank's shard, per tensor), the
gradient norm and the loss of step 1 (after one update) agree within ``--rtol`` (1e-5, relative).

Drift and other processes' load are cancelled by interleaving the two, A B B A A B B A ..., after
``--warmup`` untimed steps of each (the check, one step that counts the collectives: ours through
the mesh's counters, DTensor's with ``CommDebugMode``, then plain warm-up). The report gives, for
tp alone and for tp + sequence parallel, the median step time of each, a per-phase breakdown, the
CPU time per step and the collectives per step, and the ratio ours/DTensor of the medians (with
the median of the per-pair ratios).

    python benchmarks/bench_tensor_parallel.py --ranks 2 --steps 20 --json out.json
    python benchmarks/bench_tensor_parallel.py --ranks 4 --sequence-parallel       # tp + sp only
    python benchmarks/bench_tensor_parallel.py --ranks 2 --sequence-parallel off   # tp only
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import sys
import time
import warnings

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor.debug import CommDebugMode
from torch.distributed.tensor.parallel import (ColwiseParallel, PrepareModuleInput, RowwiseParallel, SequenceParallel,
                                               loss_parallel, parallelize_module)

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # the sibling benchmarks, run from anywhere
from common import run_and_report  # noqa: E402  (before bigtrain: this checkout's, not an installed one)

from bigtrain.config import Config, ModelConfig, OptimConfig, ParallelConfig, TrainConfig
from bigtrain.distributed.mesh import Mesh
from bigtrain.models.llama import build_model, count_parameters
from bigtrain.optim import build_adamw
from bigtrain.from_config import parallel_plan
from bigtrain.parallel.build import parallelize
from bigtrain.parallel.build import token_loss_sum

from bench_data_parallel import PHASES, VerificationError, _batch, _relative_error  # noqa: E402
from bench_zero import _rel  # noqa: E402

# CommDebugMode's module tracker (the untimed counting step) registers full backward hooks; harmless.
warnings.filterwarnings("ignore", message="Full backward hook is firing")

MODES = ("tp", "tp+sp")
OURS, PEER = "bigtrain", "torch DTensor"


def _name(impl: str, mode: str) -> str:
    return f"{impl} {mode.upper()}"


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--ranks", type=int, default=2, help="tensor-parallel size (Gloo ranks, forked, one thread each)")
    p.add_argument("--steps", type=int, default=20, help="timed steps of each implementation, per mode")
    p.add_argument("--warmup", type=int, default=3,
                   help="untimed steps of each (steps 0 and 1 are the check, step 2 counts the collectives)")
    p.add_argument("--sequence-parallel", nargs="?", const="on", default="both", choices=("off", "on", "both"),
                   help="Megatron sequence parallelism: 'on' (the bare flag) compares tp + sp only, 'off' tp only, "
                        "'both' runs both comparisons in the same ranks")
    p.add_argument("--dtensor-reduce-grads", action="store_true",
                   help="a variant, not torchtitan's loop: reduce DTensor's Partial gradients (the norms' weights "
                        "under sequence parallelism) once after backward instead of in clipping and every AdamW op")
    p.add_argument("--layers", type=int, default=6)
    p.add_argument("--dim", type=int, default=256)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--vocab", type=int, default=256)
    p.add_argument("--seq", type=int, default=128)
    p.add_argument("--micro-batch", type=int, default=8, help="sequences per step (every tp rank sees all)")
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--clip", type=float, default=1.0, help="gradient-norm clip of both (0: no clipping; bigtrain's "
                                                           "engine still computes the norm)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--rtol", type=float, default=1e-5, help="relative tolerance of the equivalence check")
    p.add_argument("--timeout", type=float, default=900.0, help="seconds before the ranks are killed")
    p.add_argument("--json", metavar="PATH", help="also write the numbers here")
    args = p.parse_args(argv)
    args.modes = {"off": ["tp"], "on": ["tp+sp"], "both": list(MODES)}[args.sequence_parallel]
    if args.ranks < 2:
        p.error("--ranks must be at least 2 (with one rank nothing is split)")
    if args.steps < 1 or args.warmup < 3:
        p.error("--steps must be at least 1 and --warmup at least 3 (the check and the collective count)")
    ffn = ModelConfig(dim=args.dim).ffn_dim
    if args.heads % args.ranks or ffn % args.ranks or args.vocab % args.ranks or args.dim % args.heads:
        p.error(f"--ranks must divide --heads ({args.heads}), the MLP size ({ffn}) and --vocab ({args.vocab}), "
                "so both implementations cut the same even shards")
    if "tp+sp" in args.modes and args.seq % args.ranks:
        p.error("sequence parallelism needs --seq divisible by --ranks")
    return args


# -- inside each rank -------------------------------------------------------------------------------

def _model_config(args) -> ModelConfig:
    return ModelConfig(vocab_size=args.vocab, dim=args.dim, n_layers=args.layers, n_heads=args.heads,
                       max_seq_len=args.seq)


def _optim_config(args) -> OptimConfig:
    return OptimConfig(lr=args.lr, grad_clip=args.clip)


def dtensor_plans(sequence_parallel: bool) -> tuple[dict, dict]:
    """(the model's top-level plan, each transformer block's plan) for ``parallelize_module``."""
    block = {
        "attention.wq": ColwiseParallel(),
        "attention.wk": ColwiseParallel(),
        "attention.wv": ColwiseParallel(),
        "feed_forward.w1": ColwiseParallel(),
        "feed_forward.w3": ColwiseParallel(),
    }
    if not sequence_parallel:
        # torchtitan's PrepareModuleInput before attention and the MLP, with the replicated layout of
        # plain tp: the block input becomes a DTensor once, so wq/wk/wv (w1/w3) share it and their
        # Partial input gradients are summed locally and all-reduced once, at the block's entry,
        # instead of once per linear (ColwiseParallel alone converts each linear's input itself).
        block.update({
            "attention": PrepareModuleInput(input_layouts=(Replicate(), None, None),
                                            desired_input_layouts=(Replicate(), None, None)),
            "attention.wo": RowwiseParallel(),
            "feed_forward": PrepareModuleInput(input_layouts=(Replicate(),), desired_input_layouts=(Replicate(),)),
            "feed_forward.w2": RowwiseParallel(),
        })
        top = {"tok_embeddings": RowwiseParallel(input_layouts=Replicate()),
               "output": ColwiseParallel(use_local_output=False)}
        return top, block
    block.update({
        "attention_norm": SequenceParallel(),
        # Attention.forward(x, cos, sin): gather the sequence of x only.
        "attention": PrepareModuleInput(input_layouts=(Shard(1), None, None),
                                        desired_input_layouts=(Replicate(), None, None)),
        "attention.wo": RowwiseParallel(output_layouts=Shard(1)),
        "ffn_norm": SequenceParallel(),
        "feed_forward": PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),)),
        "feed_forward.w2": RowwiseParallel(output_layouts=Shard(1)),
    })
    top = {"tok_embeddings": RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1)),
           "norm": SequenceParallel(),
           "output": ColwiseParallel(input_layouts=Shard(1), use_local_output=False)}
    return top, block


def _dtensor_clip(params: list[torch.nn.Parameter], max_norm: float) -> float:
    """Global-norm clipping of DTensor (and, without sequence parallelism, plain replicated) grads,
    as ``clip_grad_norm_`` does it (foreach norms; one collective for the DTensor part)."""
    grads = [p.grad for p in params if p.grad is not None]
    distributed = [g for g in grads if isinstance(g, DTensor)]
    plain = [g for g in grads if not isinstance(g, DTensor)]
    square = torch.zeros((), dtype=torch.float32)
    if distributed:
        square = square + torch.nn.utils.get_total_norm(distributed, foreach=True).full_tensor().pow(2)
    if plain:
        square = square + torch.nn.utils.get_total_norm(plain, foreach=True).pow(2)
    norm = float(square.sqrt())
    if max_norm > 0 and norm > max_norm:
        coef = max_norm / (norm + 1e-6)
        for group in (distributed, plain):
            if group:
                torch._foreach_mul_(group, coef)
    return norm


def _reduce_partial_grads(model: torch.nn.Module) -> None:
    """Reduce every ``Partial`` DTensor gradient to its parameter's placements, once, after backward.

    Not what torchtitan does: under sequence parallelism the norms' replicated weights get
    ``Partial`` gradients, which clipping and each of AdamW's foreach ops then all-reduce again
    (4 all-reduces per norm weight a step). ``--dtensor-reduce-grads`` shows what one reduction
    per weight, as bigtrain does, would give DTensor."""
    for p in model.parameters():
        g = p.grad
        if isinstance(g, DTensor) and any(pl.is_partial() for pl in g.placements):
            p.grad = g.redistribute(p.device_mesh, p.placements)


class Runner:
    """One implementation in one mode on one rank: its model, its optimizer, its step."""

    def __init__(self, impl: str, mode: str, args, mesh: Mesh):
        self.impl, self.mode, self.name, self.args, self.mesh = impl, mode, _name(impl, mode), args, mesh
        self.tokens = args.micro_batch * args.seq  # the loss is the mean over the (replicated) batch
        sequence_parallel = mode == "tp+sp"
        self.times: list[float] = []
        self.cpu_times: list[float] = []
        self.phases: dict[str, list[float]] = {k: [] for k in PHASES}
        if impl == OURS:
            cfg = Config(model=_model_config(args),
                         parallel=ParallelConfig(tp=args.ranks, sequence_parallel=sequence_parallel),
                         optim=_optim_config(args),
                         train=TrainConfig(seed=args.seed, micro_batch=args.micro_batch, global_batch=args.micro_batch))
            self.parallel = parallelize(build_model(cfg.model), mesh, parallel_plan(cfg), "cpu")
            self.model, self.engine = self.parallel.model, self.parallel.engine
            return
        self.model = build_model(_model_config(args))
        self.model.to_empty(device="cpu")
        self.model.init_weights(args.seed)  # the same full values on every rank; parallelize_module cuts them
        device_mesh = DeviceMesh.from_group(mesh.groups["tp"], "cpu")
        top, block = dtensor_plans(sequence_parallel)
        parallelize_module(self.model, device_mesh, top)
        for layer in self.model.layers:
            parallelize_module(layer, device_mesh, block)
        # Decay on matrices only, as bigtrain's; the two groups also keep DTensor and plain-tensor
        # parameters (the norms, without sequence parallelism) apart for the foreach kernels.
        self.optimizer = build_adamw(self.model, _optim_config(args), args.lr)

    def step(self, step: int, record: bool, before_optimizer=None) -> dict:
        """One optimizer step; returns the summed token loss and the gradient norm."""
        args = self.args
        tokens, targets = _batch(args, step, 0, 0)  # the same tokens on every tp rank
        dist.barrier(group=self.mesh.groups["tp"])  # every rank starts the step together; not timed
        clock = time.perf_counter
        cpu_start = time.process_time()  # this rank's CPU time, its Gloo threads included
        t0 = clock()
        if self.impl == OURS:
            loss_sum = self.parallel.forward_loss(tokens, targets)
            t1 = clock()
            self.engine.backward(loss_sum / self.tokens)
            t2 = clock()
            self.engine.finish_grad_sync()  # nothing to do at dp = 1: tp gradients are complete after backward
            t3 = clock()
            if before_optimizer is not None:  # the equivalence check; never in a timed step
                before_optimizer(self)
                t3 = clock()
            norm, _ = self.engine.step(args.lr, args.clip)
            t4 = clock()
            self.engine.zero_grad()
        else:
            with loss_parallel():
                loss_sum = token_loss_sum(self.model(tokens), targets)
                t1 = clock()
                (loss_sum / self.tokens).backward()
            t2 = clock()
            if args.dtensor_reduce_grads:
                _reduce_partial_grads(self.model)
            t3 = clock()  # by default DTensor reduces inside backward, or lazily in the clip and the step
            if before_optimizer is not None:
                before_optimizer(self)
                t3 = clock()
            norm = _dtensor_clip(list(self.model.parameters()), args.clip)
            self.optimizer.step()
            t4 = clock()
            self.optimizer.zero_grad(set_to_none=True)
        end = clock()
        if record:
            self.times.append(end - t0)
            self.cpu_times.append(time.process_time() - cpu_start)
            for k, v in zip(PHASES, (t1 - t0, t2 - t1, t3 - t2, t4 - t3, end - t4)):
                self.phases[k].append(v)
        loss = loss_sum.detach()
        return {"loss_sum": float(loss.to_local() if isinstance(loss, DTensor) else loss), "grad_norm": float(norm)}

    def local_grads(self) -> dict[str, torch.Tensor]:
        """This rank's gradient shards by parameter name (DTensor partial sums reduced first)."""
        out = {}
        for name, p in self.model.named_parameters():
            g = p.grad
            if isinstance(g, DTensor):
                g = g.redistribute(p.device_mesh, p.placements).to_local()
            out[name] = g.detach().clone()
        return out

    def collectives(self, step: int) -> dict:
        """Collective calls and payload bytes of one (untimed) step, by kind."""
        if self.impl == OURS:
            before = self.mesh.stats.snapshot()
            self.step(step, record=False)
            delta = self.mesh.stats.since(before)
            calls = {op: n for (axis, op), n in delta.calls.items() if axis == "tp"}
            return {"calls": sum(calls.values()), "by_op": calls,
                    "payload_bytes": sum(v for (axis, _), v in delta.payload.items() if axis == "tp")}
        mode = CommDebugMode()
        with mode:
            self.step(step, record=False)
        counts = {str(op).split(".")[-1]: n for op, n in mode.get_comm_counts().items()}
        return {"calls": mode.get_total_counts(), "by_op": counts, "payload_bytes": None}


def _verify(ours: Runner, peer: Runner, args) -> dict:
    """Steps 0 and 1 of both: the same loss before and after one update, the same gradients and norm."""
    grads = {}

    def keep_grads(runner: Runner) -> None:
        grads[runner.impl] = runner.local_grads()

    first = {r.impl: r.step(0, record=False, before_optimizer=keep_grads) for r in (ours, peer)}
    second = {r.impl: r.step(1, record=False) for r in (ours, peer)}
    worst_grad, worst_name = 0.0, ""
    for name, g in grads[OURS].items():
        err = _relative_error(g, grads[PEER][name])
        if err > worst_grad:
            worst_grad, worst_name = err, name
    errors = torch.tensor([_rel(first[OURS]["loss_sum"], first[PEER]["loss_sum"]), worst_grad,
                           _rel(first[OURS]["grad_norm"], first[PEER]["grad_norm"]),
                           _rel(second[OURS]["loss_sum"], second[PEER]["loss_sum"])], dtype=torch.float64)
    dist.all_reduce(errors, op=dist.ReduceOp.MAX, group=ours.mesh.groups["tp"])  # every rank takes the same decision
    report = {"loss_step0_rel_err": float(errors[0]), "max_grad_rel_err": float(errors[1]),
              "worst_grad_this_rank": worst_name, "grad_norm_step0_rel_err": float(errors[2]),
              "loss_step1_rel_err": float(errors[3]), "rtol": args.rtol,
              "loss_step0": first[PEER]["loss_sum"] / ours.tokens,
              "loss_step1": {r.name: second[r.impl]["loss_sum"] / ours.tokens for r in (ours, peer)}}
    if float(errors.max()) > args.rtol:
        raise VerificationError(f"{ours.name} and {peer.name} disagree in the first steps: {report}")
    return report


def _rank_main(rank: int, world_size: int, args) -> dict:
    mesh = Mesh({"tp": world_size}, rank)
    runners = {mode: (Runner(OURS, mode, args, mesh), Runner(PEER, mode, args, mesh)) for mode in args.modes}
    checks = {mode: _verify(*pair, args) for mode, pair in runners.items()}
    comms = {}
    for mode, pair in runners.items():  # step 2 (untimed): count the collectives
        for runner in pair:
            comms[runner.name] = runner.collectives(2)
    for step in range(3, args.warmup):
        for pair in runners.values():
            for runner in pair:
                runner.step(step, record=False)
    last_loss = {}
    for i in range(args.steps):  # within each mode: A B B A A B B A ...
        step = args.warmup + i
        for pair in runners.values():
            for runner in (pair if i % 2 == 0 else pair[::-1]):
                last_loss[runner.name] = runner.step(step, record=True)["loss_sum"]
    pairs = list(runners.values())
    return {
        "rank": rank,
        "params_total": count_parameters(build_model(_model_config(args))),
        "params_local": {ours.mode: count_parameters(ours.model) for ours, _ in pairs},
        "checks": checks,
        "final_loss_rel_err": {ours.mode: _rel(last_loss[ours.name], last_loss[peer.name]) for ours, peer in pairs},
        "comms": comms,
        "times": {r.name: r.times for pair in pairs for r in pair},
        "cpu_times": {r.name: r.cpu_times for pair in pairs for r in pair},
        "phases": {r.name: r.phases for pair in pairs for r in pair},
    }


# -- in the parent ----------------------------------------------------------------------------------

def summarize(args, results: list[dict], wall_s: float) -> dict:
    out = {"config": {k: v for k, v in vars(args).items() if k not in ("json", "timeout")},
           "machine": {"cpus": os.cpu_count(), "torch": torch.__version__, "python": platform.python_version(),
                       "platform": platform.platform(), "threads_per_rank": 1, "backend": "gloo"},
           "params": results[0]["params_total"], "wall_s": wall_s, "impl": {}, "comparisons": {}}
    for mode in args.modes:
        names = (_name(OURS, mode), _name(PEER, mode))
        slowest = {}
        for name in names:
            per_step = [max(r["times"][name][i] for r in results) for i in range(args.steps)]
            slowest[name] = per_step
            out["impl"][name] = {
                "mode": mode, "median_s": statistics.median(per_step), "min_s": min(per_step),
                "max_s": max(per_step), "step_times_s": per_step,
                "phase_median_s": {k: statistics.median(statistics.mean(r["phases"][name][k][i] for r in results)
                                                        for i in range(args.steps)) for k in PHASES},
                "cpu_median_s": statistics.median(statistics.mean(r["cpu_times"][name][i] for r in results)
                                                  for i in range(args.steps)),
                "collectives_per_step": results[0]["comms"][name],
            }
        a, b = (out["impl"][n] for n in names)
        check = dict(results[0]["checks"][mode])
        check["worst_grad_per_rank"] = [r["checks"][mode]["worst_grad_this_rank"] for r in results]
        check["final_loss_rel_err_max_rank"] = max(r["final_loss_rel_err"][mode] for r in results)
        out["comparisons"][mode] = {
            "ours": names[0], "peer": names[1], "check": check, "params_local": results[0]["params_local"][mode],
            "ratio_step_time": a["median_s"] / b["median_s"],
            # Less sensitive to other processes on a shared machine than the ratio of the medians:
            "paired_ratio_median": statistics.median(x / y for x, y in zip(slowest[names[0]], slowest[names[1]])),
            "ratio_min_step_time": a["min_s"] / b["min_s"],
            "ratio_cpu_time": a["cpu_median_s"] / b["cpu_median_s"],
        }
    return out


def print_report(args, out: dict) -> None:
    cfg = out["config"]
    print(f"tensor parallel, tp = {args.ranks} Gloo ranks x 1 thread on {out['machine']['cpus']} CPUs, torch "
          f"{out['machine']['torch']}; Llama {cfg['layers']} layers d{cfg['dim']} {cfg['heads']} heads "
          f"({out['params'] / 1e6:.2f} M params, fp32), seq {cfg['seq']}, micro-batch {cfg['micro_batch']}; "
          f"{cfg['steps']} timed steps each after {cfg['warmup']} warm-up, interleaved within each mode")
    if cfg["dtensor_reduce_grads"]:
        print("variant --dtensor-reduce-grads: DTensor's Partial gradients reduced once after backward (in 'sync'), "
              "not torchtitan's loop")
    for mode, c in out["comparisons"].items():
        k = c["check"]
        print(f"check {mode}: loss rel err {k['loss_step0_rel_err']:.1e} at step 0, {k['loss_step1_rel_err']:.1e} "
              f"after one update; grads rel err {k['max_grad_rel_err']:.1e} (worst tensor), grad norm "
              f"{k['grad_norm_step0_rel_err']:.1e}; tolerance {k['rtol']:g}: ok (after the last step: "
              f"{k['final_loss_rel_err_max_rank']:.1e})")
    header = (f"{'':20} {'median ms':>9} {'min ms':>7} {'max ms':>7} {'cpu ms':>6} | {'fwd':>6} {'bwd':>6} "
              f"{'sync':>5} {'step':>6} {'zero':>5} | {'collectives':>11}")
    print(header)
    print("-" * len(header))
    for name, r in out["impl"].items():
        ph = r["phase_median_s"]
        print(f"{name:20} {r['median_s'] * 1e3:9.1f} {r['min_s'] * 1e3:7.1f} {r['max_s'] * 1e3:7.1f} "
              f"{r['cpu_median_s'] * 1e3:6.1f} | {ph['forward'] * 1e3:6.1f} {ph['backward'] * 1e3:6.1f} "
              f"{ph['sync'] * 1e3:5.1f} {ph['optimizer'] * 1e3:6.1f} {ph['zero_grad'] * 1e3:5.1f} | "
              f"{r['collectives_per_step']['calls']:11d}")
    print("(step: slowest rank; cpu: CPU time a rank spent in the step, its Gloo threads included; phases: per-rank "
          "medians, 'fwd' includes the loss, 'step' = clip + AdamW; collectives: calls per step on a rank, "
          "DTensor's counted by CommDebugMode)")
    load = out["machine"]["loadavg_1min_before_after"]
    print(f"wall {out['wall_s']:.0f} s; 1-min load average {load[0]:.1f} before, {load[1]:.1f} after "
          f"(the ranks themselves add {args.ranks})")
    for mode, c in out["comparisons"].items():
        label = "tp only" if mode == "tp" else "tp + sequence parallel"
        print(f"ratio ours/dtensor step time = {c['ratio_step_time']:.2f} ({label}; paired median "
              f"{c['paired_ratio_median']:.2f}, min {c['ratio_min_step_time']:.2f}, cpu {c['ratio_cpu_time']:.2f})")


def main(argv=None) -> int:
    return run_and_report(_rank_main, parse_args(argv), summarize, print_report)


if __name__ == "__main__":
    sys.exit(main())
