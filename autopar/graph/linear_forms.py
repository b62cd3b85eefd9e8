"""Linears written out by hand, brought to the one form the catalog splits: `aten.linear`.

`x @ w.T`, `torch.matmul(x, w.t())`, `x @ w.transpose(0, 1)`, `x @ w.permute(1, 0)`,
`x @ w.mT`, `torch.mm(x, w.t())` and `torch.addmm(b, x, w.t())` with `w` a 2D weight
[out, in] compute `F.linear(x, w[, b])`; so does such a product followed by `+ b` for a
bias `b` [out] in the same module (Falcon's linear layer). Each becomes one `aten.linear`
node, so its layer splits and is priced like any `nn.Linear`.
"""

from __future__ import annotations

import torch
import torch.fx as fx

aten = torch.ops.aten

_PRODUCTS = (aten.matmul.default, aten.mm.default)


def canonical_linears(gm: fx.GraphModule) -> int:
    """Rewrite every hand-written linear of `gm` into `aten.linear`; the number rewritten."""
    count = 0
    for node in list(gm.graph.nodes):
        if node.op != "call_function":
            continue
        if node.target in _PRODUCTS and len(node.args) == 2 and not node.kwargs:
            x, weight = node.args[0], _transposed_weight(node.args[1])
            bias = None
        elif node.target is aten.addmm.default and len(node.args) == 3 and \
                all(node.kwargs.get(k, 1) == 1 for k in ("beta", "alpha")):
            bias, x, weight = node.args[0], node.args[1], _transposed_weight(node.args[2])
            if weight is None or not _is_bias(bias, weight):
                continue  # transformers' Conv1D, addmm(b, x, w[in, out]), is a linear as it is
        else:
            continue
        if weight is None or _ndim(x) < 2:
            continue
        transpose = node.args[-1]
        last = node
        if bias is None:
            bias, last = _added_bias(node, weight)
        _replace(gm.graph, node, last, x, weight, bias)
        if not transpose.users:
            gm.graph.erase_node(transpose)
        count += 1
    if count:
        gm.graph.lint()
        gm.recompile()
    return count


def _transposed_weight(node) -> fx.Node | None:
    """The [out, in] weight whose transpose `node` is, or None."""
    if not isinstance(node, fx.Node) or node.op != "call_function" or not node.args:
        return None
    source = node.args[0]
    if not isinstance(source, fx.Node) or source.op != "get_attr" or _ndim(source) != 2:
        return None
    target, args = node.target, node.args
    if target in (aten.t.default, aten.numpy_T.default, aten.mT.default) and len(args) == 1:
        return source
    if target is aten.transpose.int and {d % 2 for d in args[1:3]} == {0, 1}:
        return source
    if target is aten.permute.default and [d % 2 for d in args[1]] == [1, 0]:
        return source
    return None


def _added_bias(product: fx.Node, weight: fx.Node) -> tuple[fx.Node | None, fx.Node]:
    """A bias [out] the product's only user adds in the same module: (bias, that add), else
    (None, product)."""
    users = list(product.users)
    if len(users) != 1:
        return None, product
    add = users[0]
    if add.target is not aten.add.Tensor or len(add.args) != 2 or add.kwargs or \
            add.meta.get("autopar_module") != product.meta.get("autopar_module"):
        return None, product
    other = add.args[1] if add.args[0] is product else add.args[0]
    if other is product or not _is_bias(other, weight):
        return None, product
    return other, add


def _is_bias(node, weight: fx.Node) -> bool:
    """A parameter of one dim holding one value per output feature of `weight`."""
    if not isinstance(node, fx.Node) or node.op != "get_attr" or _ndim(node) != 1:
        return False
    return node.meta["val"].shape[0] == weight.meta["val"].shape[0]


def _replace(graph: fx.Graph, product: fx.Node, last: fx.Node, x: fx.Node, weight: fx.Node,
             bias: fx.Node | None) -> None:
    """`aten.linear` in place of `product` (and of `last`, the bias add, when it is one)."""
    args = (x, weight) if bias is None else (x, weight, bias)
    with graph.inserting_before(last):
        linear = graph.call_function(aten.linear.default, args)
    linear.meta = dict(product.meta)
    linear.meta["val"] = last.meta["val"]
    last.replace_all_uses_with(linear)
    if last is not product:
        graph.erase_node(last)
    graph.erase_node(product)


def _ndim(node) -> int:
    val = node.meta.get("val") if isinstance(node, fx.Node) else None
    return val.dim() if isinstance(val, torch.Tensor) else -1
