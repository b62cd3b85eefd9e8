"""ZeRO stage 1 (`autopar.runtime.zero`): each data-parallel rank keeps 1/dp of the
optimizer state and updates only its piece of every parameter.

Equivalence as in [1/7] (5 AdamW steps, loss and final weights within 1e-5 of one device,
every collective's bytes as the plan predicts: the data-parallel all-reduce becomes a
reduce-scatter of the gradients and an all-gather of the updated pieces), alone and with
tensor and pipeline parallelism; the optimizer state one rank holds is 1/dp of the
unsharded one (to the padding of each parameter to a multiple of dp).
"""

from distributed import dist_pool_fixture
from equivalence import assert_equal, compare

pool2 = dist_pool_fixture(2)
pool4 = dist_pool_fixture(4)

GPT = "gpt:layers=2,hidden=32,heads=4,vocab=64,seq=16"
GPT8 = "gpt:layers=8,hidden=32,heads=4,vocab=64,seq=16"
LLAMA = "llama:layers=2,hidden=32,heads=4,kv_heads=2,ffn=64,vocab=64,seq=16"


def _optimizer_bytes(engine, inputs, target) -> dict:
    state = [v for per in engine.optimizer.state.values() for v in per.values()
             if hasattr(v, "numel") and v.numel() > 1]
    params = [p for p in engine.parameters() if p.requires_grad]
    return {"state": sum(v.numel() * v.element_size() for v in state),
            "whole": 2 * sum(p.numel() * p.element_size() for p in params)}


def test_zero1_data_parallel_equals_single_device(pool2):
    results = pool2.run(compare, GPT, {"data": 2, "zero": {"stage": 1}}, 5, 8,
                        _optimizer_bytes)
    assert_equal(results)
    for r in results:
        assert r["measured"][("reduce_scatter", "dp")] > 0
        assert ("all_reduce", "dp") in r["measured"]  # the loss, 4 bytes
        probe = r["probe"]  # AdamW's two moments: half of them on each of 2 ranks
        assert probe["whole"] / 2 <= probe["state"] <= probe["whole"] / 2 * 1.01, probe


def test_zero1_with_tensor_parallelism(pool4):
    assert_equal(pool4.run(compare, LLAMA, {"data": 2, "tensor": {"size": 2, "mode": "1d"},
                                            "zero": {"stage": 1}}))


def test_zero1_with_pipeline_parallelism(pool4):
    assert_equal(pool4.run(compare, GPT8, {"data": 2, "zero": {"stage": 1},
                                           "pipeline": {"size": 2, "microbatches": 2}}))


def test_zero1_at_dp4_keeps_a_quarter_of_the_state(pool4):
    results = pool4.run(compare, GPT, {"data": 4, "zero": {"stage": 1}}, 3, 8,
                        _optimizer_bytes)
    assert_equal(results)
    for r in results:
        probe = r["probe"]
        assert probe["whole"] / 4 <= probe["state"] <= probe["whole"] / 4 * 1.02, probe
