"""World 2 (gloo): every zoo model and transformers' GPT-2 and BERT, data-only and tensor-only.

5 AdamW steps; each loss and the final weights equal the single-device run within 1e-5
relative, and the bytes of every collective equal the plan's prediction exactly.
"""

import pytest
from distributed import dist_pool_fixture
from equivalence import MODELS, compare

pool2 = dist_pool_fixture(2)

PLANS = {"data": None, "tensor": {"tensor": {"size": 2, "mode": "1d"}}}


@pytest.mark.parametrize("plan", sorted(PLANS))
@pytest.mark.parametrize("model", MODELS)
def test_equals_single_device(pool2, model, plan):
    results = pool2.run(compare, model, PLANS[plan])
    for r in results:
        assert r["loss"] <= 1e-5, r["loss"]
        assert r["weights"] <= 1e-5, r["weights"]
        assert r["noise_abs"] <= 1e-8, r["noise_abs"]
        assert r["keys_equal"]
        assert r["measured"] == r["predicted"]
        assert sum(r["measured"].values()) > 0
    axes = {axis for (_, axis) in results[0]["measured"]}
    assert axes == ({"dp"} if plan == "data" else {"tp"})
