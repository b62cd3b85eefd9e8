"""Top-k routing of a mixture-of-experts layer: how gate logits choose and weigh a token's
experts (`Router`, `route`) and Switch Transformer's balance loss over the choice. The zoo's
`SparseMoE`, the expert-parallel kernel, the recognition of transformers' MoE blocks and the
cost model's routing imbalance all route through these."""

from __future__ import annotations

from dataclasses import dataclass

import torch

SOFTMAX, SIGMOID = "softmax", "sigmoid"
SCORES = (SOFTMAX, SIGMOID)
# how a group of experts is scored for group-limited routing: its best expert's score
# (DeepSeek-V2's group_limited_greedy) or the sum of its best two (DeepSeek-V3)
GROUP_MAX, GROUP_TOP2 = "max", "top2"
GROUP_SCORES = (GROUP_MAX, GROUP_TOP2)


def check_routing(experts: int, top_k: int, score: str) -> None:
    if not 1 <= top_k <= experts:
        raise ValueError(f"top_k={top_k} must be between 1 and the number of experts "
                         f"({experts}).")
    if score not in SCORES:
        raise ValueError(f"router score {score!r} is not one of {', '.join(SCORES)}.")


@dataclass(frozen=True)
class Router:
    """How gate logits [T, E] choose and weigh a token's experts.

    `score`: softmax or sigmoid of the logits (in float32). `corrected`: a per-expert bias
    (DeepSeek-V3's e_score_correction_bias) is added to the scores for the choice only, the
    weights stay the uncorrected scores. `groups` > 1: the experts form that many groups of
    consecutive experts, each scored by `group_score` over its (corrected) scores, and a
    token chooses among the experts of its best `topk_groups` groups only (DeepSeek-V2 and
    V3's group-limited routing; the others' scores masked to -inf, or with `masks_to_zero`
    to 0). `corrects_logits`: the correction bias is added to the logits instead. `normalize`: the chosen weights are divided by their sum.
    `scale`: the weights are multiplied by it last (routed_scaling_factor)."""

    score: str = SOFTMAX
    normalize: bool = True
    scale: float = 1.0
    corrected: bool = False
    groups: int = 1
    topk_groups: int = 1
    group_score: str = GROUP_MAX
    corrects_logits: bool = False  # the bias is added to the logits, not the scores
    masks_to_zero: bool = False  # experts outside the best groups score 0, not -inf

    def __post_init__(self):
        if self.score not in SCORES:
            raise ValueError(f"router score {self.score!r} is not one of {', '.join(SCORES)}.")
        if self.group_score not in GROUP_SCORES:
            raise ValueError(f"group score {self.group_score!r} is not one of "
                             f"{', '.join(GROUP_SCORES)}.")
        if not 1 <= self.topk_groups <= self.groups:
            raise ValueError(f"topk_groups={self.topk_groups} must be between 1 and the number "
                             f"of groups ({self.groups}).")


@dataclass(frozen=True)
class Routing:
    """Where each of T tokens goes: `experts` [T, k] (long) with their combine `weights`
    [T, k], and the router's probabilities `probs` [T, E] (float32, summing to 1 per token)
    from which the balance loss is taken."""

    weights: torch.Tensor
    experts: torch.Tensor
    probs: torch.Tensor


def route(logits: torch.Tensor, top_k: int, score: str = SOFTMAX,
          normalize: bool = True, router: Router | None = None,
          correction: torch.Tensor | None = None) -> Routing:
    """Top-k routing of gate logits [T, E]: softmax (or sigmoid) scores in float32, the k
    largest by torch.topk (so ties fall as torch.topk breaks them), optionally renormalised
    to sum to 1 per token. `router` (else Router(score, normalize)) may add a correction bias
    [E] for the choice (`correction`), limit it to the best groups of experts and scale the
    weights (see Router). Sigmoid scores are normalised per token for the balance loss, as
    DeepSeek-V3's sequence-wise balance loss does."""
    router = Router(score, normalize) if router is None else router
    experts_count = logits.size(-1)
    check_routing(experts_count, top_k, router.score)
    logits = logits.float()
    scores = logits.softmax(-1) if router.score == SOFTMAX else logits.sigmoid()
    if not router.corrected and router.groups == 1:
        weights, experts = torch.topk(scores, top_k, dim=-1)
    else:
        choice = logits if router.corrects_logits else scores
        choice = choice + correction.float() if router.corrected else choice
        if router.groups > 1:
            grouped = choice.view(-1, router.groups, experts_count // router.groups)
            group = grouped.amax(-1) if router.group_score == GROUP_MAX else \
                grouped.topk(2, dim=-1).values.sum(-1)
            best = torch.topk(group, router.topk_groups, dim=-1).indices
            keep = torch.zeros_like(group, dtype=torch.bool).scatter(1, best, True)
            keep = keep.repeat_interleave(experts_count // router.groups, dim=1)
            choice = choice.masked_fill(~keep, 0.0 if router.masks_to_zero else float("-inf"))
        experts = torch.topk(choice, top_k, dim=-1).indices
        weights = scores.gather(1, experts)
    if router.normalize:
        weights = weights / weights.sum(-1, keepdim=True)
    if router.scale != 1.0:
        weights = weights * router.scale
    probs = scores if router.score == SOFTMAX else scores / scores.sum(-1, keepdim=True)
    return Routing(weights, experts, probs)


def balance_stats(routing: Routing) -> torch.Tensor:
    """[2E + 1] float32: top-k assignments per expert, summed router probabilities per expert,
    and the token count. Sums, so that ranks holding parts of a batch add theirs up."""
    probs = routing.probs
    flat = routing.experts.reshape(-1)
    counts = torch.zeros(probs.size(-1), dtype=torch.float32, device=probs.device).scatter_add(
        0, flat, torch.ones_like(flat, dtype=torch.float32))
    tokens = torch.ones_like(probs[:, :1]).sum(0)
    return torch.cat([counts, probs.sum(0), tokens])


def balance_loss(stats: torch.Tensor) -> torch.Tensor:
    """Switch Transformer's load-balancing loss (Fedus et al. 2021, eq. 4, alpha = 1):
    E * sum_i f_i P_i, f_i the share of top-k assignments sent to expert i per token and P_i
    its mean router probability; as transformers' `load_balancing_loss_func` (Mixtral)."""
    num_experts = (stats.numel() - 1) // 2
    tokens = stats[-1]
    f, p = stats[:num_experts] / tokens, stats[num_experts:2 * num_experts] / tokens
    return num_experts * (f * p).sum()
