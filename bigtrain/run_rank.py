"""One rank of ``bigtrain train`` (under bigtrain's launcher, a user's torchrun, or alone): join the
group, check that every rank runs one config in one run folder, train, and say how it ended."""

from __future__ import annotations

import sys
from pathlib import Path

from bigtrain.config import Config, ConfigError


def run_rank(cfg: Config, run_dir: Path, lock=None) -> int:
    """A rank: join the group, check it, train. ``lock``: what this process holds of the run folder
    (:func:`~bigtrain.run_dir.claim_run_dir`)."""
    from bigtrain.distributed.comm import CollectiveError
    from bigtrain.distributed.launch import launched_by_bigtrain, shutdown_distributed
    from bigtrain.distributed.mesh import Mesh
    from bigtrain.nonfinite import NonFiniteStop
    from bigtrain.preemption import Preempted
    from bigtrain.report import write_report
    from bigtrain.run_dir import SHARED_CHECK_WAIT_S, check_shared_run_dir
    from bigtrain.train import Trainer, write_summary

    # torch.distributed: only where a rank runs
    from bigtrain.distributed.join import check_same_config, join_group, world_comm

    info = join_group(cfg)
    try:
        # Several machines: their ranks must run one config (each reads its own file, flags and
        # --parallel auto's plan; checked before the mesh makes its groups, which ranks of other
        # layouts would not match) and write into one folder (a shared filesystem), or each
        # checkpoint would lack the parts of the ranks that wrote elsewhere. Refused here, before
        # anything trains; rank 0 names the ranks and the fix, the others stop quietly.
        world = world_comm(info.rank, info.world_size)
        stop, why = check_same_config(cfg, world, info.device)
        if not stop:
            stop, why = check_shared_run_dir(run_dir, world, info.device,
                                             wait_s=min(SHARED_CHECK_WAIT_S, cfg.distributed.timeout_s / 2))
        if stop:
            return refuse_before_training(why, world, info.device, run_dir, lock)
        mesh = Mesh.from_config(cfg.parallel, info.rank, info.world_size)
        trainer = Trainer(cfg, run_dir, mesh, info.device)
        try:
            history = trainer.fit()
        except CollectiveError as e:
            e.step = trainer.step
            raise
        except (NonFiniteStop, Preempted) as e:
            # Every rank stopped at the same step; rank 0 says so once. Under bigtrain's launcher the
            # code is read from stopped.json: exit 0, so torchrun neither restarts the group nor
            # prints a traceback (rank 0 exits with the code if it could not record it).
            ours = launched_by_bigtrain()
            if info.rank != 0:
                return 0 if ours else e.exit_code
            if ours:
                print(f"bigtrain: {e}", file=sys.stderr)
                return 0 if e.recorded else e.exit_code
            raise
        if info.rank == 0:
            write_summary(run_dir, trainer.summary())
            report = write_report(run_dir) if cfg.logging.report else None
            if history:
                steps = f"{trainer.step} step" + ("" if trainer.step == 1 else "s")
                if history[0].step > 0:  # resumed: '25 steps, loss 3.19 -> 3.01' read as the whole run's loss
                    first = history[0].step + 1
                    steps = (f"step {first}" if first == trainer.step else f"steps {first}-{trainer.step}") \
                        + f" (resumed at step {history[0].step})"
                print(f"bigtrain: {steps}, loss {history[0].loss:.4f} -> {history[-1].loss:.4f}; "
                      f"run directory {run_dir}" + (f", report {report}" if report else ""))
    finally:
        shutdown_distributed()
    return 0


def refuse_before_training(why: str | None, world, device, run_dir: Path, lock=None) -> int:
    """A rank's refusal found once the group formed, before anything trained (the ranks' configs
    differ, the run folder is not shared): the same on every rank, and the same in any restart.
    Each rank says its part (``why``; None: rank 0 names the fix) and leaves the run folder as it
    found it (``lock``: what taking it created, the folder and its run.lock, is removed). Then,
    once every rank has, each machine's torchrun agent is stopped if it has restarts left: it
    would restart the group on any failed rank and meet the same refusal each time
    (:func:`~bigtrain.distributed.elastic.stop_agent_restarts`). Exit code 2, as a refusal before launch."""
    import torch

    from bigtrain.distributed.elastic import stop_agent_restarts
    from bigtrain.distributed.launch import launched_by_bigtrain
    from bigtrain.run_dir import record_stop

    if why is not None:
        print(f"bigtrain: invalid configuration:\n{ConfigError(why)}", file=sys.stderr, flush=True)
    if lock is not None:  # before the agent may stop this process: a refused run leaves no lock file behind
        lock.release(remove_created=True)
    # Every rank has said its part and let go of the folder before an agent stops its ranks.
    world.max(torch.zeros(1, device=device), tag="refused")
    if launched_by_bigtrain() and world.rank == 0:  # bigtrain's launcher reads the code from here
        record_stop(run_dir, 2, why or "refused before training", 0)
    def say(agent: int) -> None:
        print(f"bigtrain: rank {world.rank}: stopped this machine's torchrun agent (pid {agent}) rather than let it "
              f"restart the ranks: a restart would be refused the same way", file=sys.stderr, flush=True)

    stop_agent_restarts(before=say)
    return 2
