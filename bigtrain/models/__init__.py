"""Reference models: plain single-device PyTorch that knows nothing of ranks."""

from bigtrain.models.llama import Llama, build_model, count_parameters

__all__ = ["Llama", "build_model", "count_parameters"]
