"""Bounds of a search's leaf groups read before their states are priced: each schedule's
pipeline bound (`pipe_bound`) from a group's least seconds or their floors
(`floors.group_floor`), and the least gradient sync of its parameters (`dp_floor`): the
free search orders its `Pending` groups by them, a grid search leaves groups out by them."""

from __future__ import annotations

from autopar.cost.hybrid import hybrid_split
from autopar.modes import CP, INTERLEAVED, PP, TP, ZERO_BUBBLE
from autopar.search.floors import base_lists, group_floor, group_params
from autopar.search.prepared import Pending

__all__ = ["dp_floor", "grid_past", "group_bound", "past", "pipe_bound", "schedules_of",
           "sync_past", "with_sync"]


def dp_floor(search, mesh, walk, zeros, m: int, param_bytes: float) -> float:
    """The least gradient sync of `param_bytes` per device over a leaf's ZeRO options
    (offloading leaves the sync as it is: once per stage and shard)."""
    grad_pl, dp_cache = walk[1], walk[2]
    return min(search._dp_time(param_bytes, z, m, grad_pl, cache=None if shard else dp_cache,
                               hybrid=hybrid_split(mesh, shard, search.world.per_node))
               for z, shard in dict.fromkeys((z, s) for z, _, s in zeros))


def group_bound(search, mesh, walk, group, work: bool = False) -> float | None:
    """A lower bound of the pipeline bound of every leaf of one group of a mesh's walk,
    before its Prepared is made: each kind at its least `floors.state_floor`
    (`floors.group_floor`, once per group number; with `work`, at its least
    `floors.state_work`, a lower bound of that floor read with no collective priced), and
    each schedule's pipeline bound does not decrease in the least seconds (`past`); None
    where the group has no leaf (a kind of layer with no state, or no schedule). The
    product with 1 - 1e-9 covers the rounding of the floors' sums."""
    pl, per_replica = walk[0], walk[3]
    cp_mode, split, b, _, number = group
    key = ("work", number) if work else number
    if key not in search._floors:
        kinds = search.space.kinds(mesh[TP], b, mesh[CP] > 1)
        search._floors[key] = None if kinds is None else group_floor(
            search, kinds, b, search._context((pl[TP], pl[CP], cp_mode, (
                split.dispatch if split is not None else None))), work,
            base_lists(search, mesh, b, kinds) if search._base is not None else None)
    floor, pp, m = search._floors[key], mesh[PP], per_replica // b
    plans = schedules_of(search, pp, m)
    if floor is None or not plans:
        return None
    avg = floor[0] / pp
    return min(pipe_bound(search, s, v, m, pp, avg, max(avg, floor[1]))
               for s, v in plans) * (1 - 1e-9)


def grid_past(search, mesh, walk, group) -> bool:
    """Whether a grid search's group has no leaf under its cutoff, read before any Prepared
    (its own or its base search's) is priced: from `group_bound` (the bound of its work
    first, then with the collectives), then with its least gradient sync (`sync_past`):
    its floor is under every leaf's bound. Asked only of a group whose micro-batch takes a
    state of the grid (`Space.takes_grid`: `Search._leaves` leaves the others out, whose
    leaves are the base search's). A group number whose floor alone puts its
    meshes of so many micro-batches per stage past (`_throughput_past`) is past for each
    mesh of as many or more that meets it after."""
    number = group[4]
    rate, past_from = (walk[3] // group[2]) / mesh[PP], search._floors.get(("past", number))
    if past_from is not None and rate >= past_from:
        return True
    pipe = group_bound(search, mesh, walk, group, work=True)  # (first the one shared more)
    if pipe is None or pipe >= search._cutoff:
        _throughput_past(search, group, ("work", number), rate)
        return True
    pipe = group_bound(search, mesh, walk, group)
    if pipe >= search._cutoff:
        _throughput_past(search, group, number, rate)
        return True
    return sync_past(search, mesh, walk, group, pipe)


def _throughput_past(search, group, key, rate: float) -> None:
    """Where the floor of ``group``'s number (``search._floors[key]``) puts a mesh past by
    its throughput alone, keep the micro-batches per stage ``rate`` (``m / pp``) it takes: every
    schedule's `pipe_bound` is at least ``m x avg`` = ``(m / pp) x`` the floor's seconds,
    which grows with ``m / pp`` (``global batch x cp x tp / (devices x b)`` on a mesh of the
    whole world: the same for every mesh of the number, whose tp, cp and micro-batch are
    its own), so every mesh of the number with as many is past too; none where it has no
    states. The margin 2e-9 covers the rounding of ``m x (total / pp)`` against this
    product."""
    floor = search._floors[key]
    if floor is None:
        search._floors[("past", group[4])] = 0.0
    elif rate * floor[0] * (1 - 2e-9) >= search._cutoff:
        known = search._floors.get(("past", group[4]))
        search._floors[("past", group[4])] = rate if known is None else min(known, rate)


def sync_past(search, mesh, walk, group, pipe: float) -> bool:
    """Whether ``pipe`` (a lower bound of the group's leaves' pipeline seconds) plus their
    least gradient sync (`dp_floor` of the group's least parameter bytes per pipeline rank,
    `floors.group_params`) is at the cutoff or over, read before its Prepared is made: the
    ZeRO options' syncs in turn, stopping at the first under what the cutoff leaves (the
    least is then under it too)."""
    m = walk[3] // group[2]
    grad_pl, dp_cache, held = walk[1], walk[2], _params(search, mesh, walk, group) / mesh[PP]
    for z, shard in dict.fromkeys((z, s) for z, _, s in group[3]):
        sync = search._dp_time(held, z, m, grad_pl, cache=None if shard else dp_cache,
                               hybrid=hybrid_split(mesh, shard, search.world.per_node))
        if pipe + sync * (1 - 1e-9) < search._cutoff:
            return False
    return True


def with_sync(search, pending: Pending) -> float:
    """A `Pending`'s floor with its leaves' own least gradient sync (of the Prepared's
    parameter bytes, `floors.group_params`, to the bit), kept for its leaves."""
    mesh, walk, group = pending.mesh, pending.walk, pending.group
    held = _params(search, mesh, walk, group) / mesh[PP]
    pending.dp = (held, dp_floor(search, mesh, walk, group[3], walk[3] // group[2], held))
    return pending.pipe + pending.dp[1] * (1 - 1e-9)


def _params(search, mesh, walk, group) -> float:
    """`floors.group_params` of a group, once per group number and search, and once per
    state list, cp size and ep size: a state's parameter bytes read no more of its Context
    (`cost.model.state_params`), so the group numbers of one tensor size and micro-batch
    that differ in placement or cp mode share them."""
    number = group[4]
    params = search._floors.get(("params", number))
    if params is None:
        pl, cp_mode, split = walk[0], group[0], group[1]
        kinds = search.space.kinds(mesh[TP], group[2], mesh[CP] > 1)
        key = ("params", id(kinds), mesh[CP], split.ep if split is not None else 1)
        params = search._floors.get(key)
        if params is None:
            params = search._floors[key] = group_params(search, kinds, search._context((
                pl[TP], pl[CP], cp_mode, split.dispatch if split is not None else None)))
        search._floors[("params", number)] = params
    return params


def pipe_bound(search, schedule: str, v: int, m: int, pp: int, avg: float,
                slowest: float) -> float:
    """A leaf's pipeline seconds at least (`Search._leaves`): every layer at its fastest, the
    stages `avg` seconds each, none under `slowest` (>= avg); non-decreasing in both."""
    if pp == 1:
        pipe = m * slowest
    elif schedule == INTERLEAVED:
        pipe = m * slowest + (pp - 1) * avg / v
    elif schedule == ZERO_BUBBLE:
        pipe = m * slowest + (pp - 1) * slowest / (6 if m >= 2 * pp else 3)
    else:
        pipe = (m - 1) * slowest + pp * avg
    if pp > 1 and search.hw.compute_share < 1:  # cores shared (time_shared): no less than
        # the pipeline's work spread over its cores, nor the schedule at a whole core per rank
        pipe = max(m * avg, search.hw.compute_share * pipe)
    return pipe


def past(search, pp: int, m: int, avg: float, single: float) -> bool:
    """Whether no leaf of a group can be under the cutoff, read before its Prepared is made:
    `avg` and `single` are lower bounds of its ``min_total / pp`` and ``min_single`` (a
    `Floor`'s, or the exact least seconds with a Floor's single, or 0), and `pipe_bound`
    does not decrease in either (rounding is monotone), so each schedule's pipeline bound
    with them is at most the leaf's, which its gradient sync's bound (>= 0) only raises."""
    slowest = max(avg, single)
    return all(pipe_bound(search, schedule, v, m, pp, avg, slowest) >= search._cutoff
               for schedule, v in schedules_of(search, pp, m))


def schedules_of(search, pp: int, m: int) -> list:
    """`Space.schedules` whose stages the chain's layers can fill, once per (pp, m) for
    every search sharing these caches (the same for a grid search as for its base)."""
    key = ("schedules", pp, m)
    hit = search._shared.get(key)
    if hit is None:
        hit = search._shared[key] = [(s, v) for s, v in search.space.schedules(pp, m)
                                     if pp * v <= len(search.chain.order)]
    return hit
