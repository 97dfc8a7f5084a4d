"""The model families bigtrain trains, by ``model.family``: the built-in ones, and any a user's
module registers (:func:`register_family`), imported by ``model.family_module`` before the config
is validated, in the launcher and in every rank (torchtitan's ``register_train_spec`` and
``experimental.custom_import``)."""

from __future__ import annotations

import importlib
import os
import sys

from typing import Callable

from bigtrain.config import Config, ModelConfig
from bigtrain.families.spec import Family, vocabulary_of


# The built-in families, by name, each imported when a config first names it: their modules import
# torch (and the hf one transformers), about 2 s of CPU, which commands that build no model
# (presets, fields, config) need not pay.
def _llama() -> Family:
    from bigtrain.families.llama import LLAMA

    return LLAMA


def _dlrm() -> Family:
    from bigtrain.families.dlrm import DLRM

    return DLRM


def _hf() -> Family:
    from bigtrain.families.hf import HF

    return HF


BUILT_IN_NAMES: dict[str, Callable[[], Family]] = {"llama": _llama, "dlrm": _dlrm, "hf": _hf}
_built_in: dict[str, Family] = {}  # those imported so far
# Live: register_family adds to it. Read it through family_of / find_family / registered_family,
# which import a config's model.family_module and a built-in family first; the module attribute
# FAMILIES is this dict with every built-in family imported (module __getattr__ below).
_registered: dict[str, Family] = {}
FIELD = "model.family_module"


def _load(name: str) -> None:
    """Import the built-in family ``name`` once, into the registry (a name the registry lost since,
    a test's clear(), stays lost)."""
    if name in BUILT_IN_NAMES and name not in _built_in:
        family = _built_in[name] = BUILT_IN_NAMES[name]()
        assert family.name == name, (family.name, name)
        _registered.setdefault(name, family)


def _is_built_in(family: Family) -> bool:
    return _built_in.get(family.name) is family


def __getattr__(name: str):
    if name in ("FAMILIES", "BUILT_IN"):
        for built_in in BUILT_IN_NAMES:
            _load(built_in)
        return _registered if name == "FAMILIES" else tuple(_built_in[n] for n in BUILT_IN_NAMES)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def family_names() -> tuple[str, ...]:
    """The registered names, the built-in ones first, importing no family."""
    return tuple(dict.fromkeys([*(n for n in BUILT_IN_NAMES if n in _registered or n not in _built_in),
                                *_registered]))


def _defined_in(family: Family) -> str | None:
    """The module a family's builder comes from: a module imported again (importlib.reload, a
    notebook) registers a new Family object of the same definition."""
    builder = family.build_meta or family.own_step
    return getattr(builder, "__module__", None)


def register_family(family: Family) -> Family:
    """Make ``family`` a ``model.family`` choice (call it at the import of the module that
    ``model.family_module`` names). Refuses a name a different family holds, naming it; registering
    the same family again (or its module imported again) is a no-op. Returns the family."""
    if not isinstance(family, Family):
        raise TypeError(f"register_family takes a bigtrain.families.Family, not a {type(family).__name__}")
    if not family.name or not isinstance(family.name, str) or family.name != family.name.strip():
        raise ValueError(f"register_family: Family.name = {family.name!r} must be a non-empty name without "
                         f"surrounding spaces (what model.family says)")
    if family.own_step is None and family.build_meta is None:
        raise ValueError(f"register_family: Family(name={family.name!r}) has no build_meta (the model on the meta "
                         f"device, from the config) and no own_step: give build_meta=lambda cfg: MyModel(...)")
    if family.own_step is None and not family.reads_tokens:
        raise ValueError(f"register_family: Family(name={family.name!r}) has reads_tokens=False and no own_step, but "
                         f"the Trainer's decoder step trains on token batches; give an own_step for other data "
                         f"(as the DLRM family's DlrmStep), or leave reads_tokens=True")
    _load(family.name)  # a built-in name is taken by bigtrain's own family
    taken = _registered.get(family.name)
    if taken is not None and taken is not family and taken != family:
        same_source = not _is_built_in(taken) and _defined_in(taken) == _defined_in(family)
        if not same_source:
            where = "bigtrain's own" if _is_built_in(taken) else f"registered from {_defined_in(taken)}"
            raise ValueError(f"register_family: model.family = {family.name!r} is taken by another family "
                             f"({where}: {taken.summary}); give yours another Family.name")
    _registered[family.name] = family
    return family


def _dotted(name: str) -> bool:
    return all(part.isidentifier() for part in name.split("."))


def import_family_module(model: ModelConfig) -> list[str]:
    """Import ``model.family_module`` (the module that registers ``model.family``); the problems,
    each naming the field and the fix ([] when it imported and the family is registered, and when
    no module is named). The working directory is on the import path, as ``python -m`` and the
    ranks bigtrain's launcher starts have it (the ``bigtrain`` script's own path does not)."""
    name = model.family_module.strip()
    if not name:
        return []
    if name.endswith(".py") or not _dotted(name):
        # A file path's dotted form, where it has one ('my_models/gpt2.py' -> 'my_models.gpt2').
        dotted = name.removesuffix(".py").replace("/", ".").replace("\\", ".").strip(".")
        like = dotted if _dotted(dotted) else "my_models.gpt2"
        return [f"{FIELD} = {model.family_module!r}: write the module's import path, dotted, like '{like}' "
                f"(no file path, no '.py'), and run from the folder it is found under; the module calls "
                f"bigtrain.families.register_family"]
    cwd = os.getcwd()
    if cwd not in sys.path and "" not in sys.path:
        sys.path.append(cwd)  # after the installed packages: a local folder does not shadow them
    try:
        importlib.import_module(name)
    except ModuleNotFoundError as e:
        if e.name is not None and (name == e.name or name.startswith(e.name + ".")):
            return [f"{FIELD} = '{name}': no module '{e.name}' can be imported from the working directory "
                    f"{cwd} or sys.path; run from the folder that holds it, add that folder to PYTHONPATH, or "
                    f"pip install its package"]
        return [f"{FIELD} = '{name}': importing it failed: {type(e).__name__}: {e}; install what it imports"]
    except Exception as e:  # the user's module raised: say what, with the field
        return [f"{FIELD} = '{name}': importing it raised {type(e).__name__}: {e}"]
    _load(model.family)
    if model.family not in _registered:
        return [f"model.family = '{model.family}': {FIELD} = '{name}' imported, and registered no family of that "
                f"name (registered: {', '.join(repr(n) for n in family_names())}); call "
                f"bigtrain.families.register_family(Family(name='{model.family}', ...)) in it, or set model.family "
                f"to the name it registers"]
    return []


def registered_family(name: str) -> Family | None:
    """The family registered under ``name``, importing nothing (validation imports the module once,
    first: a module that fails would otherwise run again for every rule that asks); a built-in
    family is imported here, the first time."""
    _load(name)
    return _registered.get(name)


def find_family(model: ModelConfig) -> Family | None:
    """The family ``model.family`` names, after importing ``model.family_module``; None for a name
    nothing registered (validation names it, with the module's problem)."""
    _load(model.family)
    if model.family not in _registered and model.family_module.strip():
        import_family_module(model)
    return _registered.get(model.family)


def family_of(cfg: Config) -> Family:
    """The family ``cfg.model.family`` names (importing ``model.family_module`` first); KeyError
    naming the choices (validation refuses an unknown name before anything asks)."""
    family = find_family(cfg.model)
    if family is None:
        problems = import_family_module(cfg.model) if cfg.model.family_module.strip() else []
        raise KeyError(problems[0] if problems else
                       f"model.family = '{cfg.model.family}': must be one of "
                       f"{', '.join(repr(n) for n in family_names())}, or a family that the module named by {FIELD} "
                       f"registers")
    return family


def model_vocabulary(cfg: Config) -> tuple[int, str]:
    """The vocabulary the model's embedding has and the field that sets it: what token ids are
    checked against (model.vocab_size, unless the family's own file sets it: Family.vocabulary)."""
    return vocabulary_of(family_of(cfg), cfg)
