"""The strategy search: mesh x per-layer strategy x pipeline x ZeRO x recompute.

For every factorisation of the world into pp x dp x cp x tp (tp innermost, so a node's
fast links carry it first), every micro-batch size and pipeline schedule, the search
chooses each layer's tensor mode, sequence parallelism and recompute by a dynamic
program over the layer chain, balances pipeline stages by a second one, picks the ZeRO
stage and offload, and prices the step in seconds. Candidates that cannot fit memory are
kept with the amount they miss by, so a report can say why they lost. Branch and bound
skips candidates whose memory-free lower bound is already slower than the k-th best.

Everything is deterministic: candidates are visited in a fixed order and ties go to the
first, so every rank computes the same plan.
"""

from __future__ import annotations

import dataclasses
import heapq
import itertools
import math
import time
from dataclasses import dataclass, field

import numpy as np

from autopar.cost.comm import collective_time, placements
from autopar.cost.hardware import GiB, Hardware
from autopar.cost.layer import LayerChain
from autopar.cost.precision import Precision, precision_of
from autopar.cost.schedule import SCHEDULES, check_microbatches, in_flight, stage_count, \
    stage_owner, step_time, time_shared
from autopar.cost.model import (
    RECOMPUTE,
    Context,
    LayerState,
    TensorMode,
    state_cost,
    tensor_modes,
)
from autopar.errors import PlanError
from autopar.search.partition import balance, balance_within, choose_states

ORDER = ("tp", "cp", "dp", "pp")  # innermost first
USABLE_MEMORY = 0.92  # the rest goes to the framework, kernels' workspaces, fragmentation


@dataclass
class Constraints:
    """Any subset of the plan, fixed. None = the search chooses."""

    tp: int | None = None
    pp: int | None = None
    dp: int | None = None
    cp: int | None = None
    tp_mode: str | None = None
    sp: str | None = None  # none | megatron | ulysses | ring
    zero: int | None = None
    offload: bool | None = None
    recompute: str | None = None
    microbatches: int | None = None
    micro_batch_size: int | None = None
    schedule: str | None = None
    chunks: int | None = None  # stages per rank of the interleaved schedule

    @classmethod
    def of(cls, value) -> Constraints:
        if value is None:
            return cls()
        if isinstance(value, Constraints):
            return value
        if not isinstance(value, dict):
            raise PlanError(f"constraints must be a dict, not {type(value).__name__}.")
        names = set(cls.__dataclass_fields__)
        unknown = set(value) - names
        if unknown:
            raise PlanError(f"unknown constraint(s) {sorted(unknown)}; valid ones are "
                            f"{sorted(names)}.")
        made = cls(**value)
        made.check()
        return made

    def check(self) -> None:
        """Refuse a constraint of the wrong type or out of range, naming it and what works."""
        for name in ("tp", "pp", "dp", "cp", "microbatches", "micro_batch_size", "chunks"):
            value = getattr(self, name)
            if value is not None and (isinstance(value, bool) or not isinstance(value, int)
                                      or value < 1):
                raise PlanError(f"constraint {name}={value!r} must be a whole number >= 1.")
        for name, options in (("tp_mode", ("1d", "2d", "2.5d", "3d")),
                              ("sp", ("none", "megatron", "ulysses", "ring")),
                              ("recompute", RECOMPUTE), ("schedule", SCHEDULES),
                              ("zero", (0, 1, 2, 3)), ("offload", (True, False))):
            value = getattr(self, name)
            if value is not None and (value not in options or isinstance(value, bool) !=
                                      (name == "offload")):
                raise PlanError(f"constraint {name}={value!r} must be one of "
                                f"{', '.join(map(str, options))}.")
        if self.sp == "megatron" and self.tp == 1:
            raise PlanError("constraint sp='megatron' splits the sequence over the tensor axis, "
                            "but tp is fixed to 1; fix tp to 2 or more, or drop sp.")
        if self.sp in ("ulysses", "ring") and self.cp == 1:
            raise PlanError(f"constraint sp='{self.sp}' runs over a cp axis, but cp is fixed "
                            "to 1; fix cp to 2 or more, or drop sp.")
        if self.tp_mode in ("2d", "2.5d", "3d") and self.tp not in (None, 1):
            from autopar.sharding.axes import grid_size_error

            depths = [d for d in range(1, self.tp + 1) if self.tp % d == 0]
            errors = [grid_size_error(self.tp_mode, self.tp, d) for d in
                      (depths if self.tp_mode == "2.5d" else [1])]
            if all(errors):
                raise PlanError(f"constraint tp={self.tp} cannot run tp_mode="
                                f"'{self.tp_mode}': {errors[0]}")


@dataclass
class Options:
    global_batch: int
    # the compute dtype (its GEMM rate; activation bytes come from the trace), named as
    # parallelize's precision=; state bytes per parameter: autopar.cost.precision
    dtype: str = "bf16"
    attention_kernel: str = "flash"
    executable: set | None = None  # restrict to what the runtime runs: {"tp_modes": .., ...}
    top: int = 5
    max_micro_batch: int = 16


@dataclass
class Candidate:
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
    compute_s: float
    comm_s: float
    bubble_s: float
    dp_comm_s: float
    optimizer_s: float
    memory: dict  # worst device: bytes by kind
    memory_per_device: float
    comm_bytes_per_device: float
    fits: bool
    host_per_device: float = 0.0  # bytes offloaded to the host per device (ZeRO-Offload)

    def describe(self) -> str:
        m = self.mesh
        modes = sorted({str(s.mode) for s in self.states if s.mode.size > 1}) or ["-"]
        rc = sorted({s.recompute for s in self.states})
        sp = sorted({s.sp for s in self.states} - {"none"})
        parts = [f"pp{m['pp']} dp{m['dp']} cp{m['cp']} tp{m['tp']}", f"tp {'/'.join(modes)}"]
        if sp:
            parts.append("sp " + "/".join(sp))
        if self.cp_mode:
            parts.append(f"cp {self.cp_mode}")
        if m["pp"] > 1:
            parts.append(f"{self.schedule}" + (f"x{self.chunks}" if self.schedule == "interleaved"
                                               else ""))
        parts.append(f"mb {self.micro_batch}x{self.microbatches}")
        parts.append(f"zero {self.zero}" + ("+offload" if self.offload else ""))
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


def divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def factorisations(world: int, c: Constraints, n_blocks: int, seq_ok) -> list[dict]:
    out = []
    for tp in divisors(world):
        if c.tp is not None and tp != c.tp:
            continue
        for pp in divisors(world // tp):
            if (c.pp is not None and pp != c.pp) or pp > max(1, n_blocks):
                continue
            for cp in divisors(world // (tp * pp)):
                if (c.cp is not None and cp != c.cp) or not seq_ok(cp):
                    continue
                dp = world // (tp * pp * cp)
                if c.dp is not None and dp != c.dp:
                    continue
                out.append({"pp": pp, "dp": dp, "cp": cp, "tp": tp})
    return out


class Search:
    """One search over one model and world; reusable for several questions."""

    def __init__(self, chain: LayerChain, world, options: Options, constraints=None):
        self.chain = chain
        self.world = world
        self.hw: Hardware = world.profile
        self.opt = options
        self.c = Constraints.of(constraints)
        self.layers = chain.layers()
        self.blocks = [i for i, lt in enumerate(self.layers) if lt.is_block]
        self._cost_cache: dict = {}
        self._contexts: dict = {}  # (tp placement, cp placement, cp mode) -> Context
        # the runtime runs cp beside 1D tensor parallelism only (without Megatron-SP)
        self._cp_tp_1d_only = (options.executable or {}).get("cp_with_tp") == "1d"
        self._balance_cache: dict = {}
        self.left_out: list[str] = []
        self.capacity = self.hw.memory_bytes * USABLE_MEMORY
        self.host_capacity = host_capacity(self.hw, world.per_node, world.devices)
        self.precision = precision_of(chain.param_dtype, executable=options.executable is not None)
        self.candidates = 0
        self._leaf_numbers = itertools.count()

    # ------------------------------------------------------------------ spaces
    def _tp_modes(self, tp: int, block: bool = True) -> list[TensorMode]:
        """Tensor modes a layer may take. A fixed --tp-mode applies to blocks (layers with
        weights of their own); embeddings, norms and the loss stay 1D, converting at the
        block boundary as they would in any 2D/2.5D/3D plan."""
        allowed = ("1d", "2d", "2.5d", "3d")
        depth = None
        if self.opt.executable is not None:
            allowed = tuple(m for m in allowed if m in self.opt.executable.get("tp_modes", ()))
            if "grid" in self.opt.executable:  # one grid per plan: (mode, 2.5D depth) or None
                grid = self.opt.executable["grid"]
                allowed = tuple(m for m in allowed if m == "1d" or (grid and m == grid[0]))
                depth = grid[1] if grid else None
        if self.c.tp_mode is not None:
            allowed = (self.c.tp_mode,) if block else ("1d",)
        if tp == 1:
            return [TensorMode("1d", 1)]
        modes = [m for m in tensor_modes(tp, allowed) if depth is None or m.d == depth
                 or m.name != "2.5d"]
        return [m for m in modes if all(tp in lt.sharded or m.name != "1d" for lt in
                                        self.chain.types)]

    def _refused_tensor_sizes_1d(self) -> dict[int, str]:
        """Tensor size -> why 1d blocks cannot take it (heads or widths that do not split:
        `autopar.sharding.divisible`), from the chain's refusals."""
        out = {}
        for r in self.chain.refused:
            size, _, why = r.partition(": ")
            if size.startswith("tp=") and size[3:].isdigit():
                out[int(size[3:])] = why.rstrip(".")
        return out

    def _sp_modes(self, mode: TensorMode) -> list[str]:
        if mode.name != "1d" or mode.size == 1:
            return ["none"]
        allowed = ["none", "megatron"]
        ex = self.opt.executable
        if ex is not None and ("megatron" not in ex.get("sp", ()) or (
                "sp_seq" in ex and not (ex["sp_seq"] and ex["sp_seq"] % mode.size == 0))):
            allowed = ["none"]  # the runtime splits the sequence into tp equal pieces
        if self.c.sp in ("none", "megatron"):
            allowed = [self.c.sp] if self.c.sp in allowed or self.opt.executable is None else []
        return allowed

    def _recompute(self) -> tuple:
        rc = RECOMPUTE
        if self.opt.executable is not None:
            rc = tuple(r for r in rc if r in self.opt.executable.get("recompute", ("none",)))
        if self.c.recompute is not None:
            rc = (self.c.recompute,)
        return rc

    def _states(self, lt, tp: int) -> list[LayerState]:
        key = ("states", id(lt), tp)
        if key not in self._cost_cache:
            self._cost_cache[key] = self._make_states(lt, tp)
        return self._cost_cache[key]

    def _make_states(self, lt, tp: int) -> list[LayerState]:
        out = []
        for mode in self._tp_modes(tp, lt.is_block):
            if mode.name == "1d" and tp > 1 and lt.sharded[tp].refused:
                continue  # heads or widths 1d does not split: the runtime refuses them
            for sp in self._sp_modes(mode):
                if lt.is_block:
                    out.extend(LayerState(mode, sp, r) for r in self._recompute())
                elif mode.name == "1d":
                    out.append(LayerState(mode, sp, "none"))
        return out

    # ------------------------------------------------------------------ pricing
    def run(self, progress=None) -> SearchResult:
        """Price every leaf's lower bound, then evaluate leaves best bound first until the
        bound passes the k-th best plan found (branch and bound: exact for the top k)."""
        start = time.perf_counter()
        meshes, leaves = self._all_leaves(progress)
        leaves.sort(key=lambda leaf: (leaf.bound, leaf.order))
        top: list = []  # max-heap by time of the k best fitting candidates
        per_mesh: dict = {}
        bounds: dict = {}
        for j, leaf in enumerate(leaves):
            if progress and j % 64 == 0:
                progress(len(meshes) + j * len(meshes) // len(leaves), 2 * len(meshes))
            key = _mesh_key(leaf.mesh)
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
            if key not in per_mesh and winner is not None:
                alternatives.append((self._bound_candidate(leaf),
                                     f"at least {100 * (leaf.bound / winner.step_time - 1):.1f}% "
                                     "slower (lower bound: never fully priced)"))
        alternatives = alternatives[: self.opt.top]
        return SearchResult(winner, alternatives, self.candidates, time.perf_counter() - start,
                            self.left_out, self.opt.attention_kernel, self.precision)

    def _all_leaves(self, progress=None) -> tuple[list[dict], list]:
        """The meshes this search allows and every leaf under them (mesh x cp mode x
        micro-batch x schedule), each with its lower bound, in a fixed order."""
        world = self.world.devices
        seq = self.chain.tokens_per_sample
        has_attention = any(lt.attention for lt in self.chain.types)
        heads = min((a.heads for lt in self.chain.types for a in lt.attention), default=1)

        def seq_ok(cp: int) -> bool:
            if cp == 1:
                return True
            if self.opt.executable is not None and "cp" not in self.opt.executable.get("axes", ()):
                return False
            # a chosen cp leaves each rank 256 tokens or more; a fixed one only has to divide
            return has_attention and seq % cp == 0 and (seq // cp >= 256 or self.c.cp == cp)

        meshes = factorisations(world, self.c, len(self.blocks) or 1, seq_ok)
        if self.opt.executable is not None:
            axes = self.opt.executable.get("axes", ("dp", "tp"))
            meshes = [m for m in meshes if all(m[a] == 1 for a in ("pp", "cp") if a not in axes)
                      and (self.opt.executable.get("cp_with_tp", True) or m["cp"] == 1
                           or m["tp"] == 1)]
            self.left_out.extend(_not_executable(self.opt.executable))
        if not meshes:
            raise PlanError(self._no_mesh_reason(world))
        leaves = []
        for i, mesh in enumerate(meshes):
            if progress:
                progress(i, 2 * len(meshes))
            leaves.extend(self._leaves(mesh, heads))
        if not leaves:
            raise PlanError(self._no_leaf_reason(meshes))
        return meshes, leaves

    def every(self, progress=None) -> list[Candidate]:
        """Every candidate this search can price, not only the top k: each leaf (mesh, cp
        mode, micro-batch, schedule) with each ZeRO stage and offload it allows, in leaf
        order, each layer's state chosen by the dynamic program as in `run`. Nothing is
        skipped by a bound, so this prices the whole space (for benchmarks that run every
        plan and for checking the search; `run` answers the planner's question)."""
        _, leaves = self._all_leaves(progress)
        out = []
        for leaf in leaves:
            for cand in self._evaluate(leaf):
                self.candidates += 1
                out.append(cand)
        return out

    def _no_mesh_reason(self, world: int) -> str:
        fixed = {k: v for k, v in vars(self.c).items()
                 if k in ("tp", "pp", "dp", "cp") and v is not None}
        blocks = len(self.blocks) or 1
        tiles = world % math.prod(fixed.values()) == 0
        if tiles and fixed.get("pp", 1) > blocks:
            return (f"pp {fixed['pp']} needs at least {fixed['pp']} blocks to put one on each "
                    f"stage, but the model has {blocks}; use pp "
                    f"{max(d for d in divisors(world) if d <= blocks)} or less.")
        if tiles and fixed.get("cp", 1) > 1:
            seq = self.chain.tokens_per_sample
            return (f"cp {fixed['cp']} splits the sequence over {fixed['cp']} ranks, but this "
                    f"model has " + (f"a sequence of {seq} tokens, which it does not divide"
                                     if any(lt.attention for lt in self.chain.types) else
                                     "no attention to split") + "; choose another cp size.")
        if fixed:
            prod = math.prod(fixed.values())
            near = [d for d in divisors(world)]
            return (f"the fixed sizes {fixed} (product {prod}) cannot tile a world of {world} "
                    f"devices; each size must divide {world} and their product must too "
                    f"(divisors: {', '.join(map(str, near[:12]))}"
                    f"{', ...' if len(near) > 12 else ''}).")
        return f"no way to split this model over {world} devices."

    def _reason(self, cand: Candidate, winner: Candidate | None) -> str:
        if not cand.fits and cand.host_per_device > self.host_capacity:
            return (f"host memory short by {(cand.host_per_device - self.host_capacity) / GiB:.1f}"
                    f" GiB per device ({cand.host_per_device / GiB:.1f} GiB offloaded, "
                    f"{self.host_capacity / GiB:.1f} GiB of host memory per device)")
        if not cand.fits:
            over = cand.memory_per_device - self.capacity
            return (f"out of memory by {over / GiB:.1f} GiB per device "
                    f"({cand.memory_per_device / GiB:.1f} GiB needed, "
                    f"{self.capacity / GiB:.1f} GiB usable)")
        if winner is None:
            return "fits"
        pct = 100 * (cand.step_time / winner.step_time - 1)
        why = []
        if cand.bubble_s > winner.bubble_s * 1.2 + 1e-9:
            why.append(f"pipeline bubble {cand.bubble_s:.3f} s")
        if cand.comm_s > winner.comm_s * 1.2 + 1e-9:
            why.append(f"tensor/sequence comm {cand.comm_s:.3f} s")
        if cand.dp_comm_s > winner.dp_comm_s * 1.2 + 1e-9:
            why.append(f"data-parallel sync {cand.dp_comm_s:.3f} s")
        if cand.compute_s > winner.compute_s * 1.05:
            why.append(f"compute {cand.compute_s:.3f} s")
        return f"{pct:.1f}% slower" + (f" ({', '.join(why)})" if why else "")

    # ------------------------------------------------------------ one mesh
    def _no_leaf_reason(self, meshes) -> str:
        gb = self.opt.global_batch
        dps = sorted({m["dp"] for m in meshes})
        split = [m for m in meshes if gb % m["dp"] == 0]
        refused = self._refused_tensor_sizes(split)
        if split and all(m["tp"] in refused and all(mode.name == "1d" for mode in
                                                    self._tp_modes(m["tp"])) for m in split):
            tp = split[0]["tp"]
            other = sorted({m["dp"] for m in meshes} - {m["dp"] for m in split})
            return (f"tensor size {tp} cannot split this model: {refused[tp]}" +
                    (f"; or give a global batch that is a multiple of {other[0]} (data "
                     "parallelism)." if other else "."))
        m_fixed = self.c.microbatches
        if split and m_fixed is not None and all((gb // m["dp"]) % m_fixed for m in split):
            m = split[0]
            per = gb // m["dp"]
            return (f"microbatches {m_fixed} does not divide the {per} sample(s) per "
                    f"data-parallel replica (global batch {gb} over dp {m['dp']}); use a number "
                    f"of micro-batches that divides {per}, or a global batch that is a multiple "
                    f"of {m_fixed * m['dp']}.")
        if split and all(m["pp"] > 1 for m in split):
            m = min(split, key=lambda m: m["pp"])
            per_replica = gb // m["dp"]
            return (f"every mesh left has a pipeline, and none gets as many micro-batches as "
                    f"stages: with pp {m['pp']} and dp {m['dp']} each replica has "
                    f"{per_replica} sample(s) for {m['pp']} stages; use a global batch of at "
                    f"least {m['pp'] * m['dp']}, or fewer stages (pp).")
        if split:
            tp = split[0]["tp"]
            return (f"no micro-batch size fits the constraints: the global batch {gb} over dp "
                    f"{split[0]['dp']} gives {gb // split[0]['dp']} sample(s) per replica; "
                    "relax microbatches or the tensor mode (2D/2.5D/3D split the micro-batch "
                    "too)" + (f", as 1d cannot split tensor size {tp} ({refused[tp]})"
                              if tp in refused else "") + ".")
        return (f"the global batch {gb} does not split over any data-parallel size this world "
                f"allows ({', '.join(map(str, dps[:10]))}); use a batch that is a multiple of "
                f"{dps[0]}" + (f" or fix dp to a divisor of {gb}" if len(dps) > 1 else "") + ".")

    def _refused_tensor_sizes(self, meshes) -> dict[int, str]:
        """Tensor size -> why 1d cannot take it, for the meshes' tensor sizes."""
        refused = self._refused_tensor_sizes_1d()
        return {m["tp"]: refused[m["tp"]] for m in meshes if m["tp"] in refused}

    # ------------------------------------------------------------ leaves
    def _prepared(self, mesh, pl, cp_mode, b):
        """Costs of every layer state for this tp/cp placement and micro-batch, the fastest
        path through the chain and its per-layer numbers (shared by all pp x dp)."""
        key = (mesh["tp"], pl["tp"], pl["cp"], cp_mode, b)
        hit = self._cost_cache.get(key)
        if hit is not None:
            return hit
        ctx_key = (pl["tp"], pl["cp"], cp_mode)
        ctx = self._contexts.get(ctx_key)
        if ctx is None:
            ctx = self._contexts[ctx_key] = Context(self.hw, self.opt.dtype, pl["tp"], pl["cp"],
                                                    cp_mode, self.opt.attention_kernel)
        per_type = []
        cp_1d = self._cp_tp_1d_only and mesh["cp"] > 1
        for lt in self.chain.types:
            states = [s for s in self._states(lt, mesh["tp"]) if b % s.mode.batch_split == 0
                      and not (cp_1d and (s.mode.name != "1d" or s.sp != "none"))]
            per_type.append((states, [state_cost(lt, s, b, ctx) for s in states]))
        if any(not states for states, _ in per_type):
            self._cost_cache[key] = None
            return None
        prep = _Prepared(self, per_type, pl, b)
        self._cost_cache[key] = prep
        return prep

    def _leaves(self, mesh, heads):
        c = self.c
        pl = placements(mesh, ORDER, self.world.per_node)
        gb, dp = self.opt.global_batch, mesh["dp"]
        if gb % dp:
            return []
        per_replica = gb // dp
        cp_modes = [None]
        if mesh["cp"] > 1:
            cp_modes = [c.sp] if c.sp in ("ulysses", "ring") else ["ulysses", "ring"]
        micro = [b for b in divisors(per_replica) if b <= self.opt.max_micro_batch]
        if c.micro_batch_size is not None:
            micro = [b for b in divisors(per_replica) if b == c.micro_batch_size]
        if c.microbatches is not None:
            micro = [b for b in micro if per_replica // b == c.microbatches]
        if mesh["pp"] == 1 and not (self.opt.executable or {}).get("accumulation", True):
            # without a pipeline the runtime runs a replica's whole batch in one pass
            micro = [per_replica] if c.micro_batch_size in (None, per_replica) and \
                c.microbatches in (None, 1) else []
        grad_pl = None
        out = []
        for cp_mode in cp_modes:
            if cp_mode == "ulysses" and heads % (mesh["cp"] * mesh["tp"]):
                continue
            for b in micro:
                prep = self._prepared(mesh, pl, cp_mode, b)
                if prep is None:
                    continue
                if grad_pl is None:
                    grad_pl = placements({"tp": mesh["tp"], "dpcp": mesh["dp"] * mesh["cp"],
                                          "pp": mesh["pp"]}, ("tp", "dpcp", "pp"),
                                         self.world.per_node)["dpcp"]
                m = per_replica // b
                zeros = self._zero_options(mesh)
                if not zeros:
                    continue
                pp = mesh["pp"]
                # lower bound without building the chain: every layer at its fastest state,
                # stages perfectly balanced, parameters evenly spread
                avg = prep.min_total / pp
                slowest = max(avg, prep.min_single)
                dp_lb = min(self._dp_time(prep.min_params / pp, z, m, grad_pl) for z, _ in zeros)
                for schedule, v in self._schedule_options(pp, m):
                    if pp * v > len(self.chain.order):
                        continue
                    if pp == 1:
                        pipe = m * slowest
                    elif schedule == "interleaved":
                        pipe = m * slowest + (pp - 1) * avg / v
                    elif schedule == "zero_bubble":
                        pipe = m * slowest + (pp - 1) * slowest / (6 if m >= 2 * pp else 3)
                    else:
                        pipe = (m - 1) * slowest + pp * avg
                    if pp > 1 and self.hw.compute_share < 1:  # cores shared (time_shared):
                        # no less than the pipeline's work spread over its cores, nor the
                        # schedule at a whole core per rank
                        pipe = max(m * avg, self.hw.compute_share * pipe)
                    out.append(_Leaf(pipe + dp_lb, next(self._leaf_numbers), dict(mesh), pl,
                                     grad_pl, cp_mode, b, m, schedule, v, prep, None, None,
                                     zeros))
        return out

    def _schedule_options(self, pp, m):
        if pp == 1:
            return [("none", 1)]
        if m < pp:  # fewer micro-batches than stages leaves stages idle whatever the schedule
            return []
        out = []
        for s in SCHEDULES:
            if self.c.schedule is not None and s != self.c.schedule:
                continue
            if self.opt.executable is not None and s not in self.opt.executable.get(
                    "schedules", ()):
                continue
            if s == "interleaved":
                options = [(s, v) for v in ((self.c.chunks,) if self.c.chunks else (2, 4))
                           if len(self.blocks) >= pp * v
                           and m % pp == 0]
            elif s == "zero_bubble":  # ZB-V: two stages per rank
                options = [(s, 2)] if len(self.blocks) >= 2 * pp else []
            else:
                options = [(s, 1)]
            for option in options:
                try:
                    check_microbatches(s, pp, m, option[1])
                except PlanError:
                    continue
                out.append(option)
        return out

    def _zero_options(self, mesh):
        out = []
        replicas = mesh["dp"] * mesh["cp"]
        for zero in (0, 1, 2, 3):
            if self.c.zero is not None and zero != self.c.zero:
                continue
            if zero and replicas == 1:
                continue
            ex = self.opt.executable
            if ex is not None and (zero not in ex.get("zero", (0,)) or (
                    mesh["pp"] > 1 and zero not in ex.get("zero_with_pp", (0, 1, 2, 3)))):
                continue
            for offload in (False, True):
                if self.c.offload is not None and offload != self.c.offload:
                    continue
                if offload and (zero == 0 or (self.opt.executable is not None and not
                                              self.opt.executable.get("offload", False))):
                    continue
                if offload and zero == 3 and mesh["dp"] == 1 and self.opt.executable is not None:
                    continue  # the runtime cuts ZeRO-3 pieces over dp alone (Plan.unsupported)
                out.append((zero, offload))
        return out

    def _dp_time(self, param_bytes: float, zero: int, m: int, grad_pl, units: int = 1) -> float:
        """Data-parallel gradient sync of one device's parameters. ZeRO-1 reduce-scatters
        gradients and all-gathers parameters once; ZeRO-2 reduce-scatters every micro-batch;
        ZeRO-3 also all-gathers parameters for each micro-batch's forward and backward
        (Rajbhandari et al. 2019), layer by layer (`autopar.runtime.zero3`): `units`, the
        layers holding parameters, each gather and reduce-scatter its own share, so the
        latency is paid once per layer (equal shares: the bandwidth term is unchanged)."""
        if grad_pl.size <= 1:
            return 0.0
        if zero == 3 and units > 1:
            return units * self._dp_time(param_bytes / units, zero, m, grad_pl)
        key = ("dp", param_bytes, grad_pl)
        hit = self._cost_cache.get(key)
        if hit is None:
            hit = self._cost_cache[key] = tuple(
                collective_time(op, param_bytes, grad_pl, self.hw)
                for op in ("all_reduce", "reduce_scatter", "all_gather"))
        ar, rs, ag = hit
        return {0: ar, 1: rs + ag, 2: m * rs + ag, 3: m * (rs + 2 * ag)}[zero]

    def _pipeline_time(self, layer_time, device_of, stage_of, pp, v, m, schedule, pl, b):
        """(step seconds of the pipeline, bubble seconds, per-device seconds per micro-batch)."""
        dev = np.bincount(device_of, weights=layer_time, minlength=pp)
        transfer = 0.0
        if pp > 1:
            # activations cross each stage boundary forward and their gradients backward,
            # and interleaving crosses v times as many boundaries
            transfer = stage_transfer(self.layers, stage_of, b, pl, self.hw)[0]
            dev = dev + 2 * v * transfer
        slowest = float(dev.max())
        if pp == 1 or schedule == "none":
            total = m * slowest
        elif self.hw.compute_share < 1:
            # ranks time-sharing fewer cores (CPU): a waiting rank's cores go to the busy
            # ones, so the schedule is played with the cores shared out as ranks wait
            stage_s = np.bincount(stage_of, weights=layer_time,
                                  minlength=stage_count(schedule, pp, v)) + 2 * transfer
            total = time_shared(schedule, pp, m, stage_s, self.hw.compute_share, v)
        else:  # closed forms of autopar.cost.schedule (checked against its simulation)
            total = step_time(schedule, pp, m, [float(x) for x in dev], v)
        return total, max(0.0, total - m * slowest), dev

    def _in_flight(self, schedule, pp, v, m) -> np.ndarray:
        """Micro-batches whose activations each device holds at its peak."""
        if pp == 1:
            return np.ones(1)
        return np.array(in_flight(schedule, pp, m, v))

    # ------------------------------------------------------------ evaluation
    def _evaluate(self, leaf):
        leaf.prep.build()
        if leaf.stage_of is None:
            leaf.stage_of = leaf.prep.stages(leaf.mesh["pp"] * leaf.v)
            leaf.device_of = [stage_owner(leaf.schedule, s, leaf.mesh["pp"])
                              for s in leaf.stage_of]
        for zero, offload in leaf.zeros:
            cand = self._price(leaf, zero, offload)
            yield cand
            if leaf.mesh["pp"] > 1 and leaf.v == 1 and (
                    not cand.fits or cand.states != leaf.prep.states_of(leaf.prep.fast)):
                # the time-balanced split needs recomputation or does not fit: also try the
                # fastest split whose stages hold their in-flight activations as they are
                alt = self._memory_split(leaf, zero, offload)
                if alt is not None and alt != leaf.stage_of:
                    yield self._price(dataclasses.replace(leaf, stage_of=alt, device_of=alt),
                                      zero, offload)

    def _memory_split(self, leaf, zero, offload) -> list[int] | None:
        """Stages balanced by time under each stage's memory limit, fastest states kept."""
        prep, pp = leaf.prep, leaf.mesh["pp"]
        replicas = leaf.mesh["dp"] * leaf.mesh["cp"]
        per_param = sum(state_factors(self.precision, replicas, zero, offload))
        in_flight = self._in_flight(leaf.schedule, pp, 1, leaf.m)
        weights = prep.params[None, :] * per_param + in_flight[:, None] * prep.acts[None, :]
        buffers = (2 * prep.biggest if replicas > 1 else 0.0) + \
            (2 * prep.biggest if zero == 3 else 0.0)
        capacity = np.full(pp, self.capacity - buffers)
        return balance_within(prep.layer_time, weights, capacity, pp)

    def _memory(self, leaf, params_dev, acts_dev, biggest, zero, offload, in_flight):
        parts = memory_by_kind(params_dev, acts_dev, biggest, leaf.mesh["dp"] * leaf.mesh["cp"],
                               zero, offload, in_flight, self.precision, leaf.prep.workspace)
        return sum(parts.values()), parts

    def _price(self, leaf, zero, offload) -> Candidate:
        prep, mesh = leaf.prep, leaf.mesh
        pp = mesh["pp"]
        in_flight = self._in_flight(leaf.schedule, pp, leaf.v, leaf.m)
        chosen = list(prep.fast)
        params_dev = np.bincount(leaf.device_of, weights=prep.params, minlength=pp)
        acts_dev = np.bincount(leaf.device_of, weights=prep.acts, minlength=pp)
        total, parts = self._memory(leaf, params_dev, acts_dev, prep.biggest, zero, offload,
                                    in_flight)
        if total.max() > self.capacity:
            fixed = total - parts["activations"]
            for d in range(pp):
                if total[d] > self.capacity:
                    budget = (self.capacity - fixed[d]) / in_flight[d]
                    prep.fit(chosen, [i for i in range(len(chosen)) if leaf.device_of[i] == d],
                             budget)
            acts = np.array([prep.mem_layers[i][s] for i, s in enumerate(chosen)])
            acts_dev = np.bincount(leaf.device_of, weights=acts, minlength=pp)
            # a layer that changed layout holds its parameters differently too
            params = np.array([prep.cost(i, s).params for i, s in enumerate(chosen)])
            params_dev = np.bincount(leaf.device_of, weights=params, minlength=pp)
            biggest = float(params.max()) if len(params) else 0.0
            total, parts = self._memory(leaf, params_dev, acts_dev, biggest, zero, offload,
                                        in_flight)
        layer_time = prep.path_time(chosen)
        pipe, bubble, dev = self._pipeline_time(layer_time, leaf.device_of, leaf.stage_of, pp,
                                                leaf.v, leaf.m, leaf.schedule, leaf.pl, leaf.b)
        worst = float(params_dev.max())
        replicas = mesh["dp"] * mesh["cp"]
        heaviest = int(np.argmax(params_dev))
        units = sum(1 for i, s in enumerate(chosen)  # its layers holding parameters
                    if leaf.device_of[i] == heaviest and prep.cost(i, s).params > 0)
        dp_s = self._dp_time(worst, zero, leaf.m, leaf.grad_pl, units=max(1, units))
        optimizer_s = optimizer_time(worst, replicas, zero, offload, self.precision, self.hw)
        host = host_bytes(worst, replicas, zero, offload, self.precision)
        step = pipe + dp_s + optimizer_s
        slow = int(np.argmax(dev))
        on_slow = [i for i in range(len(chosen)) if leaf.device_of[i] == slow]
        compute = leaf.m * sum(prep.compute(i, chosen[i]) for i in on_slow)
        comm = leaf.m * sum(prep.cost(i, chosen[i]).comm for i in on_slow)
        comm_bytes = leaf.m * sum(prep.cost(i, chosen[i]).comm_bytes for i in on_slow)
        comm_bytes += dp_wire_bytes(worst, replicas, zero)
        worst_dev = int(np.argmax(total))
        memory = {k: float(v[worst_dev]) for k, v in parts.items()}
        return Candidate(dict(mesh), leaf.b, leaf.m, leaf.schedule if pp > 1 else "none",
                         leaf.v, zero, offload, leaf.cp_mode, prep.states_of(chosen),
                         leaf.stage_of, step, compute, comm, bubble, dp_s, optimizer_s, memory,
                         float(total.max()), comm_bytes,
                         bool(total.max() <= self.capacity and host <= self.host_capacity), host)

    def _bound_candidate(self, leaf) -> Candidate:
        prep = leaf.prep.build()
        return Candidate(dict(leaf.mesh), leaf.b, leaf.m, leaf.schedule, leaf.v, 0, False,
                         leaf.cp_mode, prep.states_of(prep.fast), [], leaf.bound,
                         0.0, 0.0, 0.0, 0.0, 0.0, {}, 0.0, 0.0, True)


@dataclass
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
    prep: object
    stage_of: list
    device_of: list
    zeros: list


class _Prepared:
    """One tp/cp placement and micro-batch: per-layer state costs along the chain."""

    def __init__(self, search: Search, per_type, pl, b):
        order = search.chain.order
        self.search = search
        self.per_type = per_type
        self.order = order
        self.pl, self.b = pl, b
        counts = np.bincount(order, minlength=len(per_type))
        fastest = [min(c.time for c in costs) for _, costs in per_type]
        self.min_total = float(np.dot(counts, fastest))
        self.min_single = max(fastest[t] for t in set(order))
        self.min_params = float(np.dot(counts, [min(c.params for c in costs)
                                                for _, costs in per_type]))
        self.workspace = max((c.workspace for _, costs in per_type for c in costs), default=0.0)
        self.built = False
        self._stages: dict = {}

    def build(self) -> _Prepared:
        """The chain arrays, the fastest path and its numbers: only for leaves that are
        priced (the lower bounds above need none of it)."""
        if self.built:
            return self
        self.built = True
        search, per_type, order, pl, b = self.search, self.per_type, self.order, self.pl, self.b
        self.t_layers = [np.array([c.time for c in per_type[t][1]]) for t in order]
        self.mem_layers = [np.array([c.activations for c in per_type[t][1]]) for t in order]
        self.conv = [None]
        for i in range(1, len(order)):
            self.conv.append(self._conversion(search, order[i - 1], order[i], pl, b))
        self.fast, _ = choose_states([len(t) for t in self.t_layers], self.t_layers,
                                     self.mem_layers, self.conv, 0.0)
        self.layer_time = self.path_time(self.fast)
        self.params = np.array([self.cost(i, s).params for i, s in enumerate(self.fast)])
        self.acts = np.array([self.mem_layers[i][s] for i, s in enumerate(self.fast)])
        self.biggest = float(self.params.max()) if len(self.params) else 0.0
        return self

    def _conversion(self, search, a, b_type, pl, b):
        key = ("conv", a, b_type, b, pl["tp"], pl["cp"])
        mat = search._cost_cache.get(key)
        if mat is None:
            prev_states, cur_states = self.per_type[a][0], self.per_type[b_type][0]
            gather = conversion_s(search.chain.types[a].boundary(b), pl, search.hw)
            mat = np.array([[0.0 if sa.layout == sb.layout else gather for sb in cur_states]
                            for sa in prev_states])
            search._cost_cache[key] = mat
        return mat

    def cost(self, i, s):
        return self.per_type[self.order[i]][1][s]

    def compute(self, i, s):
        c = self.cost(i, s)
        return c.forward + c.backward + c.recompute

    def states_of(self, chosen):
        return [self.per_type[t][0][chosen[i]] for i, t in enumerate(self.order)]

    def path_time(self, chosen) -> np.ndarray:
        out = np.array([self.t_layers[i][s] for i, s in enumerate(chosen)])
        for i in range(1, len(chosen)):
            out[i] += self.conv[i][chosen[i - 1], chosen[i]]
        return out

    def stages(self, k: int) -> list[int]:
        hit = self._stages.get(k)
        if hit is None:
            hit = self._stages[k] = balance(self.layer_time, k)
        return hit

    def fit(self, chosen, idx, budget) -> None:
        """Fit one device's layers in ``budget`` activation bytes at the least extra time.

        Layers of one kind on a device keep one layout (a switch between identical layers
        costs a conversion and gains nothing) and choose their recompute freely; with three
        recompute levels the exact optimum is found by counting: for each number of fully
        recomputed layers, as many as fit keep everything, the rest recompute selectively.
        """
        groups: dict = {}
        for i in idx:
            groups.setdefault(self.order[i], []).append(i)
        spare = budget - sum(self.mem_layers[i][chosen[i]] for i in idx)
        # shrink the biggest groups first: each gets the share of the deficit it can cover
        for t, members in sorted(groups.items(), key=lambda g: -len(g[1])):
            states = self.per_type[t][0]
            if len(states) <= 1 or spare >= 0:
                continue
            layout = states[chosen[members[0]]].layout
            used = sum(self.mem_layers[i][chosen[i]] for i in members)
            best = None
            for lay in {s.layout for s in states}:
                options = [k for k, s in enumerate(states) if s.layout == lay]
                counts = _counts(options, self.t_layers[members[0]],
                                 self.mem_layers[members[0]], len(members), used + spare)
                if counts is None:
                    continue
                penalty = 0.0 if lay == layout else 2 * max(
                    (float(m.max()) for m in (self.conv[members[0]],) if m is not None),
                    default=0.0)
                time_, mem, assignment = counts
                if best is None or time_ + penalty < best[0]:
                    best = (time_ + penalty, mem, assignment)
            if best is None:  # nothing fits: take the least memory there is
                k = int(np.argmin(self.mem_layers[members[0]]))
                best = (0.0, len(members) * self.mem_layers[members[0]][k], [k] * len(members))
            for i, k in zip(members, best[2]):
                chosen[i] = k
            spare = used + spare - best[1]


def state_factors(precision: Precision, replicas: int, zero: int,
                  offload: bool) -> tuple[float, float, float]:
    """Bytes of (parameters, gradients, master + optimizer state) one device holds per byte
    of the weights its layers have. ZeRO-1 shards the optimizer's master and moments over
    the replicas, 2 also the gradients, 3 also the parameters (Rajbhandari et al. 2019,
    §5); offload moves master and moments to the host (Ren et al. 2021)."""
    w = precision.weights
    return (1 / (replicas if zero == 3 else 1),
            precision.gradients / w / (replicas if zero >= 2 else 1),
            0.0 if offload else (precision.master + precision.optimizer) / w
            / (replicas if zero else 1))


def memory_by_kind(params_dev, acts_dev, biggest: float, replicas: int, zero: int,
                   offload: bool, in_flight, precision: Precision, workspace: float = 0.0) -> dict:
    """Bytes per device by kind (arrays over the pipeline ranks) from the parameter and
    activation bytes of the layers each holds. A function of its own so that the plan's
    report prices every pipeline rank exactly as the search priced the worst one.

    Parameter, gradient and optimizer bytes follow `precision` and the ZeRO stage
    (`state_factors`); the buffers are the flat communication buffers of the biggest
    layer, twice for data-parallel sync and twice more for ZeRO-3's gathers, plus the
    largest transient `workspace` of one layer (ring attention's K/V receive buffers)."""
    weights, grads, optim = state_factors(precision, replicas, zero, offload)
    buffers = np.full_like(params_dev, (2 * biggest if replicas > 1 else 0.0)
                           + (2 * biggest if zero == 3 else 0.0) + workspace)
    return dict(parameters=params_dev * weights, gradients=params_dev * grads,
                optimizer=params_dev * optim, buffers=buffers, activations=acts_dev * in_flight)


def host_bytes(param_bytes: float, replicas: int, zero: int, offload: bool,
               precision: Precision) -> float:
    """Bytes one device offloads to its host: its ZeRO shard's master, moments and gradient
    (`Precision.offloaded`); none without offload."""
    if not offload:
        return 0.0
    return param_bytes / precision.weights * precision.offloaded / (replicas if zero else 1)


def host_capacity(hw: Hardware, per_node: int, devices: int) -> float:
    """Host memory one device may offload to: its node's `host_memory_bytes` shared by the
    devices on that node."""
    return hw.host_memory_bytes / max(1, min(per_node, devices))


def optimizer_time(param_bytes: float, replicas: int, zero: int, offload: bool,
                   precision: Precision, hw: Hardware) -> float:
    """Seconds of the optimizer step on one device holding `param_bytes` of weights: its
    shard's `Precision.step_bytes` at the memory bandwidth, or, offloaded, the gradient down
    and the weights up over the host link and the step's bytes at that link's rate."""
    elements = param_bytes / precision.weights / (replicas if zero else 1)
    if offload:
        return elements * (precision.gradients + precision.weights + precision.step_bytes) \
            / hw.host_bandwidth
    return elements * precision.step_bytes / (hw.memory_bandwidth * hw.memory_efficiency)


def dp_wire_bytes(param_bytes: float, replicas: int, zero: int) -> float:
    """Bytes one device sends to sync its gradients over the data-parallel replicas (ring
    all-reduce, or reduce-scatter + all-gather: the same bytes), half again under ZeRO-3,
    whose parameters are gathered for the backward as well as the forward."""
    if replicas <= 1:
        return 0.0
    return 2 * (replicas - 1) / replicas * param_bytes * (1.5 if zero == 3 else 1)


def stage_transfer(layers, stage_of, b: int, pl: dict, hw: Hardware) -> tuple[float, float]:
    """(seconds, bytes) of one point-to-point transfer between pipeline stages: the
    biggest activation that crosses a stage boundary, of which each rank sends its
    1/(tp x cp) slice (Narayanan et al. 2021 §4.1, scatter/gather)."""
    crossing = [layers[i].boundary(b) for i in range(len(stage_of) - 1)
                if stage_of[i] != stage_of[i + 1]]
    if not crossing:
        return 0.0, 0.0
    nbytes = max(crossing) / (pl["tp"].size * pl["cp"].size)
    return collective_time("p2p", nbytes, pl["pp"], hw), nbytes


def conversion_s(boundary_bytes: float, pl: dict, hw: Hardware) -> float:
    """Seconds to hand a layer's output to a neighbour of another layout: an all-gather
    over tp of this rank's cp share of it."""
    if pl["tp"].size <= 1:
        return 0.0
    return collective_time("all_gather", boundary_bytes / max(1, pl["cp"].size), pl["tp"], hw)


def _counts(options, times, mems, n, budget):
    """Exact cheapest assignment of ``options`` (state indices) to ``n`` identical layers
    within ``budget`` bytes: enumerate how many take each option but the two cheapest in
    time, which then split the rest (as many as fit on the faster one)."""
    opts = sorted(options, key=lambda k: (times[k], mems[k]))
    if not opts:
        return None
    best = None
    fast, rest = opts[0], opts[1:]
    if not rest:
        mem = n * mems[fast]
        return (n * times[fast], mem, [fast] * n) if mem <= budget else None
    second = min(rest, key=lambda k: mems[k])
    others = [k for k in rest if k != second]
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


def _compositions(n, k):
    """Every tuple of k non-negative counts with sum <= n (k is 0, 1 or 2 here)."""
    if k == 0:
        yield ()
        return
    for first in range(n + 1):
        for tail in _compositions(n - first, k - 1):
            yield (first, *tail)


def _mesh_key(mesh) -> tuple:
    return (mesh["pp"], mesh["dp"], mesh["cp"], mesh["tp"])


def _better(a: Candidate, b: Candidate) -> bool:
    if a.fits != b.fits:
        return a.fits
    if a.fits:
        return a.step_time < b.step_time
    return a.memory_per_device < b.memory_per_device


def _not_executable(executable: dict) -> list[str]:
    """What the runtime cannot execute yet, in words, from the EXECUTABLE description."""
    out = []
    axes = executable.get("axes", ())
    if "cp" not in axes:
        out.append("sequence parallelism over a cp axis (Ulysses, ring)")
    if "cp" in axes and not executable.get("cp_with_tp", True):
        out.append("a cp axis combined with tensor parallelism")
    elif "cp" in axes and executable.get("cp_with_tp") == "1d":
        out.append("a cp axis combined with 2D/2.5D/3D tensor parallelism or Megatron-SP")
    modes = [m for m in ("2d", "2.5d", "3d") if m not in executable.get("tp_modes", ())]
    if modes:
        out.append("/".join(modes) + " tensor parallelism")
    if "megatron" not in executable.get("sp", ()):
        out.append("Megatron sequence parallelism")
    rc = [r for r in ("selective", "full") if r not in executable.get("recompute", ())]
    if rc:
        out.append("/".join(rc) + " recomputation")
    zero = [z for z in (1, 2, 3) if z not in executable.get("zero", ())]
    if zero:
        out.append("ZeRO stage " + "/".join(map(str, zero)))
    with_pp = [z for z in executable.get("zero", ()) if z and z not in
               executable.get("zero_with_pp", executable.get("zero", ()))]
    if with_pp:
        out.append("ZeRO stage " + "/".join(map(str, with_pp)) + " together with a pipeline")
    if not executable.get("offload", False):
        out.append("optimizer offload")
    if not executable.get("accumulation", True):
        out.append("gradient accumulation over micro-batches when pp is 1 (a replica's batch "
                   "runs in one pass)")
    out = [w + ": the runtime cannot execute it yet" for w in out]
    if "pp" not in axes:
        out.insert(0, "pipeline parallelism (pp > 1): runs from a plan that names it "
                      "(pipeline=dict(size=...)); this search does not choose it yet")
    return out
