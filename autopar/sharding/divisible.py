"""Whether a 1D tensor-parallel solution splits every head and block width evenly.

The solver keeps an op whole when its dims do not divide; for attention heads and block
projections that would run a plan nobody asked for, so the engine refuses such a size and
the planner never offers it (one check, two callers).
"""

from __future__ import annotations

from autopar.graph.analysis import OpKind
from autopar.modes import TP_1D


def indivisible(traced, solution, nodes=None) -> str | None:
    """The sentence refusing `solution`'s tensor size for `traced` (only its `nodes` when
    given: one layer), or None when it splits: heads first (the usual cause), then the
    widths of the blocks' projections."""
    size = solution.size
    if size == 1:
        return None
    kept = [(node, node.meta["autopar"]) for node, strategy in solution.strategies.items()
            if strategy.name == "replicate" and solution.modes.get(
                node.meta["autopar"].layer) == TP_1D and (nodes is None or node in nodes)]
    for _, info in kept:
        if info.kind is OpKind.ATTENTION and int(info.shape[1]) % size:
            heads = int(info.shape[1])
            ok = [d for d in range(1, heads + 1) if heads % d == 0]
            return (f"attention in {info.module or info.layer} has {heads} heads, which do not "
                    f"split over tensor size {size}; use a tensor size that divides {heads} "
                    f"({', '.join(map(str, ok))}).")
    # a planner's trace of an MoE module (its experts' grouped matmuls): the engine runs the
    # module as one opaque op, whole on every tensor rank, so its router and shared-expert
    # gate (an [H, E] and an [H, 1] linear) are not split there and refuse no size
    moe = tuple({info.module + "." for _, info in (
        (n, n.meta["autopar"]) for n in solution.strategies)
        if info.kind is OpKind.GROUPED_MM and info.module})
    for node, info in kept:
        if info.kind is not OpKind.LINEAR or not any(c.isdigit() for c in info.layer):
            continue
        if moe and (info.module or "").startswith(moe):
            continue
        hint = solution.hints.get(node.name)
        if hint == ("replicate",):  # kept whole on purpose: key/value heads fewer than ranks
            continue
        width = int(info.shape[-1])
        groups = hint[1] if hint and hint[0] == "groups" else 1
        if width % (size * groups) == 0:
            continue
        if groups > 1:
            return (f"{info.module} has {width} output features in {groups} groups of "
                    f"{width // groups}, and {width // groups} does not split over tensor size "
                    f"{size}; use a tensor size that divides {width // groups}.")
        return (f"{info.module} has {width} output features, which do not split over tensor "
                f"size {size}; use a tensor size that divides {width}.")
    return None
