"""Ctrl-C at any moment of a start exits 130 with one line, as it does during a run
(docs/reliability.md): during the ~3 s the CLI spends importing torch it printed a traceback."""

import os
import signal
import subprocess
import sys
from pathlib import Path

from bigtrain import cli, entry_point

ROOT = Path(__file__).resolve().parents[1]


class _InterruptImport:
    """A finder that raises KeyboardInterrupt when ``name`` is imported: Ctrl-C inside that import."""

    def __init__(self, name):
        self.name = name

    def find_spec(self, fullname, path=None, target=None):
        if fullname == self.name:
            raise KeyboardInterrupt
        return None


def test_the_console_script_is_the_entry_point_that_imports_the_cli_inside_its_handler():
    import tomllib

    scripts = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["scripts"]
    assert scripts == {"bigtrain": "bigtrain.entry_point:main"}
    assert "from bigtrain.entry_point import main" in (ROOT / "bigtrain" / "__main__.py").read_text()


def test_ctrl_c_while_the_cli_imports_exits_130_with_one_line(monkeypatch, capsys):
    monkeypatch.delitem(sys.modules, "bigtrain.cli")  # imported afresh, as a new process does
    monkeypatch.setattr(sys, "meta_path", [_InterruptImport("bigtrain.cli"), *sys.meta_path])
    assert entry_point.main() == 130
    assert capsys.readouterr().err == "bigtrain: interrupted\n"


def test_ctrl_c_while_the_arguments_are_parsed_exits_130_with_one_line(monkeypatch, capsys):
    def interrupted(*_):
        raise KeyboardInterrupt

    monkeypatch.setattr(cli, "_parser", interrupted)  # outside the commands' handlers before
    assert cli.main(["presets"]) == 130
    assert capsys.readouterr().err == "bigtrain: interrupted\n"


def test_sigint_to_a_starting_bigtrain_process_exits_130_without_a_traceback(tmp_path):
    """The program itself: SIGINT while ``python -m bigtrain`` imports the CLI, halfway through torch
    (its C extension loaded, about 1 s of torch's Python still to import). ``-X importtime`` says
    when: each import's line as it completes."""
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    child = subprocess.Popen([sys.executable, "-X", "importtime", "-m", "bigtrain", "train", "--preset", "tiny",
                              "--output-dir", str(tmp_path / "run"), "--data.cache_dir", str(tmp_path / "cache")],
                             cwd=tmp_path, env=env, stderr=subprocess.PIPE, text=True,
                             # as from a terminal: a test run started in the background (``cmd &``,
                             # ``timeout``) ignores SIGINT, and its children inherit that
                             preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    lines = []
    try:
        for line in child.stderr:
            lines.append(line)
            if line.startswith("import time:") and line.split("|")[-1].strip() == "torch._C":
                child.send_signal(signal.SIGINT)
                break
        lines += child.stderr.readlines()
        code = child.wait(timeout=30)
    finally:
        child.kill()
    said = [line.rstrip() for line in lines if not line.startswith("import time:")]
    assert (code, said) == (130, ["bigtrain: interrupted"]), "".join(lines)
    assert not (tmp_path / "run").exists()
