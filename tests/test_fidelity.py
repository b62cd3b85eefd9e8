"""Published A100 runs, and MosaicML's H100 runs, priced on their published layouts stay
within 15% of what they measured (benchmarks/bench_fidelity.py prints every row; the
Megatron-Core H100 rows are reported there, not held to the bar here, as two are further
off: see docs/fidelity.md).

Deterministic model-against-paper checks, no timing: MosaicML's MPT runs (FSDP, bf16,
FlashAttention v1) and Megatron-LM's 2022 runs with sequence parallelism and selective
recomputation (Korthikanti et al. 2022). On H100 the GEMMs' operand traffic (the additive
roofline) is what brings MPT-1B and 7B within the bar: without it they run 15-17% over.
"""

import os
import sys

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                                "benchmarks"))

from bench_fidelity import MEGATRON_H100_MFU, RUNS, _config, figure, predict  # noqa: E402

A100_RUNS = [run for run in RUNS if run.device.startswith("a100")]
H100_MPT = [run for run in RUNS if run.device.startswith("h100") and run.name.startswith("MPT")]


@pytest.fixture(scope="module")
def rows():
    return [predict(run) for run in A100_RUNS]


def test_a100_runs_within_15_percent(rows):
    assert len(rows) >= 10
    off = [(r["name"], round(r["error_percent"], 1)) for r in rows
           if abs(r["error_percent"]) > 15]
    assert not off, off


def test_a100_errors_have_both_signs(rows):
    errors = [r["error_percent"] for r in rows]
    assert min(errors) < 0 < max(errors)


def test_a100_mean_error_under_8_percent(rows):
    errors = [abs(r["error_percent"]) for r in rows]
    assert sum(errors) / len(errors) < 8, errors


@pytest.fixture(scope="module")
def h100_rows():
    return [predict(run) for run in H100_MPT]


def test_h100_mpt_runs_within_15_percent_with_both_signs(h100_rows):
    assert len(h100_rows) >= 6
    off = [(r["name"], round(r["error_percent"], 1)) for r in h100_rows
           if abs(r["error_percent"]) > 15]
    assert not off, off
    errors = [r["error_percent"] for r in h100_rows]
    assert min(errors) < 0 < max(errors)


def test_operand_traffic_is_what_brings_small_h100_gemms_down(monkeypatch):
    import dataclasses

    from autopar.cost import hardware
    run = next(r for r in H100_MPT if r.name == "MPT-7b s2048 x8")
    with_traffic = predict(run)["error_percent"]
    h100 = hardware.load_hardware("h100-80gb")
    monkeypatch.setitem(hardware._CACHE, "h100-80gb",
                        dataclasses.replace(h100, gemm_operand_traffic=0.0))
    without = predict(run)["error_percent"]
    assert without > 15 >= abs(with_traffic)


MEGATRON_H100 = [run for run in RUNS if run.name.endswith("(Megatron)")]


def test_megatron_h100_rows_are_the_readme_table():
    """Each Megatron-Core H100 row as its table prints it: the model priced has the table's
    size (embeddings untied; tied, 1.7B would be 1.48e9), its TFLOP/s over 989 is the
    table's MFU column, and the figure is Megatron-LM's own FLOP count per GPU-second."""
    import torch

    from autopar.models.gpt import GPT
    assert len(MEGATRON_H100) == len(MEGATRON_H100_MFU) == 9
    for run in MEGATRON_H100:
        size = run.name.split()[1]
        with torch.device("meta"):
            params = sum(p.numel() for p in GPT(_config(run)).parameters())
        assert abs(params / (float(size[:-1]) * 1e9) - 1) < 0.035, (run.name, params)
        assert round(100 * run.published / 989) == MEGATRON_H100_MFU[size], run.name
        cfg = _config(run)
        b, s, n, h, v = run.batch, run.seq, cfg.n_layer, cfg.n_embd, cfg.vocab_size
        flops = 12 * b * s * n * h * h * ((2 + s / h) + 4 + v / (2 * n * h))
        assert figure(run, 1.0) == pytest.approx(flops / run.gpus / 1e12, rel=1e-12)


def test_the_optimism_check_holds_gpt3_175b_to_its_own_published_run():
    """The optimism check's GPT-3 175B A100 row (the README's first command) compares with
    the 175B run of the table above: the same MFU, and an HFU above it (selective
    recomputation counted)."""
    from bench_fidelity import BEST_PUBLISHED

    mfu, hfu, _ = BEST_PUBLISHED[("gpt3-175b", "a100-80gb")]
    (run,) = [r for r in RUNS if r.name == "GPT 175B (Korthikanti)"]
    assert mfu == run.published and mfu < hfu


def test_the_evidence_adjusted_bar_counts_each_ingredient_up_to_its_measured_speed_up(
        monkeypatch):
    """`evidence` fixes the best run's choices one after another on the winner's search: the
    priced factors chain from the winner's MFU to the last search's, each counts at most what
    its source measured, and the bar is the published MFU times what counts."""
    import bench_fidelity

    from autopar.models import workload
    from autopar.search import planner
    from autopar.world import World

    w = workload("gpt:layers=2,hidden=256,heads=8,vocab=512,seq=1024", max_layers=None)
    chain = planner.prepare(w.model, w.inputs, loss_fn=w.loss_fn, example_target=w.target,
                            tokens_per_sample=w.tokens_per_sample, tp_sizes=[1, 2, 4, 8])
    world = World(16, per_node=8, device="a100-80gb")
    monkeypatch.setitem(bench_fidelity.INGREDIENTS, "tiny", (
        ("attention", {"attention_kernel": "unfused"}, 1.01, "a"),
        ("recompute", {"recompute": "full"}, 2.0, "b")))
    best = planner.search(chain, world, global_batch=32).best
    ideal = planner.model_flops(chain, 32) / (16 * world.profile.flops("bf16"))
    mfu = ideal / best.step_time
    got = bench_fidelity.evidence("tiny", chain, world, 32, ideal, mfu, 0.4)
    rows = got["ingredients"]
    assert [r["ingredient"] for r in rows] == ["attention", "recompute"]
    assert all(r["priced"] > 1 for r in rows)  # unfused scores and full recompute cost time
    assert rows[0]["counted"] == 1.01 < rows[0]["priced"]  # capped at what was measured
    assert rows[1]["counted"] == rows[1]["priced"] < 2.0  # all of it: measured more
    assert rows[0]["priced"] * rows[1]["priced"] == pytest.approx(mfu / got["mfu_all_fixed"])
    assert got["evidence"] == pytest.approx(rows[0]["counted"] * rows[1]["counted"])
    assert got["adjusted_mfu"] == pytest.approx(0.4 * got["evidence"])
    assert got["ratio_to_adjusted"] == pytest.approx(mfu / got["adjusted_mfu"])
