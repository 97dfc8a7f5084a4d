"""Every command in README.md's shell blocks runs here, in README order, in one scratch folder, so
the README cannot rot. Each is run as written, with only its length cut: a few steps on a small slice
of the corpus (:data:`SHORT`). Commands that start several ranks run up to the launch: the config is
resolved, validated and pre-flighted as written, and torchrun's world size and arguments are checked,
but the launch itself is recorded instead of started (2 to 4 more Python processes each, too slow for
the suite; each layout's training is proved in its own tests). ``BIGTRAIN_README_FULL=1`` launches
them too. What cannot run here is skipped by name, with the reason (:data:`SKIPPED`).
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
FULL = os.environ.get("BIGTRAIN_README_FULL") == "1"
SKIPPED = {
    "bash scripts/setup.sh": "makes .venv and installs packages (needs the network); the train after it runs",
    "bash scripts/test.sh": "the whole test suite, which this test is part of",
    "torchrun --nnodes 2": "two machines of 8 ranks each",
    "scripts/fuzz-layouts.sh": "every layout it draws starts 2 to 8 ranks (BIGTRAIN_README_FULL=1 runs 1 layout)",
}
MY_TOML = "[train]\nsteps = 500\nglobal_batch = 8\nmicro_batch = 4\n\n[model]\nn_layers = 2\ndim = 64\n"


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


def _short(cache: str, argv: list[str]) -> list[str]:
    steps = 3 if "--resume" in argv else 2  # a resumed run goes on from the 2 steps before it
    return argv + [f"--train.steps={steps}", f"--data.cache_dir={cache}", "--data.max_bytes=400000",
                   "--logging.log_every=1", "--logging.progress=false", "--train.eval_batches=1"]


def _skip_reason(command: str) -> str | None:
    return next((why for start, why in SKIPPED.items() if command.startswith(start)), None)


COMMANDS = readme_commands()


@pytest.fixture(scope="module")
def workdir(tmp_path_factory):
    path = tmp_path_factory.mktemp("readme")
    (path / "my.toml").write_text(MY_TOML)
    return path


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

    if not FULL:
        monkeypatch.setattr(launch, "launch_local", record)
    return seen


def test_the_readme_has_its_commands():
    assert len(COMMANDS) >= 20 and COMMANDS[0] == "bash scripts/setup.sh"
    assert any(c.startswith("bigtrain generate") for c in COMMANDS)


@pytest.mark.parametrize("command", COMMANDS)
def test_readme_command_runs(command, workdir, corpus_cache, launches, monkeypatch, capsys):
    reason = _skip_reason(command)
    if reason and not (FULL and command.startswith("scripts/fuzz-layouts.sh")):
        pytest.skip(reason)
    monkeypatch.chdir(workdir)
    argv = shlex.split(command)
    if argv[0].startswith("scripts/"):
        count = ["1"] if FULL and "layouts" in argv[0] else ["3"]
        env = {**os.environ, "PYTHONPATH": str(ROOT)}
        done = subprocess.run(["bash", str(ROOT / argv[0]), *count, *argv[2:]], env=env, capture_output=True,
                              text=True, timeout=300)
        assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
        return
    argv = argv[1:] if argv[0] in ("bigtrain", ".venv/bin/bigtrain") else pytest.fail(f"not a bigtrain command: {command}")
    if argv[0] in ("train", "check"):
        argv = _short(corpus_cache, argv)
        if argv[0] == "check":  # check compares steps of its own (--steps), not train.steps
            argv = [a for a in argv if not a.startswith("--train.steps=")] + ["--steps", "1"]
    code = main(argv)
    out, err = capsys.readouterr()
    assert code == 0, f"{command}\n{out[-2000:]}\n{err[-2000:]}"
    if argv[0] == "check" and not FULL:
        assert [world for world, _ in launches] == [4] and "launch of 4 ranks recorded" in out
    if argv[0] == "train":
        layout = [a for a in argv if a.startswith("--parallel.") and a.split("=")[0][11:] in ("dp", "tp", "pp", "sp")]
        ranks = 1
        for a in layout:
            ranks *= int(a.split("=")[1])
        if "--world-size" in argv:
            ranks = int(argv[argv.index("--world-size") + 1])
        if ranks > 1 and not FULL:
            assert [world for world, _ in launches] == [ranks], command
        elif ranks == 1:
            assert not launches and ("bigtrain: 2 steps" in out or "bigtrain: 3 steps" in out), out[-1000:]
    if argv[0] == "generate":
        assert out.startswith("def ") and len(out) > 100
