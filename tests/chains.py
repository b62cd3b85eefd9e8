"""A model spec prepared for the search as the planner prepares it (shared by the floors' tests)."""

from autopar.models import workload
from autopar.search import planner


def prepared_chain(spec: str, tp_sizes, **kwargs):
    """`spec`'s LayerChain for these tp sizes, its repeated blocks counted once."""
    w = workload(spec, **kwargs)
    return planner.prepare(w.model, w.inputs, loss_fn=w.loss_fn, example_target=w.target,
                           tokens_per_sample=w.tokens_per_sample, tp_sizes=tp_sizes,
                           repeat={"blocks.1": w.layers - 1} if w.layers > 2 else None)
