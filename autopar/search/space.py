"""The space a search walks: its constraints, its options and the filters that say which
meshes, layer states, micro-batches, schedules and ZeRO stages it may take.

What a runtime executes comes in as an `autopar.modes.Capabilities`; None prices everything.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from autopar.cost.hybrid import shard_sizes
from autopar.cost.model import LayerState, TensorMode, tensor_modes
from autopar.cost.schedule import check_microbatches
from autopar.errors import PlanError
from autopar.kernels.float8 import TENSORWISE
from autopar.modes import (
    AXES,
    BF16,
    CP,
    DP,
    DP_SHARD,
    EP,
    GRID_MODES,
    INTERLEAVED,
    LAYER_SP,
    MEGATRON_SP,
    NO_PIPELINE,
    NO_RECOMPUTE,
    NO_SP,
    PP,
    RECOMPUTE,
    SCHEDULES,
    SEQUENCE_MODES,
    TP,
    TP_1D,
    TP_25D,
    TP_MODES,
    ULYSSES,
    ZERO_BUBBLE,
    ZERO_STAGES,
    Capabilities,
)


@dataclass
class Constraints:
    """Any subset of the plan, fixed. None = the search chooses."""

    tp: int | None = None
    pp: int | None = None
    dp: int | None = None
    cp: int | None = None
    tp_mode: str | None = None
    sp: str | None = None  # none | megatron | ulysses | ring
    cp_mode: str | None = None  # ulysses | ring over the cp axis, beside sp's layers' choice
    zero: int | None = None
    offload: bool | None = None
    recompute: str | None = None
    microbatches: int | None = None
    micro_batch_size: int | None = None
    schedule: str | None = None
    chunks: int | None = None  # stages per rank of the interleaved schedule
    ep: int | None = None  # experts over ep ranks inside the dp x cp ranks (1: replicated)
    dp_shard: int | None = None  # HSDP: ZeRO over this many dp ranks (dp: over all of dp)

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
        for name in (TP, PP, DP, CP, "microbatches", "micro_batch_size", "chunks", EP, DP_SHARD):
            value = getattr(self, name)
            if value is not None and (isinstance(value, bool) or not isinstance(value, int)
                                      or value < 1):
                raise PlanError(f"constraint {name}={value!r} must be a whole number >= 1.")
        for name, options in (("tp_mode", TP_MODES), ("sp", LAYER_SP + SEQUENCE_MODES),
                              ("cp_mode", SEQUENCE_MODES),
                              ("recompute", RECOMPUTE), ("schedule", SCHEDULES),
                              ("zero", ZERO_STAGES), ("offload", (True, False))):
            value = getattr(self, name)
            if value is not None and (value not in options or isinstance(value, bool) !=
                                      (name == "offload")):
                raise PlanError(f"constraint {name}={value!r} must be one of "
                                f"{', '.join(map(str, options))}.")
        if self.dp_shard is not None and self.zero == 0:
            raise PlanError(f"constraint dp_shard={self.dp_shard} cuts ZeRO's state over "
                            f"{self.dp_shard} ranks, but zero is fixed to 0; fix zero to 1, 2 "
                            "or 3, or drop dp_shard.")
        if self.sp == MEGATRON_SP and self.tp == 1:
            raise PlanError("constraint sp='megatron' splits the sequence over the tensor axis, "
                            "but tp is fixed to 1; fix tp to 2 or more, or drop sp.")
        for name in ("sp", "cp_mode"):
            if getattr(self, name) in SEQUENCE_MODES and self.cp == 1:
                raise PlanError(f"constraint {name}='{getattr(self, name)}' runs over a cp axis, "
                                f"but cp is fixed to 1; fix cp to 2 or more, or drop {name}.")
        if self.cp_mode is not None and self.sp in SEQUENCE_MODES and self.sp != self.cp_mode:
            raise PlanError(f"constraints sp='{self.sp}' and cp_mode='{self.cp_mode}' name two "
                            "sequence modes for one cp axis; drop one of them.")
        if self.tp_mode in GRID_MODES and self.tp not in (None, 1):
            from autopar.sharding.axes import grid_size_error

            depths = [d for d in range(1, self.tp + 1) if self.tp % d == 0]
            errors = [grid_size_error(self.tp_mode, self.tp, d) for d in
                      (depths if self.tp_mode == TP_25D else [1])]
            if all(errors):
                raise PlanError(f"constraint tp={self.tp} cannot run tp_mode="
                                f"'{self.tp_mode}': {errors[0]}")


@dataclass
class Options:
    global_batch: int
    # the compute dtype (its GEMM rate; activation bytes come from the trace), named as
    # parallelize's precision=; state bytes per parameter: autopar.cost.precision
    dtype: str = BF16
    attention_kernel: str = "flash"
    compile: bool = False  # price parallelize(compile=True): inductor's fused regions
    fp8_recipe: str = TENSORWISE  # under fp8, the scaling recipe (cost.model.Context's)
    executable: Capabilities | None = None  # restrict to what a runtime runs (modes.RUNTIME)
    top: int = 5
    max_micro_batch: int = 16
    sp_seq: int | None = None  # the sequence Megatron-SP splits: tp must divide it (if given)


def divisors(n: int) -> list[int]:
    """The divisors of n in increasing order, from the pairs (d, n // d) with d <= sqrt(n):
    a world of 10^9 devices has 100 of them, found in 31623 steps, not 10^9."""
    small, large = [], []
    d = 1
    while d * d <= n:
        if n % d == 0:
            small.append(d)
            if d * d != n:
                large.append(n // d)
        d += 1
    return small + large[::-1]


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
                out.append({PP: pp, DP: dp, CP: cp, TP: tp})
    return out


# every search's states of one value are one object: searches that share state costs (the
# executable search's, one per tensor grid) then find them by identity, where equal but
# distinct states would compare field by field on every lookup
_STATES: dict = {}


def _state(mode: TensorMode, sp: str, recompute: str) -> LayerState:
    key = (mode.name, mode.size, mode.q, mode.d, sp, recompute)
    hit = _STATES.get(key)
    if hit is None:
        hit = _STATES[key] = LayerState(mode, sp, recompute)
    return hit


class Space:
    """The filters of one search's space: its chain, constraints, options and capabilities."""

    def __init__(self, chain, options: Options, constraints: Constraints,
                 n_blocks: int | None = None):
        """`n_blocks`: the chain's blocks, where the caller counted them."""
        self.chain, self.opt, self.c = chain, options, constraints
        self.caps = options.executable  # None: everything the planner can price
        self.n_blocks = sum(1 for lt in chain.layers() if lt.is_block) if n_blocks is None \
            else n_blocks
        self._states: dict = {}
        self._kinds: dict = {}  # (tp, micro-batch, beside cp) -> `kinds`
        self._split_states: dict = {}  # (kind, tp, beside cp) -> `_splits`
        self._grid_splits: dict = {}  # (tp, beside cp) -> the grid states' batch splits
        self._takes_grid: dict = {}  # (tp, micro-batch, beside cp) -> `takes_grid`
        self._modes: dict = {}  # (tp, block) -> `tp_modes`
        self._grids: dict = {}  # tp -> `has_grid`

    # ------------------------------------------------------------------ layers
    def tp_modes(self, tp: int, block: bool = True) -> list[TensorMode]:
        """Tensor modes a layer may take; a fixed tp_mode applies to blocks, the other
        layers stay 1D and convert at the block boundary."""
        hit = self._modes.get((tp, block))
        if hit is None:
            hit = self._modes[(tp, block)] = self._tp_modes(tp, block)
        return hit

    def _tp_modes(self, tp: int, block: bool) -> list[TensorMode]:
        allowed, depth = TP_MODES, None
        if self.caps is not None:
            allowed = tuple(m for m in allowed if m in self.caps.tp_modes)
            depth = self.caps.tp_depth
        if self.c.tp_mode is not None:
            allowed = (self.c.tp_mode,) if block else (TP_1D,)
        if tp == 1:
            return [TensorMode(TP_1D, 1)]
        modes = [m for m in tensor_modes(tp, allowed) if depth is None or m.d == depth
                 or m.name != TP_25D]
        return [m for m in modes if all(tp in lt.sharded or m.name != TP_1D for lt in
                                        self.chain.types)]

    def has_grid(self, tp: int) -> bool:
        """Whether a tensor group of `tp` ranks may take a multi-dimensional mode here."""
        hit = self._grids.get(tp)
        if hit is None:
            hit = self._grids[tp] = any(m.name != TP_1D for m in self.tp_modes(tp))
        return hit

    def refused_tensor_sizes_1d(self) -> dict[int, str]:
        """Tensor size -> why 1d blocks cannot take it, from the chain's refusals."""
        out = {}
        for r in self.chain.refused:
            size, _, why = r.partition(": ")
            if size.startswith("tp=") and size[3:].isdigit():
                out[int(size[3:])] = why.rstrip(".")
        return out

    def sp_modes(self, mode: TensorMode) -> list[str]:
        if mode.name != TP_1D or mode.size == 1:
            return [NO_SP]
        allowed = list(LAYER_SP)
        caps, seq = self.caps, self.opt.sp_seq
        if caps is not None and (MEGATRON_SP not in caps.sequence_parallel or (
                seq is not None and seq % mode.size)):
            allowed = [NO_SP]  # the runtime splits the sequence into tp equal pieces
        if self.c.sp in LAYER_SP:
            allowed = [self.c.sp] if self.c.sp in allowed or caps is None else []
        return allowed

    def recompute(self) -> tuple:
        rc = RECOMPUTE
        if self.caps is not None:
            rc = tuple(r for r in rc if r in self.caps.recompute)
        if self.c.recompute is not None:
            rc = (self.c.recompute,)
        return rc

    def states(self, lt, tp: int) -> list[LayerState]:
        """The states one kind of layer may take at tensor size `tp`."""
        key = (id(lt), tp)
        hit = self._states.get(key)
        if hit is None:
            hit = self._states[key] = self._make_states(lt, tp)
        return hit

    def kinds(self, tp: int, b: int, beside_cp: bool) -> list | None:
        """(kind, its states) per kind of layer at tensor size `tp` and micro-batch `b` (the
        states whose batch split divides it; `beside_cp`: those a cp axis allows), in chain-type
        order; None where some kind has none. One list per arguments, shared by every leaf
        asking (the placements and meshes of a tensor size differ only in their prices)."""
        key = (tp, b, beside_cp)
        if key in self._kinds:
            return self._kinds[key]
        out = []
        for lt in self.chain.types:
            states = [s for s, split in self._splits(lt, tp, beside_cp) if b % split == 0]
            if not states:
                out = None
                break
            out.append((lt, states))
        self._kinds[key] = out
        return out

    def takes_grid(self, tp: int, b: int, beside_cp: bool) -> bool:
        """Whether some kind of layer has a multi-dimensional state at tensor size `tp` and
        micro-batch `b` (`kinds`' filters): where none has, a grid search's states there are
        its base search's 1D ones, or none."""
        key = (tp, b, beside_cp)
        hit = self._takes_grid.get(key)
        if hit is None:
            splits = self._grid_splits.get((tp, beside_cp))
            if splits is None:
                splits = self._grid_splits[(tp, beside_cp)] = {
                    split for lt in self.chain.types for s, split
                    in self._splits(lt, tp, beside_cp) if s.mode.name != TP_1D}
            hit = self._takes_grid[key] = any(b % split == 0 for split in splits)
        return hit

    def _splits(self, lt, tp: int, beside_cp: bool) -> list[tuple[LayerState, int]]:
        """(state, its batch split) of `states` (those a cp axis allows, given `beside_cp`),
        once per kind, tensor size and cp: `kinds` filters them by micro-batch."""
        key = (id(lt), tp, beside_cp)
        hit = self._split_states.get(key)
        if hit is None:
            hit = self._split_states[key] = [(s, s.mode.batch_split) for s in self.states(lt, tp)
                                             if not beside_cp or self.beside_cp(s)]
        return hit

    def _make_states(self, lt, tp: int) -> list[LayerState]:
        out = []
        for mode in self.tp_modes(tp, lt.is_block):
            if mode.name == TP_1D and tp > 1 and lt.sharded[tp].refused:
                continue  # heads or widths 1d does not split: the runtime refuses them
            for sp in self.sp_modes(mode):
                if lt.is_block:
                    out.extend(_state(mode, sp, r) for r in self.recompute())
                elif mode.name == TP_1D:
                    out.append(_state(mode, sp, NO_RECOMPUTE))
        return out

    def beside_cp(self, state: LayerState) -> bool:
        """Whether a layer may take `state` where the mesh has a cp axis."""
        if self.caps is None:
            return True
        return state.mode.name in self.caps.cp_with_tp and (
            state.sp == NO_SP or self.caps.cp_with_megatron_sp)

    # ------------------------------------------------------------------ meshes
    def expert_counts(self) -> set[int]:
        """The expert counts of the chain's MoE layers (empty for a dense model)."""
        return {lt.experts.count for lt in self.chain.types if lt.experts is not None}

    def ep_sizes(self, mesh: dict) -> list[int]:
        """Expert-parallel sizes for `mesh`: divisors of dp x cp that divide every MoE layer's
        expert count ([1] for a dense model, or where the runtime has no ep axis)."""
        counts, caps = self.expert_counts(), self.caps
        if not counts or (caps is not None and (not caps.expert or (
                mesh[CP] > 1 and not caps.expert_with_cp) or (
                mesh[CP] > 1 and not caps.expert_cp_extras and (
                    mesh[TP] > 1 or mesh[PP] > 1)) or (
                mesh[PP] > 1 and not caps.expert_with_pp))):
            return [1] if self.c.ep in (None, 1) else []
        top = math.gcd(mesh[DP] * mesh[CP], *counts)
        return [e for e in divisors(top) if self.c.ep in (None, e)]

    def meshes(self, world: int) -> list[dict]:
        """Every mesh pp x dp x cp x tp of `world` this space allows."""
        seq = self.chain.tokens_per_sample
        has_attention = any(lt.attention for lt in self.chain.types)
        caps = self.caps

        def seq_ok(cp: int) -> bool:
            if cp == 1:
                return True
            if caps is not None and CP not in caps.axes:
                return False
            # a chosen cp leaves each rank 256 tokens or more; a fixed one only has to divide
            return has_attention and seq % cp == 0 and (seq // cp >= 256 or self.c.cp == cp)

        meshes = factorisations(world, self.c, self.n_blocks or 1, seq_ok)
        if caps is not None:
            meshes = [m for m in meshes if all(m[a] == 1 for a in AXES if a not in caps.axes)
                      and (caps.cp_with_tp or m[CP] == 1 or m[TP] == 1)]
        return meshes

    def cp_modes(self, mesh: dict, heads: int) -> list:
        """Sequence modes over the mesh's cp axis (None without one); Ulysses needs the
        heads to split over cp x tp."""
        if mesh[CP] == 1:
            return [None]
        fixed = self.c.cp_mode or (self.c.sp if self.c.sp in SEQUENCE_MODES else None)
        modes = [fixed] if fixed else list(SEQUENCE_MODES)
        return [m for m in modes if m != ULYSSES or heads % (mesh[CP] * mesh[TP]) == 0]

    def micro_batches(self, per_replica: int, pp: int) -> list[int]:
        """Micro-batch sizes for a replica's `per_replica` samples."""
        c = self.c
        micro = [b for b in divisors(per_replica) if b <= self.opt.max_micro_batch]
        if c.micro_batch_size is not None:
            micro = [b for b in divisors(per_replica) if b == c.micro_batch_size]
        if c.microbatches is not None:
            micro = [b for b in micro if per_replica // b == c.microbatches]
        if pp == 1 and self.caps is not None and not self.caps.accumulation:
            # without a pipeline the runtime runs a replica's whole batch in one pass
            micro = [per_replica] if c.micro_batch_size in (None, per_replica) and \
                c.microbatches in (None, 1) else []
        return micro

    def schedules(self, pp: int, m: int) -> list[tuple[str, int]]:
        """(schedule, stages per rank) for `pp` ranks and `m` micro-batches."""
        if pp == 1:
            return [(NO_PIPELINE, 1)]
        if m < pp:  # fewer micro-batches than stages leaves stages idle whatever the schedule
            return []
        out = []
        for s in SCHEDULES:
            if self.c.schedule is not None and s != self.c.schedule:
                continue
            if self.caps is not None and s not in self.caps.schedules:
                continue
            if s == INTERLEAVED:
                options = [(s, v) for v in ((self.c.chunks,) if self.c.chunks else (2, 4))
                           if self.n_blocks >= pp * v and m % pp == 0]
            elif s == ZERO_BUBBLE:  # ZB-V: two stages per rank
                options = [(s, 2)] if self.n_blocks >= 2 * pp else []
            else:
                options = [(s, 1)]
            for option in options:
                try:
                    check_microbatches(s, pp, m, option[1])
                except PlanError:
                    continue
                out.append(option)
        return out

    def expert_zero_options(self, mesh: dict, zeros: list) -> list[tuple[int, bool, int | None]]:
        """The (ZeRO stage, offload, hybrid shard size) options of `zeros` that run beside an
        ep axis. Under HSDP the dense weights' state is cut over the shard group and the
        experts' over their whole expert-data group, as the runtime cuts them
        (`runtime.zero_experts`; `cost.step.memory_by_kind` prices both)."""
        caps = self.caps
        if caps is None:
            return zeros
        return [(z, o, shard) for z, o, shard in zeros if z in caps.expert_zero and (
            mesh[PP] == 1 or z in caps.expert_zero_with_pp) and (
            mesh.get(CP, 1) == 1 or z == 0 or caps.expert_cp_extras) and (
            shard is None or caps.hybrid_with_ep)]

    def zero_options(self, mesh: dict, per_node: int) -> list[tuple[int, bool, int | None]]:
        """(ZeRO stage, offload, hybrid shard size) options for this mesh: the shard None
        cuts over all of dp; a size (`cost.hybrid.shard_sizes`) is HSDP, tried without offload,
        for ZeRO-3 (any stage when the constraint dp_shard fixes it)."""
        out = []
        replicas = mesh[DP] * mesh[CP]
        caps = self.caps
        fixed = self.c.dp_shard  # (the data-parallel size itself: ZeRO over all of dp)
        shards = [] if fixed == mesh[DP] or (caps is not None and not (
            caps.hybrid_shard and (mesh[PP] == 1 or caps.hybrid_with_pp))) \
            else shard_sizes(mesh, per_node, fixed)
        for zero in ZERO_STAGES:
            if self.c.zero is not None and zero != self.c.zero:
                continue
            if zero and replicas == 1:
                continue
            if caps is not None and (zero not in caps.zero or (
                    mesh[PP] > 1 and zero not in caps.zero_with_pp)):
                continue
            for offload in (False, True):
                if self.c.offload is not None and offload != self.c.offload:
                    continue
                if offload and (zero == 0 or (caps is not None and not caps.offload)):
                    continue
                if offload and zero == 3 and mesh[DP] == 1 and caps is not None and \
                        not caps.offload_zero3_single_rank:
                    continue  # the runtime cuts ZeRO-3 pieces over dp alone (Plan.unsupported)
                if fixed is None or fixed == mesh[DP]:
                    out.append((zero, offload, None))
                if not offload and (zero == 3 or (zero and fixed is not None)):
                    # free, HSDP is tried for ZeRO-3, whose per-layer gathers it keeps near
                    out += [(zero, offload, shard) for shard in shards]
        return out
