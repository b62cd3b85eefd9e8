"""The engine's recomputation: which layers of the training graph run again in the backward
(the plan's modes), the pass that wraps them in each graph this rank runs, and which of the
catalog's forward collectives that replays (`Recompute.replayed`, for the accounting)."""

from __future__ import annotations

import operator

import torch.fx as fx

from autopar.cost.recompute import fused_with_inside, selective_core
from autopar.modes import FULL, NO_RECOMPUTE, SELECTIVE
from autopar.passes.recompute import fused_keys, wrap_recompute
from autopar.runtime.measure import is_mark
from autopar.runtime.zero3 import is_gather


class Recompute:
    """The plan's recompute modes over one traced training graph."""

    def __init__(self, plan, traced):
        names = [layer.name for layer in traced.layers]
        self.modes = {n: m for n, m in plan.recompute_modes(names).items() if m != NO_RECOMPUTE}
        self.fused: set = set()
        core: set = set()
        if SELECTIVE in self.modes.values():
            fused = fused_with_inside(traced)
            self.fused = fused_keys(traced.gm, fused)
            core = selective_core(traced)
        # the traced nodes whose forward collectives run again in the backward
        self.replayed = {n.name for n in traced.gm.graph.nodes
                         if self._reruns(n, core)}
        self._core = {n.name for n in core if n.name in self.replayed}

    def kept_inputs(self, solution) -> set[int]:
        """The ids of the collectives that hand a selectively recomputed core a value made
        outside it (cp's K/V all-gather before eager attention's matmuls): the region keeps
        what they hand it as an input, so they run once."""
        return {id(c) for t in solution.transitions
                if t.consumers[0].name in self._core and t.producer.name not in self._core
                for c in t.comm}

    def _reruns(self, node: fx.Node, core: set) -> bool:
        mode = self.modes.get(getattr(node.meta.get("autopar"), "layer", None))
        return mode == FULL or (mode == SELECTIVE and node in core)

    def apply(self, gm: fx.GraphModule) -> list[str]:
        """Wrap the recomputed regions of one of this rank's graphs (the training graph, or
        a pipeline stage), after the recorder's marks and ZeRO-3's gathers are in."""
        if not self.modes:
            return []
        return wrap_recompute(gm, self.modes, lambda n: _stays_out(gm, n), self.fused)


def _stays_out(gm: fx.GraphModule, node: fx.Node) -> bool:
    """The recorder's marks (a layer's time starts outside its recomputation) and ZeRO-3's
    gathers with their pieces (the forward's gather is not run again: the backward's,
    which the plan prices, serves the recomputation)."""
    if node.op == "call_module":
        module = gm.get_submodule(node.target)
        return is_mark(module) or is_gather(module)
    if node.op == "call_function" and node.target is operator.getitem:
        src = node.args[0]
        return src.op == "call_module" and is_gather(gm.get_submodule(src.target))
    return False
