"""Elastic restarts: what a rank that torchrun's agent restarts needs to rejoin its group and go on.

``bigtrain train --max-restarts N`` runs the ranks under torchrun with ``--max-restarts N``. When a
rank dies (killed, out of memory, a lost peer) the agent stops the others and starts the whole group
again, with ``TORCHELASTIC_RESTART_COUNT`` one higher and the same command line. Two things make that
new round a continuation of the same run rather than a second failure or a silent restart at step 0:

- its process group must not meet the keys the previous round left in the store (:func:`round_store`);
- it resumes from the run directory's newest checkpoint
  (:func:`bigtrain.checkpoint.resume.resume_after_restart`).
"""

from __future__ import annotations

import os
from datetime import timedelta
from pathlib import Path
from typing import Mapping

import torch.distributed as dist

TORCH_ISSUE = "https://github.com/pytorch/pytorch/issues/135712"


def _int_env(env: Mapping[str, str], name: str, default: int) -> int:
    try:
        return int(env.get(name, default))
    except ValueError:
        return default


def restart_round(env: Mapping[str, str] = os.environ) -> int:
    """0 in a launcher's first round (or with no launcher), N after its N-th restart of the group."""
    return max(0, _int_env(env, "TORCHELASTIC_RESTART_COUNT", 0))


def shares_agent_store(env: Mapping[str, str] = os.environ) -> bool:
    """True when torchrun hands its ranks its own rendezvous TCPStore (its default since pytorch#128096, 2024)."""
    return env.get("TORCHELASTIC_USE_AGENT_STORE") == "True"


def round_store(world_size: int, timeout: timedelta, env: Mapping[str, str] = os.environ) -> dist.Store | None:
    """The store this rank's process group should use, or None for torch's own (``env://``).

    torchrun's c10d rendezvous shares its agent's TCPStore with the ranks and keeps that one store,
    on the same ``MASTER_PORT``, for every restart round. ``init_process_group`` names its keys the
    same way in every round, and a read of a key returns the value already there: a restarted rank
    that reads a peer's address before that peer has written it this round gets the address its
    killed predecessor left. Gloo picks the side of a pair that dials by comparing the two
    addresses, so that rank either dials a port nobody listens on (``connectFullMesh ... Connection
    refused``) or waits to be dialled by a peer that, comparing the true addresses, may wait too (a
    hang for the group's timeout); NCCL would read a stale unique id the same way. Torch's ranks add no per-round prefix under a shared store (its rendezvous handler
    assumes a fresh store per round, which the agent no longer makes). So each round gets its own
    key space here.

    The round number is the same on every rank only when one agent started them all: with several
    machines, an agent whose own ranks were healthy restarts them without counting a restart
    (``TORCH_ISSUE``), and rounds with different prefixes would never meet. There the fix is torch's
    ``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1`` (a fresh store each round; :func:`elastic_warnings`
    asks for it), and this returns None.
    """
    if not shares_agent_store(env) or _int_env(env, "GROUP_WORLD_SIZE", 1) != 1:
        return None
    client = dist.TCPStore(env["MASTER_ADDR"], int(env["MASTER_PORT"]), world_size, is_master=False,
                           timeout=timeout)
    return dist.PrefixStore(f"bigtrain/round_{restart_round(env)}/", client)


def elastic_warnings(env: Mapping[str, str] = os.environ) -> list[str]:
    """Restarts that would fail to re-form the group: several machines sharing the agent's store."""
    if (shares_agent_store(env) and _int_env(env, "TORCHELASTIC_MAX_RESTARTS", 0) > 0
            and _int_env(env, "GROUP_WORLD_SIZE", 1) > 1):
        return [f"environment: torchrun restarts groups (TORCHELASTIC_MAX_RESTARTS = "
                f"{env['TORCHELASTIC_MAX_RESTARTS']}) on {env['GROUP_WORLD_SIZE']} machines and shares its "
                f"rendezvous store with the ranks, so a restarted group can read the previous round's "
                f"addresses and fail to form ({TORCH_ISSUE}); export TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 "
                f"before torchrun on every machine"]
    return []


def restart_notice(resume: str, run_dir: Path, env: Mapping[str, str] = os.environ) -> str | None:
    """The line rank 0 prints when a restarted round begins: a restart is never silent."""
    if restart_round(env) == 0 or env.get("RANK", "0") != "0":
        return None
    where = f"the newest valid checkpoint in {run_dir / 'checkpoints'}" if resume == "auto" else f"'{resume}'"
    return (f"bigtrain: the launcher restarted the ranks after a failure (restart {restart_round(env)} of "
            f"{env.get('TORCHELASTIC_MAX_RESTARTS', '?')}); resuming from {where}")


def restarts_left(env: Mapping[str, str] = os.environ) -> int:
    """How many more times torchrun's agent would restart this group after a failure (0 outside
    one). With several machines an agent whose own ranks were healthy may not count a restart
    (``TORCH_ISSUE``): then more are counted here than are left, never fewer."""
    if "TORCHELASTIC_RUN_ID" not in env:
        return 0
    return max(0, _int_env(env, "TORCHELASTIC_MAX_RESTARTS", 0) - restart_round(env))


def stop_agent_restarts(env: Mapping[str, str] = os.environ, before=None) -> int | None:
    """After a refusal that every restart would repeat (the ranks' configs differ, the run folder is
    not shared: deterministic, found before anything trained), keep torchrun's agent from
    restarting the group: it restarts on any failed rank whatever its exit code, and only a
    success ends it otherwise. The first local rank of each machine sends its agent (its parent)
    SIGTERM, which makes the agent stop its ranks and exit non-zero without a restart. ``before``
    (the agent's pid): called first, since the agent's SIGTERM to this rank may come before a line
    printed after the kill is out. The pid signalled, or None: no restart left, not under torchrun's
    agent, or not the machine's first rank."""
    import signal

    agent = os.getppid()
    if restarts_left(env) == 0 or _int_env(env, "LOCAL_RANK", 0) != 0 or agent <= 1:
        return None
    if before is not None:
        before(agent)
    os.kill(agent, signal.SIGTERM)
    return agent
