"""torchrun as ``bigtrain train`` starts it: the same agent, one line instead of its tracebacks.

``python -m torch.distributed.run`` ends a group whose rank failed with a ``ChildFailedError``
traceback and a signal with a ``SignalException`` one, about 30 lines each, printed after the
ranks' own one-line message. This module runs torchrun's own argument parsing and agent
(:func:`torch.distributed.run.run`) and turns those two endings into one line and an exit code:
1 for a failed rank (the launcher reads a deliberate stop's code from ``stopped.json``), 128 + N
for a signal.
"""

from __future__ import annotations

import atexit
import gc
import sys


def _exit_text(code: int) -> str:
    import signal

    if code < 0:
        try:
            return f"signal {signal.Signals(-code).name}"
        except ValueError:
            return f"signal {-code}"
    return f"exit code {code}"


def main(argv: list[str] | None = None) -> int:
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import parse_args, run

    try:
        run(parse_args(argv))
    except ChildFailedError as e:
        failed = ", ".join(f"rank {rank} (pid {f.pid}) with {_exit_text(f.exitcode)}"
                           for rank, f in sorted(e.failures.items()))
        print(f"bigtrain: torchrun: {failed}; the ranks' messages are above", file=sys.stderr, flush=True)
        return 1
    except SignalException as e:
        return 128 + int(e.sigval)
    return 0


if __name__ == "__main__":  # pragma: no cover - the launcher runs it as a module
    atexit.register(gc.freeze)  # shutdown skips torch's objects (bigtrain.cli.main says why)
    sys.exit(main())
