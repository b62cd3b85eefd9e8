"""Expert parallelism's costs: the routing imbalance of an ep group and the all-to-alls that
dispatch tokens to their experts' ranks and combine them back.

Experts split over `ep` ranks inside the data (and cp) ranks, as Megatron-Core and
DeepSpeed-MoE place them: each rank keeps E/ep experts and runs every row routed to them
from the ep ranks' tokens, so under balanced routing it computes as many rows as it routes.
Routing is not balanced: the busiest rank of a group receives `routing_imbalance` times the
mean, and the others wait for it (its expert GEMMs, its received bytes).
"""

from __future__ import annotations

import functools
import math

import numpy as np
import torch

from autopar.cost.comm import Placement, collective_time
from autopar.cost.hardware import Hardware
from autopar.cost.layer import Experts
from autopar.kernels.routing import route

# The router as autopar's zoo initialises it (autopar.models.moe: gate weights N(0, 0.02))
# on unit-RMS inputs (the RMSNorm before the MoE at initialisation).
INIT_STD = 0.02
SEED = 0
SAMPLED_TOKENS = 65536  # tokens routed to measure each expert's share of the rows
DRAWS = 256  # micro-batches drawn from those shares per imbalance


@functools.lru_cache(maxsize=64)
def expert_shares(experts: int, top_k: int, hidden: int) -> tuple[float, ...]:
    """Each expert's share of the token-expert rows, measured by routing SAMPLED_TOKENS tokens
    through the zoo router at initialisation: gate weights W [hidden, experts] drawn
    N(0, INIT_STD) (seeded), inputs of unit RMS, so a token's logits are N(0, WᵀW);
    `autopar.kernels.routing.route` picks its top_k. A narrow router's gate columns differ in
    norm, so its experts differ in share; a wide one's are near 1/E."""
    gen = torch.Generator().manual_seed(SEED)
    w = torch.randn(hidden, experts, generator=gen, dtype=torch.float64) * INIT_STD
    scale = torch.linalg.cholesky(w.T @ w + 1e-12 * torch.eye(experts, dtype=torch.float64))
    logits = torch.randn(SAMPLED_TOKENS, experts, generator=gen) @ scale.T.float()
    chosen = route(logits, top_k).experts.reshape(-1)
    counts = torch.bincount(chosen, minlength=experts).double()
    return tuple((counts / counts.sum()).tolist())


@functools.lru_cache(maxsize=1024)
def routing_imbalance(experts: int, top_k: int, ep: int, tokens: int, hidden: int) -> float:
    """Rows the busiest of `ep` ranks receives over the mean when one ep group routes `tokens`
    tokens top-`top_k` of `experts`: rank r holds experts r·E/ep ... (r+1)·E/ep - 1 (as
    `autopar.kernels.moe.MoE`), its share of the rows is its experts' `expert_shares`, and
    DRAWS micro-batches of tokens·top_k rows are drawn from those shares (multinomial,
    seeded); the mean over the draws of max/mean. A trained router with a balance loss is
    not bound to its initial shares: this is the imbalance with nothing learnt yet."""
    if ep <= 1 or tokens <= 0:
        return 1.0
    shares = np.asarray(expert_shares(experts, top_k, hidden)).reshape(ep, -1).sum(1)
    rows = np.random.default_rng(SEED).multinomial(tokens * top_k, shares / shares.sum(),
                                                    size=DRAWS)
    return float((rows.max(1) / rows.mean(1)).mean())


def group_tokens(moe: Experts, batch: float, cp: int, ep: int) -> int:
    """Tokens an ep group routes per micro-batch: ep ranks' shares of `batch` samples."""
    return int(math.ceil(moe.tokens(batch) / cp * ep))


def imbalance_of(moe: Experts, batch: float, cp: int, ep: int) -> float:
    """`routing_imbalance` of this layer's ep group for a micro-batch of `batch` samples."""
    return routing_imbalance(moe.count, moe.top_k, ep, group_tokens(moe, batch, cp, ep),
                             moe.hidden)


def tokens_per_expert(moe: Experts, batch: float, cp: int, ep: int) -> float:
    """Rows each expert computes per micro-batch under balanced routing: its share of the
    ep group's token-expert pairs (top_k per token, over E experts)."""
    return moe.tokens(batch) / cp * ep * moe.top_k / moe.count


def dispatch_bytes(moe: Experts, batch: float, cp: int) -> float:
    """Bytes of one rank's all-to-all buffer: its tokens' top_k rows of `hidden` values."""
    return moe.rows(batch) / cp


def alltoall_count(reruns: int = 1) -> int:
    """All-to-alls of one MoE layer per micro-batch: the row counts, dispatch and combine per
    forward run (`reruns`: 2 under full recomputation), and the mirrors of dispatch and
    combine backward (which reuse the counts)."""
    return 3 * reruns + 2


def alltoall_s(moe: Experts, batch: float, cp: int, placement: Placement, hw: Hardware,
               imbalance: float, reruns: int = 1) -> tuple[float, float, int]:
    """(seconds, bytes sent, all-to-alls) of one MoE layer's dispatch per micro-batch over
    an ep group (GShard, Lepikhin et al. 2020; dropless as `autopar.kernels.moe`): the row
    counts (E int64 per rank), then dispatch and combine forward and their mirrors backward,
    each priced on the busiest rank's `imbalance` x its balanced buffer. `reruns`: forward
    runs (2 under full recomputation)."""
    ep = placement.size
    if ep <= 1:
        return 0.0, 0.0, 0
    rows = dispatch_bytes(moe, batch, cp)
    counts = moe.count * 8
    row_s = collective_time("all_to_all", imbalance * rows, placement, hw)
    count_s = collective_time("all_to_all", counts, placement, hw)
    sent = (ep - 1) / ep
    seconds = reruns * (2 * row_s + count_s) + 2 * row_s
    nbytes = sent * (reruns * (2 * rows + counts) + 2 * rows)
    return seconds, nbytes, alltoall_count(reruns)
