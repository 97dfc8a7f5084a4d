"""Every command in README.md's shell blocks runs here, in README order, in one scratch folder, so
the README cannot rot. Each is run as written, with only its length cut: a few steps on a small slice
of the corpus (:func:`_short`).

Two ways. In this process (fast): commands that start several ranks run up to the launch (the config
is resolved, validated and pre-flighted as written, torchrun's world size and arguments are checked,
the launch itself recorded), and every quoted output (a ```console block: ``$ command`` then what it
prints) must be what the command prints now. In a fresh ``bash -l`` each (slow): every "Using it"
line after the activate line the README states, with nothing of this process's environment but
PYTHONPATH, launches included, as a new user would type them (the two launch lines, bigtrain's
and torchrun's, in the extended lane: tests/extended.txt says which suite launches make them). What
cannot run here is skipped by name, with the reason (:data:`SKIPPED`).
"""

import json
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from bigtrain.cli import main

ROOT = Path(__file__).resolve().parents[1]
RUNS_IN_ORDER = True  # later commands use what earlier ones made (tests/lanes.py keeps the file whole)
SKIPPED = {
    "bash scripts/setup.sh": "makes .venv and installs packages (needs the network); the train after it runs",
    "bash scripts/test.sh": "the whole test suite, which this test is part of",
    "torchrun --nnodes 2": "two machines of 8 ranks each (tests/test_multinode.py runs two torchrun machines of 2)",
}
IN_A_SHELL_ONLY = {  # what the in-process run leaves to the fresh shells
    "source ": "changes the shell, not this process",
    "torchrun ": "a launcher of its own: the fresh-shell test starts it",
    "scripts/fuzz-layouts.sh": "every layout it draws starts 2 to 8 ranks",
}
ACTIVATE = "source .venv/bin/activate"
# Lines whose launch another fresh-shell line already makes: the in-process test runs each as written
# up to its launch (config, validation, preflight, torchrun's world size and arguments), and the
# layouts themselves are proven against the reference on forked ranks (tests/test_zero.py,
# test_tensor_parallel.py (Megatron SP and Ulysses), test_pipeline_training.py). Each full launch
# costs 20-40 s of the suite's 15 minutes (2 cores, 4 shards).
SAME_LAUNCH = ("the launch of `bigtrain train --parallel.dp=2` (in a fresh shell in the extended lane; the same "
               "launch_local runs in the suite in tests/test_elastic.py) with another layout")
COVERED_BY_ANOTHER_LINE = {
    "bigtrain train --parallel auto --world-size 4":
        "the calibrate line after it runs this command, with --hardware-file added",
    "bigtrain train --parallel.dp=2 --parallel.zero=3 --precision.mode=bf16": SAME_LAUNCH,
    "bigtrain train --parallel.tp=2 --parallel.sequence_parallel=true": SAME_LAUNCH,
    "bigtrain train --parallel.dp=2 --parallel.sp=2": SAME_LAUNCH,
    "bigtrain train --parallel.pp=2 --parallel.pp_schedule=interleaved --parallel.pp_virtual=2 --train.micro_batch=2":
        SAME_LAUNCH,
}


def readme_commands() -> list[str]:
    """The command lines of README.md's ```bash blocks (comments dropped; ``a && b`` is two)."""
    text = (ROOT / "README.md").read_text()
    out = []
    for block in re.findall(r"```bash\n(.*?)```", text, re.S):
        for line in block.splitlines():
            line = re.sub(r"\s+#\s.*$", "", line).strip()
            if line and not line.startswith("#"):
                out += [part.strip() for part in line.split("&&")]
    return out


def console_blocks() -> list[tuple[str, list[str]]]:
    """(command, the lines it prints) of README.md's ```console blocks."""
    text = (ROOT / "README.md").read_text()
    out = []
    for block in re.findall(r"```console\n(.*?)```", text, re.S):
        first, *printed = block.rstrip("\n").splitlines()
        assert first.startswith("$ "), f"a console block starts with '$ command': {first!r}"
        out.append((first[2:], printed))
    return out


def _short(cache: str, argv: list[str]) -> list[str]:
    steps = 2 if "--resume" in argv else 1  # a resumed run goes on from the step before it
    return argv + [f"--train.steps={steps}", f"--data.cache_dir={cache}", "--data.max_bytes=400000",
                   "--logging.log_every=1", "--logging.progress=false", "--train.eval_batches=1"]


# bench --calibrate's length cut: one rank (its collectives are test_plan.py's), small shapes.
CALIBRATE_SHORT = ["--ranks", "1", "--matmul-size", "64", "--layers=1", "--dim=32", "--seq=8", "--batch=2"]


def _skip_reason(command: str, skipped: dict[str, str] = SKIPPED) -> str | None:
    return next((why for start, why in skipped.items() if command.startswith(start)), None)


COMMANDS = readme_commands()


@pytest.fixture(scope="module")
def workdir(tmp_path_factory):
    return tmp_path_factory.mktemp("readme")


@pytest.fixture
def launches(monkeypatch):
    """Multi-rank launches, recorded (world size, torchrun's arguments) instead of started."""
    import bigtrain.distributed.launch as launch

    seen = []

    def record(world, argv, **kw):
        seen.append((world, argv))
        if argv[0] == "check":  # what the ranks would leave for the launching process to print
            from bigtrain.check.cli import REPORT

            out = Path(argv[argv.index("--output-dir") + 1])
            (out / REPORT).write_text(json.dumps({"text": f"launch of {world} ranks recorded", "agree": True}))
        return 0

    monkeypatch.setattr(launch, "launch_local", record)
    return seen


def test_the_readme_has_its_commands():
    assert len(COMMANDS) >= 20 and COMMANDS[0] == "bash scripts/setup.sh"
    assert any(c.startswith("bigtrain generate") for c in COMMANDS)


@pytest.mark.parametrize("command", COMMANDS)
def test_readme_command_runs(command, workdir, corpus_cache, launches, monkeypatch, capsys):
    reason = _skip_reason(command) or _skip_reason(command, IN_A_SHELL_ONLY)
    if reason:
        pytest.skip(reason)
    monkeypatch.chdir(workdir)
    argv = shlex.split(command)
    if ">" in argv:  # bigtrain config ... > my.toml
        argv, target = argv[:argv.index(">")], argv[argv.index(">") + 1]
        assert main(argv[1:]) == 0, command
        Path(target).write_text(capsys.readouterr().out)
        return
    if argv[0].startswith("scripts/"):
        count = ["3"]
        env = {**os.environ, "PYTHONPATH": str(ROOT)}
        done = subprocess.run(["bash", str(ROOT / argv[0]), *count, *argv[2:]], env=env, capture_output=True,
                              text=True, timeout=300)
        assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
        return
    argv = argv[1:] if argv[0] in ("bigtrain", ".venv/bin/bigtrain") else pytest.fail(f"not a bigtrain command: {command}")
    if argv[:2] == ["bench", "--calibrate"]:
        argv = argv + CALIBRATE_SHORT
    if argv[0] in ("train", "check"):
        argv = _short(corpus_cache, argv)
        if argv[0] == "check":  # check compares steps of its own (--steps), not train.steps
            argv = [a for a in argv if not a.startswith("--train.steps=")] + ["--steps", "1"]
    code = main(argv)
    out, err = capsys.readouterr()
    assert code == 0, f"{command}\n{out[-2000:]}\n{err[-2000:]}"
    if argv[0] == "check":
        assert [world for world, _ in launches] == [4] and "launch of 4 ranks recorded" in out
    if argv[0] == "train":
        layout = [a for a in argv if a.startswith("--parallel.") and a.split("=")[0][11:] in ("dp", "tp", "pp", "sp")]
        ranks = 1
        for a in layout:
            ranks *= int(a.split("=")[1])
        if "--world-size" in argv:
            ranks = int(argv[argv.index("--world-size") + 1])
        if ranks > 1:
            assert [world for world, _ in launches] == [ranks], command
        elif ranks == 1:
            said = ("bigtrain: 1 step,", "bigtrain: 2 steps,", "bigtrain: step 2 (resumed at step 1),")  # --resume: 1 more
            assert not launches and any(s in out for s in said), out[-1000:]
    if argv[0] == "generate":
        assert out.startswith("def ") and len(out) > 100


@pytest.mark.parametrize("command, printed", console_blocks(), ids=[c for c, _ in console_blocks()])
def test_a_quoted_output_is_what_the_command_prints(command, printed, workdir, monkeypatch, capsys):
    monkeypatch.chdir(workdir)
    argv = shlex.split(command)
    assert argv[0] == "bigtrain", command
    main(argv[1:])
    out, err = capsys.readouterr()
    assert (out + err).rstrip("\n").splitlines() == printed


# -- each line in a fresh shell --------------------------------------------------------------------
def using_it_lines() -> list[str]:
    """The "Using it" block's lines after its first, which must be the activate line."""
    text = (ROOT / "README.md").read_text()
    block = re.search(r"## Using it\n.*?```bash\n(.*?)```", text, re.S).group(1)
    lines = [re.sub(r"\s+#\s.*$", "", line).strip() for line in block.splitlines()]
    lines = [line for line in lines if line]
    assert lines[0] == ACTIVATE, f"the Using-it block starts by putting bigtrain on PATH: {ACTIVATE}"
    return lines[1:]


def _short_line(cache: str, line: str) -> str:
    """The line as a shell runs it, each command in it cut short like :func:`_short`."""
    parts = []
    for part in line.split("&&"):
        argv = shlex.split(part)
        if argv[0].startswith("scripts/fuzz-"):
            argv[1] = "1" if "layouts" in argv[0] else "3"
        elif argv[:3] == ["bigtrain", "bench", "--calibrate"]:
            argv = argv + CALIBRATE_SHORT
        elif "train" in argv[:7] or (argv[:2] == ["bigtrain", "check"]):  # torchrun ... -m bigtrain train
            argv = _short(cache, argv)
            if argv[1] == "check":
                argv = [a for a in argv if not a.startswith("--train.steps=")] + ["--steps", "1"]
        parts.append(" ".join(shlex.quote(a) if a != ">" else a for a in argv))
    return " && ".join(parts)


@pytest.fixture(scope="module")
def shell_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("readme-shell")


def _fresh_env() -> dict[str, str]:
    """A login shell's environment: no virtual environment active, its bin not on PATH."""
    env = {k: v for k, v in os.environ.items() if k != "VIRTUAL_ENV"}
    env["PATH"] = os.pathsep.join(p for p in env.get("PATH", "").split(os.pathsep)
                                  if not p.rstrip("/").endswith(".venv/bin"))
    return env


@pytest.mark.slow
@pytest.mark.parametrize("line", using_it_lines())
def test_a_readme_line_runs_in_a_fresh_shell(line, shell_dir, corpus_cache):
    reason = _skip_reason(line) or COVERED_BY_ANOTHER_LINE.get(line)
    if reason:
        pytest.skip(reason)
    venv = ROOT / ".venv"
    if not (venv / "bin" / "activate").is_file():
        pytest.skip("no .venv here: the setup command makes it")
    (shell_dir / ".venv").unlink(missing_ok=True)
    (shell_dir / ".venv").symlink_to(venv)  # the activate line names .venv of the checkout
    (shell_dir / "scripts").unlink(missing_ok=True)
    (shell_dir / "scripts").symlink_to(ROOT / "scripts")
    script = f"{ACTIVATE} && {_short_line(corpus_cache, line)}"
    done = subprocess.run(["bash", "-lc", script], cwd=shell_dir, env=_fresh_env(), capture_output=True, text=True,
                          timeout=600)
    assert done.returncode == 0, f"{script}\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}"
    assert "Traceback" not in done.stderr, done.stderr[-3000:]
