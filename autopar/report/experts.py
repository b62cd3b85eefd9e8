"""The expert layout of a plan: experts per rank, tokens per expert (predicted) and the
all-to-all traffic on the ep axis, for `explain`'s text, JSON (`experts`) and HTML."""

from __future__ import annotations

from autopar.cost import experts as moe_cost
from autopar.cost.layer import LayerChain
from autopar.cost.model import StateCost
from autopar.modes import CP, EP, FULL, TP, TP_1D


def expert_layout(plan, chain: LayerChain, costs: list[StateCost], slow: list[int],
                  m: int, b: int) -> dict | None:
    """The `experts` object of the report (None for a dense model): per MoE layer kind its
    experts, those each rank holds (and over how many tensor ranks each is split), the rows each expert computes per micro-batch under
    balanced routing and on the busiest rank (times the measured imbalance), and per step
    on the slowest pipeline rank the all-to-alls and their bytes and seconds."""
    moe_layers = [i for i, lt in enumerate(chain.layers()) if lt.experts is not None]
    if not moe_layers:
        return None
    ep, cp = plan.ep, plan.mesh[CP]
    first = chain.layers()[moe_layers[0]]
    moe, tp = first.experts, plan.mesh[TP]
    # the tensor ranks each expert's FFN is split over (1D tensor parallelism), else 1
    split = first.sharded[tp].expert_split if plan.tp_mode == TP_1D and tp in first.sharded \
        else 1
    balanced = moe_cost.tokens_per_expert(moe, b, cp, ep)
    imbalance = moe_cost.imbalance_of(moe, b, cp, ep)
    on_slow = [i for i in slow if i in set(moe_layers)]
    count = sum(moe_cost.alltoall_count(2 if _recompute(plan, i) == FULL else 1)
                for i in on_slow) if ep > 1 else 0
    return {
        EP: ep, "experts": moe.count, "top_k": moe.top_k, "moe_layers": len(moe_layers),
        # transformer blocks with a dense feed-forward (DeepSeek-V3's first three): priced
        # with no all-to-all and no expert memory
        "dense_layers": sum(1 for lt in chain.layers() if lt.attention and lt.experts is None),
        "experts_per_rank": moe.count // ep, "expert_tensor_split": split,
        "tokens_per_expert_per_microbatch": balanced,
        "tokens_per_expert_busiest": balanced * imbalance,
        "routing_imbalance": imbalance,
        "imbalance_source": "measured on the router at initialisation (autopar.cost.experts)",
        "expert_param_bytes_per_rank": int(sum(costs[i].expert_params for i in moe_layers
                                               if i in set(slow))),
        "all_to_alls_per_step": m * count,
        "all_to_all_bytes_per_step": m * sum(costs[i].ep_comm_bytes for i in on_slow),
        "all_to_all_s_per_step": m * sum(costs[i].ep_comm for i in on_slow),
    }


def _recompute(plan, i: int) -> str:
    """Layer i's recompute mode: its own where the plan lists its layers (the planner's),
    else the plan's (a runtime plan given as a dict)."""
    return plan.layers[i].recompute if i < len(plan.layers) else plan.recompute


def expert_lines(data: dict) -> list[str]:
    """`explain`'s lines of the expert layout."""
    e = data.get("experts")
    if not e:
        return []
    head = (f"  experts     {e['experts']} per MoE layer (top-{e['top_k']}) over ep={e[EP]}: "
            f"{e['experts_per_rank']} per rank")
    if e.get("expert_tensor_split", 1) > 1:
        head += f", each split over tp={e['expert_tensor_split']} (its FFN width)"
    if e.get("dense_layers"):
        head += (f"; {e['moe_layers']} MoE layers, {e['dense_layers']} dense layers (no "
                 "experts, no all-to-all)")
    tokens = ("              tokens per expert per micro-batch "
              f"{e['tokens_per_expert_per_microbatch']:.0f} predicted (balanced)")
    if e[EP] > 1:
        tokens += (f", {e['tokens_per_expert_busiest']:.0f} on the busiest rank (routing "
                   f"imbalance {e['routing_imbalance']:.3f}, {e['imbalance_source']})")
    lines = [head, tokens]
    if e[EP] > 1:
        lines.append(f"              all-to-all on ep: {e['all_to_alls_per_step']} per step, "
                     f"{e['all_to_all_bytes_per_step'] / 1024 ** 3:.2f} GiB sent, "
                     f"{1e3 * e['all_to_all_s_per_step']:.1f} ms on the slowest rank")
    return lines
