"""The planner's step time against published training runs on A100 and H100, and how
far its own free choices claim beyond them.

    python benchmarks/bench_fidelity.py [--tolerance 15] [--skip-optimism] [--fp8-only]

(a) Fidelity. Each published run is priced on its published layout (tensor, pipeline,
data and context sizes, ZeRO stage, recompute, micro-batch, attention kernel where
published; the search chooses only what the source leaves open) and its figure is
recomputed from the predicted step time with the source's own FLOP count. Sources:
MosaicML llm-foundry's MPT benchmarking tables (FSDP = ZeRO-3, bf16; published by
October 2023, when llm-foundry's GPU install pinned flash-attn 1.0.9, so FlashAttention
v1), the Megatron-LM README's H100 weak-scaling table (Megatron-Core, sequence 4096,
interleaved pipeline assumed where pp > 1), Korthikanti et al. 2022 (A100, sequence
parallelism + selective recompute, 2022 kernels) and Narayanan et al. 2021 Table 1 (A100,
priced as benchmarks/bench_megatron.py does). No parameter was fitted to any of these
rows: the effects' parameters come from the measurements cited in the device profiles.
Two choices were made after seeing the rows, and say so: pricing each GEMM's operand
traffic (the additive roofline, a share of 1 with nothing tuned; it moved every row, A100
and H100 alike) with GEMM efficiency at the measured best-shape rate, and pricing the
Megatron-LM rows' cross-entropy on fp32 logits, which is what Megatron-LM's code does.
``held_out`` marks the rows that played no part in choosing any parameter; Table 1's do
not count as held out, the A100 profile's GEMM and link figures having been checked
against them before (bench_megatron's 15% bar). The Megatron-Core rows were checked
against the table image itself (commit f2e5db4: every layout, batch and TFLOP/s; its MFU
column is TFLOP/s / 989 rounded; PFLOP/s = TFLOP/s x GPUs) and the FLOP count against
that commit's num_floating_point_operations; their model sizes count the output
projection apart from the embedding, so they are priced untied (under 1 point on each).
Two of them stay beyond 15% (1.7B over, 32B under); the table under the rows shows why no
setting of the communication closes both: see docs/fidelity.md.

(b) Optimism. The free search (no constraint beyond world, global batch and sequence) for
Llama-3 8B and 70B at sequence 8192 with a global batch of 512 sequences (4M tokens) on
64 and 512 A100-80GB and H100-80GB: the chosen plan's predicted MFU beside the best
published MFU, and HFU, of a dense model of that class on that GPU (and the run it comes
from), and their ratios; for a winner over 1.15x, the evidence-adjusted bar (`evidence`):
what the winner has that the run had not, each priced on the winner's search and counted
up to the speed-up its source measured (`INGREDIENTS`).

(c) FP8. Published FP8 runs on H100 (NVIDIA NeMo 24.12's performance summary, torchtitan's
float8 benchmarks) priced with --dtype fp8 on their published layouts (autopar.cost.fp8;
docs/fp8.md): every row held to the bar within 15%, their mean under 8%, held-out rows
reported apart. `--fp8-only` prints this table alone.

Prints three tables and writes benchmarks/results/fidelity.json (fidelity_fp8.json with
--fp8-only).
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from dataclasses import asdict, dataclass, replace

import torch.nn.functional as F

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from bench_megatron import predict as megatron_predict  # noqa: E402
from gloo_world import write_and_judge  # noqa: E402

from autopar.cost.hardware import load_hardware  # noqa: E402
from autopar.models import workload  # noqa: E402
from autopar.models.gpt import GPTConfig  # noqa: E402
from autopar.models.zoo import MEGATRON_TABLE1, get_config, parse_spec  # noqa: E402
from autopar.search import planner  # noqa: E402
from autopar.world import World  # noqa: E402

MEGATRON_H100 = ("Megatron-LM README, 'Performance Benchmarking' model table "
                 "(images/model_table.png, added in commit f2e5db4, July 2024): weak scaling "
                 "on H100, vocabulary 131072, sequence 4096")
# That table's MFU column, which is its TFLOP/s over 989 TFLOP/s (H100 SXM dense bf16)
# rounded: kept to check the transcription of each row (tests/test_fidelity.py).
MEGATRON_H100_MFU = {"1.7B": 41, "7.1B": 47, "16B": 49, "32B": 46, "70B": 42, "119B": 43,
                     "177B": 44, "314B": 48, "462B": 47}
MPT_A100 = ("llm-foundry scripts/train/benchmarking/README.md (October 2023), table 'A100 "
            "80GB with 1600 Gbps node-node interconnect (RoCE)'")
MPT_H100 = ("llm-foundry scripts/train/benchmarking/README.md (October 2023), table 'H100 "
            "80GB BF16'")
KORTHIKANTI = ("Korthikanti et al. 2022 (arXiv 2205.05198) Table 3 layouts, MFU as "
               "in Table 5 and the Megatron-LM README of 2022")


@dataclass(frozen=True)
class Run:
    """One published run: the model, the layout it ran with, and its published figure."""

    name: str
    source: str
    device: str
    model: str  # a zoo name, or "mpt-<size>" (GPT blocks without biases, vocab 50368)
    seq: int
    gpus: int
    batch: int  # global batch in sequences
    tp: int = 1
    pp: int = 1
    cp: int = 1
    zero: int | None = None  # None: the source does not say; the search chooses
    recompute: str | None = None
    micro_batch: int | None = None
    metric: str = "mfu"  # "mfu" (fraction of bf16 peak) or "tflops" (per GPU)
    flops: str = "megatron"  # "megatron" (Narayanan Eq. 3 without recompute) or "mpt"
    published: float = 0.0
    params: int = 0  # the source's own parameter count (its MFU formula uses it)
    attention: str = "flash"  # the kernel the run used: flash (v2), flash1, unfused
    schedule: str | None = None  # the pipeline schedule, where pp > 1
    # the loss reads fp32 logits: Megatron-LM's vocab_parallel_cross_entropy upcasts them
    # (megatron/core/tensor_parallel/cross_entropy.py, logits.float()), so its softmax
    # passes move 4-byte values over seq x vocab per sample
    fp32_loss: bool = False
    # the output projection shares the embedding's weights (a zoo GPT's default); the
    # Megatron-Core H100 table's sizes count them apart (--untie-embeddings-and-output-weights)
    tied_embeddings: bool = True
    held_out: bool = True
    dtype: str = "bf16"  # the precision the planner prices it in (fp8: autopar.cost.fp8)
    chunks: int | None = None  # the interleaved schedule's stages per rank, where published
    # why a row is reported but not held to the bar (empty: held to it)
    not_judged: str = ""


MPT = {  # llm-foundry scripts/train/yamls/pretrain/mpt-*.yaml: d_model, n_heads, n_layers
    "1b": (2048, 16, 24), "3b": (2560, 20, 32), "7b": (4096, 32, 32),
    "13b": (5120, 40, 40), "30b": (7168, 56, 48), "70b": (8192, 64, 80)}


def _mpt(size, device, gpus, seq, mb, accum, mfu, params, ac) -> Run:
    """An MPT row: FSDP FULL_SHARD (ZeRO-3), activation checkpointing ``ac`` (full)."""
    return Run(f"MPT-{size} s{seq} x{gpus}", MPT_A100 if "a100" in device else MPT_H100,
               device, f"mpt-{size}", seq, gpus, gpus * mb * accum, zero=3,
               recompute="full" if ac else "none", micro_batch=mb, metric="mfu", flops="mpt",
               published=mfu / 100, params=params, attention="flash1")


def _megatron_h100(params, heads, hidden, layers, tp, pp, gpus, batch, tflops) -> Run:
    """A Megatron-Core H100 row. Its sizes count the output projection apart from the
    embedding (1.7B: 1.75e9 untied, 1.48e9 tied), so the embeddings are priced untied."""
    return Run(f"GPT {params} (Megatron)", MEGATRON_H100, "h100-80gb",
               f"gpt:layers={layers},hidden={hidden},heads={heads},vocab=131072,seq=4096",
               4096, gpus, batch, tp=tp, pp=pp, metric="tflops", published=tflops,
               schedule="interleaved" if pp > 1 else None, fp32_loss=True,
               tied_embeddings=False)


def _korthikanti(params, heads, hidden, layers, pp, gpus, batch, mfu) -> Run:
    return Run(f"GPT {params} (Korthikanti)", KORTHIKANTI, "a100-80gb",
               f"gpt:layers={layers},hidden={hidden},heads={heads},vocab=51200,seq=2048",
               2048, gpus, batch, tp=8, pp=pp, zero=0, recompute="selective", micro_batch=1,
               metric="mfu", published=mfu / 100, attention="unfused",
               schedule="1f1b" if pp > 1 else None, fp32_loss=True)


RUNS: tuple[Run, ...] = (
    # MosaicML MPT: bf16, attn_impl flash = flash-attn 1.0.9 (llm-foundry's GPU install then)
    _mpt("1b", "a100-80gb", 8, 2048, 14, 4, 59.86, 1315950592, False),
    _mpt("3b", "a100-80gb", 8, 2048, 10, 2, 62.11, 2651837440, False),
    _mpt("7b", "a100-80gb", 8, 2048, 6, 2, 64.23, 6658859008, False),
    _mpt("13b", "a100-80gb", 8, 2048, 2, 3, 59.57, 12853954560, False),
    _mpt("30b", "a100-80gb", 8, 2048, 3, 21, 55.30, 29975214080, True),
    _mpt("70b", "a100-80gb", 64, 2048, 8, 4, 53.33, 64862437376, True),
    _mpt("7b", "a100-80gb", 8, 8192, 8, 2, 54.47, 6684024832, True),
    _mpt("1b", "h100-80gb", 8, 2048, 14, 1, 41.82, 1315950592, False),
    _mpt("7b", "h100-80gb", 8, 2048, 6, 1, 46.44, 6658859008, False),
    _mpt("13b", "h100-80gb", 64, 2048, 2, 1, 39.86, 12853954560, False),
    _mpt("30b", "h100-80gb", 32, 2048, 14, 3, 43.92, 29975214080, True),
    _mpt("70b", "h100-80gb", 64, 2048, 8, 4, 42.57, 64862437376, True),
    _mpt("7b", "h100-80gb", 8, 8192, 8, 2, 37.14, 6684024832, True),
    # Megatron-Core on H100, per-GPU TFLOP/s; its cuDNN attention is priced as FlashAttention-2
    _megatron_h100("1.7B", 16, 2048, 24, 1, 1, 48, 192, 408.8),
    _megatron_h100("7.1B", 32, 4096, 30, 2, 1, 96, 192, 465.9),
    _megatron_h100("16B", 48, 6144, 32, 4, 1, 192, 192, 489.1),
    _megatron_h100("32B", 56, 7168, 48, 8, 1, 384, 192, 459.6),
    _megatron_h100("70B", 64, 8192, 84, 8, 2, 768, 384, 419.7),
    _megatron_h100("119B", 80, 10240, 92, 8, 4, 1536, 768, 420.5),
    _megatron_h100("177B", 96, 12288, 96, 8, 6, 2304, 1152, 432.8),
    _megatron_h100("314B", 128, 16384, 96, 8, 8, 3072, 1536, 474.4),
    _megatron_h100("462B", 144, 18432, 112, 8, 16, 6144, 3072, 459.9),
    # Megatron-LM 2022 on A100: sequence parallelism + selective recompute, dp 1
    _korthikanti("22B", 64, 6144, 48, 1, 8, 4, 41.5),
    _korthikanti("175B", 96, 12288, 96, 8, 64, 64, 51.4),
    _korthikanti("530B", 128, 20480, 105, 35, 280, 280, 56.0),
    _korthikanti("1T", 160, 25600, 128, 64, 512, 512, 56.3),
)

# The best published figures of dense decoder training of each model class on each GPU:
# MFU, and the hardware FLOP rate (HFU: recomputation counted) of the run with the best one
# at least as long as 2048 tokens; a plan that needs no recomputation can turn a sustained
# hardware rate into MFU, so HFU bounds what a recompute-free plan may claim.
BEST_PUBLISHED = {
    ("llama3-8b", "a100-80gb"): (0.6423, 0.7682,
                                 "MFU: MPT-7B s2048 x8, no recompute (64.23%); HFU: MPT-13B "
                                 "s4096 x8, full recompute (76.82%); llm-foundry A100 80GB table"),
    ("llama3-70b", "a100-80gb"): (0.5333, 0.7110,
                                  "MPT-70B s2048 x64, full recompute: MFU 53.33%, HFU 71.10% "
                                  "(llm-foundry A100 80GB table)"),
    ("llama3-8b", "h100-80gb"): (0.4709, 0.5381,
                                 "MFU: Megatron-Core 7.1B x96, 465.9 TFLOP/s (47.1%, Megatron-LM "
                                 "README); HFU: MPT-7B s4096 x8, full recompute (53.9%)"),
    ("llama3-70b", "h100-80gb"): (0.4257, 0.5676,
                                  "MPT-70B s2048 x64, full recompute: MFU 42.57%, HFU 56.76% "
                                  "(llm-foundry H100 table); Megatron-Core 70B x768: 42.4%"),
    ("gpt3-175b", "a100-80gb"): (0.514, 0.528,
                                 "GPT 175B x512, SP + selective recompute, dp 1: MFU 51.4%, "
                                 "HFU 52.8% (Megatron-LM README, from Korthikanti et al. 2022); "
                                 "the best A100 run of any size: 1T, MFU 56.3%, HFU 57.0%"),
}


# the same, in a few words for the optimism table's column
BEST_TAG = {
    ("llama3-8b", "a100-80gb"): "MPT-7B x8 (llm-foundry)",
    ("llama3-70b", "a100-80gb"): "MPT-70B x64 (llm-foundry)",
    ("llama3-8b", "h100-80gb"): "Megatron-Core 7.1B x96",
    ("llama3-70b", "h100-80gb"): "MPT-70B x64 (llm-foundry)",
    ("gpt3-175b", "a100-80gb"): "GPT 175B x512 (Korthikanti)",
}

FA2_PAPER = ("Dao 2023 (FlashAttention-2), end-to-end GPT3-1.3B/2.7B training on 8 A100: "
             "2k tokens 142/149 TFLOP/s without FlashAttention, 196/205 with v2 (1.38x); 8k "
             "tokens 170/175 with v1, 220/225 with v2 (1.29x)")
# What a plan of the free search has that the best published run of its class did not, as
# the constraint (or attention kernel) that prices the run's choice instead, with the
# largest speed-up of that ingredient a source measured (>= 1; 1.0: none measured) and the
# source. `evidence` fixes them one after another on the winner's search: each priced
# factor is what the model says that ingredient is worth on this plan, and only as much of
# it as was measured somewhere raises the bar.
INGREDIENTS = {
    "gpt3-175b": (
        ("FlashAttention-2 (the run: 2022 fused softmax kernels)",
         {"attention_kernel": "unfused"}, 1.38, FA2_PAPER + ", at 2k"),
        ("ZB-V zero-bubble pipelining (the run: 1F1B)", {"schedule": "1f1b"}, 1.23,
         "Qi et al. 2024 (Zero Bubble Pipeline Parallelism): up to 1.23x the throughput of "
         "1F1B at a similar memory limit, 1.5B-28.3B models on up to 32 A100"),
        ("no recomputation (the run: selective)", {"recompute": "selective"}, 0.528 / 0.514,
         "the run's own HFU / MFU (52.8% / 51.4%, Korthikanti et al. 2022)"),
        ("its tensor size (the run: tp 8)", {"tp": 8}, 1.0, "none measured apart"),
    ),
    "llama3-70b": (
        ("FlashAttention-2 (the run: FlashAttention v1)", {"attention_kernel": "flash1"},
         1.29, FA2_PAPER + ", at 8k"),
        ("no recomputation (the run: full)", {"recompute": "full"}, 4 / 3,
         "MPT-70B's own HFU / MFU (71.10% / 53.33% on A100, 56.76% / 42.57% on H100)"),
    ),
}


NEMO_H100 = ("NVIDIA NeMo Framework 24.12 performance summary, pre-training, DGX-H100, FP8 "
             "(model TFLOP/s per GPU, NeMo's flops_formulas)")
TITAN_2412 = ("torchtitan benchmarks/llama3_h100_202412_torchtitan.md (Dec 2024): H100 "
              "(Grand Teton, 96 GB HBM2e, 500 W), torch.compile + Float8 (tensorwise), TPS/GPU")
TITAN_2506 = ("torchtitan benchmarks/asyncTP_llama3_h100_2025-06_torchtitan.md (June 2025): "
              "float8 tensorwise, compile, vanilla TP, TPS/GPU")


def _nemo(name, model, gpus, batch, seq, tp, pp, cp, vp, tflops, held_out) -> Run:
    """A NeMo FP8 row: Megatron-Core with the distributed optimizer (ZeRO-1), interleaved
    pipeline of `vp` chunks where pp > 1; recompute and micro-batch left to the search."""
    return Run(name, NEMO_H100, "h100-80gb", model, seq, gpus, batch, tp=tp, pp=pp, cp=cp,
               zero=1, metric="tflops", flops="nemo", published=tflops, dtype="fp8",
               schedule="interleaved" if pp > 1 else None, chunks=vp if pp > 1 else None,
               fp32_loss=True, held_out=held_out)


def _titan(name, source, model, gpus, local, seq, tp, pp, ac, tps, held_out,
           schedule=None, not_judged="") -> Run:
    """A torchtitan float8 row: FSDP2 (ZeRO-3) over the rest, local batch `local` per data
    rank in one pass (micro-batches of 1 through a pipeline), tokens/s per GPU."""
    dp = gpus // (tp * pp)
    return Run(name, source, "h100-80gb", model, seq, gpus, dp * local, tp=tp, pp=pp, zero=3,
               recompute=ac, micro_batch=1 if pp > 1 else local, metric="tokens",
               published=tps, dtype="fp8", schedule=schedule, held_out=held_out,
               not_judged=not_judged)


# Published FP8 runs, each on its published layout. torchtitan's "selective" (per-op) AC
# keeps less than autopar's selective recompute (attention only), which does not fit at
# local batch 2, so its 8B rows are priced with full recompute. held_out=False: the rows
# looked at while choosing how fp8 casts are priced (first a separate amax pass, unfused
# transposes and weights cast every micro-batch; then Transformer Engine's fused
# cast-transpose with weights cast once per step). The held-out rows were priced under
# both and played no part in the choice (docs/fp8.md gives their errors under both).
FP8_RUNS: tuple[Run, ...] = (
    _nemo("Llama3 8B (NeMo)", "llama3-8b", 8, 128, 8192, 1, 1, 2, 1, 711, False),
    _nemo("Llama3 70B (NeMo)", "llama3-70b", 64, 128, 8192, 4, 4, 2, 5, 734, False),
    _nemo("GPT-3 175B (NeMo)", "gpt3-175b", 512, 2048, 2048, 4, 8, 1, 6, 888, True),
    _titan("Llama3.1 8B x8 (titan)", TITAN_2412, "llama3.1-8b", 8, 2, 8192, 1, 1,
           "full", 8532, False),
    _titan("Llama3.1 70B x256 (titan)", TITAN_2506, "llama3.1-70b", 256, 16, 8192, 8, 1,
           "full", 809.8, False),
    _titan("Llama3.1 8B x8 s32k (titan)", TITAN_2412, "llama3.1-8b", 8, 1, 32768, 1, 1,
           "full", 3890, False,
           not_judged="attention-bound (half its FLOPs at 32k tokens) on a 500 W part: the "
                      "profile's attention curve is FlashAttention-2 at full power"),
    _titan("Llama3.1 8B x128 (titan)", TITAN_2412, "llama3.1-8b", 128, 2, 8192, 1, 1,
           "full", 8380, True),
    _titan("Llama3.1 70B x256 2024 (titan)", TITAN_2412, "llama3.1-70b", 256, 16, 8192, 8, 1,
           "full", 829, True),
    _titan("Llama3.1 405B x512 (titan)", TITAN_2412, "llama3.1-405b", 512, 32, 8192, 8, 8,
           "full", 128, True, schedule="interleaved"),
)


def _config(run: Run):
    if run.model.startswith("mpt-"):
        hidden, heads, layers = MPT[run.model[4:]]
        return GPTConfig(vocab_size=50368, n_layer=layers, n_head=heads, n_embd=hidden,
                         block_size=run.seq, bias=False)
    if ":" not in run.model:
        return get_config(run.model)
    return run.model if run.tied_embeddings else replace(parse_spec(run.model),
                                                         tie_embeddings=False)


_CHAINS: dict = {}


def fp32_token_loss(logits, target):
    """Cross-entropy on logits cast to fp32 first, as Megatron-LM computes it."""
    return F.cross_entropy(logits.float().reshape(-1, logits.size(-1)), target.reshape(-1))


def chain_for(model, seq: int, tp_sizes, fp32_loss: bool = False):
    """Trace two blocks of ``model`` at ``seq`` and count the rest (cached per model)."""
    key = (str(model), seq, tuple(tp_sizes), fp32_loss)
    if key not in _CHAINS:
        w = workload(model, seq=seq)
        _CHAINS[key] = planner.prepare(w.model, w.inputs,
                                       loss_fn=fp32_token_loss if fp32_loss else w.loss_fn,
                                       example_target=w.target,
                                       repeat={"blocks.1": w.layers - 1},
                                       tokens_per_sample=w.tokens_per_sample,
                                       tp_sizes=list(tp_sizes),
                                       # the published runs computed the loss over whole
                                       # logits (Megatron-LM's vocab-parallel cross-entropy,
                                       # NeMo's, torchtitan's): no chunked loss to price
                                       chunked_loss=False)
    return _CHAINS[key]


def figure(run: Run, step_s: float) -> float:
    """The run's published metric recomputed from a step time, with the source's FLOPs."""
    peak = load_hardware(run.device).flops("bf16")
    b, s = run.batch, run.seq
    if run.metric == "tokens":
        return b * s / (step_s * run.gpus)
    if run.flops == "nemo":
        flops = nemo_flops(run)
    elif run.flops == "mpt":  # llm-foundry: 6 N s + 12 L d s^2 per sequence (no recompute)
        hidden, _, layers = MPT[run.model[4:]]
        flops = b * (6 * run.params * s + 12 * layers * hidden * s * s)
    else:  # Megatron: 72 B s L h^2 (1 + s / (6h) + V / (12 L h)), no recompute counted: its
        # num_floating_point_operations (megatron/training/training.py at f2e5db4),
        # 12 B s L h^2 ((2 + s/h) + 4 + V / (2 L h)) with ffn 4h, no GQA, no SwiGLU
        spec = dict(kv.split("=") for kv in run.model.split(":")[1].split(","))
        layers, h, vocab = int(spec["layers"]), int(spec["hidden"]), int(spec["vocab"])
        flops = 72 * b * s * layers * h * h * (1 + s / (6 * h) + vocab / (12 * layers * h))
    per_gpu = flops / (step_s * run.gpus)
    return per_gpu / peak if run.metric == "mfu" else per_gpu / 1e12


def nemo_flops(run: Run) -> float:
    """Model FLOPs of one step as NeMo counts them (nemo/utils/flops_formulas.py): GPT-3
    as Megatron (72 B s L h^2 (1 + s/(6h)) + 6 B s h V); Llama 3 with GQA and SwiGLU,
    B s L h^2 (12 + 12 g/a + 18 f/h + 12 s/h + 6 V/(L h)), attention counted whole."""
    cfg = get_config(run.model)
    b, s = run.batch, run.seq
    if run.model.startswith("gpt3"):
        h, n, v = cfg.n_embd, cfg.n_layer, cfg.vocab_size
        return 72 * b * s * n * h * h * (1 + s / (6 * h)) + 6 * b * s * h * v
    h, n, v = cfg.dim, cfg.n_layer, cfg.vocab_size
    g, a, f = cfg.n_kv_head, cfg.n_head, cfg.ffn_hidden
    return b * s * n * h * h * (12 + 12 * g / a + 18 * f / h + 12 * s / h + 6 * v / (n * h))


def predict(run: Run) -> dict:
    """Price one published run on its published layout."""
    chain = chain_for(_config(run), run.seq, [run.tp], run.fp32_loss)
    world = World(run.gpus, per_node=8, device=run.device)
    dp = run.gpus // (run.tp * run.pp * run.cp)
    constraints = dict(tp=run.tp, pp=run.pp, cp=run.cp, dp=dp, tp_mode="1d")
    if run.zero != 0 and dp > 1:  # ZeRO over all of dp, as each published run shards
        constraints["dp_shard"] = dp
    for key in ("zero", "recompute"):
        if getattr(run, key) is not None:
            constraints[key] = getattr(run, key)
    if run.micro_batch is not None:
        constraints["micro_batch_size"] = run.micro_batch
    if run.schedule is not None:
        constraints["schedule"] = run.schedule
    if run.chunks is not None:
        constraints["chunks"] = run.chunks
    result = planner.search(chain, world, global_batch=run.batch, attention_kernel=run.attention,
                            constraints=constraints, dtype=run.dtype)
    best = result.best
    if best is None:
        why = result.alternatives[0][1] if result.alternatives else "no candidates"
        raise SystemExit(f"{run.name}: no plan of its published layout fits ({why}).")
    predicted = figure(run, best.step_time)
    return {"name": run.name, "device": run.device, "source": run.source, "gpus": run.gpus,
            "layout": f"tp{run.tp} pp{run.pp} dp{dp} cp{run.cp}", "batch": run.batch,
            "seq": run.seq, "metric": run.metric, "published": run.published,
            "predicted": predicted, "error_percent": 100 * (predicted / run.published - 1),
            "held_out": run.held_out, "plan": best.describe(), "step_time_s": best.step_time,
            "published_step_s": best.step_time * predicted / run.published,
            "parts_s": {"compute": best.compute_s, "tp_cp_comm": best.comm_s,
                        "bubble": best.bubble_s, "dp_sync": best.dp_comm_s,
                        "optimizer": best.optimizer_s},
            "memory_gib": best.memory_per_device / 2 ** 30, "fits": best.fits}


def optimism(model: str, device: str, gpus: int, batch: int = 512, seq: int = 8192) -> dict:
    """The free search's winner for ``model`` and its MFU against the best published."""
    chain = chain_for(model, seq, planner_tp_sizes(gpus))
    world = World(gpus, per_node=8, device=device)
    start = time.perf_counter()
    result = planner.search(chain, world, global_batch=batch)
    best = result.best
    flops = planner.model_flops(chain, batch)
    peak = gpus * world.profile.flops("bf16")
    mfu = flops / (best.step_time * peak)
    # the same with causal attention counted at the half a causal kernel computes
    attention = 3 * batch * sum(a.flops(1) for lt in chain.layers() for a in lt.attention
                                if a.causal)
    mfu_causal = (flops - attention / 2) / (best.step_time * peak)
    published, hfu, source = BEST_PUBLISHED[(model, device)]
    out = {"model": model, "device": device, "gpus": gpus, "global_batch": batch, "seq": seq,
           "plan": best.describe(), "predicted_mfu": mfu, "predicted_mfu_causal": mfu_causal,
           "best_published_mfu": published, "best_published": BEST_TAG[(model, device)],
           "best_published_hfu": hfu, "ratio": mfu / published, "ratio_to_hfu": mfu / hfu,
           "recompute": sorted({s.recompute for s in best.states}),
           "published_source": source}
    out.update(evidence(model, chain, world, batch, flops / peak, mfu, published)
               if out["ratio"] > OPTIMISM_BAR else
               {"ingredients": [], "evidence": 1.0, "adjusted_mfu": published,
                "ratio_to_adjusted": mfu / published})
    out["search_s"] = time.perf_counter() - start
    return out


def evidence(model, chain, world, batch, ideal_s, mfu, published) -> dict:
    """`INGREDIENTS` of ``model`` fixed one after another on its free search: each one's
    priced factor (MFU before / after fixing the run's choice), the measured one, and the
    bar they justify: the best published MFU times, per ingredient, the smaller of the two."""
    constraints, kernel, prev, rows, factor = {}, "flash", mfu, [], 1.0
    for name, fix, measured, source in INGREDIENTS.get(model, ()):
        kernel = fix.get("attention_kernel", kernel)
        constraints.update({k: v for k, v in fix.items() if k != "attention_kernel"})
        res = planner.search(chain, world, global_batch=batch, constraints=dict(constraints),
                             attention_kernel=kernel)
        now = ideal_s / res.best.step_time
        priced = prev / now
        rows.append({"ingredient": name, "priced": priced, "measured": measured,
                     "counted": min(priced, measured), "source": source,
                     "mfu_without": now, "plan_without": res.best.describe()})
        factor *= min(priced, measured)
        prev = now
    return {"ingredients": rows, "evidence": factor, "adjusted_mfu": published * factor,
            "ratio_to_adjusted": mfu / (published * factor),
            "mfu_all_fixed": prev, "all_fixed_over_published": prev / published}


OPTIMISM_BAR = 1.15  # the bar on predicted / best published MFU


def _justified(c: dict) -> str:
    """Whether a prediction above the bar stays under a measured rate it could reach: a plan
    that recomputes nothing turns the hardware FLOP rate (HFU) of a run into MFU."""
    if c["recompute"] == ["none"] and c["ratio_to_hfu"] <= 1:
        return (f"the plan recomputes nothing and stays under the measured HFU of that class "
                f"({c['ratio_to_hfu']:.2f}x)")
    return "NOT covered by a measured rate: the prediction claims more than anyone measured"


def table1_row(run) -> dict:
    """A row of Narayanan et al. 2021 Table 1 (A100, 2021 kernels), priced as
    benchmarks/bench_megatron.py prices it."""
    r = megatron_predict(run)
    return {"name": f"GPT {run.params_billion}B (Table 1)", "device": "a100-80gb",
            "source": "Narayanan et al. 2021 (arXiv 2104.04473) Table 1", "gpus": run.gpus,
            "layout": f"tp{run.tp} pp{run.pp} dp{run.gpus // (run.tp * run.pp)} cp1",
            "batch": run.batch, "seq": 2048, "metric": "tflops",
            "published": run.tflops_per_gpu, "predicted": r["predicted_tflops"],
            "error_percent": r["error_percent"], "held_out": False, "plan": r["plan"],
            "step_time_s": r["step_time_s"], "memory_gib": r["memory_gib"], "fits": True}


def planner_tp_sizes(gpus: int) -> list[int]:
    return [t for t in (1, 2, 4, 8, 16, 32, 64) if gpus % t == 0]


def _unit(r: dict, x: float) -> str:
    return f"{100 * x:.1f}%" if r["metric"] == "mfu" else f"{x:.0f}"


def fp8_summary(rows: list[dict]) -> dict:
    """The FP8 table's goals: over the rows held to the bar, the worst and mean |error|,
    both signs, and the held-out rows apart."""
    judged = [r for r in rows if not r["not_judged"]]
    errors = [r["error_percent"] for r in judged]
    held = [abs(r["error_percent"]) for r in judged if r["held_out"]]
    tuned = [abs(r["error_percent"]) for r in judged if not r["held_out"]]
    return {"rows": len(judged), "worst_abs_error_percent": max(map(abs, errors)),
            "mean_abs_error_percent": sum(map(abs, errors)) / len(errors),
            "held_out_mean_abs_error_percent": sum(held) / len(held),
            "looked_at_mean_abs_error_percent": sum(tuned) / len(tuned),
            "over": sum(e > 0 for e in errors), "under": sum(e < 0 for e in errors)}


def fp8_table() -> tuple[list[dict], dict]:
    """Price every published FP8 run; print the table and its summary."""
    rows = []
    for run in FP8_RUNS:
        row = predict(run)
        row["not_judged"] = run.not_judged
        rows.append(row)
    print("Published FP8 runs on H100 priced on their published layouts (--dtype fp8): "
          "model TFLOP/s per GPU (NeMo's FLOP count) or tokens/s per GPU")
    head = (f"{'run':<31} {'layout':<18} {'metric':<7} {'published':>9} {'predicted':>9} "
            f"{'err %':>7} {'held out':>8}  plan")
    print(head)
    print("-" * len(head))
    for r in rows:
        print(f"{r['name']:<31} {r['layout']:<18} {r['metric']:<7} {r['published']:>9.0f} "
              f"{r['predicted']:>9.0f} {r['error_percent']:>+7.1f} "
              f"{'yes' if r['held_out'] else 'no':>8}  {r['plan']}")
    summary = fp8_summary(rows)
    print(f"mean |error| {summary['mean_abs_error_percent']:.1f}% over {summary['rows']} runs "
          f"(held out {summary['held_out_mean_abs_error_percent']:.1f}%, looked at "
          f"{summary['looked_at_mean_abs_error_percent']:.1f}%); worst "
          f"{summary['worst_abs_error_percent']:.1f}%; {summary['over']} over, "
          f"{summary['under']} under")
    for r in rows:
        if r["not_judged"]:
            print(f"  not held to the bar: {r['name']} ({r['error_percent']:+.1f}%): "
                  f"{r['not_judged']}")
    for source in sorted({r["source"] for r in rows}):
        print(f"  source: {source}")
    return rows, summary


def _print_core(core: list[dict]) -> None:
    """The Megatron-Core H100 rows' step parts, and their errors were comm hidden."""
    print("Megatron-Core H100 rows, seconds per step: the published step (from its TFLOP/s), "
          "and the predicted one's parts; tensor-parallel comm and dp sync are priced exposed, "
          "the runs overlapped them (--tp-comm-overlap, --overlap-grad-reduce, "
          "--overlap-param-gather)")
    share = load_hardware("h100-80gb").comm_sm_share
    for r in core:
        p = r["parts_s"]
        print(f"  {r['name']:<20} published {r['published_step_s']:6.3f}  predicted "
              f"{r['step_time_s']:6.3f} = compute {p['compute']:.3f} + tp comm "
              f"{p['tp_cp_comm']:.3f} + bubble {p['bubble']:.3f} + dp sync {p['dp_sync']:.3f}"
              f" + optimizer {p['optimizer']:.3f}")
    print("  error were they hidden (an overlapped collective costing the compute beside it "
          "comm_sm_share / (1 - comm_sm_share) of its time):")
    for r in core:
        p, rest = r["parts_s"], r["step_time_s"] - r["parts_s"]["tp_cp_comm"] - r["parts_s"][
            "dp_sync"]
        hide = share / (1 - share)
        errs = [100 * (r["published_step_s"] / (rest + tp + dp) - 1) for tp, dp in (
            (hide * p["tp_cp_comm"], p["dp_sync"]), (p["tp_cp_comm"], hide * p["dp_sync"]),
            (hide * p["tp_cp_comm"], hide * p["dp_sync"]))]
        print(f"  {r['name']:<20} tp comm hidden {errs[0]:+6.1f}%  dp sync hidden "
              f"{errs[1]:+6.1f}%  both {errs[2]:+6.1f}%")


def fp8_main(tolerance: float) -> int:
    """The FP8 table alone, written to benchmarks/results/fidelity_fp8.json."""
    rows, summary = fp8_table()
    return write_and_judge("fidelity_fp8.json", {"summary": summary, "rows": rows},
                           [r for r in rows if not r["not_judged"]], "name", tolerance)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tolerance", type=float, default=15.0)
    parser.add_argument("--skip-optimism", action="store_true")
    parser.add_argument("--fp8-only", action="store_true", help="only the FP8 table")
    args = parser.parse_args()
    if args.fp8_only:
        return fp8_main(args.tolerance)
    rows = [predict(run) for run in RUNS] + [table1_row(run) for run in MEGATRON_TABLE1]
    head = (f"{'run':<22} {'GPU':<10} {'layout':<20} {'metric':<7} {'published':>9} "
            f"{'predicted':>9} {'err %':>7}  plan chosen for what the source leaves open")
    print("Published runs priced on their published layouts (MFU of bf16 peak, or TFLOP/s "
          "per GPU)")
    print(head)
    print("-" * len(head))
    for r in rows:
        print(f"{r['name']:<22} {r['device']:<10} {r['layout']:<20} {r['metric']:<7} "
              f"{_unit(r, r['published']):>9} {_unit(r, r['predicted']):>9} "
              f"{r['error_percent']:>+7.1f}  {r['plan']}")
    errors = [r["error_percent"] for r in rows]
    held = [r["error_percent"] for r in rows if r["held_out"]]
    mae = sum(map(abs, errors)) / len(errors)
    held_mae = sum(map(abs, held)) / len(held) if held else float("nan")
    worst = max(rows, key=lambda r: abs(r["error_percent"]))
    print(f"mean |error| {mae:.1f}% over {len(rows)} runs (held out: {held_mae:.1f}% over "
          f"{len(held)}); worst {worst['error_percent']:+.1f}% ({worst['name']}, "
          f"{worst['device']}); {sum(e > 0 for e in errors)} over, "
          f"{sum(e < 0 for e in errors)} under; bar {args.tolerance:.0f}%")
    print()
    fp8_rows, fp8_sum = fp8_table()
    print()
    _print_core([r for r in rows if r["source"] == MEGATRON_H100])
    checks = []
    if not args.skip_optimism:
        checks = [optimism(m, d, g) for m in ("llama3-8b", "llama3-70b")
                  for d in ("a100-80gb", "h100-80gb") for g in (64, 512)]
        # the README's first command: GPT-3 175B on 1024 A100, batch 1536 of 2048 tokens
        checks.append(optimism("gpt3-175b", "a100-80gb", 1024, batch=1536, seq=2048))
        print()
        print("Free search, sequence 8192, global batch 512 (4M tokens; GPT-3 175B: 2048 and "
              "1536, as the README plans it): predicted MFU "
              "(attention FLOPs counted whole, as the published MFUs count them; 'causal': "
              "counted at the half a causal kernel computes) against the best published MFU "
              "and HFU of that model class and GPU")
        head = (f"{'model':<11} {'GPU':<10} {'GPUs':>5} {'MFU':>6} {'causal':>6} "
                f"{'pub MFU':>8} {'best published run':<28} {'ratio':>6} {'pub HFU':>8} "
                f"{'ratio':>6} {'evid':>5} {'adj bar':>8} {'ratio':>6}  plan")
        print(head)
        print("-" * len(head))
        for c in checks:
            print(f"{c['model']:<11} {c['device']:<10} {c['gpus']:>5} "
                  f"{100 * c['predicted_mfu']:>5.1f}% {100 * c['predicted_mfu_causal']:>5.1f}% "
                  f"{100 * c['best_published_mfu']:>7.1f}% {c['best_published']:<28} "
                  f"{c['ratio']:>6.2f} {100 * c['best_published_hfu']:>7.1f}% "
                  f"{c['ratio_to_hfu']:>6.2f} {c['evidence']:>5.2f} "
                  f"{100 * c['adjusted_mfu']:>7.1f}% {c['ratio_to_adjusted']:>6.2f}  {c['plan']}")
        print("  evid: the measured speed-ups of what the plan has and that run had not (each "
              "at most what the model prices it at); adj bar: the best published MFU times "
              "evid; ratio: predicted over it")
        for key, (_, _, source) in BEST_PUBLISHED.items():
            print(f"  {key[0]} on {key[1]}: {source}")
        for c in checks:
            if c["ratio"] > OPTIMISM_BAR:
                print(f"  {c['model']} x{c['gpus']} {c['device']}: {c['ratio']:.2f}x the best "
                      f"published MFU; {_justified(c)}")
                for i in c["ingredients"]:
                    print(f"    {i['ingredient']}: priced {i['priced']:.3f}, measured up to "
                          f"{i['measured']:.3f} ({i['source']}); MFU without it "
                          f"{100 * i['mfu_without']:.1f}%")
                print(f"    left when all are fixed: {100 * c['mfu_all_fixed']:.1f}% = "
                      f"{c['all_fixed_over_published']:.3f}x the published MFU (the model's "
                      f"error on that layout); {c['ratio_to_adjusted']:.2f}x the evidence-"
                      f"adjusted bar, " + ("within" if c["ratio_to_adjusted"] <= OPTIMISM_BAR
                                           else "NOT within") + f" {OPTIMISM_BAR:.2f}x")
    return write_and_judge(
        "fidelity.json",
        {"tolerance_percent": args.tolerance, "mean_abs_error_percent": mae,
         "held_out_mean_abs_error_percent": held_mae,
         "worst_abs_error_percent": abs(worst["error_percent"]),
         "runs": [asdict(run) for run in RUNS], "rows": rows,
         "best_published": [{"model": k[0], "device": k[1], "mfu": v[0], "hfu": v[1],
                             "source": v[2]} for k, v in BEST_PUBLISHED.items()],
         "optimism": checks, "fp8": {"summary": fp8_sum, "rows": fp8_rows}},
        rows + [r for r in fp8_rows if not r["not_judged"]], "name", args.tolerance)


if __name__ == "__main__":
    sys.exit(main())
