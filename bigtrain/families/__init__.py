"""Model families (issue 30): what bigtrain needs to know about a model, one module per family;
``register_family`` adds one of your own (docs/families.md, "A family of your own")."""

from bigtrain.families.registry import (FAMILIES, family_names, family_of, find_family, import_family_module,
                                        model_vocabulary, register_family, registered_family)
from bigtrain.families.spec import Family

__all__ = ["FAMILIES", "Family", "family_names", "family_of", "find_family", "import_family_module",
           "model_vocabulary", "register_family", "registered_family"]
