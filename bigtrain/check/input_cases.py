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

Valid inputs are excluded by construction: each value is classified by a domain written here,
independently of ``validation.py`` (a field's lower bound, and the size from which rejection is
certain on any machine); a value that may be valid is skipped and counted, never run.
"""

from __future__ import annotations

import math
import os
import random
import socket
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import numpy as np

Build = Callable[[Path], tuple[list[str], dict[str, str | None]]]
NEED = 34  # the tiny preset's data.seq_len (32) + 2: the shortest corpus the sampler takes
SEED_MAX = (2**64 - 2**32) // 1_000_003
INT64 = 2**63


@dataclass
class Case:
    kind: str
    name: str
    names: tuple[str, ...]  # the message must contain one of these
    build: Build
    command: str = "train"
    uses_preset: bool = True

    def label(self) -> str:
        return f"{self.command}:{self.kind}:{self.name}"


# -- the tiny preset's fields and their domains ------------------------------------------------------
# (lower bound of a valid value, value from which rejection is certain); None: no such bound.
INT_FIELDS: dict[str, tuple[int, int | None]] = {
    "model.vocab_size": (256, 10**11), "model.dim": (8, 10**7), "model.n_layers": (1, 10**9),
    "model.n_heads": (1, 65), "model.n_kv_heads": (0, 5), "model.ffn_hidden": (0, 10**12),
    "model.max_seq_len": (32, 10**12), "parallel.dp": (1, 3), "parallel.tp": (1, 5), "parallel.pp": (1, 3),
    "parallel.sp": (1, 3), "parallel.cp": (1, 17), "parallel.ep": (1, None), "parallel.pp_virtual": (1, 2), "parallel.zero": (0, 4),
    "precision.scale_growth_interval": (1, None), "memory.checkpoint_every": (1, None),
    "optim.warmup_steps": (0, None), "optim.base_batch": (1, None), "optim.block_size": (1, None), "data.seq_len": (1, 65),
    "data.max_bytes": (0, None), "data.ignore_target": (-1, 256), "train.steps": (1, None),
    "train.global_batch": (1, 2**40), "train.micro_batch": (1, 9), "train.seed": (0, SEED_MAX + 1),
    "train.max_bad_steps": (1, None), "model.moe_experts": (0, None), "model.moe_top_k": (1, None),
    "model.moe_every": (1, None), "model.moe_ffn_hidden": (0, None),
    "checkpoint.every": (0, None), "checkpoint.keep": (1, None), "logging.log_every": (1, None),
    "model.fused_loss_chunk": (1, None), "memory.offload_min_bytes": (0, None),
    "train.eval_every": (0, None), "train.eval_batches": (1, None),
    "model.dlrm_dense_features": (1, None), "embedding.dim": (1, None), "embedding.hotness": (1, None),
    "offload.prefetch_depth": (0, None), "offload.grad_buckets": (1, None),
    "parallel.local_sgd_every": (1, 2),  # with the preset's dp_sync = 'sync', only 1 is valid
    "parallel.dp_replicate": (1, 2), "parallel.dp_shard": (0, 2),  # dp = 1: one group of one (dp_shard 0: dp's)
    "model.attention_head_dim": (0, None), "model.rope_original_max_len": (0, None),
}
# (low, low inclusive, high, high inclusive)
FLOAT_FIELDS: dict[str, tuple[float, bool, float, bool]] = {
    "model.rope_theta": (0, False, math.inf, False), "model.norm_eps": (0, False, math.inf, False),
    "model.init_std": (0, False, math.inf, False), "parallel.bucket_mb": (0, False, 2**20, True),
    "precision.loss_scale": (0, False, math.inf, False), "precision.scale_backoff": (0, False, 1, False),
    "optim.lr": (0, False, math.inf, False), "optim.min_lr_ratio": (0, True, 1, True),
    "optim.weight_decay": (0, True, math.inf, False), "optim.beta1": (0, True, 1, False),
    "optim.beta2": (0, True, 1, False), "optim.eps": (0, False, math.inf, False),
    "optim.grad_clip": (0, True, math.inf, False), "optim.adafactor_decay": (-1, True, 0, True),
    "optim.adafactor_clip": (0, False, math.inf, False), "optim.adafactor_eps": (0, False, math.inf, False), "distributed.timeout_s": (1, True, 365 * 86400, True),
    "model.moe_capacity_factor": (0, True, math.inf, False), "model.moe_aux_loss_coef": (0, True, math.inf, False),
    "data.val_fraction": (0, True, 1, False),
    "embedding.lr": (0, False, math.inf, False), "embedding.eps": (0, False, math.inf, False),
    "embedding.budget_gb": (0, True, math.inf, False), "checkpoint.every_minutes": (0, True, 1e7, True),
    "model.rope_factor": (0, False, math.inf, False), "model.rope_low_freq_factor": (0, False, math.inf, False),
    "model.rope_high_freq_factor": (0, False, math.inf, False), "model.rope_beta_fast": (0, False, math.inf, False),
    "model.rope_beta_slow": (0, False, math.inf, False), "model.rope_attention_factor": (0, True, math.inf, False),
}
BOOL_FIELDS = ["model.tie_embeddings", "parallel.sequence_parallel", "parallel.reshard_after_forward",
               "parallel.prefetch", "checkpoint.save_final", "checkpoint.async", "logging.progress",
               "logging.report", "logging.measure_memory", "logging.tensorboard", "model.fused_loss",
               "memory.activation_offload", "memory.selective_attention", "parallel.pp_vertical_sync",
               "model.attention_bias", "model.qkv_bias", "model.mlp_bias"]
ENUM_FIELDS: dict[str, tuple[str, ...]] = {
    "model.family": ("llama",), "parallel.pp_schedule": ("naive", "gpipe", "1f1b", "interleaved", "zb-h1"),
    "parallel.dp_sync": ("sync", "local-sgd"),
    "parallel.pp_balance": ("layers", "params"), "precision.mode": ("fp32", "bf16", "fp16"),
    "precision.reduce_dtype": ("auto", "fp32"), "memory.checkpointing": ("none", "full", "every", "selective"),
    "memory.activation_compression": ("none", "int8"),
    "optim.lr_scaling": ("none", "linear"), "optim.name": ("adamw", "adamw8bit", "adafactor", "lion"),  # others register at run time
    "train.device": ("auto", "cpu"),  # cuda: only with a GPU
    "model.rope_scaling": ("none", "linear", "yarn"),  # 'llama3' needs model.rope_original_max_len
    "embedding.sharding": ("auto", "table", "row", "column", "data"),  # a DLRM's; refused for any model
}
TRUE, FALSE = ("true", "1", "yes", "on"), ("false", "0", "no", "off")

INT_TEXT = ["0", "-1", "-7", "1.5", "abc", "", " ", "1e3", "0x10", "nan", "inf", "true", str(INT64),
            str(-INT64 - 1), "9" * 30, "9" * 5000, "+-1", "10**3", "1,000", "½", "-0x1", "\t", "٣", "1_0",
            str(10**12), str(10**15), str(2**62), str(INT64 - 1), "-" + str(10**12)]
FLOAT_TEXT = ["nan", "NaN", "-nan", "inf", "-inf", "Infinity", "1e400", "-1e400", "0", "-0", "-0.0", "-1",
              "5e-324", "1e308", "abc", "", "1,5", "0x10", "1/2", "1e", "--1", "2", "1", "1.0000001", "-1e-9",
              "1e9", "3e7", "1e-300"]
BOOL_TEXT = ["maybe", "", "2", "-1", "tru", "t", "y", "null", "None", "yes please", "oui", " ", "0.0", "1e0",
             "TRUE", " true ", "No"]
STR_TEXT = ["", " ", "\t", "x" * 5000, "\u00e9", "\U0001f642", "../../etc", "$(id)", "\x1b[2J", "null", "None",
            "0", "-1", "\udcff", "a" * 300, "fp 32"]


def _int_value(text: str) -> int | None:
    try:
        return int(text.strip())
    except ValueError:
        return None


def int_is_bad(name: str, text: str) -> bool:
    """True when ``text`` is certainly not a valid value of int field ``name`` (in the tiny preset)."""
    value = _int_value(text)
    if value is None or not -INT64 <= value < INT64:
        return True
    low, certain = INT_FIELDS[name]
    if name == "data.max_bytes" and 0 < value < NEED:
        return True  # a cap below one window and its target
    return value < low or (certain is not None and value >= certain)


def float_is_bad(name: str, text: str) -> bool:
    try:
        value = float(text.strip())
    except ValueError:
        return True
    low, low_in, high, high_in = FLOAT_FIELDS[name]
    if not math.isfinite(value):
        return True
    return not ((value >= low if low_in else value > low) and (value <= high if high_in else value < high))


def bool_is_bad(text: str) -> bool:
    return text.strip().lower() not in TRUE + FALSE


def str_is_bad(name: str, text: str) -> bool:
    if name == "embedding.sharding":  # one kind for every table, or one per table: 'table, row'
        return any(part.strip() not in ENUM_FIELDS[name] for part in text.split(","))
    return text not in ENUM_FIELDS[name]


# -- building blocks --------------------------------------------------------------------------------
def _args(*overrides: str, env: dict[str, str | None] | None = None) -> Build:
    return lambda folder: (list(overrides), dict(env or {}))


def _field_case(rng: random.Random) -> tuple[Case | None, str]:
    """One bad value for one field; (None, label) when the drawn value may be valid (skipped)."""
    kind = rng.choice(["int"] * 5 + ["float"] * 3 + ["bool", "enum", "enum", "text"])
    if kind == "int":
        name = rng.choice(sorted(INT_FIELDS))
        text = rng.choice(INT_TEXT + [str(rng.randint(-10**6, 10**6)), str(rng.randint(-3, 70)),
                                      str(10 ** rng.randint(6, 18) * rng.randint(1, 9))])
        bad = int_is_bad(name, text)
    elif kind == "float":
        name = rng.choice(sorted(FLOAT_FIELDS))
        text = rng.choice(FLOAT_TEXT + [repr(rng.uniform(-5, 5)), f"1e{rng.randint(-330, 330)}"])
        bad = float_is_bad(name, text)
    elif kind == "bool":
        name, text = rng.choice(BOOL_FIELDS), rng.choice(BOOL_TEXT)
        bad = bool_is_bad(text)
    elif kind == "enum":
        name = rng.choice(sorted(ENUM_FIELDS))
        good = rng.choice(ENUM_FIELDS[name])
        text = rng.choice(STR_TEXT + [good.upper(), good + " ", " " + good, good[:-1], good + "x", "cuda"])
        bad = str_is_bad(name, text)
    else:
        name = rng.choice(["data.source", "parallel.pp_split", "checkpoint.resume", "data.tokenizer"])
        text = rng.choice(STR_TEXT + ["/nonexistent/corpus.txt", "stdlib ", "STDLIB", "1,2", "a,b", "-1", "1,,2"])
        if name == "parallel.pp_split":
            bad = bool(text.strip())  # one stage: any split point is one too many
        elif name == "checkpoint.resume":
            bad = text not in ("none", "auto") and not os.path.lexists(text)
        elif name == "data.tokenizer":  # 'bytes', or a tokenizer file: none of these texts names one
            bad = text != "bytes" and not os.path.isfile(os.path.expanduser(text))
        else:
            bad = text != "stdlib" and not os.path.lexists(os.path.expanduser(text))
    label = f"--{name}={text[:40]!r}" + ("..." if len(text) > 40 else "")
    if not bad:
        return None, label
    return Case("field", label, (name,), _args(f"--{name}={text}")), label


# -- data files ------------------------------------------------------------------------------------
def _source(name: str, write: Callable[[Path], None], *extra: str, names=("data.source",)) -> Callable:
    """A case whose data.source is ``name`` in its folder, written by ``write``."""
    def build(folder: Path):
        path = folder / name
        write(path)
        return [f"--data.source={path}", *extra], {}
    return lambda label: Case("data", label, names, build)


def _save(array: np.ndarray) -> Callable[[Path], None]:
    return lambda path: np.save(path, array, allow_pickle=True)


def _tofile(array: np.ndarray) -> Callable[[Path], None]:
    return lambda path: array.tofile(path)


def _bytes(data: bytes) -> Callable[[Path], None]:
    return lambda path: path.write_bytes(data)


def _folder(files: dict[str, bytes]) -> Callable[[Path], None]:
    def write(path: Path) -> None:
        path.mkdir()
        for rel, data in files.items():
            (path / rel).parent.mkdir(parents=True, exist_ok=True)
            (path / rel).write_bytes(data)
    return write


def _link(target: str) -> Callable[[Path], None]:
    return lambda path: path.symlink_to(target)


def _fifo(path: Path) -> None:
    os.mkfifo(path)


def _socket(path: Path) -> None:
    sock = socket.socket(socket.AF_UNIX)
    sock.bind(str(path))  # the file stays after the socket closes
    sock.close()


def _loop(path: Path) -> None:
    other = path.with_name(path.name + "-other")
    path.symlink_to(other)
    other.symlink_to(path)


def _truncated_npy(n: int) -> Callable[[Path], None]:
    def write(path: Path) -> None:
        np.save(path, np.arange(n, dtype=np.uint16))
        with open(path, "r+b") as f:
            f.truncate(path.stat().st_size - n)  # the header promises n ids; half are there
    return write


def _data_case(rng: random.Random) -> Case:
    n = rng.randint(NEED, 4000)
    vocab_id = rng.randint(256, 65535)
    at = rng.randrange(n)

    def with_id(dtype, value):
        ids = np.random.default_rng(rng.randrange(2**32)).integers(0, 256, n).astype(dtype)
        ids[at] = value
        return ids

    float_kind = rng.choice(["float16", "float32", "float64", "complex64", "complex128"])
    signed = rng.choice(["int8", "int16", "int32", "int64"])
    wide = rng.choice(["uint16", "int32", "uint32", "int64", "uint64"])
    recipes = {
        f"npy of {float_kind}": _source("t.npy", _save(np.arange(n).astype(float_kind))),
        "npy of bool": _source("t.npy", _save(np.ones(n, dtype=bool))),
        "npy of text": _source("t.npy", _save(np.array(["ab"] * n))),
        "npy of dates": _source("t.npy", _save(np.arange(n).astype("datetime64[s]"))),
        "npy of records": _source("t.npy", _save(np.zeros(n, dtype=[("a", "<i4"), ("b", "<f4")]))),
        "npy of objects": _source("t.npy", _save(np.array([1, "a", None] * (n // 3 + 1), dtype=object))),
        f"npy {wide} id {vocab_id} at {at}": _source("t.npy", _save(with_id(wide, vocab_id))),
        f"npy {signed} id -1 at {at}": _source("t.npy", _save(with_id(signed, -1))),
        f"npy id {vocab_id} > vocab 300": _source("t.npy", _save(with_id("int32", max(vocab_id, 300))),
                                                  "--model.vocab_size=300", names=("data.source", "model.vocab_size")),
        "npy empty": _source("t.npy", _save(np.zeros(0, dtype=np.uint16))),
        "npy empty 2-d": _source("t.npy", _save(np.zeros((0, 7), dtype=np.int32))),
        "npy scalar": _source("t.npy", _save(np.array(5, dtype=np.int64))),
        f"npy short ({NEED - 1} ids)": _source("t.npy", _save(np.arange(NEED - 1, dtype=np.uint8))),
        "npy short 2-d": _source("t.npy", _save(np.zeros((3, 11), dtype=np.uint16))),
        "npy truncated": _source("t.npy", _truncated_npy(n)),
        "npy garbage": _source("t.npy", _bytes(bytes(rng.randrange(256) for _ in range(rng.randint(1, 300))))),
        "npy that is text": _source("t.npy", _bytes(b"hello world\n" * 10)),
        "npy header only": _source("t.npy", _bytes(b"\x93NUMPY\x01\x00")),
        "npy 0 bytes": _source("t.npy", _bytes(b"")),
        f"bin odd size ({2 * n + 1} bytes)": _source("t.bin", _bytes(b"\x01" * (2 * n + 1))),
        "bin 1 byte": _source("t.bin", _bytes(b"\x01")),
        "bin empty": _source("t.bin", _bytes(b"")),
        f"bin short ({NEED - 1} ids)": _source("t.bin", _tofile(np.arange(NEED - 1, dtype=np.uint16))),
        f"bin id {vocab_id} at {at}": _source("t.bin", _tofile(with_id(np.uint16, vocab_id))),
        "text empty": _source("t.txt", _bytes(b"")),
        f"text short ({NEED - 1} bytes)": _source("t.txt", _bytes(b"x" * (NEED - 1))),
        "text under a max_bytes cap": _source("t.txt", _bytes(b"y" * 5000),
                                              f"--data.max_bytes={rng.randint(1, NEED - 1)}",
                                              names=("data.max_bytes",)),
        "folder of csv": _source("d", _folder({"a.csv": b"1,2\n" * 100, "b.bin": b"\x00" * 100})),
        "folder empty": _source("d", _folder({})),
        "folder of empty text": _source("d", _folder({"a.txt": b"", "sub/b.py": b""})),
        "folder of short text": _source("d", _folder({"a.txt": b"abc", "sub/b.md": b"def"})),
        "folder named .bin": _source("d.bin", _folder({"a.txt": b"z" * 500})),
        "folder named .npy": _source("d.npy", _folder({"a.txt": b"z" * 500})),
        "FIFO": _source("pipe.txt", _fifo),
        "FIFO named .bin": _source("pipe.bin", _fifo),
        "socket": _source("sock.txt", _socket),
        "link to /dev/zero": _source("zero.txt", _link("/dev/zero")),
        "link to /dev/zero named .bin": _source("zero.bin", _link("/dev/zero")),
        "link to /dev/urandom named .npy": _source("r.npy", _link("/dev/urandom")),
        "dangling link": _source("gone.txt", _link("/nonexistent-bigtrain/x")),
        "link loop": _source("loop.txt", _loop),
    }
    devices = {f"device {d}": d for d in ("/dev/zero", "/dev/null", "/dev/urandom", "/dev/full", "/dev/tty")}
    label = rng.choice(sorted(recipes) + sorted(devices))
    if label in devices:
        return Case("data", label, ("data.source",), _args(f"--data.source={devices[label]}"))
    return recipes[label](label)


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
        _loop(folder / "l")
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
    return Case("env", label, names, _args(*layout, env=env), command=command)


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
                _loop(path)
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
    return Case("flag", label, names, _args(*argv), command=command, uses_preset=label not in (
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
    return Case("clumsy", label, (name,), _args(*argv))


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
            case, label = _field_case(rng)
            if case is None:
                draw.skipped_valid.append(label)
                continue
        elif kind == "data":
            case = _data_case(rng)
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
