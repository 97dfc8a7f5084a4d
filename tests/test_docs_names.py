"""The names docs/*.md give users to type are still real: every ``bigtrain <subcommand> ...`` line
(fenced blocks and inline code) names a subcommand that exists and parses with its flags, every
``--section.field`` is a config field, every preset named is shipped, and every TOML block's keys
are fields. README.md's commands run (tests/test_readme.py); the pages' are checked here by name
only, so a renamed flag or field cannot leave a page telling users to type what is refused. Parsing
only: nothing is launched (well under a second).
"""

import argparse
import contextlib
import io
import re
import shlex
import tomllib
from pathlib import Path

import pytest

from bigtrain.cli import _parser
from bigtrain.config import Config, apply_values, field_docs, joined_overrides, preset_names

ROOT = Path(__file__).resolve().parents[1]
PAGES = sorted((ROOT / "docs").glob("*.md"))
FIELDS = set(field_docs())
SECTIONS = {name.split(".")[0] for name in FIELDS}
# Lines that show a command's shape rather than one to type: what stands for a value there.
PLACEHOLDERS = {"...", "|", "--section.key=value"}
MISTYPED = {"bigtrain trian"}  # docs/ecosystem.md: what a mistyped command gets (tests/test_cli_help.py)


def _fenced(text: str) -> list[tuple[str, str]]:
    """(language, body) of each fenced block."""
    return re.findall(r"```(\w*)\n(.*?)```", text, re.S)


def _command_lines(text: str) -> list[tuple[str, bool]]:
    """Every ``bigtrain ...`` command of a page, and whether it is given whole: fenced lines
    (continuations joined, a ``$ `` prompt and a trailing comment dropped), and inline code spans that
    start with ``bigtrain `` (prose, which may name a flag without its value)."""
    out = []
    for _, body in _fenced(text):
        for line in re.sub(r"\\\n\s*", " ", body).splitlines():
            line = re.sub(r"^\$ ", "", line.strip())
            line = re.sub(r"\s+#\s.*$", "", line)
            line = re.split(r"\s{4,}", line)[0]  # docs/architecture.md: a command, then the file that runs it
            line = re.sub(r"^([A-Z_]+=\S+\s+)+", "", line)  # OMP_NUM_THREADS=1 bigtrain ...
            line = re.sub(r"^(PYTHONPATH=\S+ )?\S*python3? -m bigtrain ", "bigtrain ", line)
            if line.startswith("bigtrain "):
                out.append((line, " | " not in line))  # a synopsis ([--preset P | --config F]) is not whole
    prose = re.sub(r"```.*?```", "", text, flags=re.S)
    out += [(m, False) for m in re.findall(r"`(bigtrain [^`]*)`", prose.replace("\n", " "))]
    return out


def _commands() -> list[tuple[str, str, bool]]:
    return [(page.name, line, whole) for page in PAGES for line, whole in _command_lines(page.read_text())]


def test_pages_name_commands():
    """The scan finds what it is meant to (a regex that matched nothing would pass everything)."""
    commands = _commands()
    assert len(commands) > 100 and sum(whole for _, _, whole in commands) > 40
    assert {line.split()[1] for _, line, _ in commands} >= {"train", "check", "plan", "export", "generate", "bench"}


def test_commands_parse():
    """A command of a page names a subcommand, its flags and config fields, and a preset that is
    shipped; one given whole (a fenced line) parses as bigtrain parses it."""
    parser = _parser()
    subcommands = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction)).choices
    wrong = [problem for page, line, whole in _commands() if line not in MISTYPED
             for problem in _problems(subcommands, line, whole, f"docs/{page}: `{line}`: ")]
    assert not wrong, "\n".join(wrong)


def _problems(subcommands: dict[str, argparse.ArgumentParser], line: str, whole: bool, where: str) -> list[str]:
    words = shlex.split(re.sub(r"(^|\s)\[|\](?=\s|$)", " ", line))[1:]  # [--steps 4]: optional, not a value
    words = [w for w in words if w not in PLACEHOLDERS]
    if not words:
        return []
    command, args = words[0], words[1:]
    if command not in subcommands:
        return [f"{where}bigtrain has no subcommand {command!r}"]
    sub = subcommands[command]
    takes_overrides = command in ("train", "config", "check")
    flags = {s for a in sub._actions for s in a.option_strings}
    out = [f"{where}{name!r} is no flag of bigtrain {command}" + (" nor a config field" if takes_overrides else "")
           for name in (w.split("=", 1)[0] for w in args if w.startswith("--"))
           if name not in flags and not (takes_overrides and name[2:] in FIELDS)]
    if out or not whole or "--help" in args:
        return out
    try:
        with contextlib.redirect_stderr(io.StringIO()) as usage:
            parsed, rest = sub.parse_known_args(args)
    except SystemExit:
        return [f"{where}bigtrain {command} refuses it: {usage.getvalue().splitlines()[-1]}"]
    if rest and not takes_overrides:
        return [f"{where}bigtrain {command} takes no {rest}"]
    if getattr(parsed, "preset", None) and parsed.preset not in preset_names():
        return [f"{where}no preset {parsed.preset!r} (bigtrain presets)"]
    return []


def test_every_field_flag_is_a_field():
    """``--section.field`` anywhere in the pages (prose included) is a field of the config."""
    wrong = []
    for page in PAGES:
        for m in re.finditer(r"--([a-z]+)\.([a-z_0-9]+)", page.read_text()):
            if m.group(1) in SECTIONS and f"{m.group(1)}.{m.group(2)}" not in FIELDS:
                wrong.append(f"docs/{page.name}: --{m.group(1)}.{m.group(2)}")
    assert not wrong, "flags that are no config field (bigtrain fields lists them):\n" + "\n".join(wrong)


def test_toml_blocks_are_fields():
    """Every ```toml block of a page reads as a config: its sections and keys are fields."""
    blocks = [(page.name, body) for page in PAGES for lang, body in _fenced(page.read_text()) if lang == "toml"]
    for page, body in blocks:
        values = tomllib.loads(body)
        if not set(values) <= SECTIONS:
            continue  # a hardware profile or another file's TOML, not a run's config
        apply_values(Config(), values, f"docs/{page}")  # raises naming an unknown key


def test_scripts_and_their_flags_exist():
    """``benchmarks/X.py --flag`` / ``scripts/X.sh`` named in a page: the file is there, and each flag
    given to a Python script is one it defines (its source names it: read, not run, so no import)."""
    wrong = []
    for page in PAGES + [ROOT / "README.md"]:
        text = re.sub(r"\\\n\s*", " ", page.read_text())
        for m in re.finditer(r"((?:benchmarks|scripts)/[\w-]+\.(?:py|sh))([^\n`#|;)]*)", text):
            path, args = ROOT / m.group(1), m.group(2)
            if not path.is_file():
                wrong.append(f"{page.name}: {m.group(1)} does not exist")
                continue
            source = _with_helpers(path)
            for flag in re.findall(r"(?<!\S)(--[a-z][\w.-]*)", args):
                name = flag.split("=", 1)[0]
                if "." in name:  # a config override the script hands to bigtrain
                    known = name[2:] in FIELDS
                else:
                    known = path.suffix == ".sh" or f'"{name}"' in source or f"'{name}'" in source
                if not known:
                    wrong.append(f"{page.name}: {m.group(1)}{args.rstrip()}: {name} is not a flag of {m.group(1)}")
    assert not wrong, "\n".join(sorted(set(wrong)))


def _with_helpers(path: Path) -> str:
    """A script's source and that of the modules beside it that it imports (a shared argparse)."""
    source = path.read_text()
    for name in set(re.findall(r"^\s*(?:from|import)\s+(?:benchmarks\.)?(\w+)", source, re.M)) | \
            set(re.findall(r"^\s*from benchmarks import (\w+)", source, re.M)):
        helper = path.parent / f"{name}.py"
        if helper.is_file() and helper != path:
            source += helper.read_text()
    return source
