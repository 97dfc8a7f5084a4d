"""bigtrain: train neural networks that do not fit on one accelerator.

From Python, the pieces a script needs are here by name (imported on first use, so ``import
bigtrain``, and with it the CLI's start, stays free of torch)::

    import bigtrain
    cfg = bigtrain.load_config(preset="tiny", overrides=["--train.steps=20"])
    bigtrain.Trainer(cfg, "runs/mine", bigtrain.Mesh({})).fit()   # validated first, as the CLI does
"""

from bigtrain.lazy_exports import lazy_getattr

__version__ = "0.1.0"

# name -> the module that defines it
_EXPORTS = {
    "Config": "bigtrain.config", "ConfigError": "bigtrain.config", "load_config": "bigtrain.config",
    "validate": "bigtrain.validation", "Trainer": "bigtrain.train", "Mesh": "bigtrain.distributed.mesh",
    "parallelize": "bigtrain.parallel.build", "Family": "bigtrain.families",
    "register_family": "bigtrain.families",
}
__all__ = ["__version__", *_EXPORTS]


__getattr__ = lazy_getattr(__name__, _EXPORTS, globals())
