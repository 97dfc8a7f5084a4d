"""Model families (issue 30): what bigtrain needs to know about a model, one module per family;
``register_family`` adds one of your own (docs/families.md, "A family of your own"). The built-in
families are imported when a config first names one (``FAMILIES`` imports them all)."""

from bigtrain.families import registry
from bigtrain.families.registry import (family_names, family_of, find_family, import_family_module, model_vocabulary,
                                        register_family, registered_family)
from bigtrain.families.spec import Family

__all__ = ["FAMILIES", "Family", "family_names", "family_of", "find_family", "import_family_module",
           "model_vocabulary", "register_family", "registered_family"]


def __getattr__(name: str):
    if name == "FAMILIES":  # the live registry, every built-in family imported
        return registry.FAMILIES
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
