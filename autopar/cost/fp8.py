"""Float8 training as the planner prices it (`--dtype fp8`, `precision="fp8"`).

The recipe is the one NVIDIA Transformer Engine and torchao's float8 training share: the
matrix multiplications of the linear layers inside the blocks run in float8 (e4m3
operands with one fp32 scale per tensor, output in bf16) at the device's dense fp8 rate
with the same shape-efficiency curve as bf16; attention, norms, activations, the
embedding, the output projection (torchtitan's float8 converter leaves ``output`` out,
Megatron's output layer is no Transformer Engine module) and the loss stay in bf16; the
optimizer keeps fp32 master weights and moments as mixed precision does. What fp8 adds
beyond the faster GEMMs is priced as named effects (:data:`EFFECTS`): the casts and amax
reductions by the bytes they move, the tensor-parallel amax all-reduces, and under ZeRO-3
the weights gathered in 8 bits plus their scales.
"""

from __future__ import annotations

from dataclasses import replace

from autopar.cost.hardware import Hardware
from autopar.cost.precision import Precision
from autopar.errors import WorldError
from autopar.modes import BF16, FP8

OPERAND_BYTES = 1  # float8 e4m3 (forward) or e5m2 (gradients): one byte an element
OUTPUT_BYTES = 2  # the scaled GEMM writes bf16
SCALE_BYTES = 4  # one fp32 scale per tensor (tensorwise scaling)

EFFECTS = {
    "fp8 casts and amax": "each fp8 GEMM's input and output gradient read in bf16 "
                          "and written in fp8 as is and transposed, 4 bytes an element, "
                          "amax taken in the kernel before (Transformer Engine's fused "
                          "cast-transpose; Micikevicius et al. 2022, arXiv 2209.05433), at "
                          "memory_bandwidth x memory_efficiency",
    "fp8 amax all-reduce (tp)": "where tensor parallelism splits a scaled tensor its amax is "
                                "all-reduced over tp before the cast: one all-reduce of the "
                                "layer's fp32 amaxes forward and one backward (Transformer "
                                "Engine reduces a layer's amaxes together; torchao's float8 "
                                "over DTensor)",
}

GEMMS = ("linear layers' GEMMs inside the blocks in float8 (e4m3 x e4m3 -> bf16, one fp32 "
         "scale per tensor) at the profile's fp8 dense rate with the bf16 shape-efficiency "
         "curve (Micikevicius et al. 2022; NVIDIA Transformer Engine)")
GEMMS_ROWWISE = ("linear layers' GEMMs inside the blocks in float8 (e4m3 x e4m3 -> bf16, one "
                 "fp32 scale per row of each operand, taken from the rank's own piece: no amax "
                 "collective) at the profile's fp8 dense rate with the bf16 shape-efficiency "
                 "curve (Micikevicius et al. 2022; torchao's rowwise float8 recipe)")
KEPT = ("attention, norms, activations, embedding, the output projection and the loss in "
        "bf16 (torchtitan float8 filter_fqns ['output']; Megatron-LM's output_layer is no "
        "Transformer Engine module)")
GATHER = ("ZeRO-3 gathers each weight in float8 plus its fp32 scale, about half of bf16's "
          "bytes (torchtitan enable_fsdp_float8_all_gather); gradients reduce in bf16")
# MFU divides by the dense bf16 peak under fp8 too: NVIDIA's NeMo performance summaries
# report FP8 runs as model TFLOP/s per GPU, the Megatron-LM README's MFU column is TFLOP/s
# over 989 (H100 bf16), and torchtitan's get_peak_flops returns the bf16 peak.
MFU_PEAK = BF16
MFU_SOURCE = ("MFU divides by the dense bf16 peak (Megatron-LM README's MFU column, "
              "torchtitan's get_peak_flops); NeMo reports fp8 runs as model TFLOP/s per GPU")


def check_device(hw: Hardware) -> None:
    """Refuse fp8 on a device whose profile has no fp8 rate (no fp8 tensor cores)."""
    if FP8 not in hw.peak_flops:
        raise WorldError(f"device '{hw.name}' has no fp8 tensor cores (its profile gives no "
                         f"'fp8' peak_flops); plan it with --dtype bf16, or pick a device "
                         f"with fp8 such as h100-80gb or h200.")


def compute_dtype(dtype: str) -> str:
    """The dtype of everything that is not an fp8 GEMM: bf16 under fp8, else `dtype`."""
    return BF16 if dtype == FP8 else dtype


def kept_high(layers) -> frozenset:
    """Names of the layer kinds whose GEMMs stay in bf16 under fp8: the output projection,
    the last layer (in graph order) with a weight GEMM, when it has no attention."""
    for lt in reversed(list(layers)):
        if any(g.weight for g in lt.gemms):
            return frozenset() if lt.attention else frozenset({lt.name})
    return frozenset()


ALIGN = 16  # torch._scaled_mm and cuBLASLt's fp8 GEMMs take K and N in multiples of 16


def runs_fp8(dtype: str, g, lt, kept: frozenset) -> bool:
    """Whether GEMM `g` of layer kind `lt` runs in float8: a linear layer's (a weight
    operand), not an expert's grouped GEMM, outside the layers `kept` in bf16, with K and N
    (of the whole weight) multiples of 16, which the fp8 kernels need."""
    return dtype == FP8 and g.weight and not g.expert and lt.name not in kept and \
        g.k % ALIGN == 0 and g.n % ALIGN == 0


def operand_bytes(shape) -> float:
    """Bytes an fp8 GEMM of local shape (M, K, N) moves through HBM: both operands in fp8,
    the result in bf16."""
    m, k, n = shape
    return OPERAND_BYTES * (m * k + k * n) + OUTPUT_BYTES * m * n


def cast_bytes(shape) -> tuple[float, float]:
    """(forward, backward) bytes of the activation casts of one fp8 GEMM of local shape
    (M, K, N): forward its input (M x K), backward its output gradient (M x N), each read
    in bf16 and written in fp8 twice, as is and transposed for the other GEMM that takes it
    (Transformer Engine's fused cast-transpose), its amax taken by the kernel that produced
    it: 4 bytes an element. The weight's cast runs once per step, not per micro-batch
    (Transformer Engine keeps the fp8 weight over a step's micro-batches; FSDP's float8
    all-gather casts the 1/dp shard): 4 bytes a parameter a step, left out."""
    m, k, n = shape
    per_cast = 2 + 2 * OPERAND_BYTES  # read bf16, write fp8 and its transpose
    return per_cast * m * k, per_cast * m * n


def amax_bytes(fp8_gemms: int) -> int:
    """Bytes of one pass's amax all-reduce over tp: a scale per GEMM operand it casts."""
    return SCALE_BYTES * 2 * fp8_gemms


def planned(dtype: str, hw: Hardware, base: Precision, layers) -> tuple[Precision, frozenset]:
    """(state bytes, layer kinds kept in bf16) a search in `dtype` prices: under fp8 the
    device is checked, ZeRO-3 gathers 8 bits and the output projection stays bf16."""
    if dtype != FP8:
        return base, frozenset()
    check_device(hw)
    return precision(base), kept_high(layers)


def precision(base: Precision) -> Precision:
    """The state bytes under fp8: `base` (fp32 masters and moments as mixed precision),
    with ZeRO-3 gathering one byte per parameter plus the scales."""
    return replace(base, gathered=OPERAND_BYTES)
