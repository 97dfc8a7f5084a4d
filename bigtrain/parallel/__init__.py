"""Parallel layouts applied to plain models: data parallel (ZeRO, tensor, sequence, pipeline to come)."""

from bigtrain.parallel.data import DataParallel

__all__ = ["DataParallel"]
