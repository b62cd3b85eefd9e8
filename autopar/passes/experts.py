"""Expert parallelism in a traced graph: the `autopar::moe` nodes the engine's trace leaves in
place of a model's MoE modules (autopar.kernels.moe_layers.opaque_moe) become `ExpertLayer`
modules, the kernel that dispatches tokens to their experts' ranks over the ep axis and
sums the partial rows of experts split over tp."""

from __future__ import annotations

import torch.fx as fx

from autopar.errors import PlanError
from autopar.kernels.moe_layers import MOE_OP, ExpertLayer, spec_for
from autopar.modes import GPIPE
from autopar.passes.tensor_parallel import SPLIT_EXPERTS


def moe_nodes(gm: fx.GraphModule) -> list[fx.Node]:
    return [n for n in gm.graph.nodes if n.op == "call_function" and n.target is MOE_OP]


def expert_weights(gm: fx.GraphModule) -> set[str]:
    """get_attr targets of the experts' stacked weights (split over ep); the routers and
    shared experts are not among them (they stay whole on every ep rank)."""
    out = set()
    for node in moe_nodes(gm):
        for w in node.args[2]:
            while w.op != "get_attr":  # (a cast the precision pass put in front)
                w = w.args[0]
            out.add(w.target)
    return out


def check_balance_loss(gm: fx.GraphModule, schedule: str) -> None:
    """Under a pipeline: a balance loss in the objective is exact only when every
    micro-batch's forward of a stage runs before its backwards (GPipe), so that each
    backward knows the step's statistics (autopar.kernels.moe.ScheduleBalance); other
    schedules are refused."""
    if schedule != GPIPE and with_balance_loss(gm):
        raise PlanError(f"the model's MoE balance loss is a sum over the whole batch, which a "
                        f"pipeline takes exactly only under the gpipe schedule (every "
                        f"micro-batch's forward before any backward), not {schedule}; use "
                        f"schedule='gpipe', leave the balance loss out of the loss, or drop "
                        f"pipeline= from the plan.")


def with_balance_loss(gm: fx.GraphModule) -> bool:
    """Whether some MoE layer of the graph returns its balance loss."""
    return any(node.args[5] for node in moe_nodes(gm))


def place_expert_layers(gm: fx.GraphModule) -> fx.GraphModule:
    """Each `autopar::moe` node -> a call of its own `ExpertLayer` (moe_0, moe_1, ... in
    graph order) with the same inputs and the same (out, loss) output, its experts split
    over the tensor axis the rewrite recorded (node.meta[SPLIT_EXPERTS]) if any; requires
    nothing, ensures no `autopar::moe` node is left."""
    for i, node in enumerate(moe_nodes(gm)):
        x, gate, experts, shared, key, with_aux = node.args
        name = f"moe_{i}"
        where = node.meta.get("autopar_module") or name  # the MoE module's path
        info = node.meta.get("autopar")
        gm.add_submodule(name, ExpertLayer(spec_for(key), where, with_aux,
                                           getattr(info, "layer", None),
                                           node.meta.get(SPLIT_EXPERTS)))
        with gm.graph.inserting_before(node):
            call = gm.graph.call_module(name, (x, gate, *experts, *shared))
        call.meta = dict(node.meta)
        node.replace_all_uses_with(call)
        gm.graph.erase_node(node)
    gm.graph.lint()
    gm.recompile()
    return gm
