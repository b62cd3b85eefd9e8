"""Graph -> graph rewrites that apply a plan: the sharding passes (tensor_parallel), mixed
precision (precision) and the pipeline split into stages (pipeline)."""

from autopar.passes.pipeline import Stages, split_stages
from autopar.passes.precision import cast_precision
from autopar.passes.tensor_parallel import (
    apply_solution,
    insert_collectives,
    localize_ops,
    shard_parameters,
)

__all__ = ["Stages", "apply_solution", "cast_precision", "insert_collectives", "localize_ops",
           "shard_parameters", "split_stages"]
