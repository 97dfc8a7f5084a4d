"""What a hostile user found still losing or hiding (issue 29): a rank lost during a save, every
checkpoint corrupt, a stray file or link under a checkpoint's name, a still-full disk on resume, a
token file truncated under a running job, and two messages that named the wrong thing."""

from __future__ import annotations

import errno
import json
import multiprocessing as mp
import os
import pickle
import shutil
import signal
import subprocess
import tempfile
import uuid
from datetime import timedelta
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.distributed as dist

from bigtrain import checkpoint as ckpt
from bigtrain import train as train_module
from bigtrain.checkpoint import sharded as checkpoint_sharded
from bigtrain.cli import main
from bigtrain.metrics import read_metrics
from helpers import run_steps, tiny_config, trainer_on_rank


def _args(cache, out, *extra):
    return ["train", "--preset", "tiny", "--output-dir", str(out), "--logging.progress=false",
            "--logging.report=false", f"--data.cache_dir={cache}", "--data.max_bytes=400000",
            "--logging.log_every=1", *extra]


@pytest.fixture(scope="module")
def saved(corpus_cache, tmp_path_factory):
    """Four steps saving every 2: checkpoints step_00000002 and step_00000004."""
    out = tmp_path_factory.mktemp("saved") / "run"
    assert main(_args(corpus_cache, out, "--train.steps=4", "--checkpoint.every=2")) == 0
    return out


def _copy(run, tmp_path):
    out = tmp_path / "run"
    shutil.copytree(run, out, symlinks=True)
    return out


# -- a rank lost during a save is named like any collective's failure -------------------------------
def _save_with_rank_1_lost(rank, world, store, cfg, run_dir, how, conn):
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world,
                            timeout=timedelta(seconds=cfg.distributed.timeout_s))
    original = checkpoint_sharded.save_chunks  # the writer imports it when it saves

    def save_chunks(tmp, chunks, group):
        if rank == 1:  # killed (or frozen) while the ranks write their parts
            os.kill(os.getpid(), signal.SIGKILL if how == "dies" else signal.SIGSTOP)
        return original(tmp, chunks, group)

    checkpoint_sharded.save_chunks = save_chunks
    trainer = trainer_on_rank(rank, world, cfg, run_dir)
    run_steps(trainer, 1)
    try:
        trainer.save()
        conn.send_bytes(pickle.dumps(("saved", None)))
    except BaseException as e:  # noqa: BLE001 - what the rank would print goes to the test
        conn.send_bytes(pickle.dumps((type(e).__name__, str(e))))
    os._exit(0)


@pytest.mark.parametrize("how", ["dies", "freezes"])
def test_a_rank_lost_during_a_save_is_named_with_its_collective(how, corpus_cache, tmp_path):
    """Rank 0 used to get a 40-line traceback ending in _agree -> dist.all_reduce."""
    cfg = tiny_config(corpus_cache, "--parallel.dp=2", "--distributed.timeout_s=3")
    ctx = mp.get_context("fork")
    store = Path(tempfile.mkdtemp()) / uuid.uuid4().hex
    receive, send = ctx.Pipe(duplex=False)
    procs = [ctx.Process(target=_save_with_rank_1_lost, args=(r, 2, str(store), cfg, str(tmp_path), how, send))
             for r in range(2)]
    for proc in procs:
        proc.start()
    try:
        assert receive.poll(60), "rank 0 did not finish the failed save within 60 s"
        kind, text = pickle.loads(receive.recv_bytes())
    finally:
        for proc in procs:
            if proc.is_alive():
                os.kill(proc.pid, signal.SIGKILL)
            proc.join()
    assert kind == "CheckpointWriteError", text
    first = text.splitlines()[0]
    assert first.startswith("rank 0 at step 1: all_reduce on axis 'world' tag 'checkpoint' (4 B)"), text
    assert "in the group of ranks [0, 1]" in first and "last 8 collectives rank 0 completed" in text, text
    assert "while saving checkpoint step 1" in text and "no earlier checkpoint exists" in text, text
    assert "Traceback" not in text and len(text.splitlines()) <= 12, text
    assert not list((tmp_path / "checkpoints").iterdir())  # the partial save was removed


# -- checkpoints: all corrupt, a file or a link under a checkpoint's name -----------------------------
def test_every_checkpoint_corrupt_exits_2_before_launch(saved, tmp_path, capsys):
    """Manifests intact, a byte of every data file changed: the pre-launch check verifies the files too
    (it used to pass, and the rank stopped with exit 1)."""
    out = _copy(saved, tmp_path)
    for path in ckpt.list_checkpoints(out / "checkpoints"):
        data = sorted(path.glob("*.distcp"))[0]
        raw = bytearray(data.read_bytes())
        raw[len(raw) // 2] ^= 0xFF
        data.write_bytes(bytes(raw))
    before = (out / "metrics.jsonl").read_text()
    assert main(["train", "--output-dir", str(out), "--resume"]) == 2
    err = capsys.readouterr().err
    assert "--resume: nothing valid to resume from" in err and "checksum mismatch" in err, err
    assert (out / "metrics.jsonl").read_text() == before


def test_a_file_named_like_a_checkpoint_does_not_stop_every_resume(saved, tmp_path):
    """A regular file checkpoints/step_00000006 made every resume die at step 6's save."""
    out = _copy(saved, tmp_path)
    (out / "checkpoints" / "step_00000006").write_text("not a checkpoint")
    assert main(["train", "--output-dir", str(out), "--resume", "--train.steps=6", "--checkpoint.every=2"]) == 0
    assert [p.name for p in ckpt.list_checkpoints(out / "checkpoints")][0] == "step_00000006"
    ckpt.verify_checkpoint(out / "checkpoints" / "step_00000006")


def test_a_link_under_a_checkpoints_name_is_not_a_checkpoint(saved, tmp_path, monkeypatch, capsys):
    """A link step_00000010 was listed as the newest checkpoint and named 'intact' by a failed save."""
    out = _copy(saved, tmp_path)
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    (out / "checkpoints" / "step_00000010").symlink_to(elsewhere)
    assert [p.name for p in ckpt.list_checkpoints(out / "checkpoints")] == ["step_00000004", "step_00000002"]

    import torch.distributed.checkpoint.filesystem as dcp_files

    def full_disk(*args):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(dcp_files, "_write_item", full_disk)
    assert main(["train", "--output-dir", str(out), "--resume", "--train.steps=6", "--checkpoint.every=2"]) == 1
    err = capsys.readouterr().err
    assert "checkpoint step 6: no space left on device" in err and "step_00000004 is intact" in err, err
    assert elsewhere.is_dir() and (out / "checkpoints" / "step_00000010").is_symlink()  # untouched


# -- a still-full disk on resume ------------------------------------------------------------------------
@pytest.fixture
def small_disk(tmp_path):
    """A 16 MiB tmpfs (root only; skipped elsewhere)."""
    where = tmp_path / "disk"
    where.mkdir()
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=16m", "tmpfs", str(where)], capture_output=True)
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount a small tmpfs here: {mounted.stderr.decode().strip()}")
    try:
        yield where
    finally:
        subprocess.run(["umount", "-l", str(where)], check=False)


def test_resume_on_a_still_full_disk_says_so_and_leaves_the_run_as_it_was(saved, small_disk, capsys):
    out = small_disk / "run"
    shutil.copytree(saved, out)
    before = {p: p.read_bytes() for p in out.rglob("*") if p.is_file() and p.name != "run.lock"}
    with open(small_disk / "filler", "wb") as filler:  # the disk that filled up during the run
        try:
            while True:
                filler.write(b"\0" * (1 << 16))
                filler.flush()
        except OSError as e:
            assert e.errno == errno.ENOSPC
    assert main(["train", "--output-dir", str(out), "--resume", "--train.steps=8"]) == 1
    err = capsys.readouterr().err
    assert "could not be written (No space left on device)" in err and "free space" in err, err
    assert "Traceback" not in err
    after = {p: p.read_bytes() for p in out.rglob("*") if p.is_file() and p.name != "run.lock"}
    assert after == before  # no empty metrics.jsonl.tmp, no truncated config.toml


# -- a token file truncated under a running job ---------------------------------------------------------
def test_a_token_file_truncated_under_a_running_job_is_named(corpus_cache, tmp_path):
    """Reading a mapped page past the new end used to kill the process with SIGBUS, naming nothing."""
    data = tmp_path / "ids.bin"
    np.random.default_rng(0).integers(0, 256, size=200_000, dtype=np.uint16).tofile(data)
    trainer = trainer_on_rank(0, 1, tiny_config(corpus_cache, f"--data.source={data}"), tmp_path)
    run_steps(trainer, 1)
    os.truncate(data, 4096)  # a page: reading beyond it through the old mapping is SIGBUS
    with pytest.raises(Exception) as stopped:
        run_steps(trainer, 1)
    assert type(stopped.value).__name__ == "DataChanged"
    assert f"data.source: the token file {data} changed while the run read it: it has 4096 bytes, 400000" \
        in str(stopped.value)


def test_a_truncated_token_file_stops_train_with_one_line(corpus_cache, tmp_path, monkeypatch, capsys):
    data = tmp_path / "ids.bin"
    np.random.default_rng(0).integers(0, 256, size=200_000, dtype=np.uint16).tofile(data)
    original = train_module.Trainer.train_step

    def train_step(self, *args, **kwargs):
        if self.step == 2:
            os.truncate(data, 4096)
        return original(self, *args, **kwargs)

    monkeypatch.setattr(train_module.Trainer, "train_step", train_step)
    assert main(_args(corpus_cache, tmp_path / "run", f"--data.source={data}", "--train.steps=4")) == 1
    err = capsys.readouterr().err
    assert "bigtrain: data.source: the token file" in err and "Traceback" not in err, err
    assert [r["step"] for r in read_metrics(tmp_path / "run")] == [1, 2]  # the two steps before it


# -- messages that named the wrong thing ----------------------------------------------------------------
def test_invalid_values_of_fields_the_model_does_not_use_are_refused(corpus_cache, tmp_path, capsys):
    assert main(_args(corpus_cache, tmp_path / "run", "--embedding.sharding=FP32")) == 2
    err = capsys.readouterr().err
    assert "embedding.sharding = 'FP32': 'FP32' is not one of auto, table, row, column, data" in err, err
    assert not (tmp_path / "run").exists()


def test_parallel_auto_names_trains_own_field(corpus_cache, tmp_path, capsys):
    assert main(_args(corpus_cache, tmp_path / "run", "--parallel", "auto", "--world-size", "3")) == 2
    err = capsys.readouterr().err
    assert "--global-batch" not in err and "train.global_batch = 8 is not divisible" in err, err
    assert "set train.global_batch to a multiple of the world size (6 or 9)" in err


def test_a_full_disk_while_writing_run_files_is_one_line(corpus_cache, tmp_path, monkeypatch, capsys):
    """Any run file (config.toml, run.json, metrics.jsonl's rewrite) on a full disk: one line, exit 1,
    nothing half-written left beside it."""
    from pathlib import Path as P

    original = P.write_text

    def full(self, text, *args, **kwargs):
        if self.name.endswith(".tmp") and "config.toml" in self.name:
            original(self, text[:10], *args, **kwargs)
            raise OSError(errno.ENOSPC, "No space left on device")
        return original(self, text, *args, **kwargs)

    monkeypatch.setattr(P, "write_text", full)
    out = tmp_path / "run"
    assert main(_args(corpus_cache, out, "--train.steps=1")) == 1
    err = capsys.readouterr().err
    assert f"bigtrain: {out}/config.toml could not be written (No space left on device)" in err, err
    assert not [p.name for p in out.iterdir() if p.name.endswith(".tmp")]


@pytest.mark.parametrize("filled", ["segments.json", "metrics.jsonl"])
def test_a_disk_that_fills_during_training_is_one_line_not_a_traceback(filled, corpus_cache, tmp_path, monkeypatch,
                                                                       capsys):
    """The disk fills between steps (another job's files): the next save updates segments.json
    before its checkpoint, and each logged step appends to metrics.jsonl. Both were an OSError
    traceback (twice over: fit's finally updates the segment again), and segments.json's left an
    empty .segments.json.PID.tmp; now the run directory's one line and exit 1, as for config.toml.
    Seen on a 2 MiB tmpfs that another process kept full."""
    import builtins
    from pathlib import Path as P

    from bigtrain import metrics

    state = {"full": False}
    write_text, open_ = P.write_text, builtins.open

    def full_write_text(self, text, *args, **kwargs):
        if state["full"] and self.name.startswith(".segments.json"):
            write_text(self, "", *args, **kwargs)  # created, then nothing fits
            raise OSError(errno.ENOSPC, "No space left on device")
        return write_text(self, text, *args, **kwargs)

    def full_open(path, mode="r", *args, **kwargs):
        if state["full"] and "a" in mode and P(path).name == "metrics.jsonl":
            raise OSError(errno.ENOSPC, "No space left on device")
        return open_(path, mode, *args, **kwargs)

    real_save = train_module.Trainer.save

    def fill_at_the_second_save(self):  # step 4: step_00000002 is saved
        state["full"] = self.step >= 4 and filled == "segments.json"
        return real_save(self)

    monkeypatch.setattr(P, "write_text", full_write_text)
    monkeypatch.setattr(train_module.Trainer, "save", fill_at_the_second_save)
    if filled == "metrics.jsonl":
        real_write = metrics.MetricsLog.write

        def fill_at_step_3(self, record):
            state["full"] = record.get("step", 0) >= 3
            return real_write(self, record)

        monkeypatch.setattr(metrics.MetricsLog, "write", fill_at_step_3)
        monkeypatch.setattr(metrics, "open", full_open, raising=False)
    out = tmp_path / "run"
    assert main(_args(corpus_cache, out, "--train.steps=6", "--checkpoint.every=2")) == 1
    err = capsys.readouterr().err
    assert f"bigtrain: {out}/{filled} could not be written (No space left on device)" in err, err
    assert "Traceback" not in err and "continue with --resume" in err
    assert not [p.name for p in out.iterdir() if p.name.endswith(".tmp")]
    monkeypatch.undo()  # room again: the run goes on
    assert main(["train", "--output-dir", str(out), "--resume"]) == 0
    assert [r["step"] for r in read_metrics(out)] == list(range(1, 7))
