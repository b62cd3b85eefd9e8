"""A model spec prepared for the search as the planner prepares it, and a search's result
to the bit (shared by the floors' tests)."""

from autopar.models import workload
from autopar.search import planner


def prepared_chain(spec: str, tp_sizes, **kwargs):
    """`spec`'s LayerChain for these tp sizes, its repeated blocks counted once."""
    w = workload(spec, **kwargs)
    return planner.prepare(w.model, w.inputs, loss_fn=w.loss_fn, example_target=w.target,
                           tokens_per_sample=w.tokens_per_sample, tp_sizes=tp_sizes,
                           repeat={"blocks.1": w.layers - 1} if w.layers > 2 else None)


def result_bits(res) -> list:
    """Everything a search returns, to the bit."""
    out = [res.candidates, res.left_out]
    for cand, why in [(res.best, "")] + res.alternatives:
        out.append((cand.describe(), float(cand.step_time).hex(),
                    float(cand.memory_per_device).hex(), list(cand.stages), why))
    return out
