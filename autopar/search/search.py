"""The strategy search: mesh x per-layer strategy x pipeline x ZeRO x recompute.

Per leaf of the space (`search.space`: mesh, cp mode, micro-batch, schedule) a dynamic
program picks each layer's state, a second balances the stages, `cost.step` prices the
step; branch and bound skips leaves slower than the k-th best. Leaves go in a fixed order
and ties to the first, so every rank computes the same plan.
"""

from __future__ import annotations

import contextlib
import dataclasses
import gc
import heapq
import itertools
import time
from dataclasses import dataclass, field

import numpy as np

from autopar.cost import fp8
from autopar.cost.comm import placements
from autopar.cost.hardware import Hardware
from autopar.cost.hybrid import hybrid_split, replicas_wire_bytes, zero_ranks
from autopar.cost.layer import LayerChain
from autopar.cost.model import Context, state_cost
from autopar.cost.precision import Precision, precision_of
from autopar.cost.schedule import stage_owner
from autopar.cost.step import (
    USABLE_MEMORY,
    ExpertSplit,
    buffer_bytes,
    conversion_s,
    crossing_transfer,
    dp_wire_bytes,
    expert_split,
    grad_placement,
    host_bytes,
    host_capacity,
    in_flight_of,
    memory_by_kind,
    optimizer_step_dev,
    pipeline_time,
    stage_transfer,
    state_factors,
    step_parts,
    step_temps_dev,
    sync_time,
)
from autopar.errors import PlanError
from autopar.modes import (
    CP,
    DP,
    INTERLEAVED,
    NO_PIPELINE,
    NO_SP,
    ORDER,
    PP,
    RECOMPUTE,
    TP,
    ZERO_BUBBLE,
)
from autopar.search import why
from autopar.search.partition import balance, balance_within, choose_states
from autopar.search.space import Constraints, Options, Space, divisors

__all__ = ["Candidate", "Constraints", "Options", "Search", "SearchResult", "divisors"]


@dataclass(kw_only=True)
class Candidate:
    """One priced plan: its choices, its step seconds by part and its worst device's memory."""

    mesh: dict
    micro_batch: int
    microbatches: int
    schedule: str
    chunks: int
    zero: int
    offload: bool
    cp_mode: str | None
    states: list  # LayerState per layer of the chain
    stages: list  # stage (device) per layer
    step_time: float
    compute_s: float = 0.0
    comm_s: float = 0.0
    bubble_s: float = 0.0
    dp_comm_s: float = 0.0
    optimizer_s: float = 0.0
    memory: dict = field(default_factory=dict)  # worst device: bytes by kind
    memory_per_device: float = 0.0
    step_workspace: float = 0.0  # worst device: the optimizer step's temporaries (bytes)
    comm_bytes_per_device: float = 0.0
    fits: bool = True
    host_per_device: float = 0.0  # bytes offloaded to the host per device (ZeRO-Offload)
    ep: int = 1  # experts split over ep ranks inside the dp x cp ranks
    ep_comm_s: float = 0.0  # of comm_s: the all-to-alls on the ep axis
    dp_shard: int | None = None  # HSDP: ZeRO over this many dp ranks (None: all of dp)

    def describe(self) -> str:
        m = self.mesh
        modes = sorted({str(s.mode) for s in self.states if s.mode.size > 1}) or ["-"]
        rc = sorted({s.recompute for s in self.states})
        sp = sorted({s.sp for s in self.states} - {NO_SP})
        parts = [f"pp{m[PP]} dp{m[DP]} cp{m[CP]} tp{m[TP]}"
                 + (f" ep{self.ep}" if self.ep > 1 else ""), f"tp {'/'.join(modes)}"]
        if sp:
            parts.append("sp " + "/".join(sp))
        if self.cp_mode:
            parts.append(f"cp {self.cp_mode}")
        if m[PP] > 1:
            parts.append(f"{self.schedule}" + (f"x{self.chunks}" if self.schedule == INTERLEAVED
                                               else ""))
        parts.append(f"mb {self.micro_batch}x{self.microbatches}")
        parts.append(f"zero {self.zero}" + ("+offload" if self.offload else "")
                     + (f" shard {self.dp_shard}" if self.dp_shard else ""))
        parts.append("recompute " + "/".join(rc))
        return ", ".join(parts)


@dataclass
class SearchResult:
    best: Candidate | None
    alternatives: list  # (Candidate, reason) best first
    candidates: int
    time_s: float
    left_out: list[str] = field(default_factory=list)
    attention_kernel: str = "flash"
    precision: Precision | None = None  # the state bytes per parameter it priced
    compile: bool = False  # priced as parallelize(compile=True) runs it


class Search:
    """One search over one model and world; reusable for several questions."""

    def __init__(self, chain: LayerChain, world, options: Options, constraints=None,
                 state_costs: dict | None = None):
        """`state_costs`: layer state costs to share with other searches of this chain and
        world in the same dtype and attention kernel (their capabilities may differ)."""
        self.chain = chain
        self.world = world
        self.hw: Hardware = world.profile
        self.opt = options
        self.c = Constraints.of(constraints)
        self.space = Space(chain, options, self.c)
        self.layers = chain.layers()
        self.blocks = [i for i, lt in enumerate(self.layers) if lt.is_block]
        self._cost_cache: dict = {}
        self._contexts: dict = {}  # (tp placement, cp placement, cp mode) -> Context
        self._state_costs = state_costs
        self.left_out: list[str] = []
        self.capacity = self.hw.memory_bytes * USABLE_MEMORY
        self.host_capacity = host_capacity(self.hw, world.per_node, world.devices)
        self.precision, self.kept_high = fp8.planned(options.dtype, self.hw, precision_of(
            chain.param_dtype, executable=options.executable is not None), self.layers)
        self.candidates = 0
        self._leaf_numbers = itertools.count()

    # ------------------------------------------------------------------ the search
    def run(self, progress=None) -> SearchResult:
        """Price every leaf's lower bound, then evaluate leaves best bound first until the
        bound passes the k-th best plan found (branch and bound: exact for the top k)."""
        with _collector_paused():
            return self._run(progress)

    def _run(self, progress) -> SearchResult:
        start = time.perf_counter()
        meshes, leaves = self._all_leaves(progress)
        leaves.sort(key=lambda leaf: (leaf.bound, leaf.order))
        top: list = []  # max-heap by time of the k best fitting candidates
        per_mesh: dict = {}
        bounds: dict = {}
        for j, leaf in enumerate(leaves):
            if progress and j % 64 == 0:
                progress(len(meshes) + j * len(meshes) // len(leaves), 2 * len(meshes))
            key = _mesh_key(leaf.mesh) + (leaf.split.ep if leaf.split is not None else 1,)
            if len(top) >= self.opt.top and leaf.bound >= -top[0][0]:
                bounds.setdefault(key, leaf)
                continue
            for cand in self._evaluate(leaf):
                self.candidates += 1
                prev = per_mesh.get(key)
                if prev is None or _better(cand, prev):
                    per_mesh[key] = cand
                if cand.fits:
                    item = (-cand.step_time, -self.candidates, cand)
                    if len(top) < self.opt.top:
                        heapq.heappush(top, item)
                    elif cand.step_time < -top[0][0]:
                        heapq.heapreplace(top, item)
        ranked = sorted(per_mesh.values(), key=lambda c: (not c.fits, c.step_time if c.fits
                                                          else c.memory_per_device))
        winner = ranked[0] if ranked and ranked[0].fits else None
        alternatives = [(c, self._reason(c, winner)) for c in ranked[(1 if winner else 0):]]
        for key, leaf in bounds.items():
            if len(alternatives) >= self.opt.top:
                break  # the rest would be cut below
            if key not in per_mesh and winner is not None:
                alternatives.append((self._bound_candidate(leaf),
                                     f"at least {100 * (leaf.bound / winner.step_time - 1):.1f}% "
                                     "slower (lower bound: never fully priced)"))
        alternatives = alternatives[: self.opt.top]
        return SearchResult(winner, alternatives, self.candidates, time.perf_counter() - start,
                            self.left_out, self.opt.attention_kernel, self.precision,
                            self.opt.compile)

    def every(self, progress=None) -> list[Candidate]:
        """Every candidate of the space, in leaf order, none skipped by a bound (for
        benchmarks and for checking `run`)."""
        with _collector_paused():
            _, leaves = self._all_leaves(progress)
            out = []
            for leaf in leaves:
                for cand in self._evaluate(leaf):
                    self.candidates += 1
                    out.append(cand)
        return out

    def _all_leaves(self, progress=None) -> tuple[list[dict], list]:
        """The meshes this search allows and every leaf under them (mesh x cp mode x
        micro-batch x schedule), each with its lower bound, in a fixed order."""
        world = self.world.devices
        heads = min((a.heads for lt in self.chain.types for a in lt.attention), default=1)
        meshes = self.space.meshes(world)
        if self.opt.executable is not None:
            self.left_out.extend(why.not_executable(self.opt.executable))
        if not meshes:
            raise PlanError(why.no_mesh(self.c, self.chain, world, len(self.blocks)))
        if self.c.ep not in (None, 1):
            self._check_ep(meshes)
        leaves = []
        for i, mesh in enumerate(meshes):
            if progress:
                progress(i, 2 * len(meshes))
            leaves.extend(self._leaves(mesh, heads))
        if not leaves:
            raise PlanError(why.too_many_devices(self.space, meshes, world, self.opt.global_batch)
                            or why.no_leaf(self.space, meshes, self.opt.global_batch))
        return meshes, leaves

    def _check_ep(self, meshes) -> None:
        """One sentence for a fixed ep no mesh can take."""
        ep, counts = self.c.ep, self.space.expert_counts()
        if not counts:
            raise PlanError(f"ep={ep} splits experts, but the model has no mixture-of-experts "
                            "layer; drop ep.")
        if any(n % ep for n in counts):
            raise PlanError(f"{min(counts)} experts do not split over ep={ep} ranks; choose an "
                            "expert-parallel size that divides the number of experts.")
        if self.opt.executable is not None and not any(self.space.ep_sizes(m) for m in meshes):
            raise PlanError(f"ep={ep}: the runtime runs an expert axis inside the data-parallel "
                            "ranks alone (no cp axis beside it), and no mesh of this world with "
                            f"these constraints has dp divisible by {ep}; fix dp to a multiple "
                            f"of {ep} and cp to 1.")
        if not any(self.space.ep_sizes(m) for m in meshes):
            raise PlanError(f"ep={ep} must divide the data-parallel ranks dp x cp, and no mesh "
                            "of this world with these constraints has dp x cp divisible by "
                            f"{ep}; fix dp (or cp) to a multiple of {ep}.")

    def _reason(self, cand: Candidate, winner: Candidate | None) -> str:
        return why.lost(cand, winner, self.capacity, self.host_capacity)

    # ------------------------------------------------------------------ leaves
    def _prepared(self, mesh, pl, cp_mode, b, split=None):
        """Costs of every layer state for this tp/cp(/ep) placement and micro-batch (shared by
        all pp x dp); None where some layer has no state."""
        ep_pl = split.dispatch if split is not None else None
        key = (mesh[TP], pl[TP], pl[CP], cp_mode, b, ep_pl)
        if key in self._cost_cache:
            return self._cost_cache[key]
        ctx_key = (pl[TP], pl[CP], cp_mode, ep_pl)
        ctx = self._contexts.get(ctx_key)
        if ctx is None:
            ctx = self._contexts[ctx_key] = Context(self.hw, self.opt.dtype, pl[TP], pl[CP],
                                                    cp_mode, self.opt.attention_kernel,
                                                    ep=ep_pl, kept_high=self.kept_high,
                                                    compile=self.opt.compile)
        per_type = []
        beside_cp = mesh[CP] > 1
        for lt in self.chain.types:
            states = [s for s in self.space.states(lt, mesh[TP]) if b % s.mode.batch_split == 0
                      and (not beside_cp or self.space.beside_cp(s))]
            if not states:
                self._cost_cache[key] = None
                return None
            per_type.append((lt, states))
        prep = self._cost_cache[key] = _Prepared(self, per_type, pl, b, (ctx, ctx_key))
        return prep

    def _state_costs_of(self, lt, states, b: int, ctx, ctx_key) -> list:
        """`state_cost` of each state, from the shared costs where given."""
        shared = self._state_costs
        if shared is None:
            return [state_cost(lt, s, b, ctx) for s in states]
        out = []
        for s in states:
            key = (id(lt), s, b, ctx_key)
            hit = shared.get(key)
            if hit is None:
                hit = shared[key] = state_cost(lt, s, b, ctx)
            out.append(hit)
        return out

    def _leaves(self, mesh, heads):
        pl = placements(mesh, ORDER, self.world.per_node)
        gb, dp, pp = self.opt.global_batch, mesh[DP], mesh[PP]
        if gb % dp:
            return []
        per_replica = gb // dp
        micro = self.space.micro_batches(per_replica, pp)
        zeros = self.space.zero_options(mesh, self.world.per_node)
        grad_pl = grad_placement(mesh, self.world.per_node)
        dp_cache = self._dp_cache(grad_pl)
        out = []
        splits = [expert_split(mesh, e, self.world.per_node) if e > 1 else None
                  for e in self.space.ep_sizes(mesh)]
        for cp_mode, split, b in itertools.product(self.space.cp_modes(mesh, heads), splits,
                                                   micro):
            prep = self._prepared(mesh, pl, cp_mode, b, split)
            leaf_zeros = zeros if split is None else self.space.expert_zero_options(mesh, zeros)
            if prep is None or not leaf_zeros:
                continue
            m = per_replica // b
            # lower bound without building the chain: every layer at its fastest state,
            # stages perfectly balanced, parameters evenly spread (experts' sync left out:
            # it runs over a smaller group)
            avg = prep.min_total / pp
            slowest = max(avg, prep.min_single)
            dp_lb = min(self._dp_time((prep.min_params - prep.min_experts) / pp, z, m,
                                      grad_pl, cache=None if shard else dp_cache,
                                      hybrid=hybrid_split(mesh, shard, self.world.per_node))
                        for z, _, shard in leaf_zeros)
            for schedule, v in self.space.schedules(pp, m):
                if pp * v > len(self.chain.order):
                    continue
                if pp == 1:
                    pipe = m * slowest
                elif schedule == INTERLEAVED:
                    pipe = m * slowest + (pp - 1) * avg / v
                elif schedule == ZERO_BUBBLE:
                    pipe = m * slowest + (pp - 1) * slowest / (6 if m >= 2 * pp else 3)
                else:
                    pipe = (m - 1) * slowest + pp * avg
                if pp > 1 and self.hw.compute_share < 1:  # cores shared (time_shared):
                    # no less than the pipeline's work spread over its cores, nor the
                    # schedule at a whole core per rank
                    pipe = max(m * avg, self.hw.compute_share * pipe)
                out.append(_Leaf(bound=pipe + dp_lb, order=next(self._leaf_numbers),
                                 mesh=dict(mesh), pl=pl, grad_pl=grad_pl, cp_mode=cp_mode,
                                 b=b, m=m, schedule=schedule, v=v, prep=prep, zeros=leaf_zeros,
                                 dp_cache=dp_cache, split=split))
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
        return self._cost_cache.setdefault((DP, grad_pl), {})

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
        hit = self._cost_cache.get(key)
        if hit is None:
            hit = self._cost_cache[key] = in_flight_of(schedule, pp, v, m)
        return hit

    def _evaluate(self, leaf):
        leaf.prep.build()
        if leaf.stage_of is None:
            leaf.stage_of = leaf.prep.stages(leaf.mesh[PP] * leaf.v)
            leaf.device_of = [stage_owner(leaf.schedule, s, leaf.mesh[PP])
                              for s in leaf.stage_of]
        for zero, offload, shard in leaf.zeros:
            cand, moved = self._priced(leaf, zero, offload, shard)
            yield cand
            if leaf.mesh[PP] > 1 and leaf.v == 1 and (not cand.fits or (
                    moved and cand.states != leaf.prep.states_of(leaf.prep.fast))):
                # the time-balanced split needs recomputation or does not fit: also try the
                # fastest split whose stages hold their in-flight activations as they are
                alt = self._memory_split(leaf, zero, offload, shard)
                if alt is not None and alt != leaf.stage_of:
                    yield self._price(dataclasses.replace(leaf, stage_of=alt, device_of=alt,
                                                          transfer=None, fast=None),
                                      zero, offload, shard)

    def _memory_split(self, leaf, zero, offload, shard=None) -> list[int] | None:
        """Stages balanced by time under each stage's memory limit, fastest states kept."""
        prep, pp = leaf.prep, leaf.mesh[PP]
        replicas = zero_ranks(leaf.mesh, shard)
        per_param = sum(state_factors(self.precision, replicas, zero, offload))
        in_flight = self._in_flight(leaf.schedule, pp, 1, leaf.m)
        weights = prep.params[None, :] * per_param + in_flight[:, None] * prep.acts[None, :]
        buffers = buffer_bytes(prep.biggest, replicas, zero)
        capacity = np.full(pp, self.capacity - buffers)
        return balance_within(prep.layer_time, weights, capacity, pp)

    def _memory(self, leaf, params_dev, acts_dev, biggest, zero, offload, in_flight,
                experts_dev=None, temps_dev=None, shard=None):
        replicas = zero_ranks(leaf.mesh, shard)
        step = optimizer_step_dev(params_dev, temps_dev, replicas, zero, offload,
                                  self.precision, self.hw.optimizer_implementation,
                                  experts_dev, leaf.split)
        parts = memory_by_kind(params_dev, acts_dev, biggest, replicas, zero, offload,
                               in_flight, self.precision, leaf.prep.workspace, experts_dev,
                               leaf.split, step)
        return sum(parts.values()), parts, step

    def _price(self, leaf, zero, offload, shard=None) -> Candidate:
        return self._priced(leaf, zero, offload, shard)[0]

    def _priced(self, leaf, zero, offload, shard=None) -> tuple[Candidate, bool]:
        """The leaf's candidate under one ZeRO option, and whether fitting memory moved a
        layer off its fastest state."""
        prep, mesh = leaf.prep, leaf.mesh
        pp = mesh[PP]
        in_flight = self._in_flight(leaf.schedule, pp, leaf.v, leaf.m)
        chosen = list(prep.fast)
        if leaf.fast is None:
            device_of = np.asarray(leaf.device_of)
            leaf.fast = _Fast(device_of,
                              np.bincount(device_of, weights=prep.params, minlength=pp),
                              np.bincount(device_of, weights=prep.acts, minlength=pp),
                              step_temps_dev(*prep.temps, device_of, pp))
        device_of, params_dev, acts_dev = leaf.fast.device_of, leaf.fast.params_dev, \
            leaf.fast.acts_dev
        experts_dev = self._experts_dev(leaf, chosen, device_of)
        total, parts, step_dev = self._memory(leaf, params_dev, acts_dev, prep.biggest, zero,
                                              offload, in_flight, experts_dev,
                                              leaf.fast.temps_dev, shard)
        params, moved = prep.params, False
        if total.max() > self.capacity:
            # activations fit what the state, the buffers and the step's excess leave
            fixed = total - parts["activations"] - parts["optimizer_step"]
            for d in range(pp):
                if total[d] > self.capacity:
                    budget = (self.capacity - fixed[d]) / in_flight[d]
                    prep.fit(chosen, leaf.fast.layers_of(d), budget)
            acts = prep.take(prep.act_table, chosen)
            acts_dev = np.bincount(device_of, weights=acts, minlength=pp)
            # a layer that changed layout holds its parameters differently too
            params = prep.take(prep.param_table, chosen)
            params_dev = np.bincount(device_of, weights=params, minlength=pp)
            biggest = float(params.max()) if len(params) else 0.0
            experts_dev = self._experts_dev(leaf, chosen, device_of)
            temps_dev = step_temps_dev(*(prep.take(t, chosen) for t in prep.temp_tables),
                                       device_of, pp)
            total, parts, step_dev = self._memory(leaf, params_dev, acts_dev, biggest, zero,
                                                  offload, in_flight, experts_dev, temps_dev,
                                                  shard)
            moved = chosen != prep.fast
        fast = chosen == prep.fast  # what follows from the states alone is the leaf's
        chosen = np.asarray(chosen)
        heaviest = int(np.argmax(params_dev))
        units = int(np.count_nonzero((device_of == heaviest) & (params > 0)))  # holding any
        pipeline = leaf.fast.pipeline if fast else None
        hybrid = hybrid_split(mesh, shard, self.world.per_node)
        step = step_parts(prep.layer_time if fast else prep.path_time(chosen), device_of,
                          leaf.stage_of, params_dev, units, transfer=self._transfer(leaf),
                          grad_pl=leaf.grad_pl, hw=self.hw, schedule=leaf.schedule, v=leaf.v,
                          m=leaf.m, zero=zero, offload=offload, precision=self.precision,
                          cache=self._dp_cache(leaf.grad_pl if hybrid is None else
                                               hybrid.shard), pipeline=pipeline,
                          experts_dev=experts_dev, split=leaf.split, hybrid=hybrid)
        if fast:
            leaf.fast.pipeline = (step["pipeline_s"], step["bubble_s"], step["per_rank_s"])
        worst = float(params_dev.max())
        replicas = zero_ranks(mesh, shard)
        host = host_bytes(worst, replicas, zero, offload, self.precision)
        gather = self.precision.gather_ratio
        wire = dp_wire_bytes(worst, replicas, zero, gather) + \
            (replicas_wire_bytes(worst, hybrid) if hybrid is not None else 0.0)
        if leaf.split is not None:  # the heaviest rank's experts sync in their own group
            experts = float(experts_dev[int(np.argmax(params_dev))])
            host += host_bytes(experts, leaf.split.replicas, zero, offload, self.precision) - \
                host_bytes(experts, replicas, zero, offload, self.precision)
            wire += dp_wire_bytes(experts, leaf.split.replicas, zero, gather) - \
                dp_wire_bytes(experts, replicas, zero, gather)
        slow = int(np.argmax(step["per_rank_s"]))
        on_slow = np.flatnonzero(device_of == slow)
        on_chosen = chosen[on_slow]

        def slow_sum(table) -> float:  # in layer order, as a running sum
            return sum(table[on_slow, on_chosen].tolist())

        worst_dev = int(np.argmax(total))
        return Candidate(
            mesh=dict(mesh), micro_batch=leaf.b, microbatches=leaf.m,
            schedule=leaf.schedule if pp > 1 else NO_PIPELINE, chunks=leaf.v, zero=zero,
            offload=offload, cp_mode=leaf.cp_mode, states=prep.states_of(chosen.tolist()),
            stages=leaf.stage_of, step_time=step["step_s"],
            compute_s=leaf.m * slow_sum(prep.compute_table),
            comm_s=leaf.m * slow_sum(prep.comm_table),
            bubble_s=step["bubble_s"], dp_comm_s=step["dp_s"], optimizer_s=step["optimizer_s"],
            memory={k: float(v[worst_dev]) for k, v in parts.items()},
            memory_per_device=float(total.max()), step_workspace=float(step_dev[worst_dev]),
            comm_bytes_per_device=leaf.m * slow_sum(prep.comm_bytes_table) + wire,
            fits=bool(total.max() <= self.capacity and host <= self.host_capacity),
            host_per_device=host, ep=leaf.split.ep if leaf.split is not None else 1,
            ep_comm_s=leaf.m * slow_sum(prep.ep_comm_table), dp_shard=shard), moved

    def _experts_dev(self, leaf, chosen, device_of):
        """Bytes of expert weights each pipeline rank holds (None without expert parallelism)."""
        if leaf.split is None:
            return None
        experts = leaf.prep.take(leaf.prep.expert_table, chosen)
        return np.bincount(device_of, weights=experts, minlength=leaf.mesh[PP])

    def _bound_candidate(self, leaf) -> Candidate:
        prep = leaf.prep.build()
        return Candidate(mesh=dict(leaf.mesh), micro_batch=leaf.b, microbatches=leaf.m,
                         schedule=leaf.schedule, chunks=leaf.v, zero=0, offload=False,
                         cp_mode=leaf.cp_mode, states=prep.states_of(prep.fast), stages=[],
                         step_time=leaf.bound, ep=leaf.split.ep if leaf.split else 1)


@dataclass(kw_only=True)
class _Leaf:
    bound: float
    order: int
    mesh: dict
    pl: dict
    grad_pl: object
    cp_mode: str | None
    b: int
    m: int
    schedule: str
    v: int
    prep: _Prepared
    zeros: list
    dp_cache: dict  # collective seconds by parameter bytes over grad_pl
    split: ExpertSplit | None = None  # expert parallelism (None: experts on every rank)
    stage_of: list | None = None
    device_of: list | None = None
    transfer: float | None = None  # seconds of one stage-boundary crossing
    fast: _Fast | None = None  # its numbers with every layer in its fastest state


@dataclass
class _Fast:
    """What a leaf's ZeRO options share while every layer keeps its fastest state."""

    device_of: np.ndarray
    params_dev: np.ndarray  # parameter bytes per pipeline rank
    acts_dev: np.ndarray  # activation bytes per micro-batch per pipeline rank
    temps_dev: np.ndarray  # the for-loop optimizer step's temporaries per pipeline rank
    pipeline: tuple | None = None  # `pipeline_time` of the fastest path
    _layers: dict = field(default_factory=dict)

    def layers_of(self, rank: int) -> list[int]:
        """The layers pipeline rank ``rank`` holds, in order."""
        hit = self._layers.get(rank)
        if hit is None:
            hit = self._layers[rank] = np.flatnonzero(self.device_of == rank).tolist()
        return hit


class _Prepared:
    """One tp/cp placement and micro-batch: per-layer state costs along the chain."""

    def __init__(self, search: Search, kinds, pl, b, context):
        """``kinds``: (layer kind, its states) in chain-type order; ``context``: the cost
        Context and its key. The lower bound prices only each layout's state with the least
        recomputation, its fastest (recomputing adds compute and reruns collectives, never
        takes any away) and with the same parameters and workspace; `build` the rest."""
        order = search.chain.order
        self.search = search
        self.kinds, self.context = kinds, context
        self.per_type = [(states, [None] * len(states)) for _, states in kinds]
        self.order = order
        self.pl, self.b = pl, b
        least = [self._price(_least_recompute(states), t) for t, (_, states) in
                 enumerate(kinds)]
        counts = np.bincount(order, minlength=len(kinds))
        fastest = [min(c.time for c in costs) for costs in least]
        self.min_total = float(np.dot(counts, fastest))
        self.min_single = max(fastest[t] for t in set(order))
        self.min_params = float(np.dot(counts, [min(c.params for c in costs)
                                                for costs in least]))
        self.min_experts = float(np.dot(counts, [min(c.expert_params for c in costs)
                                                 for costs in least]))
        self.workspace = max((c.workspace for costs in least for c in costs), default=0.0)
        self.built = False
        self._stages: dict = {}
        self._layouts: dict = {}
        self.state_rows = [states for _, states in kinds]
        self.state_rows = [self.state_rows[t] for t in order]  # per layer: its kind's states

    def _price(self, which, t: int) -> list:
        """The costs of kind ``t``'s states at the indices ``which``, each priced once."""
        lt, states = self.kinds[t]
        costs = self.per_type[t][1]
        todo = [k for k in which if costs[k] is None]
        ctx, ctx_key = self.context
        for k, c in zip(todo, self.search._state_costs_of(lt, [states[k] for k in todo],
                                                          self.b, ctx, ctx_key)):
            costs[k] = c
        return [costs[k] for k in which]

    def build(self) -> _Prepared:
        """The chain arrays, the fastest path and its numbers: only for leaves that are
        priced (the lower bounds need none of it)."""
        if self.built:
            return self
        self.built = True
        for t, (_, states) in enumerate(self.kinds):
            self._price(range(len(states)), t)
        search, per_type, order, pl, b = self.search, self.per_type, self.order, self.pl, self.b
        self.t_layers = [np.array([c.time for c in per_type[t][1]]) for t in order]
        self.mem_layers = [np.array([c.activations for c in per_type[t][1]]) for t in order]
        self.conv = [None]
        for i in range(1, len(order)):
            self.conv.append(self._conversion(search, order[i - 1], order[i], pl, b))
        self._tables(search)
        self.fast, _ = choose_states([len(t) for t in self.t_layers], self.t_layers,
                                     self.mem_layers, self.conv, 0.0)
        self.layer_time = self.path_time(self.fast)
        self.params = self.take(self.param_table, self.fast)
        self.acts = self.take(self.act_table, self.fast)
        self.temps = tuple(self.take(t, self.fast) for t in self.temp_tables)
        self.biggest = float(self.params.max()) if len(self.params) else 0.0
        return self

    def _tables(self, search) -> None:
        """(layer, state) tables of the costs the pricing reads, padded to the most states,
        and per layer its layout ids and the seconds of a conversion before it."""
        per_type, order = self.per_type, self.order
        n, width = len(order), max(len(states) for states, _ in per_type)
        self.rows = np.arange(n)
        layout_ids: dict = {}
        kinds = []
        for states, costs in per_type:
            table = np.zeros((11, width))
            for k, c in enumerate(costs):
                table[:, k] = (c.time, c.activations, c.params, c.forward + c.backward +
                               c.recompute, c.comm, c.comm_bytes, c.expert_params, c.ep_comm,
                               c.step_temps.peak, c.step_temps.first, c.step_temps.last)
            layouts = np.full(width, -1)
            layouts[:len(states)] = [layout_ids.setdefault(st.layout, len(layout_ids))
                                     for st in states]
            kinds.append((table, layouts))
        tables = np.stack([kinds[t][0] for t in order])  # (layer, quantity, state)
        self.time_table, self.act_table, self.param_table, self.compute_table, \
            self.comm_table, self.comm_bytes_table, self.expert_table, self.ep_comm_table = (
                tables[:, q, :] for q in range(8))
        self.temp_tables = tuple(tables[:, q, :] for q in range(8, 11))  # StepTemps' fields
        self.layout_table = np.stack([kinds[t][1] for t in order])
        self.gather = np.array([0.0] + [float(c.max()) if c.size else 0.0
                                        for c in self.conv[1:]])
        self.mem_lists = [m.tolist() for m in self.mem_layers]
        layers = search.layers
        self.boundaries = np.array([layers[i].boundary(self.b) for i in range(n - 1)])
        self.time_lists = [t.tolist() for t in self.t_layers]

    def take(self, table, chosen) -> np.ndarray:
        """One value per layer: `table` at each layer's chosen state."""
        return table[self.rows, chosen]

    def _conversion(self, search, a, b_type, pl, b):
        key = ("conv", a, b_type, b, pl[TP], pl[CP])
        mat = search._cost_cache.get(key)
        if mat is None:
            prev_states, cur_states = self.per_type[a][0], self.per_type[b_type][0]
            gather = conversion_s(search.chain.types[a].boundary(b), pl, search.hw)
            mat = np.array([[0.0 if sa.layout == sb.layout else gather for sb in cur_states]
                            for sa in prev_states])
            search._cost_cache[key] = mat
        return mat

    def _by_layout(self, t: int, times, mems) -> list:
        """(layout, `_count_order` of its states) of one kind of layer, in the order `fit`
        tries them; `times`, `mems`: that kind's, per state."""
        hit = self._layouts.get(t)
        if hit is None:
            states = self.per_type[t][0]
            hit = self._layouts[t] = [
                (lay, _count_order([k for k, s in enumerate(states) if s.layout == lay],
                                   times, mems)) for lay in {s.layout for s in states}]
        return hit

    def states_of(self, chosen):
        """The LayerState of each layer at its chosen state index."""
        return [states[c] for states, c in zip(self.state_rows, chosen)]

    def path_time(self, chosen) -> np.ndarray:
        """Each layer's seconds in its chosen state, plus a conversion where its layout is not
        its predecessor's."""
        chosen = np.asarray(chosen)
        out = self.time_table[self.rows, chosen]
        layouts = self.layout_table[self.rows, chosen]
        out[1:] += np.where(layouts[1:] != layouts[:-1], self.gather[1:], 0.0)
        return out

    def stages(self, k: int) -> list[int]:
        hit = self._stages.get(k)
        if hit is None:
            hit = self._stages[k] = balance(self.layer_time, k)
        return hit

    def fit(self, chosen, idx, budget) -> None:
        """Fit one device's layers in ``budget`` activation bytes at the least extra time:
        layers of one kind keep one layout and choose their recompute (`_counts`)."""
        mems = self.mem_lists
        spare = budget - sum(mems[i][chosen[i]] for i in idx)
        if spare >= 0:
            return
        groups: dict = {}
        for i in idx:
            groups.setdefault(self.order[i], []).append(i)
        # shrink the biggest groups first: each gets the share of the deficit it can cover
        for t, members in sorted(groups.items(), key=lambda g: -len(g[1])):
            if spare >= 0:
                break
            states = self.per_type[t][0]
            if len(states) <= 1:
                continue
            layout = states[chosen[members[0]]].layout
            used = sum(mems[i][chosen[i]] for i in members)
            best = None
            times = self.time_lists[members[0]]
            for lay, order in self._by_layout(t, times, mems[members[0]]):
                counts = _count_with(order, times, mems[members[0]], len(members), used + spare)
                if counts is None:
                    continue
                # leaving the neighbours' layout costs a conversion in and one out
                penalty = 0.0 if lay == layout else 2 * float(self.gather[members[0]])
                time_, mem, assignment = counts
                if best is None or time_ + penalty < best[0]:
                    best = (time_ + penalty, mem, assignment)
            if best is None:  # nothing fits: take the least memory there is
                k = int(np.argmin(self.mem_layers[members[0]]))
                best = (0.0, len(members) * self.mem_layers[members[0]][k], [k] * len(members))
            for i, k in zip(members, best[2]):
                chosen[i] = k
            spare = used + spare - best[1]


def _least_recompute(states) -> list[int]:
    """Per layout, the index of its state with the least recomputation, in state order."""
    best: dict = {}
    for k, s in enumerate(states):
        rank = RECOMPUTE.index(s.recompute)
        if s.layout not in best or rank < best[s.layout][0]:
            best[s.layout] = (rank, k)
    return sorted(k for _, k in best.values())


def _counts(options, times, mems, n, budget):
    """Exact cheapest assignment of ``options`` (state indices) to ``n`` identical layers
    within ``budget`` bytes: enumerate the counts of all options but the two cheapest in
    time, which split the rest (as many as fit on the faster one)."""
    return _count_with(_count_order(options, times, mems), times, mems, n, budget)


def _count_order(options, times, mems):
    """(fastest, the least memory of the rest, the others) of ``options``; None if empty."""
    opts = sorted(options, key=lambda k: (times[k], mems[k]))
    if not opts:
        return None
    fast, rest = opts[0], opts[1:]
    if not rest:
        return fast, None, []
    second = min(rest, key=lambda k: mems[k])
    return fast, second, [k for k in rest if k != second]


def _count_with(order, times, mems, n, budget):
    """`_counts` from the `_count_order` of its options."""
    if order is None:
        return None
    fast, second, others = order
    if second is None:
        mem = n * mems[fast]
        return (n * times[fast], mem, [fast] * n) if mem <= budget else None
    if len(others) == 1:  # three recompute levels: one loop, as below
        return _counts_one(fast, second, others[0], times, mems, n, budget)
    best = None
    # each "other" option gets a count; with three recompute levels that is one loop
    for combo in _compositions(n, len(others)):
        used_n = sum(combo)
        mem_o = sum(c * mems[k] for c, k in zip(combo, others))
        time_o = sum(c * times[k] for c, k in zip(combo, others))
        left = n - used_n
        room = budget - mem_o - left * min(mems[fast], mems[second])
        if room < -1e-9:
            continue
        gap = mems[fast] - mems[second]
        n_fast = left if gap <= 0 else min(left, int((room + 1e-9) // gap))
        t = time_o + n_fast * times[fast] + (left - n_fast) * times[second]
        mem = mem_o + n_fast * mems[fast] + (left - n_fast) * mems[second]
        if best is None or t < best[0] - 1e-15:
            assignment = [fast] * n_fast + [second] * (left - n_fast)
            for c, k in zip(combo, others):
                assignment += [k] * c
            best = (t, mem, assignment)
    return best


def _counts_one(fast, second, other, times, mems, n, budget):
    """`_counts` with one option besides the two cheapest, its count enumerated in a plain
    loop (the same arithmetic in the same order)."""
    best = None
    t_fast, t_second, t_other = times[fast], times[second], times[other]
    m_fast, m_second, m_other = mems[fast], mems[second], mems[other]
    least = min(m_fast, m_second)
    gap = m_fast - m_second
    for c in range(n + 1):
        mem_o = 0 + c * m_other
        time_o = 0 + c * t_other
        left = n - c
        room = budget - mem_o - left * least
        if room < -1e-9:
            continue
        n_fast = left if gap <= 0 else min(left, int((room + 1e-9) // gap))
        t = time_o + n_fast * t_fast + (left - n_fast) * t_second
        if best is None or t < best[0] - 1e-15:
            best = (t, mem_o + n_fast * m_fast + (left - n_fast) * m_second, c, n_fast)
    if best is None:
        return None
    t, mem, c, n_fast = best
    return t, mem, [fast] * n_fast + [second] * (n - c - n_fast) + [other] * c


def _compositions(n, k):
    """Every tuple of k non-negative counts with sum <= n (k is 0, 1 or 2 here)."""
    if k == 0:
        yield ()
        return
    for first in range(n + 1):
        for tail in _compositions(n - first, k - 1):
            yield (first, *tail)


@contextlib.contextmanager
def _collector_paused():
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


def _mesh_key(mesh) -> tuple:
    return (mesh[PP], mesh[DP], mesh[CP], mesh[TP])


def _better(a: Candidate, b: Candidate) -> bool:
    if a.fits != b.fits:
        return a.fits
    if a.fits:
        return a.step_time < b.step_time
    return a.memory_per_device < b.memory_per_device
