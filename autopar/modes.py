"""The vocabulary of parallel modes (mesh axes, tensor and sequence modes, schedules, ZeRO,
recomputation) and what the runtime executes (`RUNTIME`), which the search,
`Plan.unsupported()` and `parallelize(plan=None)` read."""

from __future__ import annotations

from dataclasses import dataclass

# Mesh axes. ORDER is the device order, innermost first: tensor ranks are neighbours
# (one NVLink domain), then context, data and pipeline ranks.
PP, DP, CP, TP = "pp", "dp", "cp", "tp"
EP = "ep"
AXES = (PP, DP, CP, TP)
ORDER = (TP, CP, DP, PP)

# Tensor parallelism: Megatron 1D, SUMMA 2D (Xu et al. 2021), Tesseract 2.5D (Wang et al.
# 2021) and 3D (Bian et al. 2021).
TP_1D, TP_2D, TP_25D, TP_3D = "1d", "2d", "2.5d", "3d"
TP_MODES = (TP_1D, TP_2D, TP_25D, TP_3D)
GRID_MODES = (TP_2D, TP_25D, TP_3D)

# Sequence parallelism over the cp axis: DeepSpeed-Ulysses all-to-all or ring attention,
# with a contiguous or zigzag (load-balanced causal) token layout.
ULYSSES, RING = "ulysses", "ring"
SEQUENCE_MODES = (ULYSSES, RING)
ZIGZAG, CONTIGUOUS = "zigzag", "contiguous"
SEQUENCE_LAYOUTS = (ZIGZAG, CONTIGUOUS)
MEGATRON_SP = "megatron"  # Korthikanti et al. 2022: norms/dropout split on the sequence
NO_SP = "none"
LAYER_SP = (NO_SP, MEGATRON_SP)  # what one layer's `sp` may be

# Pipeline schedules: GPipe, 1F1B (PipeDream-Flush), interleaved 1F1B (Narayanan et al.
# 2021), zero-bubble ZB-H1 (Qi et al. 2024).
GPIPE, ONE_F_ONE_B, INTERLEAVED, ZERO_BUBBLE = "gpipe", "1f1b", "interleaved", "zero_bubble"
SCHEDULES = (GPIPE, ONE_F_ONE_B, INTERLEAVED, ZERO_BUBBLE)
NO_PIPELINE = "none"  # the schedule a candidate without a pipeline names

ZERO_STAGES = (0, 1, 2, 3)  # Rajbhandari et al. 2020
NO_RECOMPUTE, SELECTIVE, FULL = "none", "selective", "full"
RECOMPUTE = (NO_RECOMPUTE, SELECTIVE, FULL)  # Korthikanti et al. 2022 (selective), Chen 2016

STEP = "(step)"  # the layer of what a step sends outside the graph (gradient sync, ZeRO)


def cp_layout(mode: str | None, layout: str | None) -> str:
    """The token layout over cp: `layout` when given, else zigzag under ring attention and
    contiguous under Ulysses."""
    if layout is not None:
        return layout
    return CONTIGUOUS if mode == ULYSSES else ZIGZAG


@dataclass(frozen=True)
class Capabilities:
    """What a runtime executes; a search restricted to it proposes only runnable plans."""

    tp_modes: tuple[str, ...] = TP_MODES
    axes: tuple[str, ...] = AXES
    cp_with_tp: tuple[str, ...] = TP_MODES  # tensor modes a cp axis may run beside
    cp_with_megatron_sp: bool = True
    recompute: tuple[str, ...] = RECOMPUTE
    zero: tuple[int, ...] = ZERO_STAGES
    zero_with_pp: tuple[int, ...] = ZERO_STAGES  # stages that run beside a pipeline
    sequence_parallel: tuple[str, ...] = (MEGATRON_SP,)
    schedules: tuple[str, ...] = SCHEDULES
    offload: bool = True
    offload_zero3_single_rank: bool = True  # ZeRO-3 offload with one data-parallel rank
    accumulation: bool = True  # micro-batches without a pipeline
    tp_depth: int | None = None  # the one 2.5D depth a plan's grid layers take (None: any)


# What the planner can price: everything.
PLANNER = Capabilities()

# What autopar's runtime executes today.
RUNTIME = Capabilities(
    cp_with_tp=(TP_1D,),  # cp beside 1D tensor parallelism ...
    cp_with_megatron_sp=False,  # ... without Megatron-SP
    recompute=("none",),
    offload_zero3_single_rank=False,
    # without a pipeline a replica's batch runs in one pass: micro-batches (and ZeRO-2/3's
    # per-micro-batch collectives) come with pp > 1 only
    accumulation=False,
)
