"""Attention masks the graph builds from positions alone, recognised as causal.

transformers' models build their causal mask inside the graph (aranges, comparisons, a
cumsum of position differences for packed sequences) and pass it to
scaled_dot_product_attention with `is_causal=False`. A mask that reads no input values (only
input sizes, constants and buffers) is a constant for each sequence length, so it can be
evaluated once, at the traced shapes, and compared with the lower triangle. When it equals
it, attention kernels that take `is_causal` (ring attention and Ulysses on a sequence split)
can run in its place, and the mask's subgraph is no longer needed.
"""

from __future__ import annotations

import operator

import sympy
import torch
import torch.fx as fx

aten = torch.ops.aten

_KEY = "autopar_causal_mask"
# The largest mask evaluated (elements at batch 1): 16384 x 16384 booleans is 256 MiB, and
# the subgraph holds a few such tensors at once. Longer sequences are not evaluated.
MAX_ELEMENTS = 2 ** 28


def is_causal_mask(mask: fx.Node) -> bool:
    """Whether `mask` (an attention mask node, [..., S, S] boolean or additive) is the causal
    lower triangle for every batch entry and head, whatever the input values. Evaluated
    once per node, at the traced shapes with the batch set to 1; any dependence on input
    values (a padding mask passed in) makes it False, and so does a mask of more than
    MAX_ELEMENTS elements (it is not evaluated; pass is_causal=True to SDPA instead)."""
    if _KEY not in mask.meta:
        try:
            value = _evaluate(mask) if _elements(mask) <= MAX_ELEMENTS else None
        except _NotConstant:
            value = None
        mask.meta[_KEY] = value is not None and _lower_triangle(value)
    return mask.meta[_KEY]


def too_large(mask: fx.Node) -> bool:
    """Whether `mask` is past the size `is_causal_mask` evaluates (MAX_ELEMENTS)."""
    return _elements(mask) > MAX_ELEMENTS


def _elements(mask: fx.Node) -> int:
    shape = getattr(mask.meta.get("autopar"), "shape", None) or ()
    out = 1
    for size in shape:
        size = sympy.sympify(size)
        out *= int(size.subs({s: 1 for s in size.free_symbols}))
    return out


class _NotConstant(Exception):
    pass


def _evaluate(target: fx.Node):
    gm = target.graph.owning_module
    env: dict[fx.Node, object] = {}
    order = {n: i for i, n in enumerate(target.graph.nodes)}
    todo, seen = [target], set()
    while todo:  # the ancestors of the mask, each once
        n = todo.pop()
        if n in seen:
            continue
        seen.add(n)
        if n.op == "placeholder" or (n.op == "call_function" and n.target is aten.sym_size.int):
            continue
        todo.extend(a for a in n.all_input_nodes)
    for n in sorted(seen, key=order.__getitem__):
        env[n] = _run(n, env, gm)
    return env[target]


def _run(n: fx.Node, env: dict, gm):
    if n.op == "placeholder":
        return None  # only its sizes may be read (sym_size below); reading it raises
    if n.op == "get_attr":
        value = operator.attrgetter(n.target)(gm)
        return value.detach() if isinstance(value, torch.Tensor) else value
    if n.op != "call_function":
        raise _NotConstant(n.name)
    if n.target is aten.sym_size.int:
        shape = n.args[0].meta["autopar"].shape
        size = sympy.sympify(shape[n.args[1]])
        return int(size.subs({s: 1 for s in size.free_symbols}))

    def value(a):
        if isinstance(a, fx.Node):
            if a.op == "placeholder":
                raise _NotConstant(a.name)
            return env[a]
        if isinstance(a, torch.device):
            return torch.device("cpu")
        return a

    args = fx.node.map_aggregate(n.args, value)
    kwargs = fx.node.map_aggregate(n.kwargs, value)
    if "device" in kwargs:
        kwargs = {**kwargs, "device": torch.device("cpu")}
    out = n.target(*args, **kwargs)
    if isinstance(out, torch.Tensor) and out.device.type != "cpu":
        raise _NotConstant(n.name)
    return out


def _lower_triangle(mask) -> bool:
    if not isinstance(mask, torch.Tensor) or mask.dim() < 2 or mask.shape[-1] != mask.shape[-2]:
        return False
    s = mask.shape[-1]
    allowed = torch.ones(s, s, dtype=torch.bool).tril()
    if mask.dtype == torch.bool:
        return bool((mask == allowed).all())
    if not mask.dtype.is_floating_point:
        return False
    blocked = mask.masked_select(~allowed.expand_as(mask))
    return bool((mask.masked_select(allowed.expand_as(mask)) == 0).all()) and \
        bool((blocked <= torch.finfo(mask.dtype).min / 2).all())
