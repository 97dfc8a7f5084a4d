"""Float8 linear layers (``precision.fp8``; docs/precision.md).

:mod:`bigtrain.fp8.scaling` (formats, recipes, power-of-two dynamic scales),
:mod:`bigtrain.fp8.gemm` (one float8 GEMM: ``torch._scaled_mm`` or its emulation),
:mod:`bigtrain.fp8.linear` (``Float8Linear`` and the swap), :mod:`bigtrain.fp8.checks` (the
config rules; no torch). Import the submodule you need: this package imports nothing itself, so
that validation stays free of torch.
"""
