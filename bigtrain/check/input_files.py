"""Bad corpora written to disk (the ``data`` kind of :mod:`bigtrain.check.input_cases`): float /
complex / bool / text ``.npy``, ids at or above the vocabulary or negative, odd-sized, empty, short or
truncated files, folders without text, special files (``/dev/zero``, a FIFO, a socket, links to
them, dangling links, link loops).
"""

from __future__ import annotations

import os
import random
import socket
from pathlib import Path
from typing import Callable

import numpy as np

from bigtrain.check.input_recipe import NEED, Case, fixed_args


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


def link_loop(path: Path) -> None:
    other = path.with_name(path.name + "-other")
    path.symlink_to(other)
    other.symlink_to(path)


def _truncated_npy(n: int) -> Callable[[Path], None]:
    def write(path: Path) -> None:
        np.save(path, np.arange(n, dtype=np.uint16))
        with open(path, "r+b") as f:
            f.truncate(path.stat().st_size - n)  # the header promises n ids; half are there
    return write


def data_case(rng: random.Random) -> Case:
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
        "link loop": _source("loop.txt", link_loop),
    }
    devices = {f"device {d}": d for d in ("/dev/zero", "/dev/null", "/dev/urandom", "/dev/full", "/dev/tty")}
    label = rng.choice(sorted(recipes) + sorted(devices))
    if label in devices:
        return Case("data", label, ("data.source",), fixed_args(f"--data.source={devices[label]}"))
    return recipes[label](label)
