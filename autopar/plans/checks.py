"""Plan-against-graph checks: a plan that cannot split this model is refused, before any
process work, with a sentence naming the dim, the layer and sizes that would work."""

from __future__ import annotations

import torch
import torch.fx as fx

from autopar.errors import PlanError
from autopar.graph.analysis import OpKind
from autopar.modes import CP, GRID_MODES, TP, TP_3D, ZIGZAG
from autopar.plans.schema import Plan
from autopar.sharding.divisible import indivisible
from autopar.sharding.solve import tokens_per_sample

_PASS_THROUGH = {torch.ops.aten.view.default, torch.ops.aten.reshape.default,
                 torch.ops.aten._unsafe_view.default, torch.ops.aten.unsqueeze.default,
                 torch.ops.aten.expand.default, torch.ops.aten.clone.default,
                 torch.ops.aten.slice.Tensor, torch.ops.aten.contiguous.default,
                 torch.ops.aten.alias.default}

_WHAT = {"out": "output features", "in": "input features", "hidden": "hidden size",
         "heads": "attention heads"}


def check_divisible(traced, solution) -> None:
    """Attention heads and block widths must split evenly over the tensor axis."""
    problem = indivisible(traced, solution)
    if problem:
        raise PlanError(problem)


def _index_source(node):
    """The node an embedding's index tensor is read from, through reshapes and slices."""
    while isinstance(node, fx.Node) and node.op == "call_function" and \
            node.target in _PASS_THROUGH:
        node = node.args[0]
    return node


def embedding_lookups(traced):
    """(embedding node, rows of its table, where its indices come from) for each lookup."""
    for node in traced.graph.nodes:
        if node.op == "call_function" and node.target is torch.ops.aten.embedding.default:
            weight = node.args[0]
            pinfo = traced.params.get(weight.target) if weight.op == "get_attr" else None
            if pinfo is not None:
                yield node, int(pinfo.shape[0]), _index_source(node.args[1])


def check_positions(traced) -> None:
    """Refuse example inputs longer than a position table (a lookup of arange(n) in a table
    of fewer rows, which meta tensors trace without complaint)."""
    for node, rows, source in embedding_lookups(traced):
        if isinstance(source, fx.Node) and source.op == "call_function" and \
                source.target in (torch.ops.aten.arange.default, torch.ops.aten.arange.start):
            ends = [a for a in source.args if isinstance(a, int)]
            length = ends[-1] - (ends[0] if len(ends) > 1 else 0) if ends else None
            if length is not None and length > rows:
                module = node.meta["autopar"].module or "a position embedding"
                raise PlanError(f"the example inputs have {length} positions but {module} has "
                                f"{rows} rows; use sequences of at most {rows} tokens (or a "
                                "model with more positions).")


def _check_tokens_divide(traced, parts: int, no_sequence: str, splits: str,
                         other: str) -> None:
    """Refuse a model without token sequences, or whose sequence length does not divide
    into `parts`, naming the lengths that would."""
    seq = tokens_per_sample(traced)
    if seq is None:
        raise PlanError(no_sequence)
    if seq % parts:
        lo = seq - seq % parts
        ok = " or ".join(str(n) for n in (lo, lo + parts) if n > 0)
        raise PlanError(f"{splits.format(seq=seq)}, and {seq} does not divide by {parts}: use "
                        f"a sequence length of {ok}, or {other.format(seq=seq)}.")


def check_sequence_dims(traced, plan: Plan) -> None:
    """Megatron sequence parallelism splits each sample's tokens over tp (beside cp: each
    rank's cp block of them): they must divide."""
    tp, cp = plan.mesh[TP], plan.mesh[CP]
    if not plan.sequence_parallel_layers() or tp == 1:
        return
    over = f"tensor size {tp}" + (f" within each of the sequence size {cp}'s blocks"
                                  if cp > 1 else "")
    _check_tokens_divide(
        traced, tp * cp, "sequence_parallel needs token sequences, but the model's first input "
        "is not [batch, tokens, ...]; drop sequence_parallel for this model.",
        f"sequence_parallel splits each sample's {{seq}} tokens over {over}",
        "a tensor size that divides {seq}" + (f" / {cp}" if cp > 1 else ""))


def check_context_dims(traced, plan: Plan) -> None:
    """Context parallelism splits each sample's tokens over cp: they must divide."""
    cp = plan.mesh[CP]
    if cp == 1:
        return
    zigzag = plan.cp_layout() == ZIGZAG
    _check_tokens_divide(
        traced, 2 * cp if zigzag else cp, "sequence parallelism over cp needs token sequences, "
        "but the model's first input is not [batch, tokens, ...]; use a sequence size of 1.",
        f"sequence size {cp} splits each sample's {{seq}} tokens over cp" +
        (f" in the zigzag layout (2 x {cp} chunks)" if zigzag else ""),
        "layout='contiguous' (chunks of S / cp), or a sequence size whose double divides "
        "{seq}" if zigzag else "a sequence size that divides {seq}")


def check_graph(traced, plan: Plan, mesh) -> None:
    """Every check above a plan's mesh makes of a traced model."""
    check_positions(traced)
    check_grid_dims(traced, plan, mesh)
    check_sequence_dims(traced, plan)
    check_context_dims(traced, plan)


def _grid_checks(node, info, q: int, out_parts: int) -> list[tuple[str, int, int]]:
    """(what, size, parts) for each dim a grid layer's op splits."""
    if info.kind is OpKind.LINEAR:
        addmm = node.target is torch.ops.aten.addmm.default
        shape = (node.args[2] if addmm else node.args[1]).meta["autopar"].shape
        out_f, in_f = (shape[1], shape[0]) if addmm else (shape[0], shape[1])
        return [("out", int(out_f), out_parts), ("in", int(in_f), q)]
    if info.kind in (OpKind.NORM, OpKind.EMBEDDING):
        return [("hidden", int(info.shape[-1]), q)]
    if info.kind is OpKind.ATTENTION:
        return [("heads", int(info.shape[1]), q)]
    return []


def check_grid_dims(traced, plan: Plan, mesh) -> None:
    """Every dim a 2D, 2.5D or 3D layer splits must divide by its grid: refuse with the dim,
    the layer and the nearest sizes that would."""
    if mesh.mode not in GRID_MODES or plan.mesh[TP] == 1:
        return
    modes = plan.layer_modes()
    q = mesh.size(mesh.physical[-1])
    out_parts = q * q if mesh.mode == TP_3D else q
    for node in traced.graph.nodes:
        info = node.meta.get("autopar")
        if info is None or modes.get(info.layer, plan.tp_mode) != mesh.mode:
            continue
        for what, n, parts in _grid_checks(node, info, q, out_parts):
            if n % parts:
                ok = [m for m in (n - n % parts, n - n % parts + parts) if m > 0]
                raise PlanError(f"{mesh.mode} tensor parallelism over {plan.mesh['tp']} ranks "
                                f"splits the {_WHAT[what]} of {info.module or info.layer} into "
                                f"{parts}, and {n} does not divide: use "
                                f"{' or '.join(map(str, ok))} {_WHAT[what]}, or another tensor "
                                "size.")
