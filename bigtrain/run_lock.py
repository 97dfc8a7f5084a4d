"""Who owns a run directory: one run at a time writes into it.

``RUN/run.lock`` is a lock file held with ``flock`` for as long as a run lives, by every process
that may write into the folder: the ``bigtrain train`` that launches the ranks (or the single
process that trains), and each rank that launcher starts. The kernel drops a process's lock when
it exits, however it exits (``kill -9`` included), so a holder that is gone never keeps a folder
locked: the lock is recovered by the next run without any clean-up, and the file's stale content
is overwritten.

Taking a folder (:func:`take_run_dir`): an exclusive lock without waiting proves that no process
of any run holds it; the holder's name (host, pid, start time, command and a token) is written
into the file, and the lock is turned into a shared one, which the ranks the launcher starts join
(:func:`join_run_dir`, with the token through the environment: torchrun closes inherited
descriptors, so they open the file themselves). The change from exclusive to shared is not atomic;
a run that took the lock in between has written its own token, so a taker reads the file back once
it holds the shared lock and gives up unless its own token is there. A run that finds the lock held
is refused before it writes anything, naming the holder. A holder whose process is gone while its
ranks still hold the lock (its launcher was killed) is named as such: the ranks notice their
launcher's death and stop within ``distributed.timeout_s`` (:mod:`bigtrain.distributed.launch`).

Under a launcher that is not ours (a user's torchrun), rank 0 takes the lock for the whole run.
On a filesystem without ``flock`` (some network filesystems) the run goes on with a warning.
"""

from __future__ import annotations

import errno
import fcntl
import json
import os
import socket
import sys
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path

from bigtrain.config import ConfigError

LOCK_FILE = "run.lock"
TOKEN_ENV = "BIGTRAIN_RUN_LOCK"  # the launcher's token, for the ranks it starts
_HOLDER_MAX_BYTES = 64 << 10


@dataclass
class RunLock:
    """A held lock on ``run_dir`` (``fd`` None: nothing is held, e.g. a filesystem without flock)."""

    run_dir: Path
    fd: int | None
    token: str | None
    created: list[Path] = field(default_factory=list)  # what taking it created: the file, new folders

    def release(self, remove_created: bool = False) -> None:
        """Drop the lock; with ``remove_created`` also what taking it created (a run refused after
        it took the folder leaves nothing behind). Removing the file while holding it is safe:
        a taker checks that the file it locked is still the one the path names."""
        if remove_created:
            for path in self.created:
                try:
                    path.rmdir() if path.is_dir() else path.unlink()
                except OSError:
                    pass  # a folder someone else wrote into meanwhile stays
            self.created = []
        if self.fd is not None:
            os.close(self.fd)  # closing the last descriptor drops the flock
            self.fd = None

    def __enter__(self) -> "RunLock":
        return self

    def __exit__(self, *exc) -> None:
        self.release()


def _holder_record(token: str, command: str | None) -> dict:
    command = command if command is not None else " ".join(["bigtrain", *sys.argv[1:]])
    return {"host": socket.gethostname(), "pid": os.getpid(), "started": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
            "command": command[:500], "token": token}


def _read_holder(fd: int) -> dict:
    try:
        text = os.pread(fd, _HOLDER_MAX_BYTES, 0)
        value = json.loads(text)
    except (OSError, ValueError):
        return {}
    return value if isinstance(value, dict) else {}


def _write_holder(fd: int, record: dict) -> None:
    """In place (the lock belongs to this inode: a rename would make a new one); best effort: on a
    full disk the lock is held all the same, with no name in it."""
    try:
        os.ftruncate(fd, 0)
        os.pwrite(fd, (json.dumps(record) + "\n").encode(), 0)
    except OSError:
        pass


def process_alive(pid: int) -> bool:
    """Whether process ``pid`` (on this host) is running: not gone, not a zombie."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:  # a zombie (exited, not yet reaped) holds nothing
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return True


def describe_holder(holder: dict) -> str:
    """``pid 123 on host h, started ... (bigtrain train ...)``, and whether that process is gone."""
    pid, host = holder.get("pid"), holder.get("host")
    if not isinstance(pid, int) or not isinstance(host, str):
        return "a run that has not written its name yet (or an older bigtrain)"
    text = f"pid {pid} on {host}, started {holder.get('started', '?')}"
    if holder.get("command"):
        text += f" ({holder['command']})"
    if host == socket.gethostname() and not process_alive(pid):
        text += ("; that process is gone, and the ranks it started still hold the folder: they stop on their own "
                 "within distributed.timeout_s of their launcher's death")
    return text


def _in_use(run_dir: Path, holder: dict, flag: str) -> ConfigError:
    return ConfigError(f"{flag} = '{run_dir}' is in use by another run: {describe_holder(holder)}; wait for it to "
                       f"end or stop it, or choose another --output-dir")


def _open_lock_file(run_dir: Path) -> tuple[int, list[Path]]:
    """A descriptor of ``run_dir/run.lock``, and what opening it created (the file, new folders)."""
    created = []
    missing = run_dir.absolute()
    while not missing.exists() and missing != missing.parent:
        created.insert(0, missing)
        missing = missing.parent
    run_dir.mkdir(parents=True, exist_ok=True)
    path = run_dir / LOCK_FILE
    try:
        try:
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o644)
            created.append(path)
        except FileExistsError:
            fd = os.open(path, os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError as e:  # a link, a folder, no permission, no inode left
        for folder in created[::-1]:
            try:
                folder.rmdir()
            except OSError:
                pass
        raise ConfigError(f"--output-dir = '{run_dir}': its lock file {path} cannot be opened ({e.strerror}); "
                          f"remove whatever is there under that name, or choose another --output-dir") from None
    return fd, created[::-1]  # the file first, then the folders inside out


def _same_file(fd: int, path: Path) -> bool:
    try:
        mine, now = os.fstat(fd), os.stat(path, follow_symlinks=False)
    except OSError:
        return False
    return (mine.st_dev, mine.st_ino) == (now.st_dev, now.st_ino)


def _no_flock(run_dir: Path, error: OSError) -> RunLock:
    import warnings

    warnings.warn(f"{run_dir}: this filesystem does not support file locks ({error.strerror}); nothing stops "
                  f"a second run from writing into the same folder meanwhile", stacklevel=3)
    return RunLock(run_dir, None, None)


def take_run_dir(run_dir: Path, flag: str = "--output-dir", command: str | None = None) -> RunLock:
    """Own ``run_dir`` for this process and the ranks it starts (:func:`join_run_dir`); a
    ConfigError naming the holder when another run holds it. Creates the folder and the lock file
    (and nothing else) when they do not exist."""
    run_dir = Path(run_dir)
    token = uuid.uuid4().hex
    for _ in range(8):  # the file was removed or replaced between open and lock: open it again
        fd, created = _open_lock_file(run_dir)
        lock = RunLock(run_dir, fd, token, created)
        # Held: the file is the holder's now, even if this process created it.
        unsupported = _flock_or_refuse(lock, fcntl.LOCK_EX, flag)
        if unsupported is not None:
            return _no_flock(run_dir, unsupported)
        if not _same_file(fd, run_dir / LOCK_FILE):
            lock.release()
            continue
        _write_holder(fd, _holder_record(token, command))
        # The ranks join; nobody else gets in (held: another run took it while the lock changed
        # from exclusive to shared).
        unsupported = _flock_or_refuse(lock, fcntl.LOCK_SH, flag)
        if unsupported is not None:  # it was supported a moment ago
            raise unsupported
        holder = _read_holder(fd)
        if holder.get("token") not in (token, None):  # None: a full disk kept our name out
            lock.release()
            raise _in_use(run_dir, holder, flag)
        return lock
    raise ConfigError(f"{flag} = '{run_dir}': its {LOCK_FILE} keeps being replaced; is another program removing it?")


def _flock_or_refuse(lock: RunLock, mode: int, flag: str) -> OSError | None:
    """``flock(mode)`` on ``lock``'s file without waiting. Held by another run: ``lock`` released
    and the run refused, naming the holder. A filesystem without flock: ``lock`` released and the
    error returned (the caller says what that means); any other error raised."""
    try:
        fcntl.flock(lock.fd, mode | fcntl.LOCK_NB)
    except BlockingIOError:
        holder = _read_holder(lock.fd)
        lock.release()
        raise _in_use(lock.run_dir, holder, flag) from None
    except OSError as e:
        lock.release()
        if e.errno in (errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOSYS, errno.EINVAL):
            return e
        raise
    return None


def join_run_dir(run_dir: Path, token: str, flag: str = "--output-dir") -> RunLock:
    """A rank of the launcher that owns ``run_dir`` (its ``token``): hold the folder with it, so
    that the folder stays owned while this rank lives, also if the launcher dies first."""
    run_dir = Path(run_dir)
    try:
        fd = os.open(run_dir / LOCK_FILE, os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError as e:
        raise ConfigError(f"{flag} = '{run_dir}': the launcher's {LOCK_FILE} cannot be opened ({e.strerror}); "
                          f"{TOKEN_ENV} = {token} names a lock that is not there (a leftover? unset it)") from None
    lock = RunLock(run_dir, fd, token)
    if _flock_or_refuse(lock, fcntl.LOCK_SH, flag) is not None:
        return RunLock(run_dir, None, token)  # no flock here: the launcher warned already
    holder = _read_holder(fd)
    if holder.get("token") not in (token, None):
        lock.release()
        raise _in_use(run_dir, holder, flag)
    return lock


def own_run_dir(run_dir: Path, rank: int, launched_by_us: bool, command: str | None = None
                ) -> tuple[RunLock | None, bool]:
    """What a ``bigtrain train`` process holds of ``run_dir``: (the lock or None, whether this
    process took it, rather than joined its launcher's). Our launcher's ranks join its lock; under
    another launcher rank 0 takes it and the other ranks hold none."""
    token = os.environ.get(TOKEN_ENV)
    if launched_by_us and token:
        return join_run_dir(run_dir, token), False
    if rank != 0:
        return None, False
    return take_run_dir(run_dir, command=command), True
