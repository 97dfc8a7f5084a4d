"""Hostile and clumsy inputs for ``bigtrain train`` / ``bigtrain check``, each one that must be rejected.

A :class:`Case` is a recipe: it writes whatever files it needs into its own folder and returns the
command line and the environment changes of one invocation, and the names (a dotted field, a flag,
an environment variable) one of which the rejection must name. :func:`generate` draws cases from a
seeded generator over eight kinds:

* ``field``: a bad value for one field of the tiny preset on the command line: wrong type, empty,
  NaN, infinities, negative, zero, out of 64 bits, absurd sizes, bad enums, undecodable text;
* ``data``: a bad corpus written to disk: float / complex / bool / text ``.npy``, ids at or above
  the vocabulary or negative, odd-sized, empty, short or truncated files, folders without text,
  special files (``/dev/zero``, a FIFO, a socket, links to them, dangling links, link loops);
* ``output``: an output folder that cannot be written (a file, under a file, ``/proc``, too long);
* ``env``: ``RANK`` / ``WORLD_SIZE`` / ``MASTER_*`` left over without a launcher, or malformed;
* ``toml``: a config file with wrong types, NUL, NaN, unknown keys, bad syntax, or a special file;
* ``flag``: bad command-line flags (``--world-size``, ``--steps``, malformed overrides, presets);
* ``clumsy``: valid-looking values that contradict each other (dim vs heads, batch vs micro-batch);
* ``hardware``: a ``--hardware-file`` for ``--parallel auto`` that is missing, a folder, not a table,
  names no preset as its base, or holds a bad field (zero rates, infinities, NaN, unknown names).

The ``field`` kind is drawn in :mod:`.input_fields`, the ``data`` kind in :mod:`.input_files`;
:class:`Case` is :mod:`.input_recipe`'s. Valid inputs are excluded by construction: each value is
classified by a domain written in :mod:`.input_fields`, independently of ``validation.py`` (a field's lower bound, and the size from which rejection is
certain on any machine); a value that may be valid is skipped and counted, never run.
"""

from __future__ import annotations

import os
import random
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

from bigtrain.check.input_fields import field_case
from bigtrain.check.input_files import data_case, link_loop
from bigtrain.check.input_recipe import SEED_MAX, Build, Case, fixed_args


# -- output folders, environment, config files, flags, contradictions ---------------------------------
def _output_case(rng: random.Random, command: str) -> Case:
    def under(make: Callable[[Path], str]) -> Build:
        return lambda folder: (["--output-dir", make(folder)], {})

    def file_at(folder: Path) -> str:
        (folder / "f").write_text("x")
        return str(folder / "f")

    def dangling(path: Path) -> str:
        path.symlink_to("/nonexistent-bigtrain/x")
        return str(path)

    def loop(folder: Path) -> str:
        link_loop(folder / "l")
        return str(folder / "l")

    recipes = {
        "an existing file": under(file_at),
        "under a file": under(lambda folder: file_at(folder) + "/run"),
        "in /proc": under(lambda folder: f"/proc/bigtrain-{rng.randrange(10**6)}/run"),
        "in /sys": under(lambda folder: f"/sys/bigtrain-{rng.randrange(10**6)}"),
        "/dev/null": under(lambda folder: "/dev/null"),
        "under /dev/null": under(lambda folder: "/dev/null/run"),
        "a name of 300 bytes": under(lambda folder: str(folder / ("n" * 300))),
        "a dangling link": under(lambda folder: dangling(folder / "d")),
        "a link loop": under(loop),
        "empty": under(lambda folder: ""),
        "blank": under(lambda folder: "  "),
    }
    label = rng.choice(sorted(recipes))
    return Case("output", label, ("--output-dir",), recipes[label], command=command)


ENV_CASES: dict[str, tuple[dict[str, str | None], tuple[str, ...]]] = {
    "RANK and WORLD_SIZE, no MASTER_*": ({"RANK": "0", "WORLD_SIZE": "2"}, ("MASTER_ADDR",)),
    "rank 1 of 4, no MASTER_*": ({"RANK": "1", "WORLD_SIZE": "4"}, ("MASTER_ADDR",)),
    "no MASTER_PORT": ({"RANK": "0", "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1"}, ("MASTER_PORT",)),
    "WORLD_SIZE not a number": ({"RANK": "0", "WORLD_SIZE": "two"}, ("WORLD_SIZE",)),
    "WORLD_SIZE empty": ({"RANK": "0", "WORLD_SIZE": ""}, ("WORLD_SIZE",)),
    "RANK not a number": ({"RANK": "first", "WORLD_SIZE": "2"}, ("RANK",)),
    "RANK 1e0": ({"RANK": "1e0", "WORLD_SIZE": "2"}, ("RANK",)),
    "RANK negative": ({"RANK": "-1", "WORLD_SIZE": "2"}, ("RANK",)),
    "RANK = WORLD_SIZE": ({"RANK": "2", "WORLD_SIZE": "2"}, ("RANK",)),
    "WORLD_SIZE 0": ({"RANK": "0", "WORLD_SIZE": "0"}, ("WORLD_SIZE",)),
    "MASTER_PORT not a port": ({"RANK": "0", "WORLD_SIZE": "2", "MASTER_ADDR": "localhost", "MASTER_PORT": "http"},
                               ("MASTER_PORT",)),
    "MASTER_PORT 70000": ({"RANK": "0", "WORLD_SIZE": "2", "MASTER_ADDR": "localhost", "MASTER_PORT": "70000"},
                          ("MASTER_PORT",)),
    "launcher of 3 ranks for a 1-rank layout": ({"RANK": "0", "WORLD_SIZE": "3", "MASTER_ADDR": "127.0.0.1",
                                                 "MASTER_PORT": "29500", "TORCHELASTIC_RUN_ID": "x"},
                                                ("parallel.dp",)),
}


def _env_case(rng: random.Random, command: str) -> Case:
    label = rng.choice(sorted(ENV_CASES))
    env, names = ENV_CASES[label]
    world = env.get("WORLD_SIZE", "")
    # A layout of as many ranks as WORLD_SIZE says: the leftovers, not a size mismatch, must be the finding.
    layout = [f"--parallel.dp={world}", "--train.micro_batch=1"] if world in ("2", "4") and "TORCHELASTIC_RUN_ID" \
        not in env else []
    return Case("env", label, names, fixed_args(*layout, env=env), command=command)


TOML_CASES: dict[str, tuple[bytes, tuple[str, ...]]] = {
    "string for an int": (b'[model]\ndim = "sixty-four"\n', ("model.dim",)),
    "array for an int": (b"[model]\ndim = [64]\n", ("model.dim",)),
    "table for an int": (b"[model]\ndim = {a = 1}\n", ("model.dim",)),
    "date for an int": (b"[train]\nsteps = 1979-05-27\n", ("train.steps",)),
    "bool for an int": (b"[train]\nsteps = true\n", ("train.steps",)),
    "fraction for an int": (b"[train]\nsteps = 2.5\n", ("train.steps",)),
    "int beyond 64 bits": (b"[train]\nsteps = 92233720368547758070\n", ("train.steps",)),
    "int for a bool": (b"[logging]\nprogress = 1\n", ("logging.progress",)),
    "int for a string": (b"[model]\nfamily = 5\n", ("model.family",)),
    "nan": (b"[optim]\nlr = nan\n", ("optim.lr",)),
    "inf": (b"[distributed]\ntimeout_s = inf\n", ("distributed.timeout_s",)),
    "-inf": (b"[optim]\ngrad_clip = -inf\n", ("optim.grad_clip",)),
    "NUL in a path": (b'[data]\nsource = "corpus\\u0000.txt"\n', ("data.source",)),
    "NUL in the cache": (b'[data]\ncache_dir = "a\\u0000b"\n', ("data.cache_dir",)),
    "unknown section": (b"[trainer]\nsteps = 5\n", ("[trainer]",)),
    "unknown key": (b"[model]\ndimm = 64\n", ("model.dimm",)),
    "key outside a section": (b"steps = 5\n", ("[steps]",)),
    "section that is a value": (b"model = 5\n", ("[model]",)),
    "syntax error": (b"[model\ndim = 64\n", ("not valid TOML",)),
    "duplicate key": (b"[model]\ndim = 64\ndim = 32\n", ("not valid TOML",)),
    "binary garbage": (bytes(range(256)) * 4, ("not valid TOML",)),
    "UTF-16": ("[model]\ndim = 64\n".encode("utf-16"), ("not valid TOML",)),
    "empty source": (b'[data]\nsource = ""\n', ("data.source",)),
    "negative seed": (b"[train]\nseed = -1\n", ("train.seed",)),
    "zero timeout": (b"[distributed]\ntimeout_s = 0\n", ("distributed.timeout_s",)),
}


def _toml_case(rng: random.Random, command: str) -> Case:
    specials = {"a folder": "dir", "/dev/zero": "/dev/zero", "a FIFO": "fifo", "a missing file": "missing",
                "a link loop": "loop"}
    label = rng.choice(sorted(TOML_CASES) + sorted(specials))

    def build(folder: Path):
        path = folder / "c.toml"
        if label in TOML_CASES:
            path.write_bytes(TOML_CASES[label][0])
        else:
            kind = specials[label]
            if kind == "dir":
                path.mkdir()
            elif kind == "fifo":
                os.mkfifo(path)
            elif kind == "loop":
                link_loop(path)
            elif kind != "missing":
                path = Path(kind)
        return ["--config", str(path)], {}

    names = TOML_CASES[label][1] if label in TOML_CASES else ("config file",)
    return Case("toml", label, names, build, command=command, uses_preset=False)


def _flag_case(rng: random.Random) -> Case:
    size = rng.choice(["0", "-1", "-8", str(2**21), str(10**12), str(2**62)])
    recipes = {
        f"--world-size {size}": ("train", ["--parallel", "auto", "--world-size", size], ("--world-size",)),
        "--world-size x": ("train", ["--parallel", "auto", "--world-size", "x"], ("--world-size",)),
        "--parallel manual": ("train", ["--parallel", "manual"], ("--parallel",)),
        f"check --steps {min(int(size), 0)}": ("check", ["--steps", str(min(int(size), 0))], ("--steps",)),
        "check --steps x": ("check", ["--steps", "x"], ("--steps",)),
        "override without value": ("train", ["--model.dim"], ("--model.dim",)),
        "override without key": ("train", ["--model.=3"], ("model.",)),
        "override without section": ("train", ["--.dim=3"], ("[]",)),
        "override of a nested key": ("train", ["--model.dim.x=3"], ("model.dim.x",)),
        "unknown flag": ("train", ["--stepz=3"], ("--stepz",)),
        "preset typo": ("train", ["--preset", "tiyn"], ("--preset",)),
        "preset empty": ("train", ["--preset", ""], ("--preset",)),
        "preset and config": ("train", ["--preset", "tiny", "--config", "x.toml"], ("--config",)),
    }
    label = rng.choice(sorted(recipes))
    command, argv, names = recipes[label]
    return Case("flag", label, names, fixed_args(*argv), command=command, uses_preset=label not in (
        "preset typo", "preset empty", "preset and config"))


def _clumsy_case(rng: random.Random) -> Case:
    k = rng.randint(1, 40)
    recipes = {
        "dim not divisible by heads": ([f"--model.dim={4 * k + rng.choice([1, 2, 3])}"], "model.dim"),
        "seq_len above max_seq_len": ([f"--data.seq_len={64 + k}"], "data.seq_len"),
        "global batch not a multiple": ([f"--train.global_batch={4 * k + rng.choice([1, 2, 3])}"],
                                        "train.global_batch"),
        "kv heads not dividing heads": (["--model.n_kv_heads=3"], "model.n_kv_heads"),
        "tp not dividing heads": (["--parallel.tp=3", "--train.global_batch=8"], "parallel.tp"),
        "more stages than layers": ([f"--parallel.pp={2 + k}"], "parallel.pp"),
        "ignore_target at vocab": ([f"--data.ignore_target={256 + k}"], "data.ignore_target"),
        "reshard without ZeRO-3": (["--parallel.reshard_after_forward=false"], "parallel.reshard_after_forward"),
        "interleaved with one chunk": (["--parallel.pp=2", "--parallel.pp_schedule=interleaved"],
                                       "parallel.pp_virtual"),
        "byte text with a small vocab": ([f"--model.vocab_size={rng.randint(1, 255)}"], "model.vocab_size"),
        "seed beyond the generators": ([f"--train.seed={SEED_MAX + k}"], "train.seed"),
        "resume from nowhere": ([f"--checkpoint.resume=/nonexistent-bigtrain/{k}"], "checkpoint.resume"),
        "cuda without a GPU": (["--train.device=cuda"], "train.device"),
        "a year and a day": ([f"--distributed.timeout_s={366 * 86400}"], "distributed.timeout_s"),
        "cache in a file": (["--data.cache_dir=/etc/hostname/cache"], "data.cache_dir"),
        "cache in /proc": ([f"--data.cache_dir=/proc/bigtrain-{k}"], "data.cache_dir"),
    }
    label = rng.choice(sorted(recipes))
    argv, name = recipes[label]
    if label == "cuda without a GPU":
        import torch

        if torch.cuda.is_available():
            argv, name = ["--train.device=tpu"], "train.device"
    return Case("clumsy", label, (name,), fixed_args(*argv))


def _hardware_case(rng: random.Random) -> Case:
    """A hostile --hardware-file for --parallel auto: the file or one field of it named."""
    field_name, bad = rng.choice([("peak_flops_fp32", "0"), ("hbm_bandwidth", "0"), ("gpus_per_node", "1e400"),
                                  ("memory_bytes", "-1"), ("peak_flops_bf16", "NaN"), ("comm_overlap", "2"),
                                  ("peak_flopz", "1"), ("achievable_fraction", "\"x\"")])
    recipes = {
        "missing": (None, "--hardware-file"),
        "not JSON": (b"{", "--hardware-file"),
        "a list": (b"[1, 2]", "--hardware-file"),
        "a folder": ("folder", "--hardware-file"),
        "base not a preset": (b'{"base": "tpu"}', "base"),
        f"{field_name} = {bad}": (f'{{"base": "cpu", "{field_name}": {bad}}}'.encode(), field_name),
        "without --parallel auto": ("plain", "--hardware-file"),
    }
    label = rng.choice(sorted(recipes))
    content, name = recipes[label]

    def build(folder: Path):
        path = folder / "hw.json"
        if content == "folder":
            path.mkdir()
        elif isinstance(content, bytes):
            path.write_bytes(content)
        elif content == "plain":
            path.write_text('{"base": "cpu"}')
            return ["--hardware-file", str(path)], {}
        return ["--parallel", "auto", "--world-size", "2", "--hardware-file", str(path)], {}
    return Case("hardware", label, (name,), build)


# -- drawing cases -------------------------------------------------------------------------------------
# bigtrain check sets these itself (no checkpoints, no resume, no report): a value of the right type is ignored.
CHECK_OVERWRITES = {"checkpoint.resume", "checkpoint.every", "checkpoint.save_final", "logging.progress",
                    "logging.report"}  # (a value of the wrong type is still rejected when the config loads)
KINDS = {"field": 50, "data": 17, "output": 6, "env": 6, "toml": 9, "flag": 5, "clumsy": 7, "hardware": 3}


@dataclass
class Draw:
    cases: list[Case] = field(default_factory=list)
    skipped_valid: list[str] = field(default_factory=list)
    duplicates: int = 0


def generate(count: int, seed: int) -> Draw:
    """``count`` distinct must-reject cases drawn with ``seed`` (values that may be valid are skipped)."""
    rng = random.Random(seed)
    draw, seen = Draw(), set()
    while len(draw.cases) < count:
        kind = rng.choices(list(KINDS), weights=list(KINDS.values()))[0]
        command = "check" if rng.random() < 0.2 else "train"
        if kind == "field":
            case, label = field_case(rng)
            if case is None:
                draw.skipped_valid.append(label)
                continue
        elif kind == "data":
            case = data_case(rng)
        elif kind == "output":
            case = _output_case(rng, command)
        elif kind == "env":
            case = _env_case(rng, command)
        elif kind == "toml":
            case = _toml_case(rng, command)
        elif kind == "flag":
            case = _flag_case(rng)
        elif kind == "hardware":
            case = _hardware_case(rng)
        else:
            case = _clumsy_case(rng)
        if kind in ("field", "data", "clumsy") and not set(case.names) & CHECK_OVERWRITES:
            case.command = command
        if case.label() in seen:
            draw.duplicates += 1
            if draw.duplicates > 50 * count:
                break
            continue
        seen.add(case.label())
        draw.cases.append(case)
    return draw
