"""bigtrain: train neural networks that do not fit on one accelerator."""

__version__ = "0.1.0"
