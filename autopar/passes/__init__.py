"""Graph -> graph rewrites that apply a plan."""

from autopar.passes.tensor_parallel import apply_solution, insert_collectives, localize_ops, \
    shard_parameters

__all__ = ["apply_solution", "insert_collectives", "localize_ops", "shard_parameters"]
