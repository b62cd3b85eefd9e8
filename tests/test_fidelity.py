"""Published A100 runs priced on their published layouts stay within 15% of what they
measured (benchmarks/bench_fidelity.py prints every row, H100 included; its H100 rows
are reported there, not held to the bar here, as some are further off: see README).

Deterministic model-against-paper checks, no timing: MosaicML's MPT runs (FSDP, bf16,
FlashAttention v1) and Megatron-LM's 2022 runs with sequence parallelism and selective
recomputation (Korthikanti et al. 2022).
"""

import os
import sys

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                                "benchmarks"))

from bench_fidelity import RUNS, predict  # noqa: E402

A100_RUNS = [run for run in RUNS if run.device.startswith("a100")]


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
