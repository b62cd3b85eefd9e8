"""World 4 (gloo): data, tensor and tensor x data plans against the single-device run
(tests/equivalence.py's `compare`: 2 AdamW steps, the second on the state the first left).

Also checks memory: under tensor size 4 each rank holds a quarter of every sharded
parameter, and the engine lists what stays replicated.
"""

import pytest
from equivalence import MODELS, assert_equal, compare
from pretraced import forked_pool_fixture

# the world forked from the test process once it traced the models (tests/pretraced.py)
pool4 = forked_pool_fixture(4, MODELS)

PLANS = {"data": {"data": 4},
         "tensor": {"tensor": {"size": 4, "mode": "1d"}},
         "tensor x data": {"tensor": {"size": 2, "mode": "1d"}}}
# Data parallelism alone over 4 runs for gpt-tiny only: the gradients' average and the batch
# split are the same code for every model, which tests/test_equivalence_world2.py runs over
# data 2 for each of them and "tensor x data" here over dp 2 beside tp 2.
DATA4_MODELS = ("gpt-tiny",)
CASES = [(m, p) for m in MODELS for p in sorted(PLANS) if p != "data" or m in DATA4_MODELS]
# One run per (model, plan): the held-bytes test reads the tensor-4 runs the equivalence
# test made (compare returns what each rank holds after the last step) instead of training
# the same plan again. A test run alone makes its own.
_RUNS: dict = {}


def _run(pool4, model: str, plan: str) -> list[dict]:
    if (model, plan) not in _RUNS:
        _RUNS[model, plan] = pool4.run(compare, model, PLANS[plan], 2)
    return _RUNS[model, plan]


@pytest.mark.parametrize("model,plan", CASES)
def test_equals_single_device(pool4, model, plan):
    results = _run(pool4, model, plan)
    assert_equal(results)
    axes = {axis for (_, axis) in results[0]["measured"]}
    expected = {"data": {"dp"}, "tensor": {"tp"}, "tensor x data": {"tp", "dp"}}[plan]
    assert axes == expected


@pytest.mark.parametrize("model", ["gpt-tiny", "llama-tiny", "hf-gpt2"])
def test_tensor4_holds_a_quarter_of_each_sharded_layer(pool4, model):
    r = _run(pool4, model, "tensor")[0]
    sharded = {k: v for k, v in r["held"].items() if k not in r["replicated"]}
    assert sharded
    for name, (held, whole) in sharded.items():
        assert held * 4 == whole, name
    replicated = 0
    for name in r["replicated"]:
        held, whole = r["held"][name]
        assert held == whole
        replicated += whole
    # what stays whole is small: norms, biases of row-split layers, rotary tables
    total_whole = sum(w for _, w in r["held"].values())
    assert replicated < 0.1 * total_whole
    total_held = sum(h for h, _ in r["held"].values())
    assert total_held < 0.35 * total_whole


def test_searched_plan_runs_and_equals_single_device(pool4):
    """plan=None: the search picks among executable modes; the run still equals one device."""
    results = pool4.run(compare, "gpt-tiny", None, 2)
    for r in results:
        assert r["loss"] <= 1e-5 and r["weights"] <= 1e-5
        assert r["measured"] == r["predicted"]
