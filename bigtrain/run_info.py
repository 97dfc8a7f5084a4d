"""What identifies a run and what the planner expected of it, recorded in ``summary.json`` at the
end and read by the report: the config's hash, the code (git commit) and torch it ran with, the
layout, the data, and the planner's prediction of its step time and per-rank memory for this
machine's hardware profile (``bigtrain plan`` for the same layout), to set beside what was measured.
"""

from __future__ import annotations

import hashlib
import json
import platform
import subprocess
from pathlib import Path

from bigtrain.config import Config


def config_hash(cfg: Config) -> str:
    """12 hex digits of the resolved config: runs with the same settings have the same hash."""
    return hashlib.sha256(json.dumps(cfg.to_dict(), sort_keys=True).encode()).hexdigest()[:12]


def git_commit(where: Path = Path(__file__).parent) -> str | None:
    """The commit of the checkout bigtrain runs from (with '+dirty' for uncommitted edits); None
    outside a git checkout (an installed wheel) or without git."""
    try:
        head = subprocess.run(["git", "-C", str(where), "rev-parse", "--short=12", "HEAD"], capture_output=True,
                              text=True, timeout=5)
        if head.returncode != 0:
            return None
        dirty = subprocess.run(["git", "-C", str(where), "status", "--porcelain", "--untracked-files=no"],
                               capture_output=True, text=True, timeout=5)
    except (OSError, subprocess.SubprocessError):
        return None
    return head.stdout.strip() + ("+dirty" if dirty.stdout.strip() else "")


def layout_text(cfg: Config, cuda: bool = False) -> str:
    """``dp=2 tp=1 pp=1 sp=1 zero=3 fp32 ...``: the planner's description of the configured layout as
    it runs on a CUDA device (``cuda``) or a CPU (``compile.enabled = 'auto'`` compiles on one only)."""
    from bigtrain.plan.fit import _layout

    return _layout(cfg, cuda).describe()


def identity(cfg: Config, cuda: bool = False) -> dict:
    import torch

    return {"config_hash": config_hash(cfg), "git_commit": git_commit(), "torch": torch.__version__,
            "python": platform.python_version(), "layout": layout_text(cfg, cuda)}


def prediction(cfg: Config, cuda: bool) -> dict | None:
    """The planner's step time, tokens/s and worst-rank memory (params, grads, optimizer,
    activations) of this config's layout on this machine's profile; None where it models no such run."""
    from bigtrain.plan.hardware import local_hardware
    from bigtrain.plan.fit import _layout
    from bigtrain.plan.hardware import get_profile
    from bigtrain.plan.layout import Cluster
    from bigtrain.plan.model import ModelSpec
    from bigtrain.plan.search import evaluate

    hardware = local_hardware() if cuda else "cpu"
    try:
        plan = evaluate(ModelSpec.from_model_config(cfg.model, cfg.data.seq_len, device="cuda" if cuda else "cpu"), _layout(cfg, cuda),
                        Cluster.build(cfg.parallel.world_size, get_profile(hardware)), cfg.train.global_batch)
    except Exception:  # noqa: BLE001 - a layout the planner does not model is no reason to fail a finished run
        return None
    worst = plan.memory  # the worst rank's
    return {"hardware": hardware, "step_time_s": plan.time.step_time_s, "tokens_per_s": plan.time.tokens_per_s,
            "mem": {"params": worst.params, "grads": worst.grads, "optimizer": worst.optimizer,
                    "activations": worst.activations}, "peak_bytes": worst.peak}
