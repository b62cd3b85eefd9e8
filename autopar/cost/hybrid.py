"""Hybrid sharded data parallelism priced (HSDP; Zhao et al. 2023, "PyTorch FSDP", §3.2.2
hybrid sharding): ZeRO's state cut over a shard group of neighbouring dp x cp ranks, replicated
over the groups. Its gathers and reduce-scatters stay inside the shard group (a node or a few
nodes, on their faster links), and each reduce-scattered piece is summed over the replicas by
one all-reduce of 1/shard of the bytes; a device holds 1/shard of the state, not 1/dp."""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

from autopar.cost.comm import Placement, collective_time, placements
from autopar.cost.hardware import Hardware
from autopar.modes import CP, DP, DP_REPLICATE, DP_SHARD, PP, TP

SOURCE = "Zhao et al. 2023 (PyTorch FSDP) §3.2.2, hybrid sharding"


@dataclass(frozen=True)
class HybridSplit:
    """Where a mesh's shard groups (`shard`: dp_shard x cp neighbouring ranks after tp) and
    replica groups (`replicate`: the dp / dp_shard ranks at the same place of each) sit."""

    dp_shard: int
    shard: Placement
    replicate: Placement

    @property
    def ranks(self) -> int:
        """The ranks ZeRO cuts the state over (the shard group, cp included)."""
        return self.shard.size


def hybrid_split(mesh: dict, dp_shard: int | None, per_node: int) -> HybridSplit | None:
    """The shard and replica placements of `mesh` under a shard size `dp_shard` (dividing dp;
    None: no HSDP)."""
    if dp_shard is None:
        return None
    return _split(mesh[TP], mesh[CP], mesh[DP], mesh[PP], dp_shard, per_node)


@lru_cache(maxsize=4096)
def _split(tp: int, cp: int, dp: int, pp: int, dp_shard: int, per_node: int) -> HybridSplit:
    pl = placements({TP: tp, DP_SHARD: dp_shard * cp, DP_REPLICATE: dp // dp_shard, PP: pp},
                    (TP, DP_SHARD, DP_REPLICATE, PP), per_node)
    return HybridSplit(dp_shard, pl[DP_SHARD], pl[DP_REPLICATE])


def zero_ranks(mesh: dict, dp_shard: int | None) -> int:
    """The ranks ZeRO cuts the state over: the dp x cp replicas, or the HSDP shard group."""
    return (dp_shard or mesh[DP]) * mesh[CP]


def replicas_time(param_bytes: float, zero: int, m: int, split: HybridSplit, hw: Hardware,
                  units: int = 1, cache: dict | None = None) -> float:
    """Seconds of the replicas' all-reduces: each reduce-scatter's piece (1/shard of its
    bytes) summed over dp_replicate; once per step under ZeRO-1, per micro-batch under
    ZeRO-2 and 3, and per layer (`units`) under ZeRO-3, as the runtime sends them.
    `cache`: a piece's all-reduce seconds by (piece bytes, replica placement), on `hw`."""
    if split.replicate.size <= 1 or not zero:
        return 0.0
    sends = units if zero == 3 else 1
    runs = m if zero >= 2 else 1
    piece = param_bytes / split.shard.size / sends
    key = (piece, split.replicate)
    hit = cache.get(key) if cache is not None else None
    if hit is None:
        hit = collective_time("all_reduce", piece, split.replicate, hw)
        if cache is not None:
            cache[key] = hit
    return runs * sends * hit


def replicas_wire_bytes(param_bytes: float, split: HybridSplit) -> float:
    """Bytes one device sends in the replicas' ring all-reduce of its 1/shard piece."""
    r = split.replicate.size
    return 2 * (r - 1) / r * param_bytes / split.shard.size if r > 1 else 0.0


def shard_sizes(mesh: dict, per_node: int, fixed: int | None = None) -> list[int]:
    """Shard sizes the search tries for `mesh`: `fixed` when given (dividing dp), else those
    whose group spans exactly 1, 2, 4 or 8 nodes (tp x cp x dp_shard ranks) and leaves two or
    more replicas; none where all of dp x cp lies inside one node (nothing to keep in)."""
    dp, inner = mesh[DP], mesh[TP] * mesh[CP]
    if fixed is not None:
        return [fixed] if 2 <= fixed < dp and dp % fixed == 0 else []
    if inner * dp <= per_node:
        return []
    out = []
    for nodes in (1, 2, 4, 8):
        ranks = nodes * per_node
        if ranks % inner == 0:
            shard = ranks // inner
            if 2 <= shard < dp and dp % shard == 0:
                out.append(shard)
    return out
