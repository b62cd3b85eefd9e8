"""The strategy search: mesh x per-layer strategy x pipeline x ZeRO x recompute.

Per leaf of the space (`search.space`: mesh, cp mode, micro-batch, schedule) a dynamic
program picks each layer's state, a second balances the stages, `cost.step` prices the
step; branch and bound skips leaves slower than the k-th best. Leaves go in a fixed order
and ties to the first, so every rank computes the same plan.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import gc
import heapq
import itertools
import time

import numpy as np

from autopar.cost import fp8
from autopar.cost.comm import placements
from autopar.cost.hardware import Hardware
from autopar.cost.hybrid import hybrid_split, zero_ranks
from autopar.cost.layer import LayerChain
from autopar.cost.model import Context
from autopar.cost.precision import precision_of
from autopar.cost.schedule import stage_owner
from autopar.cost.step import (
    USABLE_MEMORY,
    crossing_transfer,
    expert_split,
    grad_placement,
    host_capacity,
    in_flight_of,
    memory_by_kind,
    optimizer_step_dev,
    pipeline_time,
    stage_memory,
    stage_transfer,
    step_parts,
    step_temps_dev,
    sync_bytes,
    sync_time,
    zero3_held,
)
from autopar.errors import PlanError
from autopar.modes import (
    CP,
    DP,
    ORDER,
    PP,
    TP,
    ZERO_BUBBLE,
)
from autopar.search import why
from autopar.search.bounds import (
    dp_floor,
    grid_past,
    group_bound,
    past,
    pipe_bound,
    schedules_of,
    with_sync,
)
from autopar.search.floors import base_lists, least_floor, least_priced
from autopar.search.partition import balance_within
from autopar.search.prepared import (
    Fast,
    Leaf,
    Pending,
    Prepared,
    Priced,
    cost_table,
    least_states,
    least_total,
    plain_table,
)
from autopar.search.result import Candidate, SearchResult, better, candidate_of, result_of
from autopar.search.space import Constraints, Options, Space, divisors

__all__ = ["Candidate", "Constraints", "Options", "Search", "SearchResult", "collector_paused",
           "divisors"]

_UNASKED = object()  # a cache's answer not asked for yet (where None is an answer)


class Search:
    """One search over one model and world; reusable for several questions."""

    def __init__(self, chain: LayerChain, world, options: Options, constraints=None,
                 state_costs: dict | None = None, base: Search | None = None,
                 settled: dict | None = None):
        """`state_costs`: layer state costs to share with other searches of this chain and
        world in the same dtype and attention kernel (their capabilities may differ);
        `base`: the 1D search run before this one, whose space is this one's but for the
        multi-dimensional modes: only the meshes whose tensor group may take one, and of those
        no placement or micro-batch where its states add none to `base`'s or none that a
        candidate can take (`Prepared.adds_nothing`): there the candidates are `base`'s;
        `settled`: shared with those searches, the leaves (under one ZeRO option) whose
        fastest states fit as they are, so a search that meets one with the same fastest
        states skips the candidate already priced."""
        self.chain = chain
        self.world = world
        self.hw: Hardware = world.profile
        self.opt = options
        self.c = Constraints.of(constraints)
        if base is not None:  # the same chain: its layers as the base search read them
            self.layers, self.blocks = base.layers, base.blocks
        else:
            self.layers = chain.layers()
            self.blocks = [i for i, lt in enumerate(self.layers) if lt.is_block]
        self.space = Space(chain, options, self.c, len(self.blocks))
        self._cost_cache: dict = {}
        self._by_group: dict = {}  # `_prepared` by the number `_mesh_walk` gives its key
        self._singles: dict = {}  # by that number: a Floor's bound of the Prepared's min_single
        # placement-only caches (contexts, dp sync, in flight), shared with the base search's
        self._shared: dict = base._shared if base is not None else {}
        self._contexts: dict = self._shared.setdefault("contexts", {})  # per ctx key
        self._state_costs = state_costs
        self.left_out: list[str] = []
        self.capacity = self.hw.memory_bytes * USABLE_MEMORY
        self.host_capacity = host_capacity(self.hw, world.per_node, world.devices)
        # (a base search's: the same chain, device and dtype)
        self.precision, self.kept_high = (base.precision, base.kept_high) if base is not None \
            else fp8.planned(options.dtype, self.hw, precision_of(chain.param_dtype), self.layers)
        self._base = base
        self._settled = settled
        self._cutoff = float("inf")  # `run`'s: leaves whose bound reaches it are not made
        self.candidates = 0
        self.best_times: list[float] = []  # after `run`: the k best fitting step times
        self._group_seq = itertools.count()  # each leaf group's place in leaf order
        self._floors: dict = {}  # `floors.group_floor` by group number (None: no states),
        # and `floors.group_params` by ("params", group number)

    # ------------------------------------------------------------------ the search
    def run(self, progress=None, cutoff: float = float("inf")) -> SearchResult:
        """Price every leaf's lower bound, then evaluate leaves best bound first until the
        bound passes the k-th best plan found (branch and bound: exact for the top k);
        `cutoff`: the k-th best step time other searches found, which no leaf whose bound
        reaches it can enter."""
        with collector_paused():
            return self._run(progress, cutoff)

    def _run(self, progress, cutoff: float) -> SearchResult:
        start = time.perf_counter()
        self._cutoff = cutoff
        meshes, queue = _queue(self, progress)
        top: list = []  # max-heap by time of the k best fitting candidates
        per_mesh: dict = {}
        bounds: dict = {}
        skipped: list = []  # the Pending groups whose floor was past the k best
        popped = made = 0
        pushed = len(queue)
        while queue:  # leaves (and groups not made yet) best bound first, ties to the first
            bound, _, leaf = heapq.heappop(queue)
            popped += 1
            if progress and popped % 64 == 0:
                progress(len(meshes) + popped * len(meshes) // pushed, 2 * len(meshes))
            past = bound >= min(cutoff, -top[0][0] if len(top) >= self.opt.top else cutoff)
            if leaf.__class__ is Pending:  # its floor is under every leaf's bound
                if past:  # and so is every one of them
                    skipped.append(leaf)
                    continue
                if not leaf.full:  # next, under its floor with the collectives
                    leaf.full, leaf.pipe = True, group_bound(self, leaf.mesh, leaf.walk,
                                                             leaf.group)
                    if leaf.pipe < cutoff:
                        heapq.heappush(queue, (leaf.pipe, (leaf.seq, -2), leaf))
                        pushed += 1
                    continue
                if leaf.dp is None:  # next, under its floor with the gradient sync
                    floor = with_sync(self, leaf)
                    if floor < cutoff:
                        heapq.heappush(queue, (floor, (leaf.seq, -1), leaf))
                        pushed += 1
                    continue
                for made_leaf in _group_leaves(self, leaf):
                    heapq.heappush(queue, (made_leaf.bound, made_leaf.order, made_leaf))
                    made += 1
                    pushed += 1
                continue
            made += 1
            key = _leaf_key(leaf)
            if past:
                bounds.setdefault(key, leaf)
                continue
            for cand in self._evaluate(leaf):
                self.candidates += 1
                prev = per_mesh.get(key)
                if prev is None or better(cand, prev):
                    per_mesh[key] = cand
                if cand.fits:
                    item = (-cand.step_time, -self.candidates, cand)
                    if len(top) < self.opt.top:
                        heapq.heappush(top, item)
                    elif cand.step_time < -top[0][0]:
                        heapq.heapreplace(top, item)
        if not made:
            _no_leaf(self, meshes)
        if self.opt.executable is not None:
            self.left_out.extend(why.not_executable(self.opt.executable))
        self.best_times = sorted(-t for t, _, _ in top)
        per_mesh = {key: p.candidate() for key, p in per_mesh.items()}  # (the rest: compared)
        if skipped and len(per_mesh) <= self.opt.top:  # `result_of` may read bounds of these
            bounds = _with_skipped(self, bounds, skipped)
        return result_of(self, per_mesh, bounds, time.perf_counter() - start)

    def every(self, progress=None) -> list[Candidate]:
        """Every candidate of the space, in leaf order, none skipped by a bound (for
        benchmarks and for checking `run`)."""
        with collector_paused():
            _, leaves = self._all_leaves(progress)
            out = []
            for leaf in leaves:
                for priced in self._evaluate(leaf):
                    self.candidates += 1
                    out.append(priced.candidate())
        return out

    def _all_leaves(self, progress=None) -> tuple[list[dict], list]:
        """The meshes this search allows and every leaf under them (mesh x cp mode x
        micro-batch x schedule), each with its lower bound, in a fixed order."""
        meshes, heads = _meshes(self)
        leaves = []
        for i, mesh in enumerate(meshes):
            if progress:
                progress(i, 2 * len(meshes))
            leaves.extend(self._leaves(mesh, heads))
        if not leaves:
            _no_leaf(self, meshes)
        return meshes, leaves

    def reason(self, cand: Candidate, winner: Candidate | None) -> str:
        """Why `cand` lost to `winner` (`why.lost`)."""
        return why.lost(cand, winner, self.capacity, self.host_capacity)

    # ------------------------------------------------------------------ leaves
    def _prepared(self, mesh, pl, cp_mode, b, split=None, least=False, floor=False):
        """Costs of every layer state for this tp/cp(/ep) placement and micro-batch (shared by
        all pp x dp); None where some layer has no state. `least`: where it is not made yet,
        only its ``min_total`` (a float, which `_leaves` asks first under a cutoff), or with
        `floor` a bound of it (`_least`)."""
        if self._base is not None and not self.space.takes_grid(mesh[TP], b, mesh[CP] > 1):
            return None  # its states are the base search's (1D), or none: so are its leaves
        per_type = self.space.kinds(mesh[TP], b, mesh[CP] > 1)
        if per_type is None or _base_known(self, per_type) is False:
            return None  # some layer has no state, or the base search's leaves are these
        ep_pl = split.dispatch if split is not None else None
        key = (mesh[TP], pl[TP], pl[CP], cp_mode, b, ep_pl)
        if key in self._cost_cache:
            return self._cost_cache[key]
        ctx_key = (pl[TP], pl[CP], cp_mode, ep_pl)
        ctx = self._context(ctx_key)
        base = _base_of(self, mesh, pl, cp_mode, b, split, per_type)
        if base is False:
            self._cost_cache[key] = None
            return None
        context = (ctx, cost_table(self._state_costs, b, ctx_key),
                   plain_table(self._shared, b, pl))
        if least:
            return _least(self, per_type, b, context, base, floor)
        prep = self._cost_cache[key] = Prepared(self, per_type, pl, b, context, base)
        return prep

    def _context(self, key) -> Context:
        """The cost Context of a (tp placement, cp placement, cp mode, ep placement)."""
        ctx = self._contexts.get(key)
        if ctx is None:
            ctx = self._contexts[key] = Context(self.hw, self.opt.dtype, key[0], key[1], key[2],
                                                self.opt.attention_kernel, ep=key[3],
                                                kept_high=self.kept_high,
                                                compile=self.opt.compile,
                                                fp8_recipe=self.opt.fp8_recipe,
                                                shared=self._shared.setdefault("prices", {}))
        return ctx

    def _leaves(self, mesh, heads):
        walk = _mesh_walk(self, mesh, heads)
        if walk is None:
            return []
        pl, pp, per_replica = walk[0], mesh[PP], walk[3]
        out = []
        preps, bounded = self._by_group, self._cutoff < float("inf")
        groups = walk[4]
        if self._base is not None:  # a group whose micro-batch takes no state of this grid
            # has the base search's states (1D) or none, so its leaves are the base's
            # (`_prepared` gives None): left out before anything is asked of it
            takes, tp, beside = self.space.takes_grid, mesh[TP], mesh[CP] > 1
            micro = {b for b in {g[2] for g in groups} if takes(tp, b, beside)}
            groups = [g for g in groups if g[2] in micro]
        for cp_mode, split, b, leaf_zeros, group in groups:
            seq = next(self._group_seq)
            prep = preps.get(group, preps)  # (itself: not asked yet)
            if prep is preps and bounded and grid_past(self, mesh, walk, (
                    cp_mode, split, b, leaf_zeros, group)):
                continue  # (not kept: another mesh of this group may have fewer micro-batches)
            if prep is preps:  # under a cutoff, its least seconds first (`least_total`)
                prep = preps[group] = self._prepared(mesh, pl, cp_mode, b, split, bounded,
                                                     bounded)
            if prep is None:
                continue
            m = per_replica // b
            if prep.__class__ is Floor:  # a bound of the least seconds, nothing priced for it
                if m * (prep / pp) >= self._cutoff or past(self, pp, m, prep / pp, prep.single):
                    continue
                self._singles[group] = prep.single
                prep = preps[group] = self._prepared(mesh, pl, cp_mode, b, split, True)
            if prep.__class__ is float:  # the Prepared's min_total: made once a leaf needs it
                if m * (prep / pp) >= self._cutoff or \
                        past(self, pp, m, prep / pp, self._singles.get(group, 0.0)):
                    continue
                prep = preps[group] = self._prepared(mesh, pl, cp_mode, b, split)
            out.extend(_made_leaves(self, mesh, walk, (cp_mode, split, b, leaf_zeros), prep, seq))
        return out

    # ------------------------------------------------------------------ pricing
    def _dp_time(self, param_bytes: float, zero: int, m: int, grad_pl, units: int = 1,
                 cache: dict | None = None, hybrid=None) -> float:
        """Data-parallel gradient sync of one device's parameters (`cost.step.sync_time`;
        `hybrid`: HSDP's groups); `cache`: the one of its placement (`_dp_cache`)."""
        if cache is None:
            cache = self._dp_cache(grad_pl if hybrid is None else hybrid.shard)
        return sync_time(param_bytes, zero, m, grad_pl, self.hw, units, cache, hybrid,
                         self.precision.gather_ratio)

    def _dp_cache(self, grad_pl) -> dict:
        """Collective seconds by parameter bytes, over one gradient placement."""
        return self._shared.setdefault((DP, grad_pl), {})

    def _pipeline_time(self, layer_time, device_of, stage_of, pp, v, m, schedule, pl, b):
        """(step seconds of the pipeline, bubble seconds, per-device seconds per micro-batch)."""
        transfer = stage_transfer(self.layers, stage_of, b, pl, self.hw)[0] if pp > 1 else 0.0
        return pipeline_time(layer_time, device_of, stage_of, pp, v, m, schedule, self.hw,
                             transfer)

    def _transfer(self, leaf) -> float:
        """Seconds of one activation crossing a stage boundary of the leaf's pipeline
        (`cost.step.stage_transfer`), once per leaf."""
        if leaf.mesh[PP] == 1:
            return 0.0
        if leaf.transfer is None:
            stages = np.asarray(leaf.stage_of)
            crossing = leaf.prep.boundaries[stages[:-1] != stages[1:]]
            leaf.transfer = crossing_transfer(float(crossing.max()) if len(crossing) else None,
                                              leaf.pl, self.hw)[0]
        return leaf.transfer

    def _in_flight(self, schedule, pp, v, m) -> np.ndarray:
        key = ("in flight", schedule, pp, v, m)
        hit = self._shared.get(key)
        if hit is None:
            hit = self._shared[key] = in_flight_of(schedule, pp, v, m)
        return hit

    def _evaluate(self, leaf):
        if leaf.prep.adds_nothing():
            return  # the base search's candidates: priced there, or bounded above its k best
        leaf.prep.build()
        settled, fast, zeros = self._settled, None, leaf.zeros
        if settled is not None:
            fast = leaf.prep.fast_key()
            key = (_mesh_key(leaf.mesh), leaf.split.ep if leaf.split is not None else 1,
                   leaf.cp_mode, leaf.b, leaf.schedule, leaf.v)
            # what another search priced alike is the same candidate
            zeros = [z for z in zeros if settled.get(key + z) != fast]
            if not zeros:
                return
        if leaf.stage_of is None:
            leaf.stage_of = leaf.prep.stages(leaf.mesh[PP] * leaf.v, leaf.mesh[PP] > 1 and
                                             leaf.schedule == ZERO_BUBBLE)
            leaf.device_of = [stage_owner(leaf.schedule, s, leaf.mesh[PP])
                              for s in leaf.stage_of]
        for zero, offload, shard in zeros:
            cand = self._priced(leaf, zero, offload, shard)
            if fast is not None and cand.fits and not cand.moved:
                settled.setdefault(key + (zero, offload, shard), fast)
            yield cand
            if leaf.mesh[PP] > 1 and leaf.v == 1 and (not cand.fits or (
                    cand.moved and cand.states() != leaf.prep.states_of(leaf.prep.fast))):
                # the time-balanced split needs recomputation or does not fit: also try the
                # fastest split whose stages hold their in-flight activations as they are
                alt = self._memory_split(leaf, zero, offload, shard)
                if alt is not None and alt != leaf.stage_of:
                    yield self._priced(dataclasses.replace(leaf, stage_of=alt, device_of=alt,
                                                           transfer=None, fast=None),
                                       zero, offload, shard)

    def _memory_split(self, leaf, zero, offload, shard=None) -> list[int] | None:
        """Stages balanced by time under each stage's memory limit, fastest states kept."""
        prep, pp = leaf.prep, leaf.mesh[PP]
        replicas = zero_ranks(leaf.mesh, shard)
        key = (leaf.schedule, pp, leaf.m, replicas, zero, offload)
        hit = prep.splits.get(key, _UNASKED)  # (a split may be None: nothing balances)
        if hit is _UNASKED:
            weights, capacity = stage_memory(
                prep.params, prep.acts, self._in_flight(leaf.schedule, pp, 1, leaf.m),
                prep.biggest, self.capacity, self.precision, replicas, zero, offload)
            hit = prep.splits[key] = balance_within(prep.layer_time, weights, capacity, pp)
        return hit

    def _memory(self, leaf, params_dev, acts_dev, biggest, zero, offload, in_flight,
                experts_dev=None, temps_dev=None, shard=None, held=None):
        replicas = zero_ranks(leaf.mesh, shard)
        step = optimizer_step_dev(params_dev, temps_dev, replicas, zero, offload,
                                  self.precision, self.hw.optimizer_implementation,
                                  experts_dev, leaf.split)
        parts = memory_by_kind(params_dev, acts_dev, biggest, replicas, zero, offload,
                               in_flight, self.precision, leaf.prep.workspace, experts_dev,
                               leaf.split, step, held)
        return sum(parts.values()), parts, step

    def _price(self, leaf, zero, offload, shard=None) -> Candidate:
        return self._priced(leaf, zero, offload, shard).candidate()

    def _priced(self, leaf, zero, offload, shard=None) -> Priced:
        """The leaf's candidate under one ZeRO option: what ranks it, and whether fitting
        memory moved a layer off its fastest state (`Priced`); the rest once asked."""
        prep, mesh = leaf.prep, leaf.mesh
        pp = mesh[PP]
        in_flight = self._in_flight(leaf.schedule, pp, leaf.v, leaf.m)
        chosen = list(prep.fast)
        if leaf.fast is None:
            device_of = np.asarray(leaf.device_of)
            leaf.fast = Fast(device_of,
                              np.bincount(device_of, weights=prep.params, minlength=pp),
                              np.bincount(device_of, weights=prep.acts, minlength=pp),
                              step_temps_dev(*prep.temps, device_of, pp))
        device_of, params_dev, acts_dev = leaf.fast.device_of, leaf.fast.params_dev, \
            leaf.fast.acts_dev
        experts_dev = self._experts_dev(leaf, chosen, device_of)
        total, parts, step_dev = self._memory(leaf, params_dev, acts_dev, prep.biggest, zero,
                                              offload, in_flight, experts_dev, leaf.fast.temps_dev,
                                              shard, _held(leaf, zero, self.precision))
        params, moved = prep.params, False
        memory = total.max()
        if memory > self.capacity:
            # activations fit what the state, the buffers and the step's excess leave
            prep.fit_ranks(chosen, leaf.fast, total, total - parts["activations"] -
                           parts["optimizer_step"], self.capacity, in_flight)
            acts_dev, params, params_dev, biggest, experts_dev, temps_dev = \
                _fitted(self, leaf, chosen)
            total, parts, step_dev = self._memory(leaf, params_dev, acts_dev, biggest, zero,
                                                  offload, in_flight, experts_dev, temps_dev,
                                                  shard, _held(leaf, zero, self.precision, chosen))
            moved = chosen != prep.fast
            memory = total.max()
        fast = chosen == prep.fast  # what follows from the states alone is the leaf's
        chosen = np.asarray(chosen)
        heaviest = int(np.argmax(params_dev))
        units = int(np.count_nonzero((device_of == heaviest) & (params > 0)))  # holding any
        hybrid = hybrid_split(mesh, shard, self.world.per_node)
        layer_time = prep.layer_time if fast else prep.path_time(chosen)
        if leaf.schedule == ZERO_BUBBLE and pp > 1:  # the loss's backward split in two
            layer_time = layer_time + prep.take(prep.split_table, chosen)
        step = step_parts(layer_time, device_of, leaf.stage_of, params_dev, units,
                          transfer=self._transfer(leaf), grad_pl=leaf.grad_pl, hw=self.hw,
                          schedule=leaf.schedule, v=leaf.v, m=leaf.m, zero=zero, offload=offload,
                          precision=self.precision, experts_dev=experts_dev, split=leaf.split,
                          cache=self._dp_cache(leaf.grad_pl if hybrid is None else hybrid.shard),
                          expert_cache=self._dp_cache(leaf.split.data) if leaf.split else None,
                          pipeline=leaf.fast.pipeline if fast else None, hybrid=hybrid)
        if fast:
            leaf.fast.pipeline = (step["pipeline_s"], step["bubble_s"], step["per_rank_s"])
        host, wire = sync_bytes(float(params_dev.max()), zero_ranks(mesh, shard), zero, offload,
                                self.precision, hybrid, leaf.split, float(experts_dev[heaviest])
                                if leaf.split is not None else 0.0)
        fits, memory = bool(memory <= self.capacity and host <= self.host_capacity), float(memory)
        return Priced(step["step_s"], fits, memory, moved, leaf, chosen, functools.partial(
            candidate_of, leaf, zero, offload, shard, chosen, step, total, parts, step_dev, host,
            wire, step["step_s"], fits, memory))

    def _experts_dev(self, leaf, chosen, device_of):
        """Bytes of expert weights each pipeline rank holds (None without expert parallelism)."""
        if leaf.split is None:
            return None
        experts = leaf.prep.take(leaf.prep.expert_table, chosen)
        return np.bincount(device_of, weights=experts, minlength=leaf.mesh[PP])


def _with_skipped(search: Search, bounds: dict, skipped: list) -> dict:
    """`bounds` (each mesh's first leaf past the k best) as a walk of every leaf would
    have found it: with the leaves of the groups skipped whole, in leaf order."""
    leaves = list(bounds.values())
    for pending in skipped:
        leaves.extend(_group_leaves(search, pending))
    leaves.sort(key=lambda leaf: (leaf.bound, leaf.order))
    out: dict = {}
    for leaf in leaves:
        out.setdefault(_leaf_key(leaf), leaf)
    return out


def _queue(search: Search, progress) -> tuple[list[dict], list]:
    """The meshes and a heap of (bound, order, leaf): a grid search's leaves; a search
    with no base, per group of leaves a `Pending` under the floor of its work (`group_bound`
    with `work`: no leaf's bound is under it), whose floor with the collectives is read only
    once it comes first, and its Prepared priced only once that floor comes first."""
    if search._base is not None:
        meshes, leaves = search._all_leaves(progress)
        queue = [(leaf.bound, leaf.order, leaf) for leaf in leaves]
    else:
        meshes, heads = _meshes(search)
        queue = []
        for i, mesh in enumerate(meshes):
            if progress:
                progress(i, 2 * len(meshes))
            walk = _mesh_walk(search, mesh, heads)
            for group in walk[4] if walk is not None else ():
                seq = next(search._group_seq)
                pipe = group_bound(search, mesh, walk, group, work=True)
                if pipe is not None and pipe < search._cutoff:
                    queue.append((pipe, (seq, -3), Pending(mesh, walk, group, seq, pipe,
                                                           full=False)))
    heapq.heapify(queue)
    return meshes, queue


def _meshes(search: Search) -> tuple[list[dict], int]:
    """The meshes this search allows, and the fewest heads of an attention core."""
    world = search.world.devices
    heads = min((a.heads for lt in search.chain.types for a in lt.attention), default=1)
    meshes = search._shared.get("meshes")  # a grid search's are its base's (`_mesh_walk`)
    if meshes is None:
        meshes = search._shared["meshes"] = search.space.meshes(world)
    if search._base is not None:  # (`has_grid` once per tensor size)
        grid_tps = {tp for tp in {m[TP] for m in meshes} if search.space.has_grid(tp)}
        meshes = [m for m in meshes if m[TP] in grid_tps]
    if not meshes:
        raise PlanError(why.no_mesh(search.c, search.chain, world, len(search.blocks)))
    if search.c.ep not in (None, 1):
        why.check_ep(search.c, search.space, search.opt.executable, meshes)
    return meshes, heads


def _no_leaf(search: Search, meshes) -> None:
    """Raise why the search has no leaf."""
    if search._cutoff < float("inf"):  # (read by no one: the first search's error is the
        # one raised) cheaper than the sentences below
        raise PlanError(f"every leaf is bounded above the {search._cutoff:.3f} s of the k "
                        "best plans other searches found; none of it can enter the top k.")
    world = search.world.devices
    raise PlanError(why.too_many_devices(search.space, meshes, world, search.opt.global_batch)
                    or why.no_leaf(search.space, meshes, search.opt.global_batch))


def _group_leaves(search: Search, pending: Pending) -> list:
    """The leaves of a `Pending` group, its Prepared made."""
    mesh, walk, group = pending.mesh, pending.walk, pending.group
    prep = search._prepared(mesh, walk[0], group[0], group[2], group[1])
    return _made_leaves(search, mesh, walk, group, prep, pending.seq, pending.dp)


def _made_leaves(search: Search, mesh, walk, group, prep, seq: int,
                 dp: tuple | None = None) -> list:
    """The leaves of one group of a mesh's walk (cp mode, expert split, micro-batch, ZeRO
    options) once its Prepared is made, each under the cutoff with its bound: every layer
    at its fastest state, stages perfectly balanced, parameters evenly spread (experts'
    sync left out: it runs over a smaller group)."""
    pl, grad_pl, dp_cache, per_replica, _ = walk
    cp_mode, split, b, leaf_zeros = group[:4]
    pp, m = mesh[PP], per_replica // b
    avg = prep.min_total / pp
    if m * avg >= search._cutoff:  # every schedule's pipeline takes m x avg or more
        return []
    out = []
    slowest, dp_lb = max(avg, prep.min_single), None  # dp's: once a leaf needs it
    for k, (schedule, v) in enumerate(schedules_of(search, pp, m)):
        pipe = pipe_bound(search, schedule, v, m, pp, avg, slowest)
        if pipe >= search._cutoff:  # (with the sync's, no sooner: it takes no time off)
            continue
        if dp_lb is None:  # (the floor's where it read these bytes: the same sync)
            held = (prep.min_params - prep.min_experts) / pp
            dp_lb = dp[1] if dp is not None and dp[0] == held else \
                dp_floor(search, mesh, walk, leaf_zeros, m, held)
        if pipe + dp_lb >= search._cutoff:
            continue  # another search's k best are faster
        out.append(Leaf(bound=pipe + dp_lb, order=(seq, k), mesh=dict(mesh), pl=pl,
                        grad_pl=grad_pl, cp_mode=cp_mode, b=b, m=m, schedule=schedule,
                        v=v, prep=prep, zeros=leaf_zeros, dp_cache=dp_cache, split=split))
    return out


def _fitted(search: Search, leaf, chosen) -> tuple:
    """What `Search._priced` reads of the states `fit` chose, per pipeline rank or per layer:
    (activation bytes per rank, parameter bytes per layer and per rank, the biggest
    layer's, expert bytes per rank, the for-loop step's temporaries per rank); once per
    leaf and choice (its ZeRO options' fits often choose alike)."""
    key = tuple(chosen)
    hit = leaf.fast.fitted.get(key)
    if hit is not None:
        return hit
    prep, device_of, pp = leaf.prep, leaf.fast.device_of, leaf.mesh[PP]
    chosen = np.asarray(chosen)  # (one index array for every table)
    acts = prep.take(prep.act_table, chosen)
    acts_dev = np.bincount(device_of, weights=acts, minlength=pp)
    # a layer that changed layout holds its parameters differently too
    params = prep.take(prep.param_table, chosen)
    params_dev = np.bincount(device_of, weights=params, minlength=pp)
    biggest = float(params.max()) if len(params) else 0.0
    experts_dev = search._experts_dev(leaf, chosen, device_of)
    # by its inputs' values, shared by the search's leaves (GPT-3/1024: 27 distinct of 707)
    temps = [prep.take(t, chosen) for t in prep.temp_tables]
    temps_key = (*(t.tobytes() for t in temps), device_of.tobytes(), pp)
    memo = search._shared.setdefault("temps", {})
    temps_dev = memo.get(temps_key)
    if temps_dev is None:
        temps_dev = memo[temps_key] = step_temps_dev(*temps, device_of, pp)
    hit = leaf.fast.fitted[key] = (acts_dev, params, params_dev, biggest, experts_dev,
                                   temps_dev)
    return hit


def _least(search: Search, kinds, b: int, context, base, floor: bool) -> float:
    """A placement's ``min_total`` before its Prepared is made (`least_total`); with `floor`,
    in a grid search, first a lower bound of it priced from the layers' sizes alone where the
    grid's states would be priced for it (`floors.least_floor`: a `Floor`)."""
    if search._base is None:
        return least_total(search, kinds, b, context, base)
    which = least_states(search, kinds, base)
    if floor:
        bound = least_floor(search, kinds, b, context, base, which)
        if bound is not None:
            made = Floor(bound[0])
            made.single = bound[1]
            return made
    return least_priced(search, kinds, b, context, base, which)


class Floor(float):
    """`Search._prepared`'s lower bound of a Prepared's ``min_total`` (`floors.least_floor`),
    told apart from the exact one (a float) by its class; ``single``: a lower bound of its
    ``min_single``."""

    single: float = 0.0


@contextlib.contextmanager
def collector_paused():
    """Python's cyclic garbage collector paused while the search runs. The search makes
    many short-lived containers, and each full collection they trigger walks every object
    the process holds (torch alone keeps some 400k alive): about a quarter of the search's
    time. Reference counting still frees what the search drops; the few cycles it leaves
    are collected once the collector runs again."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


def _base_known(search: Search, kinds):
    """False where the base search's states of each kind are known to be `kinds` (`_base_of`
    decided it for this list): every leaf there is the base search's; else None."""
    if search._base is None:
        return None
    known = search._cost_cache.get(("base of", id(kinds)))
    return False if known is not None and known[0] and not known[1] else None


def _base_of(search: Search, mesh, pl, cp_mode, b, split, kinds):
    """The base search's `Prepared` of this placement and micro-batch where its states of
    each kind begin this search's and it lacks some (False where it lacks none: its leaves
    are the base search's own); None without a base search, or where it has no states."""
    if search._base is None:
        return None
    # whether the base's states begin these and lack some follows from the two state lists
    # alone (`Space.kinds`: one per tensor size and micro-batch): decided once per list, the
    # base's Prepared asked for only where its leaves are to be priced
    known = search._cost_cache.get(("base of", id(kinds)))
    if known is None:
        had = base_lists(search, mesh, b, kinds)  # (the base's lists, where they begin these)
        adds = had is not None and any(len(s) > len(old) for (_, s), (_, old) in zip(kinds, had))
        known = search._cost_cache[("base of", id(kinds))] = (had is not None, adds)
    use, adds = known
    if not use:
        return None
    return search._base._prepared(mesh, pl, cp_mode, b, split) if adds else False


def _mesh_walk(search: Search, mesh, heads):
    """What the leaves of `mesh` share, made once for every search sharing these caches
    (a grid search's space is its base's but for the tensor modes, so its meshes,
    placements, micro-batches, cp modes, expert splits and ZeRO options are the base's):
    (placements, gradient placement, its dp cache, samples per replica, and the (cp mode,
    expert split, micro-batch, ZeRO options) of each leaf group in leaf order); None
    where dp does not divide the global batch."""
    key = ("walk", _mesh_key(mesh))
    if key in search._shared:
        return search._shared[key]
    walk = None
    gb, dp, pp = search.opt.global_batch, mesh[DP], mesh[PP]
    if gb % dp == 0:
        pl, grad_pl = _shared_placements(search._shared, mesh, search.world.per_node)
        per_replica = gb // dp
        micro = search.space.micro_batches(per_replica, pp)
        zeros = search.space.zero_options(mesh, search.world.per_node)
        splits = [expert_split(mesh, e, search.world.per_node) if e > 1 else None
                  for e in search.space.ep_sizes(mesh)]
        expert_zeros = search.space.expert_zero_options(mesh, zeros) \
            if any(s is not None for s in splits) else None
        # each group's `_prepared` key as a number: equal keys of other meshes, one number
        numbers = search._shared.setdefault("group numbers", {})
        groups = [(cp_mode, split, b, zeros if split is None else expert_zeros,
                   numbers.setdefault((mesh[TP], pl[TP], pl[CP], cp_mode, b, split.dispatch
                                       if split is not None else None), len(numbers)))
                  for cp_mode, split, b in itertools.product(
                      search.space.cp_modes(mesh, heads), splits, micro)]
        walk = (pl, grad_pl, search._dp_cache(grad_pl), per_replica,
                [group for group in groups if group[3]])
    search._shared[key] = walk
    return walk


def _shared_placements(shared: dict, mesh, per_node: int):
    """(placements, gradient placement) of `mesh`, one object per mesh for every search
    sharing these caches: their keys hold them, and the same object is found by identity
    where an equal one compares field by field."""
    key = ("placements", _mesh_key(mesh))
    hit = shared.get(key)
    if hit is None:
        hit = shared[key] = (placements(mesh, ORDER, per_node), grad_placement(mesh, per_node))
    return hit


def _leaf_key(leaf) -> tuple:
    """The mesh (with its ep size) a leaf's candidates compete in."""
    return _mesh_key(leaf.mesh) + (leaf.split.ep if leaf.split is not None else 1,)


def _mesh_key(mesh) -> tuple:
    return (mesh[PP], mesh[DP], mesh[CP], mesh[TP])


def _held(leaf, zero: int, precision, chosen=None) -> tuple[float, float] | None:
    """ZeRO-3's weights held across layers (a tied embedding) with their gradients, at the
    leaf's fastest states or at `chosen` (`cost.step.zero3_held`)."""
    if zero != 3:
        return None
    prep, pp = leaf.prep, leaf.mesh[PP]
    if chosen is None:
        return zero3_held(prep.params, prep.held, precision, pp)
    return zero3_held(prep.take(prep.param_table, chosen), prep.take(prep.held_table, chosen),
                      precision, pp)
