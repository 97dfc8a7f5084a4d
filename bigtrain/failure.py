"""The failure of a run that one clear line explains (exit 1, no traceback), and the line of a run
interrupted (exit 130). Here, apart, so the command line can catch both without importing torch."""

INTERRUPTED = "bigtrain: interrupted"  # Ctrl-C, at start-up too (bigtrain.entry_point): exit 130


class RunFailure(RuntimeError):
    """A run that stopped on an error worth one clear line (exit 1, no traceback)."""
