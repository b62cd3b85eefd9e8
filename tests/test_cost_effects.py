"""The physical effects the cost model prices beyond an ideal device, each alone.

Ring attention's exposed hops (the first K/V hop and the gradient return wait, the rest
hide only behind the attention step beside them), causal imbalance under a contiguous
split, FlashAttention-2's rate at short sequences, the per-kernel launch floor, GEMM
efficiency in the problem size and the HBM time of its operands (additive roofline),
collectives' SM contention, and that explain shows each effect with its seconds.
"""

import dataclasses
import functools
import math

import pytest

from autopar import World, plan
from autopar.cost.cp import contention_s, ring_exposed
from autopar.cost.hardware import Hardware, load_hardware
from autopar.cost.model import (
    EFFECTS,
    attention_time,
    causal_imbalance,
    gemm_time,
    gemm_traffic_s,
    local_gemm_shape,
    memory_time,
)
from autopar.errors import WorldError
from autopar.models import workload

A100 = load_hardware("a100-80gb")
H100 = load_hardware("h100-80gb")


@pytest.mark.parametrize("c", [2, 4, 8])
def test_ring_hides_all_but_first_hop_and_gradient_return(c):
    hop = 1e-3
    exposed, hidden = ring_exposed(c, hop, 2 * hop, step_f=1.0, step_b=2.0, rerun=False)
    assert exposed == pytest.approx(3 * hop)  # first K/V hop forward and backward, dK/dV home
    assert hidden == pytest.approx((c - 2) * hop + (c - 2) * 2 * hop + hop)
    rerun, _ = ring_exposed(c, hop, 2 * hop, step_f=1.0, step_b=2.0, rerun=True)
    assert rerun == pytest.approx(4 * hop)  # recomputation waits for its first hop again


@pytest.mark.parametrize("c", [2, 4, 8])
def test_ring_without_compute_exposes_every_hop(c):
    hop = 1e-3
    exposed, hidden = ring_exposed(c, hop, 2 * hop, step_f=0.0, step_b=0.0, rerun=False)
    assert exposed == pytest.approx((3 * c - 2) * hop)  # every block sent: c-1, c-1, c
    assert hidden == 0.0


def test_ring_hop_longer_than_step_shows_the_difference():
    exposed, _ = ring_exposed(4, 3.0, 6.0, step_f=1.0, step_b=2.0, rerun=False)
    # forward: 3 + 2 x (3 - 1); backward: 2 x 3 + 2 x (6 - 2) + (3 - 2)
    assert exposed == pytest.approx(7.0 + 15.0)


def test_causal_imbalance_contiguous_only():
    assert causal_imbalance(1, "contiguous") == 1.0
    assert causal_imbalance(8, "zigzag") == 1.0
    for c in (2, 4, 8):
        # the last rank: c - 1 full blocks and one half block, against c / 2 on average
        assert causal_imbalance(c, "contiguous") == pytest.approx((c - 0.5) / (c / 2))


def test_attention_rate_rises_with_keys_and_causal_halves_the_work():
    flops = 1e13
    times = [attention_time(flops, s, False, A100, "bf16") for s in (512, 1024, 4096, 16384)]
    assert times == sorted(times, reverse=True)
    # FlashAttention-2 causal, head dim 128 on A100: 99 TFLOP/s at 512 tokens, 189 at 16k
    # (Dao 2023, Fig. 6), on FLOPs counting the backward as 2.5x: time of 3.5 units of work
    for keys, measured in ((512, 99e12), (16384, 189e12)):
        ours = 3 * attention_time(flops, keys, True, A100, "bf16")
        theirs = 3.5 * (flops / 2) / measured
        assert ours == pytest.approx(theirs, rel=0.03)
    assert attention_time(flops, 4096, True, A100, "bf16") == pytest.approx(
        attention_time(flops, 4096, False, A100, "bf16") / 2)
    cpu = load_hardware("cpu")  # no measured curve: a GEMM of the full FLOPs
    assert cpu.attention_efficiency is None
    assert attention_time(flops, 512, True, cpu, "bf16") == gemm_time(flops, cpu, "bf16")


def test_gemm_efficiency_grows_with_size_and_floor_binds_tiny_kernels():
    sizes = [1e6, 1e8, 1e9, 1e10, 1e12]
    rates = [f / gemm_time(f, A100, "bf16") for f in sizes]
    assert rates == sorted(rates)
    assert rates[-1] == pytest.approx(A100.gemm_efficiency * A100.flops("bf16"), rel=0.01)
    # F / (F + half) is a fixed cost half / rate per GEMM: about the launch floor itself
    assert gemm_time(1e3, A100, "bf16") == pytest.approx(A100.kernel_floor_s, rel=0.01)
    slow_launch = dataclasses.replace(A100, kernel_floor_s=1e-5)
    assert gemm_time(1e3, slow_launch, "bf16") == 1e-5
    assert gemm_time(1e12, slow_launch, "bf16") == gemm_time(1e12, A100, "bf16")


def test_gemm_operand_traffic_adds_the_bytes_time_to_the_math():
    m, k, n = 4096, 2048, 2048
    flops = 2 * m * k * n
    moved = 2 * (m * k + k * n + m * n)  # bf16 A, B read and C written once
    for hw in (A100, H100):
        extra = gemm_time(flops, hw, "bf16", (m, k, n)) - gemm_time(flops, hw, "bf16")
        assert extra == pytest.approx(moved / (hw.memory_bandwidth * hw.memory_efficiency))
        assert gemm_traffic_s((m, k, n), hw) == pytest.approx(extra)
    off = dataclasses.replace(A100, gemm_operand_traffic=0.0)  # CPU and calibrated profiles
    assert gemm_time(flops, off, "bf16", (m, k, n)) == gemm_time(flops, off, "bf16")
    assert gemm_traffic_s((m, k, n), off) == 0.0
    with pytest.raises(WorldError, match="gemm_operand_traffic is 1.5"):
        Hardware.from_json({**A100.to_json(), "gemm_operand_traffic": 1.5})
    fp32 = gemm_time(flops, A100, "fp32", (m, k, n), 4) - gemm_time(flops, A100, "fp32")
    assert fp32 == pytest.approx(2 * moved / (A100.memory_bandwidth * A100.memory_efficiency))


def test_gemm_operand_traffic_costs_thin_shapes_and_h100_most():
    def rate(hw, m, k, n):
        return 2 * m * k * n / gemm_time(2 * m * k * n, hw, "bf16", (m, k, n))
    # the same FLOPs, square against a tensor-parallel slice 8 times thinner on one side
    square, thin = (8192, 4096, 4096), (8192, 512, 32768)
    for hw in (A100, H100):
        assert rate(hw, *square) > rate(hw, *thin)
        assert rate(hw, *square) < hw.gemm_efficiency * hw.flops("bf16")
    # H100's ridge point (peak / bandwidth) is about twice A100's: its GEMMs keep a smaller
    # share of their best rate at the same shape
    for shape in (square, thin):
        best = {hw.name: hw.gemm_efficiency * hw.flops("bf16") for hw in (A100, H100)}
        assert rate(H100, *shape) / best["h100-80gb"] < rate(A100, *shape) / best["a100-80gb"]
    # a 16k x 2048 x 2048 GEMM on H100 (Megatron's 1.7B model) lands near 600 TFLOP/s
    assert 550e12 < rate(H100, 16384, 2048, 2048) < 700e12


def test_local_gemm_shape_cuts_the_wide_side_and_tokens():
    from autopar.cost.layer import Gemm, Lin
    qkv = Gemm(Lin(0, 2 * 4096 * 1024 * 3072), 1024, 3072, True)  # 4096 tokens per sample
    fc2 = Gemm(Lin(0, 2 * 4096 * 4096 * 1024), 4096, 1024, True)
    assert local_gemm_shape(qkv, 2, 4, 1) == (8192, 1024, 768)  # column split: N / tp
    assert local_gemm_shape(fc2, 2, 4, 1) == (8192, 1024, 1024)  # row split: K / tp
    assert local_gemm_shape(qkv, 2, 1, 2) == (4096, 1024, 3072)  # cp: tokens / cp


def test_layer_reports_gemm_operand_traffic():
    lt = _block()
    cost = _cost(lt, "ulysses")
    assert "GEMM operand traffic" in EFFECTS
    assert 0 < cost.effects["GEMM operand traffic"] < 3 * cost.forward
    off = _cost(lt, "ulysses", hw=dataclasses.replace(A100, gemm_operand_traffic=0.0))
    assert off.effects["GEMM operand traffic"] == 0.0
    # the launch floor may already cover a tiny GEMM's bytes: never more than their time
    assert 0 < cost.forward - off.forward <= cost.effects["GEMM operand traffic"] / 3 * (1 + 1e-9)


def test_contention_slows_only_overlapped_compute():
    assert contention_s(1.0, dataclasses.replace(A100, comm_sm_share=0.0)) == 0.0
    assert contention_s(1.0, dataclasses.replace(A100, comm_sm_share=0.2)) == pytest.approx(0.25)
    assert contention_s(0.0, A100) == 0.0


def test_memory_bound_ops_priced_by_bytes():
    assert memory_time(2e9, A100) == pytest.approx(2e9 / (A100.memory_bandwidth *
                                                           A100.memory_efficiency))


@functools.lru_cache(maxsize=None)
def _ring_plan(device="a100-80gb"):
    w = workload("llama:layers=2,hidden=256,heads=8,kv_heads=4,ffn=512,vocab=512,seq=1024",
                 seq=1024)
    world = World(8, per_node=8, device=device)
    return plan(w.model, w.inputs, world, global_batch=8, loss_fn=w.loss_fn,
                example_target=w.target,
                constraints={"cp": 4, "sp": "ring", "tp": 1, "pp": 1, "dp": 2})


def test_explain_shows_each_effect_with_seconds():
    p = _ring_plan()
    text = p.explain()
    assert "physical effects" in text
    shown = {e["effect"]: e["seconds"] for e in p.detail["effects"]}
    for name in ("memory-bound ops", "kernel launch floor", "attention on short sequences",
                 "cp ring hops exposed", "collectives' SM contention", "GEMM operand traffic"):
        assert name in EFFECTS and name in text
        assert 0 < shown[name] < p.predicted["step_time_s"]


def test_ring_receive_buffers_are_counted_in_memory():
    p = _ring_plan()
    buffers = p.predicted["memory_breakdown_bytes"]["buffers"]
    # dp x cp = 8 replicas: twice the biggest layer for gradient sync, plus ring buffers
    assert buffers > 0
    assert math.isfinite(p.predicted["step_time_s"])


def test_flash1_is_slower_and_unknown_kernels_are_named():
    assert attention_time(1e13, 2048, True, A100, "bf16", "flash1") > \
        attention_time(1e13, 2048, True, A100, "bf16")
    with pytest.raises(ValueError, match="flash1"):
        attention_time(1e13, 2048, True, A100, "bf16", "flash9")


@functools.lru_cache(maxsize=None)
def _block():
    from autopar.search import planner
    w = workload("llama:layers=2,hidden=256,heads=8,kv_heads=4,ffn=512,vocab=512,seq=1024",
                 seq=1024)
    chain = planner.prepare(w.model, w.inputs, loss_fn=w.loss_fn, example_target=w.target,
                            tp_sizes=[1])
    return next(lt for lt in chain.types if lt.attention)


def _cost(lt, cp_mode, cp=4, hw=A100):
    from autopar.cost.comm import Placement
    from autopar.cost.model import Context, LayerState, TensorMode, state_cost
    ctx = Context(hw, "bf16", Placement(1, 1), Placement(cp, cp), cp_mode)
    return state_cost(lt, LayerState(TensorMode("1d", 1)), 4, ctx)


def test_contiguous_split_pays_causal_imbalance_and_ring_holds_buffers():
    lt = _block()
    zigzag = _cost(lt, "ring")  # 1024 tokens split in 2 x 4 chunks
    contiguous = _cost(dataclasses.replace(
        lt, attention=[dataclasses.replace(a, keys=1004) for a in lt.attention]), "ring")
    assert zigzag.effects["causal imbalance (contiguous cp)"] == 0.0
    imbalance = contiguous.effects["causal imbalance (contiguous cp)"]
    short = contiguous.effects["attention on short sequences"]
    assert imbalance > 0 and short > 0
    # the busiest rank's attention is (2cp - 1)/cp = 7/4 of the balanced one, forward and
    # backward (3 passes): 3 x 3/4 of one balanced forward of this rank's queries
    a = lt.attention[0]
    even = attention_time(a.flops(4) / 4, 1004 / 4, True, A100, "bf16")
    assert imbalance == pytest.approx(3 * 0.75 * even)
    ulysses = _cost(lt, "ulysses")
    assert ulysses.workspace == 0.0 and zigzag.workspace > 0
    assert ulysses.effects["cp ring hops exposed"] == 0.0
    # ring attention calls see 1024 / 4 keys, Ulysses the whole sequence
    assert zigzag.effects["attention on short sequences"] > \
        ulysses.effects["attention on short sequences"]


def test_memory_bound_ops_and_launch_floor_in_a_layer():
    lt = _block()
    assert lt.kernels > len(lt.gemms) + len(lt.attention)  # norms, RoPE, SwiGLU, adds, ...
    cost = _cost(lt, "ulysses")
    traffic = lt.sharded[1].traffic_split(4) + lt.sharded[1].traffic_replicated(4)
    assert cost.effects["memory-bound ops"] == pytest.approx(3 * memory_time(traffic / 4, A100))
    tiny = _cost(dataclasses.replace(lt, traffic=lt.traffic.scale(0), sharded={
        1: dataclasses.replace(lt.sharded[1], traffic_split=lt.traffic.scale(0),
                               traffic_replicated=lt.traffic.scale(0))}), "ulysses")
    mem_kernels = lt.kernels - len(lt.gemms) - len(lt.attention)
    assert tiny.effects["kernel launch floor"] == pytest.approx(
        3 * mem_kernels * A100.kernel_floor_s)
