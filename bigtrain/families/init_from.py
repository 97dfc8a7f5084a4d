"""The model shape a Hugging Face folder given as ``model.init_from`` implies: read by the CLI
(``train``, ``check``) before validation, so a run takes the folder's shape whatever its preset says."""

from __future__ import annotations

from bigtrain.config import Config, ConfigError
from bigtrain.families.registry import find_family


def init_from_architecture(cfg: Config) -> list[str]:
    """``model.init_from = "hf:PATH"``: the [model] fields of PATH/config.json as overrides (the
    model's shape is the folder's, whatever the preset says); [] without one, and for a family that
    the [model] shape fields do not describe (``model.family = "hf"`` is built from model.hf_config:
    reading a Qwen3 or Mixtral folder as bigtrain's Llama refused the run its own docs show)."""
    if not cfg.model.init_from:  # (the usual case: the commands that build no model then import no torch)
        return []
    from bigtrain.checkpoint.hf import HFFormatError, hf_folder, model_values, other_family_hint, read_hf_config

    family = find_family(cfg.model)
    if family is None or not family.model_fields:
        return []  # validation checks the folder against the family's own description
    folder = hf_folder(cfg.model.init_from)
    if folder is None or not folder.is_dir():
        return []  # validation names the problem
    try:
        values = model_values(read_hf_config(folder), str(folder))
    except HFFormatError as e:
        raise ConfigError(f"model.init_from = {cfg.model.init_from!r}: {e}{other_family_hint(folder)}") from None
    return [f"--model.{k}={v}" for k, v in values.items()]
