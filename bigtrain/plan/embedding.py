"""The embedding sharding planner lives with the recommender it places
(:mod:`bigtrain.recsys.placement`), below the model families that name it; these names stay here
for ``bigtrain plan`` and existing imports."""

from bigtrain.recsys.placement import cmd_plan_embedding, describe_plan, plan_embedding, table_bytes

__all__ = ["cmd_plan_embedding", "describe_plan", "plan_embedding", "table_bytes"]
