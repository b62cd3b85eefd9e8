"""Seconds and bytes of one layer under one strategy, and of one training step.

Compute is a roofline: a matrix multiplication of F FLOPs runs at
``peak * gemm_efficiency * F / (F + gemm_half_flops)`` (small problems fill the device
less) and also moves its operands through HBM (:func:`gemm_traffic_s`), memory-bound ops
move their bytes at ``memory_bandwidth * memory_efficiency``, and what limits real runs
beyond that is priced as the named physical effects of :data:`EFFECTS` (fused attention's
rate at short sequences, causal imbalance and exposed hops of ring attention, collectives'
SM contention, the per-kernel launch floor, a chunked loss's logits made again), each
reported per layer in ``StateCost.effects``. Communication is priced by ``autopar.cost.comm``
(alpha-beta per link class). Memory per device is parameters + gradients + optimizer states
(by ZeRO stage and offload, bytes per parameter from ``autopar.cost.precision``) + the larger
of activations (by recompute, sequence parallelism and micro-batches in flight) + buffers,
during the backward, and the optimizer step's temporaries after it
(``autopar.cost.state.step_workspace``, by the profile's ``optimizer_implementation``).
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass, field

import sympy

from autopar.cost import chunked_loss, fp8
from autopar.cost import experts as moe_cost
from autopar.cost.comm import Placement, collective_time, grid_gemm_bytes
from autopar.cost.cp import context_comm
from autopar.cost.hardware import Hardware
from autopar.cost.layer import ZERO, Attention, Gemm, LayerType
from autopar.cost.state import StepTemps
from autopar.kernels.float8 import TENSORWISE
from autopar.modes import (
    BF16,
    CONTIGUOUS,
    CP,
    FP8,
    FP16,
    FP32,
    FULL,
    MEGATRON_SP,
    NO_RECOMPUTE,
    NO_SP,
    RING,
    SELECTIVE,
    TF32,
    TP_1D,
    TP_2D,
    TP_3D,
    TP_25D,
    TP_MODES,
    ZIGZAG,
)

FUSION = "inductor fusion (compile)"  # the effect compile=True prices (EFFECTS)

# The physical effects a step's time carries beyond an ideal device, as explain names them
# (StateCost.effects), each with where its price comes from.
EFFECTS = {
    "GEMM operand traffic": "each matrix multiplication also moves its operands and result "
                            "through HBM: (MK + KN + MN) bytes at memory_bandwidth x "
                            "memory_efficiency, added to its math (additive roofline, "
                            "Williams et al. 2009): small or thin per-rank GEMMs lose most",
    "memory-bound ops": "norms, activations, RoPE, dropout, casts, residual adds: their bytes "
                        "at memory_bandwidth x memory_efficiency",
    "kernel launch floor": "every kernel takes at least kernel_floor_s, however small",
    FUSION: "compile=True: each connected group of memory-bound ops is "
                                 "one inductor kernel that moves its inputs and outputs once "
                                 "(torch._inductor.scheduler's fusion; Ansel et al. 2024, "
                                 "PyTorch 2): the seconds it saves on the two above",
    "attention on short sequences": "fused attention's rate at S keys per query, "
                                    "S / (S + attention_half_tokens) of its best "
                                    "(FlashAttention-2, Dao 2023, Fig. 4 and 6)",
    "causal imbalance (contiguous cp)": "under a contiguous split the last chunk's rank does "
                                        "(2cp - 1)/cp of the mean causal work "
                                        "(Brandon et al. 2023, Striped Attention)",
    "cp ring hops exposed": "the first K/V hop and the gradient return wait; each other hop "
                            "hides only behind the attention step beside it",
    "collectives' SM contention": "overlapped collectives hold comm_sm_share of the SMs "
                                  "(NCCL runs one thread block per channel)",
    "expert routing imbalance": "the busiest rank of an ep group computes and receives "
                                "routing_imbalance x the mean rows (measured on the router "
                                "at initialisation, autopar.cost.experts); the others wait",
    **fp8.EFFECTS,
    **chunked_loss.EFFECTS,
}

ITEMSIZE = {FP8: 1, BF16: 2, FP16: 2, TF32: 4, FP32: 4}  # bytes of a GEMM operand


@dataclass(frozen=True)
class TensorMode:
    """A tensor-parallel mode over ``size`` devices: 1D, 2D (q x q), 2.5D (q x q x d),
    3D (q x q x q)."""

    name: str
    size: int
    q: int = 1
    d: int = 1

    @functools.cached_property
    def batch_split(self) -> int:
        """How many ways the multi-dimensional modes split the micro-batch of activations
        (read once per mode)."""
        return {TP_1D: 1, TP_2D: self.q, TP_25D: self.q * self.d, TP_3D: self.q * self.q}[self.name]

    def __str__(self) -> str:
        if self.name == TP_1D or self.size == 1:
            return self.name
        if self.name == TP_25D:
            return f"2.5d({self.q}x{self.q}x{self.d})"
        return f"{self.name}({'x'.join([str(self.q)] * (2 if self.name == TP_2D else 3))})"


@functools.lru_cache(maxsize=None)
def tensor_modes(size: int, allowed=TP_MODES) -> list[TensorMode]:
    """Every tensor mode that ``size`` devices can form."""
    out = [TensorMode(TP_1D, size)] if TP_1D in allowed else []
    if size < 4:
        return out
    q = math.isqrt(size)
    if TP_2D in allowed and q * q == size:
        out.append(TensorMode(TP_2D, size, q, 1))
    if TP_25D in allowed:  # depths d with size / d a square q^2, q > 1: d = size / q^2
        for q in range(math.isqrt(size // 2), 1, -1):
            if size % (q * q) == 0:
                out.append(TensorMode(TP_25D, size, q, size // (q * q)))
    c = round(size ** (1 / 3))
    if TP_3D in allowed and c > 1 and c ** 3 == size:
        out.append(TensorMode(TP_3D, size, c, c))
    return out


@dataclass(frozen=True)
class LayerState:
    """The strategy of one layer: tensor mode, sequence parallelism, recompute."""

    mode: TensorMode
    sp: str = NO_SP
    recompute: str = NO_RECOMPUTE

    @functools.cached_property
    def layout(self) -> tuple:
        """What the layer hands its neighbour: equal layouts need no conversion (read once
        per state: the search asks it of the same states many times)."""
        return (self.mode.name, self.mode.q, self.mode.d, self.sp)


@dataclass
class Context:
    """Everything fixed while layers are priced: hardware, mesh placement, options."""

    hw: Hardware
    dtype: str
    tp: Placement
    cp: Placement
    cp_mode: str | None = None
    # "flash" (FlashAttention-2), "unfused" (scores written to memory, pre-2022) or another
    # kernel the profile measured (attention_kernels, e.g. "flash1")
    attention_kernel: str = "flash"
    tp_groups: dict | None = None  # TensorMode -> {role: Placement} for q-sized groups
    ep: Placement | None = None  # the expert-parallel groups (None: experts on every rank)
    # under fp8, the layer kinds whose GEMMs stay in bf16 (autopar.cost.fp8.kept_high)
    kept_high: frozenset = frozenset()
    compile: bool = False  # inductor fuses each layer's memory-bound ops (parallelize's)
    # under fp8, the scaling recipe: only tensorwise scales all-reduce the amax of a tensor
    # tensor parallelism splits (Transformer Engine's, the published runs'); rowwise
    # (parallelize's default fp8_recipe) scales each row from the rank's piece of it
    fp8_recipe: str = TENSORWISE
    # collective and layer-layout prices already worked out under this context: the states
    # of one layer differ only in recompute and share its layout's compute and collectives
    _memo: dict = field(default_factory=dict, repr=False, compare=False)
    # prices that read only the hardware and what their keys hold (collectives by their
    # placement, a grid's GEMM collectives by the tensor placement): shared by the contexts
    # of one search, which differ in the cp placement and mode (None: this context's own)
    shared: dict | None = field(default=None, repr=False, compare=False)

    def coll(self, op: str, nbytes: float, placement: Placement) -> float:
        """Seconds of one collective under this context's hardware (memoised)."""
        memo = self._memo if self.shared is None else self.shared
        key = (op, nbytes, placement)
        hit = memo.get(key)
        if hit is None:
            hit = memo[key] = _coll(op, nbytes, placement, self.hw)
        return hit

    def of_layer(self, key: tuple, lt: LayerType, price, shared: bool = False):
        """``price()``, memoised under ``key`` for the layer kind ``lt`` (held by identity:
        a layer kind is priced from its own numbers, and a new one never hits); `shared`: in
        the prices shared with the search's other contexts, where ``key`` holds all the
        price reads of this context (this context's own where it shares none)."""
        memo = self.shared if shared and self.shared is not None else self._memo
        key = (id(lt), *key)
        hit = memo.get(key)
        if hit is None or hit[0] is not lt:
            hit = memo[key] = (lt, price())
        return hit[1]


@dataclass
class StateCost:
    """One layer, one micro-batch, one device."""

    forward: float  # seconds of compute
    backward: float
    recompute: float
    comm: float  # seconds of tensor/sequence-parallel communication not hidden by compute
    comm_bytes: float
    activations: float  # bytes kept for backward
    params: float  # bytes of parameters held
    # the share of comm / comm_bytes spent on the cp axis (sequence parallelism around
    # attention), so a report can split communication by mesh axis; the rest is on tp
    cp_comm: float = 0.0
    cp_comm_bytes: float = 0.0
    # seconds (forward, backward and recompute) each named physical effect adds over an
    # ideal device, for explain: see EFFECTS
    effects: dict = field(default_factory=dict)
    workspace: float = 0.0  # transient bytes while the layer runs (ring K/V receive buffers)
    # expert parallelism: the all-to-alls on the ep axis (included in comm / comm_bytes) and
    # the bytes of expert weights held (included in params), which ZeRO shards over the
    # expert-data group instead of every replica
    ep_comm: float = 0.0
    ep_comm_bytes: float = 0.0
    expert_params: float = 0.0
    # the for-loop optimizer step's temporaries over this layer's parameter tensors (bytes
    # of the weights per device, before ZeRO): autopar.cost.state.StepTemps
    step_temps: StepTemps = field(default_factory=StepTemps)
    # seconds a zero-bubble split backward adds (chunked_loss.SPLIT_NAME), not in `time`
    split_backward: float = 0.0

    @property
    def time(self) -> float:
        return self.forward + self.backward + self.recompute + self.comm


def gemm_time(flops: float, hw: Hardware, dtype: str, shape=None, itemsize: int = 2) -> float:
    """Seconds of one matrix multiplication of ``flops``: the math at the efficiency curve,
    plus, where the profile prices it (``gemm_operand_traffic``) and ``shape`` (local
    M, K, N) is known, the HBM time of its operands and result (:func:`gemm_traffic_s`)."""
    return _gemm_s(flops, hw, dtype, None if shape is None else
                   gemm_traffic_s(shape, hw, itemsize))


def _gemm_s(flops: float, hw: Hardware, dtype: str, traffic: float | None) -> float:
    """`gemm_time` given its operand traffic's seconds (None: not priced)."""
    if flops <= 0:
        return 0.0
    eff = hw.gemm_efficiency * flops / (flops + hw.gemm_half_flops)
    sec = flops / (hw.flops(dtype) * eff)
    if traffic is not None:
        sec += traffic
    return max(sec, hw.kernel_floor_s)


def gemm_traffic_s(shape, hw: Hardware, itemsize: int = 2) -> float:
    """Seconds a GEMM of local shape (M, K, N) spends moving A (M x K), B (K x N) and C
    (M x N) through HBM beyond its math: the additive roofline (compute time + memory time,
    Williams et al. 2009's bound without overlap), times the profile's
    ``gemm_operand_traffic``. Its share of a GEMM is ridge / (ridge + intensity), so
    at equal shapes it costs an H100 (ridge ~ 295 FLOP/B) about twice what it costs an
    A100 (~ 166): the reason larger GEMMs run faster (Megatron-LM README, weak scaling)."""
    share = hw.gemm_operand_traffic
    if not share:
        return 0.0
    m, k, n = shape
    return share * itemsize * (m * k + k * n + m * n) / (hw.memory_bandwidth *
                                                        hw.memory_efficiency)


def local_gemm_shape(g: Gemm, batch: float, split: int, rows: int) -> tuple:
    """(M, K, N) one rank multiplies: ``rows`` ways over tokens (context parallelism, the
    batch split of 2D/2.5D/3D), ``split`` ways over the larger of K and N (Megatron's column
    split of QKV and the first MLP linear, the row split of the second and of the
    vocabulary projection: the wide side is the one cut)."""
    m = g.flops(batch) / (2 * g.k * g.n) / rows
    if g.n >= g.k:
        return (m, g.k, g.n / split)
    return (m, g.k / split, g.n)


def attention_time(flops: float, keys: float, causal: bool, hw: Hardware, dtype: str,
                   kernel: str = "flash") -> float:
    """Seconds of a fused attention kernel on ``flops`` (the full, unmasked count) over
    ``keys`` keys per query: FlashAttention's rate falls on short sequences (Dao 2023,
    arXiv 2307.08691, Fig. 4 and 6) and a causal mask skips the masked half of the blocks.
    ``kernel``: "flash" (FlashAttention-2) or a name in the profile's attention_kernels."""
    if flops <= 0:
        return 0.0
    best, half = hw.attention_efficiency, hw.attention_half_tokens
    if kernel != "flash":
        if kernel not in hw.attention_kernels:
            raise ValueError(f"device '{hw.name}' has no measured curve for attention kernel "
                             f"'{kernel}'; it knows flash, unfused"
                             + "".join(f", {k}" for k in hw.attention_kernels) + ".")
        best, half = (hw.attention_kernels[kernel][k] for k in ("efficiency", "half_tokens"))
    if best is None:
        return gemm_time(flops, hw, dtype)
    fill = 1.0 if math.isinf(keys) or keys <= 0 else keys / (keys + half)  # <= 0: unknown
    eff = best * fill
    return max((flops / 2 if causal else flops) / (hw.flops(dtype) * eff), hw.kernel_floor_s)


def attention_keys(a: Attention, cp: int, cp_mode: str | None) -> float:
    """Keys per query one attention kernel call sees: ring attention runs one call per
    block of S/cp keys; Ulysses gathers the whole sequence for a subset of heads."""
    return a.keys / cp if cp > 1 and cp_mode == RING else a.keys


def causal_imbalance(cp: int, layout: str) -> float:
    """How much more causal attention the busiest rank does than the average: under a
    contiguous split the rank holding the last chunk computes cp - 1/2 of the cp x cp key
    blocks' unmasked work against cp/2 on average (Brandon et al. 2023, arXiv 2311.09431,
    Striped Attention); the zigzag split (two mirrored chunks per rank) evens it out."""
    return (2 * cp - 1) / cp if cp > 1 and layout == CONTIGUOUS else 1.0


def memory_time(nbytes: float, hw: Hardware) -> float:
    return max(nbytes, 0.0) / (hw.memory_bandwidth * hw.memory_efficiency)


def _coll(op: str, nbytes: float, placement: Placement, hw: Hardware) -> float:
    if placement.size <= 1 or nbytes <= 0:
        return 0.0
    return collective_time(op, nbytes, placement, hw)


@dataclass(frozen=True)
class _LayoutCost:
    """What one layer kind costs under one layout (tensor mode and sequence parallelism),
    whatever it recomputes: the states of a layout share all of it."""

    gemm_fwd: float
    gemm_traffic: float
    attn_each: tuple  # per attention core: forward seconds on the busiest cp rank
    attn_fwd: float
    attn_ideal: float
    attn_even: float
    mem_roof: float
    mem_fwd: float
    fused_fwd: float  # mem_fwd as inductor runs it (ctx.compile; else mem_fwd)
    forward: float
    tp_comm: tuple  # 1D: (forward phase, seconds, wire bytes) per collective, in order
    ep: int  # expert-parallel size of this layer's experts (1: none, or no experts)
    imbalance: float  # the busiest ep rank's rows over the mean (1.0 without ep)
    expert_fwd: float  # the grouped expert GEMMs' forward seconds on the busiest ep rank
    expert_even: float  # ... were the routing balanced
    fp8_casts: tuple = (0.0, 0.0)  # (forward, backward) seconds of fp8 casts and amax passes
    fp8_gemms: int = 0  # GEMMs that run in float8 (each scales its operands)
    remade: float = 0.0  # seconds of a chunked loss's logits its backward makes again
    remade_split: float = 0.0  # ... a zero-bubble weight half's (from a single chunk too)


def _layout_cost(lt: LayerType, mode: TensorMode, sp: bool, batch: float,
                 ctx: Context) -> _LayoutCost:
    """`_LayoutCost` of ``lt`` (memoised in ``ctx`` by the layer object's identity)."""
    return ctx.of_layer(("layout", mode, sp, batch), lt,
                        lambda: _price_layout(lt, mode, sp, batch, ctx))


def _attention_cost(lt: LayerType, sharded, mode: TensorMode, batch: float, ctx: Context,
                    dtype: str) -> tuple[tuple, float, float, float]:
    """The layer's attention cores on the busiest cp rank: (seconds of each, their sum, the
    sum were every sequence long enough to reach the kernel's peak, the sum were the causal
    work even over cp)."""
    hw, t, c, one_d = ctx.hw, mode.size, ctx.cp.size, mode.name == TP_1D
    attn_fwd = attn_ideal = attn_even = 0.0
    attn_each = []
    for a, split in zip(lt.attention, sharded.attention_split if one_d else
                        [True] * len(lt.attention)):
        parts = (t if split or not one_d else 1) * c
        if ctx.attention_kernel == "unfused":
            # scores written by the first GEMM, softmax read+write, dropout read+write+mask,
            # read by the second GEMM: about six passes over B·H·S·S_k values
            sec = gemm_time(a.flops(batch) / parts, hw, dtype) + memory_time(
                6 * a.score_elements(batch) * lt.dtype_bytes / parts, hw)
            even = ideal = sec
        else:
            keys = attention_keys(a, c, ctx.cp_mode)
            kernel = ctx.attention_kernel
            even = attention_time(a.flops(batch) / parts, keys, a.causal, hw, dtype, kernel)
            ideal = attention_time(a.flops(batch) / parts, math.inf, a.causal, hw, dtype, kernel)
            layout = CONTIGUOUS if a.keys % (2 * c) else ZIGZAG
            sec = even * (causal_imbalance(c, layout) if a.causal and ctx.cp_mode == RING
                          else 1.0)
        attn_each.append(sec)
        attn_fwd += sec
        attn_ideal += ideal
        attn_even += even
    return tuple(attn_each), attn_fwd, attn_ideal, attn_even


def _price_layout(lt: LayerType, mode: TensorMode, sp: bool, batch: float,
                  ctx: Context) -> _LayoutCost:
    hw, dtype = ctx.hw, fp8.compute_dtype(ctx.dtype)
    t = mode.size
    c = ctx.cp.size
    sharded = lt.sharded[t if mode.name == TP_1D else 1]
    one_d = mode.name == TP_1D
    # Compute: GEMMs at their local size (each of the backward's two GEMMs is as large).
    gemm_fwd = gemm_traffic = 0.0
    rows = c * (1 if one_d else mode.batch_split)
    itemsize = ITEMSIZE.get(dtype, 4)
    ep = ctx.ep.size if ctx.ep is not None and lt.experts is not None else 1
    imbalance = moe_cost.imbalance_of(lt.experts, batch, c, ep) if ep > 1 else 1.0
    expert_fwd = expert_even = 0.0
    casts = [0.0, 0.0]
    fp8_gemms = 0
    for g, split in zip(lt.gemms, sharded.gemm_split if one_d else [True] * len(lt.gemms)):
        if g.expert:  # each expert's FFN width split over 1D tp (not beside cp), or whole
            cut = t if one_d and split and c == 1 else 1
            sec, even, traffic_s = _expert_gemm(g, batch, c, ep, imbalance, hw, dtype, cut,
                                                lt.experts.hidden)
            gemm_fwd += sec
            gemm_traffic += traffic_s
            expert_fwd += sec
            expert_even += even
            continue
        parts = t if split or not one_d else 1
        local = g.flops(batch) / (parts * c)
        shape = local_gemm_shape(g, batch, parts * c // rows if g.weight else 1,
                                 rows if g.weight else parts * c)
        if fp8.runs_fp8(ctx.dtype, g, lt, ctx.kept_high):
            moved = hw.gemm_operand_traffic * memory_time(fp8.operand_bytes(shape), hw)
            sec = _gemm_s(local, hw, fp8.FP8, moved)
            casts = [x + memory_time(nbytes, hw) for x, nbytes in
                     zip(casts, fp8.cast_bytes(shape))]
            fp8_gemms += 1
        else:
            moved = gemm_traffic_s(shape, hw, itemsize)
            sec = _gemm_s(local, hw, dtype, moved)
        gemm_fwd += sec
        gemm_traffic += min(sec, moved)
    attn_each, attn_fwd, attn_ideal, attn_even = _attention_cost(lt, sharded, mode, batch, ctx,
                                                                 dtype)
    if one_d:
        traffic = sharded.traffic_split(batch) + sharded.traffic_replicated(batch) / (t if sp else 1)
    else:
        traffic = lt.traffic(batch) / t
    mem_roof = memory_time(traffic / c, hw)
    mem_kernels = max(0, lt.kernels - len(lt.gemms) - len(lt.attention))
    mem_fwd = fused_fwd = max(mem_roof, mem_kernels * hw.kernel_floor_s)
    if ctx.compile:  # the same share of bytes under every layout, one kernel per group
        fused_fwd = max(mem_roof * lt.fused_share(batch), lt.fused_kernels * hw.kernel_floor_s)
    forward = gemm_fwd + attn_fwd + fused_fwd + casts[0]
    tp_comm = []
    if one_d and t > 1:
        for op, phase, nbytes in sharded.comm + (sharded.expert_comm if c == 1 else []):
            n = nbytes(batch) / c
            if sp and op == "all_reduce" and lt.is_block:
                # Megatron-SP: each all-reduce around a tensor-parallel region becomes a
                # reduce-scatter into the sequence-split region and an all-gather out of it
                sec = ctx.coll("reduce_scatter", n, ctx.tp) + ctx.coll("all_gather", n, ctx.tp)
            else:
                sec = ctx.coll(op, n, ctx.tp)
            tp_comm.append((phase == "forward", sec, _wire_bytes(op, n, t)))
    flops, chunk = sharded.loss_remade or (ZERO, ())  # the chunked loss's logits made again
    remade = [memory_time(moved, hw) + n * gemm_time(2 * math.prod(s), hw, dtype, s, itemsize)
              for n, s, moved in chunked_loss.remade_both(flops(batch / c), chunk, itemsize)]
    return _LayoutCost(gemm_fwd, gemm_traffic, attn_each, attn_fwd, attn_ideal,
                       attn_even, mem_roof, mem_fwd, fused_fwd, forward, tuple(tp_comm), ep,
                       imbalance, expert_fwd, expert_even, tuple(casts), fp8_gemms, *remade)


def state_cost(lt: LayerType, state: LayerState, batch: float, ctx: Context) -> StateCost:
    """Price one layer kind under one state for a micro-batch of ``batch`` samples."""
    mode = state.mode
    t = mode.size
    c = ctx.cp.size
    sharded = lt.sharded[t if mode.name == TP_1D else 1]
    one_d = mode.name == TP_1D
    sp = state.sp == MEGATRON_SP and one_d and t > 1
    lay = _layout_cost(lt, mode, sp, batch, ctx)
    attn_fwd, forward = lay.attn_fwd, lay.forward
    # the backward's two GEMMs per forward one; its fp8 casts are its own (fp8.cast_bytes)
    backward = 2 * (forward - lay.fp8_casts[0]) + lay.fp8_casts[1]
    recompute = {NO_RECOMPUTE: 0.0, SELECTIVE: attn_fwd, FULL: forward}[state.recompute]
    # Communication inside the layer (not overlapped with its compute).
    comm = comm_bytes = 0.0
    if one_d and t > 1:
        full = state.recompute == FULL
        for forward_phase, sec, wire in lay.tp_comm:
            reruns = 2 if forward_phase and full else 1
            comm += reruns * sec
            comm_bytes += reruns * wire
    elif t > 1:
        full = state.recompute == FULL
        sec, nbytes = grid_comm(lt, mode, batch, ctx, full)
        comm += sec
        comm_bytes += nbytes
    cp_comm = cp_bytes = 0.0
    rerun = state.recompute in (FULL, SELECTIVE)  # the attention forward runs twice
    effects = {}
    workspace = 0.0
    if c > 1 and lt.attention:
        ring = ctx.of_layer((CP, mode, sp, batch, rerun), lt, lambda: context_comm(
            lt, mode, batch, ctx, list(lay.attn_each), rerun))
        cp_bytes, workspace = ring.nbytes, ring.workspace
        cp_comm = ring.exposed + ring.contention
        comm += cp_comm
        comm_bytes += cp_bytes
        effects["cp ring hops exposed"] = ring.exposed if ctx.cp_mode == RING else 0.0
        effects["collectives' SM contention"] = ring.contention
    a_runs = 3 + rerun
    effects["attention on short sequences"] = a_runs * (lay.attn_even - lay.attn_ideal)
    effects["causal imbalance (contiguous cp)"] = a_runs * (attn_fwd - lay.attn_even)
    runs = 3 + (state.recompute == FULL)
    if lay.fp8_gemms:
        amax = _fp8_amax(lay.fp8_gemms, t, state.recompute == FULL, ctx)
        comm += amax
        comm_bytes += _fp8_amax(lay.fp8_gemms, t, state.recompute == FULL, ctx, wire=True)
        effects["fp8 amax all-reduce (tp)"] = amax
        effects["fp8 casts and amax"] = sum(lay.fp8_casts) + \
            (lay.fp8_casts[0] if state.recompute == FULL else 0.0)
    effects["GEMM operand traffic"] = runs * lay.gemm_traffic
    effects["memory-bound ops"] = runs * lay.mem_roof
    effects["kernel launch floor"] = runs * (lay.mem_fwd - lay.mem_roof)  # beyond their bytes
    effects[FUSION] = runs * (lay.fused_fwd - lay.mem_fwd)  # <= 0
    ep_comm = ep_bytes = 0.0
    ep, imbalance = lay.ep, lay.imbalance
    cut, expert_params = _expert_share(lt, sharded, one_d, c, ep)
    if lt.experts is not None:
        if ep > 1:
            reruns = 2 if state.recompute == FULL else 1
            ep_comm, ep_bytes, _ = moe_cost.alltoall_s(lt.experts, batch, c, ctx.ep, ctx.hw,
                                                       imbalance, reruns)
            comm += ep_comm
            comm_bytes += ep_bytes
            a2a_even = moe_cost.alltoall_s(lt.experts, batch, c, ctx.ep, ctx.hw, 1.0, reruns)[0]
            effects["expert routing imbalance"] = runs * (lay.expert_fwd - lay.expert_even) + \
                ep_comm - a2a_even
            # the rows received and the expert outputs sent back, held while the layer runs
            workspace = max(workspace, 2 * imbalance *
                            moe_cost.dispatch_bytes(lt.experts, batch, c))
    # a loss's logits while it runs (its tokens split over cp)
    workspace = max(workspace, sharded.loss_workspace(batch / c))
    acts, params = _held_bytes(lt, state, sharded, batch, c, expert_params)
    effects[chunked_loss.REMADE_NAME] = lay.remade  # (split: remade_split once more, zero-bubble)
    return StateCost(forward, backward + lay.remade, recompute, comm, comm_bytes, acts, params,
                     cp_comm, cp_bytes, effects, workspace, ep_comm, ep_bytes, expert_params,
                     _step_temps(lt, mode, sharded, ep, cut), lay.remade_split)


def _held_bytes(lt: LayerType, state: LayerState, sharded, batch: float, c: int,
                expert_params: float) -> tuple[float, float]:
    """(activations kept for the backward, parameters held) per device of one layer kind
    under `state`, beside a cp axis of `c` ranks (`expert_params`: its experts' share)."""
    mode = state.mode
    t, one_d = mode.size, mode.name == TP_1D
    sp = state.sp == MEGATRON_SP and one_d and t > 1
    if state.recompute == FULL:
        acts = lt.input_bytes(batch) / (t if (sp or not one_d) else 1)
    elif one_d:
        acts = sharded.act_split(batch) + sharded.act_replicated(batch) / (t if sp else 1)
        if state.recompute == NO_RECOMPUTE:
            acts += sharded.act_attention(batch)
    else:
        whole = sharded.act_split(batch) + sharded.act_replicated(batch)
        if state.recompute == NO_RECOMPUTE:
            whole += sharded.act_attention(batch)
        acts = whole / t
        if mode.name == TP_3D:
            acts += _gathered_3d(lt, mode, batch)
    acts /= c
    return acts, _params_held(lt, mode, sharded, expert_params)


def _params_held(lt: LayerType, mode: TensorMode, sharded, expert_params: float) -> float:
    """Parameter bytes per device of one layer kind under tensor mode ``mode``."""
    # each rank holds its E/ep experts, each split over 1D tp (whole in the other modes)
    expert_whole = lt.experts.param_bytes if lt.experts is not None else 0
    if mode.name == TP_1D:
        params = sharded.param_bytes - expert_whole / sharded.expert_split
    else:  # the grid kernels cut a matrix over q^2 (2D, 2.5D) or q^3 (3D) ranks, a bias, a
        # norm's weight or an embedding's table over q (autopar.kernels.multid)
        vectors = sum(b for b, one in zip(sharded.param_tensors, sharded.param_vectors) if one)
        params = (lt.param_bytes - expert_whole - vectors) / _grid_parts(mode) + \
            vectors / mode.q
    return params + expert_params


def state_params(lt: LayerType, state: LayerState, ctx: Context) -> tuple[float, float]:
    """(parameter bytes held per device, of them the experts') of one layer kind under
    ``state``: `state_cost`'s ``params`` and ``expert_params``, to the bit, without pricing
    the rest (they follow from the layer's sizes and the tensor and expert split alone)."""
    mode = state.mode
    one_d = mode.name == TP_1D
    sharded = lt.sharded[mode.size if one_d else 1]
    ep = ctx.ep.size if ctx.ep is not None else 1
    _, expert_params = _expert_share(lt, sharded, one_d, ctx.cp.size, ep)
    return _params_held(lt, mode, sharded, expert_params), expert_params


def _expert_share(lt: LayerType, sharded, one_d: bool, c: int, ep: int) -> tuple[int, float]:
    """(the tp ranks each expert is split over, the experts' parameter bytes per device):
    each of ep ranks holds E/ep experts, split over 1D tp (kept whole beside cp)."""
    cut = sharded.expert_split if one_d and c == 1 else 1
    expert = lt.experts.param_bytes / ep / cut if lt.experts is not None else 0.0
    return cut, expert


def _fp8_amax(gemms: int, t: int, full: bool, ctx: Context, wire: bool = False) -> float:
    """Seconds (or wire bytes) of the fp8 amax all-reduces over tp of one micro-batch: one
    forward (twice under full recompute) and one backward, each of the layer's amaxes. The
    rowwise recipe scales each row from the rank's own piece of it: nothing to reduce."""
    if t <= 1 or ctx.fp8_recipe != TENSORWISE:
        return 0.0
    nbytes = fp8.amax_bytes(gemms)
    runs = 3 if full else 2
    return runs * (_wire_bytes("all_reduce", nbytes, t) if wire else
                   ctx.coll("all_reduce", nbytes, ctx.tp))


def _grid_parts(mode: TensorMode) -> int:
    """The ranks a 2D, 2.5D or 3D grid cuts a weight matrix over (2.5D keeps a copy per
    depth layer)."""
    return mode.q * mode.q if mode.name == TP_25D else mode.size


def _step_temps(lt: LayerType, mode: TensorMode, sharded, ep: int, cut: int) -> StepTemps:
    """The layer's parameter tensors per device, in order, as the optimizer steps them: 1D
    as the catalog splits each, 2D and 3D 1/t of each matrix, 2.5D 1/q^2 (as `params` above), then
    its experts (a stacked one 1/ep, each 1/cut); a grid's biases and norms 1/q."""
    if mode.name == TP_1D:
        dense = list(sharded.param_tensors)
    else:
        vectors = sharded.param_vectors or (False,) * len(sharded.param_tensors)
        dense = [b / (mode.q if one else _grid_parts(mode))
                 for b, one in zip(sharded.param_tensors, vectors)]
    experts = [b / (ep if stacked else 1) / cut
               for b, stacked in (lt.experts.tensors if lt.experts is not None else ())]
    return StepTemps.of(dense + experts)


def _expert_gemm(g: Gemm, batch: float, cp: int, ep: int, imbalance: float, hw: Hardware,
                 dtype: str, tp: int = 1, hidden: int = 0) -> tuple[float, float, float]:
    """(seconds, seconds under balanced routing, operand-traffic seconds) of one grouped
    expert matmul on the busiest rank: its tokens' rows (1/cp of the micro-batch's) times
    `imbalance` under ep, one kernel over E/ep local experts whose weights it reads once each.
    `tp`: the tensor ranks each expert's FFN width is split over (the FFN side of the GEMM,
    its K when it maps back to `hidden`, else its N)."""
    itemsize = ITEMSIZE.get(dtype, 4)
    k, n = (g.k / tp, g.n) if g.n == hidden else (g.k, g.n / tp)

    def seconds(share: float) -> tuple[float, float]:
        flops = g.flops(batch) / cp * share / tp
        m = flops / (2 * k * n)
        traffic = gemm_traffic_s((m, k, n), hw, itemsize) + gemm_traffic_s(
            (0, k, n), hw, itemsize) * (g.groups / ep - 1)
        return gemm_time(flops, hw, dtype) + traffic, traffic

    sec, traffic = seconds(imbalance)
    return sec, seconds(1.0)[0], traffic


def _gathered_3d(lt: LayerType, mode: TensorMode, batch: float) -> float:
    """What 3D keeps for backward beyond its share of the layer's saved values: each
    linear keeps the activation and the weight as gathered over a group of q (1/q^2 of
    the whole, not 1/q^3), so the backward needs no second gather."""
    q, e = mode.q, lt.dtype_bytes
    extra = 0.0
    for g in lt.gemms:
        if g.weight and not g.expert:
            m = g.flops(batch) / (2 * g.k * g.n)
            extra += (m * g.k + g.k * g.n) * e * (1 / q ** 2 - 1 / q ** 3)
    return extra


def _wire_bytes(op: str, nbytes: float, p: int) -> float:
    """Bytes one rank sends for a collective on ``nbytes`` (ring algorithms)."""
    if op == "all_reduce":
        return 2 * (p - 1) / p * nbytes
    if op in ("all_gather", "reduce_scatter", "all_to_all"):
        return (p - 1) / p * nbytes
    return nbytes


def grid_comm(lt: LayerType, mode: TensorMode, batch: float, ctx: Context,
              full_recompute: bool) -> tuple[float, float]:
    """(seconds, wire bytes) of the weight GEMMs' collectives of one layer under a 2D, 2.5D
    or 3D ``mode`` for a micro-batch of ``batch`` samples (`_multi_d_comm`), memoised in
    ``ctx``: `state_cost` prices them so, and the search's floors read the same figures."""
    # without tp_groups it reads the tensor placement and the cp size alone: one price for
    # every cp placement and mode, shared by the search's contexts
    shared = ctx.tp_groups is None
    key = ("multi-d", mode, batch / ctx.cp.size, full_recompute, ctx.tp) if shared else \
        ("multi-d", mode, batch, full_recompute)
    return ctx.of_layer(key, lt, lambda: _multi_d_comm(lt, mode, batch / ctx.cp.size, ctx,
                                                       full_recompute), shared)


def _multi_d_comm(lt: LayerType, mode: TensorMode, batch: float, ctx: Context,
                  full_recompute: bool) -> tuple[float, float]:
    """Communication of the weight GEMMs of one layer under 2D, 2.5D or 3D.

    Per GEMM with activations M x K, weight K x N and output M x N (bytes e per value):
    2D SUMMA (Xu et al. 2021, arXiv 2104.05343): forward broadcasts the blocks of the
    activation along rows and of the weight along columns, (q-1)(MK + KN)/q^2 values per
    device; backward, dX = dY W^T broadcasts the weight blocks and reduces the partial dX
    blocks, dW = X^T dY broadcasts the activation blocks and reduces the partial dW
    blocks: 2(q-1)(MK + KN)/q^2 (the output gradient never moves), as
    ``autopar.kernels.multid`` runs it. 2.5D (Wang et al. 2021, arXiv 2105.14500): the same
    on M/d rows per depth layer, plus an all-reduce of the weight gradient over the d
    layers. 3D (Bian et al. 2021, arXiv 2105.14450): forward all-gathers the activation
    and the weight and reduce-scatters the output within groups of q,
    (q-1)(MK + KN + MN)/q^3 values; backward gathers the output gradient and
    reduce-scatters the two input gradients, the same volume (the gathered activation and
    weight are kept from the forward).
    """
    q, d = mode.q, mode.d
    group = _group(mode, ctx)
    seconds = nbytes_total = 0.0
    for mk, kn, mn in grid_gemm_bytes(lt, batch):
        if mode.name == TP_2D:
            fwd = (q - 1) * (mk + kn) / q ** 2
            bwd = 2 * fwd
            extra = 0.0
        elif mode.name == TP_25D:
            fwd = (q - 1) * (mk / d + kn) / q ** 2
            bwd = 2 * fwd
            extra = ctx.coll("all_reduce", kn / q ** 2, _depth(mode, ctx))
            nbytes_total += 2 * (d - 1) / d * kn / q ** 2
        else:
            fwd = (q - 1) * (mk + kn + mn) / q ** 3
            bwd = fwd
            extra = 0.0
        runs = 2 if full_recompute else 1
        # each received volume v travels as a broadcast/gather among q ranks: price it as an
        # all-gather whose whole tensor is v * q / (q - 1)
        for v, k in ((fwd, runs), (bwd, 1)):
            seconds += k * ctx.coll("all_gather", v * q / (q - 1), group)
            nbytes_total += k * v
        seconds += extra
    return seconds, nbytes_total


def _group(mode: TensorMode, ctx: Context) -> Placement:
    if ctx.tp_groups and mode in ctx.tp_groups:
        return ctx.tp_groups[mode]["q"]
    inner = min(mode.q, ctx.tp.per_node)
    return Placement(mode.q, inner, ctx.tp.sharing)


def _depth(mode: TensorMode, ctx: Context) -> Placement:
    if ctx.tp_groups and mode in ctx.tp_groups:
        return ctx.tp_groups[mode]["d"]
    inner = max(1, min(mode.d, ctx.tp.per_node // (mode.q * mode.q)))
    return Placement(mode.d, inner, ctx.tp.sharing)


def formulas() -> dict[str, sympy.Expr]:
    """The per-layer formulas, as sympy, for explain to print."""
    b, s, h, a, t, L = sympy.symbols("b s h a t L", positive=True)
    return {
        # Korthikanti et al. 2022 (arXiv 2205.05198) Table 2, bytes per layer, 16-bit values
        "activations 1d": s * b * h * (10 + 24 / t + 5 * a * s / (h * t)),
        "activations 1d+sp": s * b * h * (34 / t + 5 * a * s / (h * t)),
        "activations 1d+sp+selective": 34 * s * b * h / t,
        "activations full recompute": 2 * s * b * h,
        # Megatron-LM per-layer all-reduces of 2bsh bytes, forward and backward
        "tp comm 1d (ring)": 4 * 2 * (t - 1) / t * 2 * b * s * h,
        "model flops (Narayanan et al. 2021, Eq. 3)":
            96 * b * s * L * h ** 2 * (1 + s / (6 * h)),
    }
