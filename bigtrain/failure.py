"""The failure of a run that one clear line explains (exit 1, no traceback). Here, apart, so the
command line can catch it without importing torch."""


class RunFailure(RuntimeError):
    """A run that stopped on an error worth one clear line (exit 1, no traceback)."""
