"""Whether a folder can be (or become) one this process writes into, probed before any rank starts
with a temporary file removed at once, in the nearest folder that already exists (nothing created):
the run directory, the corpus cache, the offload folder."""

from __future__ import annotations

import os
import stat
import tempfile
from pathlib import Path

NAME_MAX = 255

def writable_dir_problem(path: str | Path, name: str) -> str | None:
    """Why ``path`` cannot be (or become) a folder this process writes into; None when it can."""
    text = str(path)
    if not text.strip():
        return f"{name} is empty; give a folder"
    try:
        target = Path(os.path.expanduser(text)).absolute()
        too_long = [p for p in target.parts if len(os.fsencode(p)) > NAME_MAX]
        if too_long:
            return f"{name} = '{text}': the name '{too_long[0][:40]}...' is longer than {NAME_MAX} bytes"
        probe = target
        while not os.path.lexists(probe):
            probe = probe.parent
        mode = os.stat(probe).st_mode  # follows links: a dangling one raises
        if not stat.S_ISDIR(mode):
            where = "it" if probe == target else f"'{probe}'"
            return f"{name} = '{text}': {where} exists and is not a folder; choose another path"
        fd, tmp = tempfile.mkstemp(dir=probe, prefix=".bigtrain-write-test-")
        os.close(fd)
        os.unlink(tmp)
    except (OSError, ValueError) as e:
        reason = getattr(e, "strerror", None) or str(e)
        return f"{name} = '{text}': cannot write there ({reason}); choose a folder you can write"
    return None
