"""A run folder has one owner (issue 29 item 4, issue 32 item 7): a lock that names its holder,
taken before anything is written and refused while held; ranks that stop when their launcher dies;
stops by signal that print one line and the documented exit code."""

from __future__ import annotations

import json
import os
import signal
import shutil
import socket
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from bigtrain.cli import main
from bigtrain.config import ConfigError
from bigtrain.metrics import read_metrics
from bigtrain.run_lock import LOCK_FILE, TOKEN_ENV, join_run_dir, take_run_dir
from helpers import descendant_pids

ROOT = Path(__file__).resolve().parents[1]


def _env() -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}


def _holder(run_dir: Path, then: str = "time.sleep(600)") -> subprocess.Popen:
    """Another process that takes ``run_dir`` (as a launcher does), says so on stdout, then runs ``then``."""
    code = textwrap.dedent(f"""
        import os, sys, time
        from bigtrain.run_lock import take_run_dir
        lock = take_run_dir({str(run_dir)!r}, command="bigtrain train --the-first-run")
        print(lock.token, flush=True)
        {then}
    """)
    proc = subprocess.Popen([sys.executable, "-c", code], env=_env(), stdout=subprocess.PIPE, text=True)
    assert proc.stdout.readline().strip(), "the holder did not take the folder"
    return proc


def _stop(proc: subprocess.Popen) -> None:
    proc.kill()
    proc.wait()


def _train(cache, out, *extra):
    return ["train", "--preset", "tiny", "--output-dir", str(out), "--logging.progress=false",
            "--logging.report=false", f"--data.cache_dir={cache}", "--data.max_bytes=400000", *extra]


# -- the lock ----------------------------------------------------------------------------------------
def test_a_held_folder_is_refused_naming_the_holder_and_recovered_when_it_is_gone(tmp_path):
    run = tmp_path / "run"
    holder = _holder(run)
    try:
        with pytest.raises(ConfigError) as refused:
            take_run_dir(run)
        text = str(refused.value)
        assert f"pid {holder.pid} on {socket.gethostname()}" in text and "bigtrain train --the-first-run" in text
        assert "that process is gone" not in text
    finally:
        _stop(holder)  # kill -9: the kernel drops its lock
    with take_run_dir(run, command="the second") as lock:  # recovered, and the file names the new holder
        assert json.loads((run / LOCK_FILE).read_text())["pid"] == os.getpid()
        assert lock.token == json.loads((run / LOCK_FILE).read_text())["token"]


def test_a_stale_lock_file_of_a_dead_process_is_taken_over(tmp_path):
    run = tmp_path / "run"
    run.mkdir()
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    (run / LOCK_FILE).write_text(json.dumps({"host": socket.gethostname(), "pid": int(dead.stdout), "token": "x"}))
    with take_run_dir(run):
        assert json.loads((run / LOCK_FILE).read_text())["pid"] == os.getpid()


def test_the_ranks_of_a_dead_launcher_keep_the_folder_and_are_named(tmp_path):
    """The launcher is gone (kill -9) but a rank it started still runs: the folder stays owned."""
    run = tmp_path / "run"
    rank = textwrap.dedent(f"""
        import os, time
        from bigtrain.run_lock import join_run_dir
        lock = join_run_dir({str(run)!r}, os.environ["{TOKEN_ENV}"])
        print("joined", flush=True)
        time.sleep(600)
    """)
    launcher = _holder(run, then=f"""import subprocess
        rank = subprocess.Popen([sys.executable, "-c", {rank!r}], env=dict(os.environ, {TOKEN_ENV}=lock.token),
                                stdout=subprocess.PIPE, text=True)
        assert rank.stdout.readline().strip() == "joined"
        print(rank.pid, flush=True)
        time.sleep(600)""")
    rank_pid = int(launcher.stdout.readline())
    try:
        _stop(launcher)
        with pytest.raises(ConfigError) as refused:
            take_run_dir(run)
        assert f"pid {launcher.pid}" in str(refused.value) and "that process is gone" in str(refused.value)
    finally:
        os.kill(rank_pid, signal.SIGKILL)
    deadline = time.monotonic() + 10
    while True:  # the rank's exit (reaped by whoever adopted it) frees the folder
        try:
            take_run_dir(run).release()
            break
        except ConfigError:
            assert time.monotonic() < deadline, "the folder stayed locked after its last holder died"
            time.sleep(0.1)


def test_a_rank_refuses_a_lock_that_another_run_took(tmp_path):
    run = tmp_path / "run"
    with take_run_dir(run):
        with pytest.raises(ConfigError, match="in use by another run"):
            join_run_dir(run, "not-this-runs-token")


def test_train_into_a_held_folder_is_refused_before_anything_is_written(corpus_cache, tmp_path, monkeypatch, capsys):
    """Two runs into one folder, and --overwrite of a folder a run trains in: refused before launch,
    naming the first run, with the folder as it was."""
    from bigtrain import cli
    from bigtrain.distributed import launch

    monkeypatch.setattr(cli, "run_rank", lambda *a: pytest.fail("a rank started"))
    monkeypatch.setattr(launch, "launch_local", lambda *a, **k: pytest.fail("torchrun started"))
    run = tmp_path / "run"
    run.mkdir()
    (run / "metrics.jsonl").write_text('{"step": 0, "loss": 5.0}\n')  # the live run's own records
    (run / "config.toml").write_text("# the live run's config\n")
    before = {p.name: p.read_bytes() for p in run.iterdir()}
    holder = _holder(run)
    try:
        for extra in ([], ["--overwrite"], ["--parallel.dp=2"], ["--overwrite", "--parallel.dp=2"]):
            assert main(_train(corpus_cache, run, *extra)) == 2
            err = capsys.readouterr().err
            assert f"is in use by another run: pid {holder.pid}" in err and "--the-first-run" in err, err
            after = {p.name: p.read_bytes() for p in run.iterdir()}
            assert after == {**before, LOCK_FILE: after[LOCK_FILE]}
    finally:
        _stop(holder)


def test_a_refused_run_leaves_no_lock_file_behind(corpus_cache, tmp_path, capsys):
    """A folder the lock created is removed with it when the run-directory rules refuse the run."""
    run = tmp_path / "typo"
    assert main(["train", "--output-dir", str(run), "--resume"]) == 2  # no run there: refused before the lock
    (run / "checkpoints").mkdir(parents=True)
    (run / "config.toml").write_text("")
    assert main(["train", "--preset", "tiny", "--output-dir", str(run), "--resume",
                 f"--data.cache_dir={corpus_cache}", "--data.max_bytes=400000"]) == 2
    assert "nothing valid to resume from" in capsys.readouterr().err
    assert sorted(p.name for p in run.iterdir()) == ["checkpoints", "config.toml"]


def test_a_folder_of_another_programs_files_under_a_runs_names_is_refused_not_removed(corpus_cache, tmp_path, capsys):
    """A folder that holds no bigtrain run but a checkpoints/ of another program (and a report.md):
    --overwrite removed the whole checkpoints/ folder by name, and a fresh run wrote its report over
    the file. Both are refused before launch now, naming the files; nothing in the folder changes."""
    run = tmp_path / "project"
    (run / "checkpoints" / "their-model").mkdir(parents=True)
    (run / "checkpoints" / "their-model" / "weights.bin").write_bytes(b"weights")
    (run / "report.md").write_text("my notes")
    before = sorted(str(p.relative_to(run)) for p in run.rglob("*"))
    for extra in (["--overwrite"], []):
        assert main(_train(corpus_cache, run, "--train.steps=1", *extra)) == 2
        err = capsys.readouterr().err
        assert f"--output-dir = '{run}' holds no bigtrain run" in err and "checkpoints/, report.md" in err, err
        assert ("--overwrite would remove them" if extra else "the run would write over them") in err
        assert sorted(str(p.relative_to(run)) for p in run.rglob("*") if p.name != LOCK_FILE) == before
    (run / "report.md").unlink()
    shutil.rmtree(run / "checkpoints" / "their-model")  # an empty checkpoints/ holds nothing to lose
    assert main(_train(corpus_cache, run, "--train.steps=1", "--overwrite")) == 0


def test_a_finished_run_releases_its_folder(corpus_cache, tmp_path):
    run = tmp_path / "run"
    assert main(_train(corpus_cache, run, "--train.steps=1")) == 0
    assert json.loads((run / LOCK_FILE).read_text())["pid"] == os.getpid()
    take_run_dir(run).release()  # nobody holds it any more
    assert main(_train(corpus_cache, run, "--train.steps=2", "--overwrite")) == 0
    assert (run / LOCK_FILE).exists()  # --overwrite keeps the lock file it holds


# -- the ranks of a dead launcher stop; signals stop a multi-rank run with one line -------------------


def _rank_pids(pid: int) -> list[int]:
    ranks = []
    for child in descendant_pids(pid):
        try:
            env = Path(f"/proc/{child}/environ").read_bytes().split(b"\0")
        except OSError:
            continue
        if any(v.startswith(b"RANK=") for v in env):
            ranks.append(child)
    return ranks


def _alive(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return False


def _start_training(cache, run, log: Path, *extra) -> subprocess.Popen:
    """``bigtrain train`` at dp=2 in a session of its own (so its process group can be killed), once
    both ranks are training (a logged step)."""
    cmd = [sys.executable, "-m", "bigtrain", *_train(cache, run, "--parallel.dp=2", "--train.steps=100000",
                                                     "--logging.log_every=1", *extra)]
    with open(log, "w") as out:
        job = subprocess.Popen(cmd, cwd=ROOT, env=_env(), stdout=subprocess.DEVNULL, stderr=out,
                               start_new_session=True)
    deadline = time.monotonic() + 240
    while not (run / "metrics.jsonl").is_file() or not (run / "metrics.jsonl").read_text().count("\n") >= 2:
        if job.poll() is not None or time.monotonic() > deadline:
            _kill_all(job)
            pytest.fail(f"the run did not start training (exit {job.poll()}):\n{log.read_text()[-3000:]}")
        time.sleep(0.2)
    return job


def _kill_all(job: subprocess.Popen) -> None:
    for pid in [job.pid, *descendant_pids(job.pid)]:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    job.wait()


@pytest.mark.slow
def test_kill_9_of_the_launchers_process_group_leaves_no_rank_alive(corpus_cache, tmp_path):
    """bigtrain and torchrun's agent killed together (the agent has its own process group, and dies
    with bigtrain): the ranks notice, save and exit within 2 x distributed.timeout_s."""
    timeout_s = 15
    run, log = tmp_path / "run", tmp_path / "log"
    job = _start_training(corpus_cache, run, log, f"--distributed.timeout_s={timeout_s}")
    ranks = _rank_pids(job.pid)
    try:
        assert len(ranks) == 2, f"ranks {ranks} under {job.pid}"
        with pytest.raises(ConfigError, match=f"in use by another run: pid {job.pid}"):
            take_run_dir(run)  # a --resume meanwhile is refused
        os.killpg(job.pid, signal.SIGKILL)
        job.wait()
        killed = time.monotonic()
        while any(_alive(pid) for pid in ranks) and time.monotonic() - killed < 2 * timeout_s:
            time.sleep(0.1)
        assert not any(_alive(pid) for pid in ranks), f"ranks alive {2 * timeout_s} s after:\n{log.read_text()[-3000:]}"
    finally:
        for pid in ranks:
            if _alive(pid):
                os.kill(pid, signal.SIGKILL)
    text = log.read_text()
    assert text.count("is gone; stopping at the next step boundary") == 2, text[-3000:]
    stopped = json.loads((run / "stopped.json").read_text())
    assert stopped["exit_code"] == 143 and (run / "checkpoints" / f"step_{stopped['step']:08d}").is_dir()
    take_run_dir(run).release()  # the folder is free again


@pytest.mark.slow
@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "SIGINT"])
def test_a_signal_to_the_launcher_alone_stops_every_rank_with_one_line(signum, corpus_cache, tmp_path):
    """kill -TERM / kill -INT to bigtrain's pid only (not its group): the ranks save a checkpoint of one
    step and stop, exit 128 + N, and stderr holds the one stop line and no traceback (torchrun's agent
    never sees the signal). Under --max-restarts 1, and not restarted: a stop on purpose leaves its
    ranks exiting 0 and its code in stopped.json, which the launcher returns. The NaN policy's stop
    takes the same path (run_rank's NonFiniteStop / Preempted branch, cli.py's recorded_exit_code):
    test_nan_policy.py's launch of it is in the extended lane, its stop in-process in the suite."""
    run, log = tmp_path / "run", tmp_path / "log"
    job = _start_training(corpus_cache, run, log, "--max-restarts", "1")
    try:
        os.kill(job.pid, signum)
        code = job.wait(timeout=240)
    finally:
        if job.poll() is None:
            _kill_all(job)
    err = log.read_text()
    assert code == 128 + signum, err[-3000:]
    assert "Traceback" not in err and "Exception" not in err, err[-3000:]
    assert "restart" not in err, err[-3000:]  # bigtrain says each restart, and a restarted round's stop
    lines = [line for line in err.splitlines() if line.startswith("bigtrain: stopped by")]
    assert len(lines) == 1 and signal.Signals(signum).name in lines[0] and "saved checkpoint" in lines[0], err
    stopped = json.loads((run / "stopped.json").read_text())
    assert (run / "checkpoints" / f"step_{stopped['step']:08d}" / "meta.json").is_file()


def test_an_output_dir_under_the_home_directory_is_the_folder_the_checks_read(corpus_cache, tmp_path, monkeypatch):
    """`--output-dir=~/runs/x`: no shell expands a '~' after '='. The checks before launch read the
    home's folder while the run wrote into a folder named '~' in the working directory."""
    home, work = tmp_path / "home", tmp_path / "work"
    home.mkdir()
    work.mkdir()
    monkeypatch.setenv("HOME", str(home))
    monkeypatch.chdir(work)
    assert main(_train(corpus_cache, "~/runs/x", "--train.steps=1")) == 0
    assert (home / "runs" / "x" / "metrics.jsonl").is_file() and not (work / "~").exists()
    assert main(["train", "--output-dir=~/runs/x", "--resume", "--train.steps=2", "--logging.report=false"]) == 0
    assert [r["step"] for r in read_metrics(home / "runs" / "x")] == [1, 2]


def test_overwrite_refuses_to_remove_an_input_the_run_reads_from_the_folder(corpus_cache, tmp_path):
    """``--data.tokenizer=RUN/tokenizer.json --overwrite`` (the earlier run's tokenizer copy, to train
    again with the same one): --overwrite removed it before the run read it. Refused before anything
    is removed, naming the field; an input outside what --overwrite removes is fine."""
    from bigtrain.run_dir import check_run_dir
    from helpers import tiny_config

    run = tmp_path / "run"
    run.mkdir()
    (run / "run.json").write_text(json.dumps({"run_id": "x"}))
    (run / "tokenizer.json").write_text("{}")
    (run / "notes.txt").write_text("mine")
    cfg = tiny_config(corpus_cache, f"--data.tokenizer={run / 'tokenizer.json'}")
    with pytest.raises(ConfigError, match=r"data.tokenizer = .*tokenizer.json.*copy it out of --output-dir"):
        check_run_dir(cfg, run, explicit_resume=False, overwrite=True)
    assert (run / "tokenizer.json").exists()
    cfg = tiny_config(corpus_cache, f"--data.source={run / 'notes.txt'}")
    assert check_run_dir(cfg, run, explicit_resume=False, overwrite=True) is None


def test_a_config_toml_the_user_wrote_in_the_run_folder_is_neither_removed_nor_replaced(corpus_cache, tmp_path, capsys):
    """--overwrite removed a config.toml the user wrote into --output-dir (their --config, even), and a
    fresh run wrote its resolved config over it, comments and all gone. Refused before launch now,
    the file as it was; the config.toml bigtrain wrote (its header) is still replaced."""
    from bigtrain.config import load_config
    from bigtrain.run_dir import CONFIG_HEADER, check_run_dir, clear_run, write_run_config

    run = tmp_path / "x"
    run.mkdir()
    mine = "# my experiment: lr sweep 3 of 5\n[optim]\nlr = 0.001\n"
    (run / "config.toml").write_text(mine)
    for extra in (["--config", str(run / "config.toml"), "--overwrite"], ["--overwrite"], []):
        args = _train(corpus_cache, run, "--train.steps=1", *extra)
        if "--config" in extra:
            args.remove("--preset"), args.remove("tiny")
        assert main(args) == 2, extra
        err = capsys.readouterr().err
        assert f"--output-dir = '{run}' holds a config.toml that bigtrain did not write" in err, err
        assert f"move it out of the folder (e.g. to {tmp_path / 'x.toml'}" in err, err
        assert ("--overwrite would remove it" in err) == ("--overwrite" in extra), err
        assert (run / "config.toml").read_text() == mine and sorted(p.name for p in run.iterdir()) == ["config.toml"]
    assert clear_run(run) == [] and (run / "config.toml").read_text() == mine
    cfg = load_config(preset="tiny")
    write_run_config(run, cfg)  # bigtrain's own (a launch that stopped before training): --overwrite takes it
    assert (run / "config.toml").read_text().startswith(CONFIG_HEADER + "\n[model]")
    assert check_run_dir(cfg, run, False, True) is None and clear_run(run) == ["config.toml"]
