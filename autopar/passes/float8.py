"""Float8 training as a graph pass: each linear of the model part whose weight is a parameter
becomes an `autopar.kernels.float8.Float8Linear` (its three GEMMs in float8), unless its
local weight has a dim the fp8 kernels cannot take, or it is the output projection (its
result is what the model returns or the loss reads: the logits, whose rounding the loss
feels directly; torchtitan's float8 recipe keeps its output layer too); those stay in the
compute dtype and the pass says which and why, as it does for the linears of 2D, 2.5D and
3D tensor parallelism (GridLinear modules by then), whose kernels have no float8 form.

Run it after `cast_precision(gm, torch.bfloat16)` (so the rest of the model computes in
bf16 and the masters stay fp32), before the collectives are bound. The forms matched are
`aten.linear(x, W[out, in], b)` and transformers' Conv1D, `aten.addmm(b, x, W[in, out])`
(and `aten.mm(x, W[in, out])`, its row-parallel product). A linear whose weight is split
over the tensor axis reduces the amax of its split operands there (a column-parallel one:
the weight and the output's gradient; a row-parallel one: the input and the weight).
"""

from __future__ import annotations

import operator
from dataclasses import dataclass, field

import torch
import torch.fx as fx

from autopar.kernels.float8 import (
    GRAD,
    INPUT,
    MULTIPLE,
    RECIPE_TEXT,
    TENSORWISE,
    WEIGHT,
    Float8Linear,
)
from autopar.kernels.modules import GridLinear
from autopar.passes.precision import CAST, LOSS_LAYER
from autopar.passes.tensor_parallel import clone_graph_module
from autopar.sharding.layout import Layout

aten = torch.ops.aten

# ops that pass a linear's result on unchanged in value (shape, dtype, a bias, a slice)
_PASS_ON = {aten.view.default, aten.reshape.default, aten._unsafe_view.default,
            aten._to_copy.default, aten.t.default, aten.transpose.int, aten.clone.default,
            aten.contiguous.default, aten.add.Tensor, aten.slice.Tensor, operator.getitem}
EXPERTS_KEPT = "its experts' GEMMs run in bf16 (the MoE kernel has no float8 form)"
OUTPUT_PROJECTION = "it is the output projection (its result is the model's output or " \
    "what the loss reads); the recipe keeps it in bf16"

MULTI_D_KEPT = "it runs {mode} tensor parallelism, whose SUMMA and 3D kernels have no " \
    "float8 form (float8 runs beside 1D tensor parallelism only)"

FLOAT8_PREFIX = "float8_linear"  # the submodules this pass adds: float8_linear_<node>


@dataclass
class Float8Report:
    """What `float8_linears` did: the modules whose linears run in float8, and those that
    stayed in the compute dtype with why (engine.explain() prints both)."""

    converted: list[str] = field(default_factory=list)
    kept: dict[str, str] = field(default_factory=dict)  # module -> why it stayed bf16
    recipe: str = TENSORWISE  # the scaling recipe (autopar.kernels.float8.RECIPES)

    def merge(self, other: "Float8Report") -> None:
        self.converted += [m for m in other.converted if m not in self.converted]
        self.kept.update({m: w for m, w in other.kept.items() if m not in self.kept})
        self.recipe = other.recipe

    def to_json(self) -> dict:
        return {"converted": list(self.converted), "kept": dict(self.kept),
                "recipe": RECIPE_TEXT[self.recipe]}


def float8_linears(gm: fx.GraphModule, params: dict[str, Layout], axis: str,
                   sizes: dict[str, int], recipe: str = TENSORWISE
                   ) -> tuple[fx.GraphModule, Float8Report]:
    """A new GraphModule whose eligible linears run in float8 (see the module docstring),
    with the report. `params`: each parameter's layout (`Solution.params`); `sizes`: ranks
    per tensor axis; `recipe`: the scaling recipe (autopar.kernels.float8.RECIPES)."""
    out, _ = clone_graph_module(gm)
    report = Float8Report(recipe=recipe)
    for node in list(out.graph.nodes):
        grid = _grid_linear(out, node)
        if grid:
            report.kept.setdefault(_module_of(node), MULTI_D_KEPT.format(mode=grid))
            continue
        form = _linear_form(node, params)
        if form is None:
            continue
        x, weight, bias, target, transposed = form
        module = _module_of(node)
        why = _unfit(out, weight, target, params[target], axis, sizes, transposed) or \
            (OUTPUT_PROJECTION if _feeds_output(node) else "")
        if why:
            report.kept.setdefault(module, why)
            continue
        name = f"{FLOAT8_PREFIX}_{node.name}"
        out.add_submodule(name, Float8Linear(axis, _split(params[target], axis, sizes,
                                                          transposed), transposed, recipe))
        with out.graph.inserting_before(node):
            fp8 = out.graph.call_module(name, (x, weight) + ((bias,) if bias is not None else ()))
        fp8.meta = dict(node.meta)
        node.replace_all_uses_with(fp8)
        out.graph.erase_node(node)
        if module not in report.converted:
            report.converted.append(module)
    out.graph.lint()
    out.recompile()
    return out, report


def _grid_linear(gm: fx.GraphModule, node: fx.Node) -> str:
    """The mode ("2d", "2.5d", "3d") of a 2D/2.5D/3D tensor-parallel linear, else ""."""
    if node.op != "call_module":
        return ""
    module = gm.get_submodule(node.target)
    return module.mode if isinstance(module, GridLinear) else ""


def _linear_form(node: fx.Node, params: dict) -> tuple | None:
    """(x, weight, bias, parameter target, transposed) of a linear reading a parameter's
    weight in the model part, else None."""
    if node.op != "call_function" or _layer(node) == LOSS_LAYER:
        return None
    if node.target is aten.linear.default and len(node.args) >= 2:
        x, weight = node.args[0], node.args[1]
        bias = node.args[2] if len(node.args) > 2 else node.kwargs.get("bias")
        transposed = False
    elif node.target is aten.addmm.default and len(node.args) == 3 and not node.kwargs:
        bias, x, weight = node.args
        transposed = True
    elif node.target is aten.mm.default and len(node.args) == 2:
        x, weight = node.args
        bias, transposed = None, True
    else:
        return None
    target = _parameter(weight)
    if target is None or target not in params or params[target].ndim != 2:
        return None
    return x, weight, bias, target, transposed


def _feeds_output(node: fx.Node, depth: int = 8) -> bool:
    """Whether `node`'s value reaches the loss part or the graph's output through ops that
    pass it on unchanged in value (collectives included)."""
    for user in node.users:
        if user.op == "output" or _layer(user) == LOSS_LAYER:
            return True
        passes = user.target in _PASS_ON if user.op == "call_function" else \
            user.op == "call_module"
        if passes and depth > 0 and _feeds_output(user, depth - 1):
            return True
    return False


def _parameter(node) -> str | None:
    """The parameter a weight argument reads, through mixed precision's cast."""
    if isinstance(node, fx.Node) and node.op == "call_function" and \
            node.meta.get(CAST) == "compute":
        node = node.args[0]
    if isinstance(node, fx.Node) and node.op == "get_attr":
        return node.target
    return None


def _unfit(gm, weight: fx.Node, target: str, layout: Layout, axis: str, sizes: dict,
           transposed: bool) -> str:
    """Why the linear cannot run in float8 ("" when it can)."""
    if any(a != axis for a in layout.axes):
        return f"its weight is split over {', '.join(layout.axes)}; float8 runs beside 1D " \
               "tensor parallelism only"
    shape = list(_shape(gm, weight, target))
    for shard in layout.shards:
        shape[shard.dim] //= sizes.get(shard.axis, 1)
    out_f, in_f = (shape[1], shape[0]) if transposed else (shape[0], shape[1])
    if in_f % MULTIPLE or out_f % MULTIPLE:
        return f"its local weight has {in_f} in and {out_f} out features; the fp8 GEMM " \
               f"needs both divisible by {MULTIPLE}"
    return ""


def _split(layout: Layout, axis: str, sizes: dict, transposed: bool) -> tuple[str, ...]:
    """The operands split over `axis`: column (out features) or row (in features) split."""
    shard = layout.shard_on(axis)
    if shard is None or sizes.get(axis, 1) == 1:
        return ()
    out_dim = 1 if transposed else 0
    return (WEIGHT, GRAD) if shard.dim == out_dim else (INPUT, WEIGHT)


def _shape(gm, weight: fx.Node, target: str) -> torch.Size:
    val = weight.meta.get("val")
    if isinstance(val, torch.Tensor):
        return val.shape
    return operator.attrgetter(target)(gm).shape


def _layer(node: fx.Node):
    return getattr(node.meta.get("autopar"), "layer", None)


def _module_of(node: fx.Node) -> str:
    info = node.meta.get("autopar")
    return getattr(info, "module", None) or node.name
