"""The vocabulary of parallel modes (mesh axes, tensor and sequence modes, schedules, ZeRO,
recomputation) and what the runtime executes (`RUNTIME`), which the search,
`Plan.unsupported()` and `parallelize(plan=None)` read."""

from __future__ import annotations

from dataclasses import dataclass

# Mesh axes. ORDER is the device order, innermost first: tensor ranks are neighbours
# (one NVLink domain), then context, data and pipeline ranks.
PP, DP, CP, TP = "pp", "dp", "cp", "tp"
AXES = (PP, DP, CP, TP)  # the world's factorisation: their sizes multiply to the world
ORDER = (TP, CP, DP, PP)
# The expert axis is no factor of the world: MoE experts are split over ep ranks that lie
# inside the data x context ranks (Megatron-Core, DeepSpeed-MoE), neighbours first; the ranks
# that hold the same experts form the expert-data axis, over which expert gradients are
# averaged.
EP, EDP = "ep", "edp"
# No axis either: the group of the dp x cp ranks that split the tokens (the MoE balance
# loss's statistics are summed over it; its collectives are logged on axis dp).
TOKENS = "dp_cp"
# Hybrid sharded data parallelism (HSDP; Zhao et al. 2023, PyTorch FSDP §3.2.2): ZeRO's
# state cut over a shard group of dp_shard neighbouring dp ranks, the shard groups
# replicas of one another over dp_replicate (dp = dp_replicate x dp_shard). Neither is a
# factor of the world beside dp: both lie inside it, and their collectives log on these axes.
DP_SHARD, DP_REPLICATE = "dp_shard", "dp_replicate"
# A layout axis, no group: Megatron-SP beside cp splits a rank's cp block of the sequence
# again over tp (cp major, tp minor); its collectives run over tp alone.
CP_TP = "cp_tp"


@dataclass(frozen=True)
class MeshSize:
    """A mesh size a user may fix: the command line's `--<axis>` flag (help text and all)
    and the search constraint of the same name."""

    axis: str
    help: str


# Every size the command line offers and the search takes as a constraint, in the order
# `--help` lists them. Distinct from AXES: an axis laid inside others (not a factor of the
# world) has a size here and no place in AXES. A new axis is one entry: the flag, its
# range check and its pass-through to the search follow.
MESH_SIZES = (
    MeshSize(TP, "tensor-parallel size (with --tp-mode: 1d, or a 2D/2.5D/3D grid)"),
    MeshSize(PP, "pipeline stages"),
    MeshSize(DP, "data-parallel size (ZeRO shards over it)"),
    MeshSize(CP, "context-parallel size: the sequence split over it (with --sp ulysses|ring)"),
    MeshSize(EP, "expert-parallel size: MoE experts split over ep ranks inside dp x cp"),
    MeshSize(DP_SHARD, "hybrid sharding: ZeRO shards over groups of this many neighbouring "
                       "dp ranks, replicated over the rest of dp"),
)

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
NO_TP = "none"  # a layer's tensor mode where the tp axis is 1 (as the HTML report labels it)

# Pipeline schedules: GPipe, 1F1B (PipeDream-Flush), interleaved 1F1B (Narayanan et al.
# 2021), zero-bubble ZB-H1 (Qi et al. 2024).
GPIPE, ONE_F_ONE_B, INTERLEAVED, ZERO_BUBBLE = "gpipe", "1f1b", "interleaved", "zero_bubble"
SCHEDULES = (GPIPE, ONE_F_ONE_B, INTERLEAVED, ZERO_BUBBLE)
NO_PIPELINE = "none"  # the schedule a candidate without a pipeline names

ZERO_STAGES = (0, 1, 2, 3)  # Rajbhandari et al. 2020
NO_RECOMPUTE, SELECTIVE, FULL = "none", "selective", "full"
RECOMPUTE = (NO_RECOMPUTE, SELECTIVE, FULL)  # Korthikanti et al. 2022 (selective), Chen 2016

# Precisions: parallelize(precision=...), the CLI's --dtype, the dtypes a profile's peak rate
# is given for (tf32: fp32 matmuls on tensor cores) and the bytes of a GEMM operand.
FP32, TF32, BF16, FP16, FP8 = "fp32", "tf32", "bf16", "fp16", "fp8"

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
    expert: bool = True  # an ep axis: MoE experts split over data ranks
    expert_with_cp: bool = True  # ep beside a cp axis (ep dividing dp x cp)
    expert_cp_extras: bool = True  # tensor, pipeline or ZeRO beside both ep and cp
    expert_zero: tuple[int, ...] = ZERO_STAGES  # ZeRO stages that run beside an ep axis
    expert_with_pp: bool = True  # ep beside a pipeline
    expert_zero_with_pp: tuple[int, ...] = ZERO_STAGES  # ZeRO stages beside ep and a pipeline
    hybrid_shard: bool = True  # HSDP: ZeRO over dp_shard ranks, replicated over dp_replicate
    hybrid_with_pp: bool = True  # HSDP beside a pipeline
    hybrid_with_ep: bool = True  # HSDP beside an ep axis


# What the planner can price: everything.
PLANNER = Capabilities()

# What autopar's runtime executes today.
RUNTIME = Capabilities(
    expert_zero=(0, 1, 2, 3),
    expert_with_pp=True,
    expert_zero_with_pp=(0, 1, 2, 3),
    hybrid_with_pp=True,
    hybrid_with_ep=True,
)
