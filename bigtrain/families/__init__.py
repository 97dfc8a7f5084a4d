"""Model families (issue 30): what bigtrain needs to know about a model, one module per family."""

from bigtrain.families.registry import FAMILIES, family_names, family_of, model_vocabulary
from bigtrain.families.spec import Family

__all__ = ["FAMILIES", "Family", "family_names", "family_of", "model_vocabulary"]
