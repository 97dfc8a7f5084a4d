"""What a run will read, write and allocate, checked before any rank starts.

:func:`validate` judges the config alone; these checks look at the machine: the data files (their
dtype, ids against the vocabulary, their length against the sampler's window), the folders the
run writes (the run directory, the corpus cache), the environment a launcher leaves (``RANK`` /
``WORLD_SIZE`` without one makes a plain ``bigtrain train`` wait for peers that never come), and
the memory the planner's model says the run needs. ``bigtrain train`` and ``bigtrain check`` call
:func:`check_environment` and :func:`preflight` before they launch anything; each problem names
the field (or variable) and a fix, and the CLI exits 2 on them without a traceback. The data's
checks are :mod:`bigtrain.data_checks`, the folders' :mod:`bigtrain.writable`.

Nothing here creates a file or folder: writability is probed with a temporary file that is removed
at once, in the nearest folder that already exists.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Mapping

from bigtrain.config import Config, ConfigError
from bigtrain.data_checks import data_problems, held_out_source_problems
from bigtrain.families import family_of
from bigtrain.families.own import none_for
from bigtrain.writable import writable_dir_problem

LAUNCHER_MARKERS = ("TORCHELASTIC_RUN_ID", "SLURM_PROCID", "OMPI_COMM_WORLD_RANK", "PMI_RANK",
                    "PMIX_RANK", "MV2_COMM_WORLD_RANK")


# -- the environment ---------------------------------------------------------------------------------
def environment_problems(env: Mapping[str, str] = os.environ) -> tuple[list[str], list[str]]:
    """(problems, warnings) about the torch.distributed variables a launcher sets, or left behind."""
    rank, world = env.get("RANK"), env.get("WORLD_SIZE")
    unset = "unset RANK WORLD_SIZE MASTER_ADDR MASTER_PORT to train in this one process"
    if rank is None or world is None:
        if rank is None and world is None:
            return [], []
        present = "RANK" if world is None else "WORLD_SIZE"
        return [], [f"environment: {present} is set without {'WORLD_SIZE' if world is None else 'RANK'}, so no "
                    f"launcher started this process (a leftover?); ignoring it and running in one process"]
    numbers = {}
    problems = []
    for name, text in (("RANK", rank), ("WORLD_SIZE", world)):
        try:
            numbers[name] = int(text)
        except ValueError:
            problems.append(f"environment: {name} = '{text}' is not a whole number; {unset}, "
                            f"or start the ranks with torchrun")
    if problems:
        return problems, []
    r, n = numbers["RANK"], numbers["WORLD_SIZE"]
    if n < 1 or not 0 <= r < n:
        return [f"environment: RANK = {r} and WORLD_SIZE = {n}: need WORLD_SIZE >= 1 and 0 <= RANK < WORLD_SIZE; "
                f"{unset}"], []
    if n == 1:
        return [], []
    addr, port = env.get("MASTER_ADDR"), env.get("MASTER_PORT")
    if not addr or not port:
        missing = [k for k, v in (("MASTER_ADDR", addr), ("MASTER_PORT", port)) if not v]
        are = "is" if len(missing) == 1 else "are"
        return [f"environment: RANK = {r} and WORLD_SIZE = {n} are set but {' and '.join(missing)} {are} not, "
                f"so no launcher started this process (leftovers of an earlier shell?); {unset} (bigtrain "
                f"train starts its own ranks), or launch with torchrun"], []
    if not port.isdigit() or not 0 < int(port) < 65536:
        return [f"environment: MASTER_PORT = '{port}' is not a port number (1-65535); {unset}"], []
    if not any(k in env for k in LAUNCHER_MARKERS):
        return [], [f"environment: RANK = {r}, WORLD_SIZE = {n}, MASTER_ADDR = {addr}:{port} are set but no launcher "
                    f"(torchrun, SLURM, MPI) marked this process: this rank will wait up to distributed.timeout_s "
                    f"for {n - 1} other rank(s) to join. If these are leftovers, {unset}"]
    return [], []


def check_environment(env: Mapping[str, str] = os.environ) -> list[str]:
    """Raise a ConfigError on the environment's problems; return its warnings."""
    problems, warnings = environment_problems(env)
    if problems:
        raise ConfigError(problems)
    return warnings


# -- memory ----------------------------------------------------------------------------------------
def preflight(cfg: Config, output_dir: str | Path, output_name: str = "--output-dir",
              local_ranks: int = 1, cuda: bool = False, check_size: bool = True) -> list[str]:
    """Raise a ConfigError naming every problem with the data, the output folder and the size of
    the run (not with ``check_size=False``: ``bigtrain train --force``); return warnings (the caller
    prints them)."""
    from bigtrain.plan.refit import size_problems_and_fixes

    problems = data_problems(cfg) + held_out_source_problems(cfg)
    out = writable_dir_problem(output_dir, output_name)
    if out:
        problems.append(out)
    if not check_size:
        size, warnings = [], []
    else:
        nvme_dir = os.path.expanduser(cfg.offload.nvme_dir) if cfg.offload.nvme_dir else str(Path(output_dir) / "offload")
        family = family_of(cfg)
        if family.size_problems is None and family.planner_config is None and not family.llama_fallbacks:
            size, warnings = [], [none_for(family, "size_problems", "no size check before launch (whether the model "
                                           "fits this machine's memory)", "the run finds out when it runs")]
        elif family.size_problems is not None:
            from bigtrain.plan.fit import machine_memory

            size, warnings = family.size_problems(cfg, local_ranks, cuda, nvme_dir=nvme_dir, machine=machine_memory(cuda))
        elif family.planner_config is not None:  # priced as bigtrain's Llama of the same shapes
            size, warnings = size_problems_and_fixes(family.planner_config(cfg), local_ranks, cuda, nvme_dir=nvme_dir,
                                                     runs_as=cfg)
            said = (f"model.family = '{cfg.model.family}', priced as bigtrain's Llama of the same shapes (the model.* "
                    f"fields named here are its own sizes under bigtrain's names)")
            size, warnings = [f"{said}: {p}" for p in size], [f"{said}: {w}" for w in warnings]
        else:
            size, warnings = size_problems_and_fixes(cfg, local_ranks, cuda, nvme_dir=nvme_dir)
    problems += size
    if problems:
        raise ConfigError(problems)
    return (layout_warnings(cfg) + init_from_tokenizer_warnings(cfg) + init_from_position_warnings(cfg)
            + held_out_warnings(cfg) + schedule_warnings(cfg) + warnings)


def init_from_position_warnings(cfg: Config) -> list[str]:
    """A Hugging Face family's model.hf_config that changes only the positions of model.init_from's
    folder (a context extension: bigtrain.families.hf.init_from_position_changes)."""
    if cfg.model.family != "hf" or not cfg.model.init_from:
        return []
    from bigtrain.families.hf import init_from_position_changes

    return init_from_position_changes(cfg)


def schedule_warnings(cfg: Config) -> list[str]:
    """A warm-up as long as the run: the learning rate rises the whole run and never reaches
    optim.lr (a preset's 100-step warm-up under a short --train.steps, without a word). One as long
    as the run reaches optim.lr at its last step: not said ("ends at 0.003, not optim.lr = 0.003;
    lower optim.warmup_steps (e.g. 1)" was said of warmup_steps = train.steps = 1)."""
    o, t = cfg.optim, cfg.train
    if o.warmup_steps > t.steps > 0:
        reached = o.lr * t.steps / o.warmup_steps
        return [f"optim.warmup_steps = {o.warmup_steps} > train.steps = {t.steps}: the learning rate rises for the "
                f"whole run and ends at {reached:.3g}, not optim.lr = {o.lr:g}; lower optim.warmup_steps (e.g. "
                f"{max(1, t.steps // 10)}) or train longer"]
    return []


def held_out_warnings(cfg: Config) -> list[str]:
    """A held-out slice nothing evaluates: data.val_fraction takes its tokens from training, and with
    train.eval_every = 0 no eval_loss is ever logged (the opposite, eval_every without a slice, is
    refused by validation)."""
    d, t = cfg.data, cfg.train
    if d.val_source and t.eval_every == 0 and family_of(cfg).reads_tokens:
        return [f"data.val_source = '{d.val_source}' is never evaluated: train.eval_every = 0 (no eval_loss is logged); "
                f"set train.eval_every, e.g. {max(1, t.steps // 10)}"]
    if d.val_fraction > 0 and t.eval_every == 0 and family_of(cfg).reads_tokens:
        return [f"data.val_fraction = {d.val_fraction:g} holds out the corpus's last tokens from training, but "
                f"train.eval_every = 0 never evaluates them (no eval_loss is logged); set train.eval_every, e.g. "
                f"{max(1, t.steps // 10)}, or data.val_fraction = 0"]
    return []


def init_from_tokenizer_warnings(cfg: Config) -> list[str]:
    """A model started from a Hugging Face folder that holds a tokenizer, trained on other ids: its
    embedding rows mean that tokenizer's tokens. `--model.init_from=hf:FOLDER` with the default
    data.tokenizer = 'bytes' fine-tuned a pretrained model on byte ids without a word (a user of
    transformers expects the folder's tokenizer to come with its model)."""
    from bigtrain.checkpoint.hf import hf_folder
    from bigtrain.data.tokenizer import BYTES, HF_FILE, file_digest, tokenizer_file

    folder = hf_folder(cfg.model.init_from)
    if folder is None or cfg.data.source.endswith((".bin", ".npy")):  # ids given as they are
        return []
    theirs = folder / HF_FILE
    if not theirs.is_file():
        return []
    fix = f"set data.tokenizer = '{folder}' to train on the model's own tokens"
    if cfg.data.tokenizer == BYTES:
        return [f"model.init_from's folder has a tokenizer ({theirs}), but data.tokenizer = 'bytes': the model is "
                f"trained on byte ids (0-255), which its embedding reads as other tokens; {fix}"]
    try:
        ours = tokenizer_file(cfg.data.tokenizer)
        same = ours.is_file() and file_digest(ours) == file_digest(theirs)
    except OSError:
        return []  # an unreadable data.tokenizer is refused by name elsewhere
    if same or not ours.is_file():
        return []
    return [f"data.tokenizer = '{cfg.data.tokenizer}' is not the tokenizer beside model.init_from's weights "
            f"({theirs} holds another file): if its ids are not that tokenizer's, the model reads them as other "
            f"tokens; {fix}"]


def layout_warnings(cfg: Config) -> list[str]:
    """Layouts that run but do not do what their name promises."""
    p, offload = cfg.parallel, cfg.offload
    # ZeRO's group is dp x cp x sp (the ranks of cp and sp hold replicas too): cp = 4 at dp = 1 shards 4 ways,
    # and the warning told such a run that nothing was saved and to set zero = 0 (4x the states a rank holds).
    alone = p.dp == 1 and p.cp == 1 and p.sp == 1
    if p.zero and alone and offload.optimizer == "none" and offload.params == "none":  # offload runs on ZeRO's engine
        return [f"parallel.zero = {p.zero} with parallel.dp = 1: ZeRO shards over the data-parallel ranks, so one "
                f"rank holds everything and nothing is saved (it only adds the engine's work; parallel.cp and "
                f"parallel.sp, whose ranks it shards over too, are 1); use parallel.dp > 1 or parallel.zero = 0"]
    return []


def print_warnings(warnings: list[str]) -> None:
    """On stderr, once: under a launcher every rank finds the same warnings, and rank 0 says them;
    in ranks that ``bigtrain train`` or ``check`` started, none does: the launching process said them
    before the launch (from the same resolved config), and its rank 0 said each a second time."""
    from bigtrain.distributed.launch import launched_by_bigtrain

    if os.environ.get("RANK", "0") != "0" or launched_by_bigtrain():
        return
    for text in warnings:
        print(f"bigtrain: warning: {text}", file=sys.stderr)


def check_inputs(cfg: Config, output_dir: str | Path, output_name: str, check_size: bool = True) -> list[str]:
    """:func:`preflight` for this process: the ranks this machine runs (the launcher's local world, or
    the layout's when bigtrain launches), on CUDA if the run will be (``check_size=False``:
    ``--force``, no size check); raises a ConfigError, returns warnings."""
    import torch

    from bigtrain.distributed.launch import launched_externally

    if launched_externally():
        local = int(os.environ.get("LOCAL_WORLD_SIZE") or os.environ["WORLD_SIZE"])
    else:
        local = cfg.parallel.world_size
    cuda = cfg.train.device == "cuda" or (cfg.train.device == "auto" and torch.cuda.is_available())
    return preflight(cfg, output_dir, output_name, local_ranks=local, cuda=cuda, check_size=check_size)
