"""Resuming on every rank: pick the checkpoint, check it against the run, load it, agree.

Every rank walks the checkpoints whose manifests verify, newest first. Before loading one, the
ranks all-gather its step: ranks that see different checkpoints (no shared filesystem, a copy that
lags) would otherwise train on from different steps, so a mismatch stops every rank naming each
one's step. Then they check its files' checksums together, each rank its share of the files, and
give it up together if any share does not verify: a run reads the checkpoint once to verify it,
not once per rank (every rank hashed every file: at 64 ranks, 64 times a 7B model's 84 GB of
weights and Adam state from a shared filesystem before the first step). A checkpoint that verifies
but fails to load on any rank (a truncated shard whose manifest was rewritten, a DCP file of
another model) is given up by all ranks together, with a warning, for the next older one. With
``'auto'`` and no checkpoint at all the run starts fresh; with checkpoints none of which serves, or
an explicit path that does not, it stops (a half-loaded model must not train).
"""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any

import torch

from bigtrain.checkpoint.commit import (CorruptCheckpoint, is_checkpoint_of, list_checkpoints, newest_valid_checkpoint,
                                        record_rollback, remove_later_checkpoints, valid_checkpoints, verify_files)
from bigtrain.checkpoint.compat import compare_configs
from bigtrain.distributed.comm import CollectiveError
from bigtrain.parallel.parallel_model import persistent_buffers


class ResumeError(ValueError):
    """A checkpoint that cannot serve the run, nothing to resume from, ranks that disagree, or a fresh
    run in a directory that holds another's checkpoints (exit 1)."""


def agree_on_step(world, step: int, device: torch.device | str) -> None:
    """Raise on every rank, naming each rank's step, unless all ranks pass the same ``step``."""
    if world.size == 1:
        return
    mine = torch.tensor([step], dtype=torch.int64, device=device)
    everyone = torch.empty(world.size, dtype=torch.int64, device=device)
    world.all_gather(everyone, mine, tag="resume_step")
    steps = everyone.tolist()
    if len(set(steps)) > 1:
        seen = ", ".join(f"rank {r}: {f'step {s}' if s >= 0 else 'none'}" for r, s in enumerate(steps))
        raise ResumeError(f"the ranks found different checkpoints to resume from ({seen}); every rank must see the "
                          f"same run directory (a shared filesystem), or give checkpoint.resume one checkpoint's "
                          f"path that every rank can read")


def files_verified(world, path: Path, meta: dict[str, Any], device) -> bool:
    """Whether every file of the checkpoint at ``path`` (its manifest ``meta`` read) matches its
    checksum, each rank of ``world`` hashing its share (:func:`verify_files`), agreed by all; where
    not, every rank warns and skips it (the rank that found it names the file)."""
    try:
        verify_files(path, meta, (world.rank, world.size))
        problem = None
    except CorruptCheckpoint as e:
        problem = str(e)
    if world.size == 1:
        bad = [0] if problem else []
    else:
        flags = torch.empty(world.size, dtype=torch.int32, device=device)
        world.all_gather(flags, torch.tensor([int(problem is not None)], dtype=torch.int32, device=device),
                         tag="resume_verify")
        bad = [r for r, flag in enumerate(flags.tolist()) if flag]
    if not bad:
        return True
    found = problem or f"{path}: rank {bad[0]} found a file whose checksum does not match"
    warnings.warn(f"skipping corrupt checkpoint: {found}", stacklevel=3)
    return False


def _all_loaded(world, ok: bool, device) -> bool:
    if world.size == 1:
        return ok
    failed = torch.tensor([0 if ok else 1], dtype=torch.int32, device=device)
    world.max(failed, tag="resume_load")
    return not int(failed.item())


def resume_checkpoint(trainer, where: str, run_id: str | None) -> tuple[Path, dict[str, Any]] | None:
    """Load the checkpoint ``where`` names ('auto': the newest of this run's) into ``trainer``'s
    model, optimizer and loss scaler, collectively; its (path, manifest), or None for a fresh start."""
    world, device = trainer.mesh.comm("world"), trainer.device
    source = trainer.checkpoint_root if where == "auto" else Path(where)
    candidates = valid_checkpoints(source, run_id if where == "auto" else None, files=False)
    tried = []
    while True:
        found = next(candidates, None)
        agree_on_step(world, int(found[1]["step"]) if found else -1, device)
        if found is None:
            break
        path, meta = found
        if not files_verified(world, path, meta, device):
            continue
        _check_serves(trainer, path, meta)
        # DCP is imported when there is a checkpoint to load, not with every run that might resume
        # (bigtrain.checkpoint.writer says why).
        from torch.distributed.checkpoint.api import CheckpointException

        from bigtrain.checkpoint.sharded import ChunkReader

        try:
            reader = ChunkReader(path)
            if trainer.family.build_meta is not None:  # a decoder (a DLRM's tables are config fields)
                check_same_entries(trainer.family.build_meta(trainer.cfg), reader, path)
            trainer.parallel.load_sharded(reader)
            error = None
        except (CollectiveError, ResumeError):  # ResumeError: every rank finds it, from the same files
            raise
        except (Exception, CheckpointException) as e:  # noqa: BLE001 - DCP raises a BaseException
            error = " ".join(str(e).split())[:400]
            tried.append(f"{path.name}: {error}")
            _finish_like_the_others(trainer.engine)
        if _all_loaded(world, error is None, device):
            if trainer.engine.scaler is not None and meta.get("loss_scaler"):
                trainer.engine.scaler.load_state_dict(meta["loss_scaler"])
            # A roll-back is a path naming this checkpoint; a folder the run fell back in removes nothing.
            if trainer.is_main and where != "auto" and Path(where).resolve() == path.resolve():
                _leave_later_checkpoints(trainer.checkpoint_root, path, int(meta["step"]))
            return path, meta
        warnings.warn(f"checkpoint {path} verifies but failed to load ({error or 'on another rank'}); "
                      f"falling back to the previous one", stacklevel=2)
    if where == "auto" and not tried and not list_checkpoints(source):
        return None
    if tried:
        # Each of them verified (its files are whole as written): what fails is more likely this run's
        # settings or code against them than the files, and removing them would lose good checkpoints.
        raise ResumeError(f"checkpoint.resume = '{where}': no checkpoint under {source} loads ({'; '.join(tried)}); "
                          f"their files verify, so this run's settings (or code) more likely differ from those they "
                          f"were written with than the files are broken: resume with those settings (bigtrain train "
                          f"--output-dir RUN --resume reads RUN/config.toml), or give checkpoint.resume another "
                          f"checkpoint's path; remove them only to start afresh")
    raise ResumeError(f"checkpoint.resume = '{where}': {source} holds no checkpoint that verifies (see the warnings "
                      f"above); remove the broken ones to start afresh, or give checkpoint.resume a good one's path")


def _leave_later_checkpoints(root: Path, resumed: Path, step: int) -> None:
    """A run rolled back to an earlier checkpoint of its own (``checkpoint.resume`` = its path: past a
    loss spike, with other settings maybe) trains the later steps again, on another timeline. Its
    later checkpoints were kept, and the next 'auto' resume (a crash, a launcher's restart) loaded
    the abandoned timeline's newest step without a word: they are removed, with a line. (An 'auto'
    fall-back past newer checkpoints that do not verify or load removes nothing: the same steps
    trained again are the same run, and a failure may pass; rotation leaves them alone.)"""
    if not is_checkpoint_of(root, resumed):
        return
    removed = remove_later_checkpoints(root, step)
    record_rollback(root, resumed)  # a second roll-back to it, once the run went on, is refused before launch
    if removed:
        print(f"bigtrain: resumed from {resumed.name}: removed the later checkpoints {', '.join(removed)} (the run "
              f"trains those steps again; kept, a later resume would load them)", flush=True)


def _finish_like_the_others(engine) -> None:
    """A load ends with a collective on the ranks where it succeeded (ZeRO 1-2 gather the loaded
    masters into the compute weights); a rank whose load stopped early takes part in it too, so
    that all ranks meet in the agreement that follows rather than wait in different collectives.
    What it gathers is discarded: the next checkpoint is loaded over it."""
    refresh = getattr(engine, "refresh_compute_weights", None)
    if refresh is not None:
        refresh()


def _check_serves(trainer, path: Path, meta: dict[str, Any]) -> None:
    """The format (the trainer's family's entries), optimizer and model must match (an error); data
    and schedule changes warn (rank 0)."""
    wanted = trainer.checkpoint_format
    if meta.get("format") != wanted:
        raise ResumeError(f"{path} is an old-format checkpoint ({meta.get('format', 'full tensors in model.pt')}); "
                         f"this run loads sharded '{wanted}' checkpoints only: start the run afresh")
    check_same_model(trainer.cfg, trainer.engine.optim_spec.name, path, meta, warn=trainer.is_main)
    described, describes = meta.get("model_description"), trainer.model_description
    if trainer.is_main and described and describes and described != describes:  # shapes: check_same_entries
        changed = sorted(k for k in set(described) | set(describes) if described.get(k) != describes.get(k))
        warnings.warn(f"resuming from {path.name}: {trainer.cfg.model.hf_config} changed since the checkpoint was "
                      f"written ({', '.join(f'{k}: {described.get(k)!r} -> {describes.get(k)!r}' for k in changed[:6])}"
                      f"{' ...' if len(changed) > 6 else ''}): the run continues the checkpoint's weights with the "
                      f"model the file describes now", stacklevel=3)
    saved, now = meta.get("data"), trainer.data_extent()
    # (A checkpoint written before the fingerprint existed is compared on the counts it has.)
    differ = [k for k in (now or {}) if saved and k in saved and saved[k] != now[k]]
    if trainer.is_main and differ:  # the same data.source, another corpus
        d = trainer.cfg.data
        named = f"data.source = '{d.source}'" + (f" and data.val_source = '{d.val_source}'" if d.val_source else "")
        counts = (f"now give{'' if d.val_source else 's'} {now['train_tokens']:,} training and "
                  f"{now['held_out_tokens']:,} held-out tokens, {saved['train_tokens']:,} and "
                  f"{saved['held_out_tokens']:,} when the checkpoint was written"
                  if differ != ["fingerprint"] else
                  f"hold{'' if d.val_source else 's'} as many tokens as when the checkpoint was written, but other "
                  f"ones (edited in place, or tokenized again otherwise)")
        warnings.warn(f"resuming from {path.name}: {named} {counts}: the corpus changed, so the run trains on other "
                      f"data from here (possibly on tokens held out before; eval_loss before and after differ)",
                      stacklevel=3)


def check_same_model(cfg, optimizer: str, path: Path, meta: dict[str, Any], warn: bool) -> None:
    """The checkpoint's optimizer and model (the fields that give parameters their shapes: a read
    of fewer rows than were saved would succeed and cut a tensor short) must be the run's, an
    error; data and schedule changes warn where ``warn``. Shared by the decoder and DLRM resumes."""
    saved_by = meta.get("optimizer")
    if saved_by != optimizer:
        raise ResumeError(f"the checkpoint's optimizer state is {saved_by!r}'s but optim.name = '{optimizer}'; "
                         f"resume with optim.name = '{saved_by}'")
    errors, changes = compare_configs(meta.get("config", {}), cfg, path.name)
    if errors:
        raise ResumeError("; ".join(errors))
    if warn:
        for text in changes:
            warnings.warn(f"resuming from {path.name}: {text}", stacklevel=4)


def check_same_entries(whole, reader, path: Path) -> None:
    """The checkpoint's model entries are ``whole``'s (the run's model on the meta device): the same
    names and full shapes. A rank reads only the rectangles its layout holds, and a read of fewer
    rows than were saved succeeds, so the config fields :func:`check_same_model` compares are not
    enough: a checkpoint of 4 experts loaded into 2 (the first two kept), of experts with a wider
    MLP into narrower ones (cut), of a model with a shared expert into one without (dropped), and a
    Hugging Face model whose config.json was edited, all loaded without a word."""
    expected = {n: tuple(p.shape) for n, p in whole.named_parameters()}
    buffers = {n: tuple(b.shape) for n, b in persistent_buffers(whole).items()}
    saved = {n: tuple(e.size) for n, e in reader.entries.items() if not n.startswith("optim/")}
    problems = [f"{n} is {saved[n]} in the checkpoint and {shape} in this model"
                for n, shape in {**expected, **buffers}.items() if n in saved and saved[n] != shape]
    missing = [n for n in expected if n not in saved]  # a buffer older checkpoints lack: load_sharded says so
    extra = [n for n in saved if n not in expected and n not in buffers]
    for names, what in ((missing, "this model has {} that the checkpoint lacks"),
                        (extra, "the checkpoint holds {} that this model lacks")):
        if names:
            shown = ", ".join(names[:4]) + (f" and {len(names) - 4} more" if len(names) > 4 else "")
            problems.append(what.format(shown))
    if problems:
        raise ResumeError(f"{path} was written by another model: {'; '.join(problems[:6])}; resume with the "
                          f"model settings it was written with (model.* and, for model.family = 'hf', the "
                          f"config.json of model.hf_config), or start a new run in another --output-dir")


def resume_after_restart(resume: str, run_dir: Path) -> str:
    """``checkpoint.resume`` for a restarted round: the run directory's newest checkpoint.

    'auto' when the first round started afresh or resumed that way. After an explicit path, 'auto'
    only once the run has saved a checkpoint of its own; before that the restarted round starts from
    the path again, as the first one did (never from step 0 with fresh weights).
    """
    if resume in ("none", "auto"):
        return "auto"
    # Every rank asks: the manifests answer it (each rank hashing every file read the checkpoint
    # N times); 'auto' then verifies the files together and falls back past a corrupt one.
    return "auto" if newest_valid_checkpoint(run_dir / "checkpoints", files=False) is not None else resume
