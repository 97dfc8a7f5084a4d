"""The model families bigtrain trains, by ``model.family``."""

from __future__ import annotations

from bigtrain.config import Config
from bigtrain.families.dlrm import DLRM
from bigtrain.families.hf import HF
from bigtrain.families.llama import LLAMA
from bigtrain.families.spec import Family

FAMILIES: dict[str, Family] = {f.name: f for f in (LLAMA, DLRM, HF)}


def family_names() -> tuple[str, ...]:
    return tuple(FAMILIES)


def family_of(cfg: Config) -> Family:
    """The family ``cfg.model.family`` names; KeyError naming the choices (validation refuses an
    unknown name before anything asks)."""
    try:
        return FAMILIES[cfg.model.family]
    except KeyError:
        raise KeyError(f"model.family = '{cfg.model.family}': must be one of "
                       f"{', '.join(repr(n) for n in FAMILIES)}") from None


def model_vocabulary(cfg: Config) -> tuple[int, str]:
    """The vocabulary the model's embedding has and the field that sets it: what token ids are
    checked against (model.vocab_size, unless the family's own file sets it: Family.vocabulary)."""
    family = family_of(cfg)
    return family.vocabulary(cfg) if family.vocabulary is not None else (cfg.model.vocab_size, "model.vocab_size")
