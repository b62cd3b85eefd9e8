"""In-place ops on a fresh value that nothing else reads, made out of place.

`y = x @ w.T; y += z` mutates the product in place. Once the rewrite gives that product
to a kernel (a split linear, a collective), it is the output of an autograd Function,
which autograd refuses to modify in place; `y + z` computes the same value when no other
op reads `y` and `y` aliases nothing.
"""

from __future__ import annotations

import torch
import torch.fx as fx


def out_of_place(gm: fx.GraphModule) -> int:
    """Replace each such in-place op of `gm` with its out-of-place twin; the number replaced."""
    count = 0
    for node in list(gm.graph.nodes):
        twin = _twin(node)
        if twin is None or not _fresh_and_private(node.args[0], node):
            continue
        node.target = twin
        count += 1
    if count:
        gm.graph.lint()
        gm.recompile()
    return count


def _twin(node: fx.Node):
    """The out-of-place overload of an op that writes its first argument, or None."""
    target = node.target
    if node.op != "call_function" or not isinstance(target, torch._ops.OpOverload) or \
            not node.args:
        return None
    schema = target._schema
    first = schema.arguments[0].alias_info if schema.arguments else None
    name = schema.name.split("::")[-1]
    if first is None or not first.is_write or not name.endswith("_") or name.endswith("__"):
        return None
    packet = getattr(torch.ops.aten, name[:-1], None)
    twin = getattr(packet, target._overloadname, None) if packet is not None else None
    if not isinstance(twin, torch._ops.OpOverload) or any(
            a.alias_info is not None for a in twin._schema.arguments):
        return None
    return twin


def _fresh_and_private(value, writer: fx.Node) -> bool:
    """Whether `value` is a new tensor (no view of another, no input or weight) read only by
    `writer`."""
    if not isinstance(value, fx.Node) or value.op != "call_function" or \
            set(value.users) != {writer}:
        return False
    target = value.target
    if not isinstance(target, torch._ops.OpOverload):
        return False
    return all(r.alias_info is None for r in target._schema.returns)
