"""ZeRO stages 0-3 with mixed precision (see engine.py for the memory each stage keeps)."""

from bigtrain.parallel.zero.engine import ZeroEngine

__all__ = ["ZeroEngine"]
