"""ZeRO stages 1 and 2 (`autopar.runtime.zero`): each data-parallel rank keeps 1/dp of the
optimizer state and updates only its piece of every parameter; with stage 2 each
gradient is cut to that piece as soon as the backward has made it.

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
        assert abs(probe["state"] - probe["whole"] / 2) <= 0.01 * probe["whole"] / 2, probe


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
        assert abs(probe["state"] - probe["whole"] / 4) <= 0.02 * probe["whole"] / 4, probe


def _gradient_peak(stage: int) -> dict:
    """After a warm-up step, the most bytes of whole gradients held at once during one
    train_step (sampled each time a parameter's gradient is about to accumulate), and the
    bytes of this rank's gradient pieces when the optimizer steps."""
    import torch
    import torch.distributed as dist
    from equivalence import build

    import autopar

    model, inputs, target, loss_fn = build(GPT, 8)
    engine = autopar.parallelize(model, dist.get_world_size(),
                                 example_inputs=tuple(t[:2] for t in inputs), loss_fn=loss_fn,
                                 optimizer=lambda ps: torch.optim.AdamW(ps, lr=1e-3),
                                 plan={"data": 2, "zero": {"stage": stage}})
    engine.train_step(inputs, target)
    params = [p for p in engine.parameters() if p.requires_grad]
    peak, pieces = [0], []

    def watch(grad):
        alive = sum(q.grad.numel() * q.grad.element_size() for q in params
                    if q.grad is not None)
        peak[0] = max(peak[0], alive)
        return grad

    handles = [p.register_hook(watch) for p in params]
    pre = engine.optimizer.register_step_pre_hook(lambda *a: pieces.append(sum(
        s.grad.numel() * s.grad.element_size() for s in engine._zero.shards
        if s.grad is not None)))
    engine.train_step(inputs, target)
    for h in handles + [pre]:
        h.remove()
    whole = sum(p.numel() * p.element_size() for p in params)
    return {"peak": peak[0], "pieces": pieces[0], "whole": whole}


def test_zero2_equals_single_device_and_never_holds_every_gradient(pool2):
    assert_equal(pool2.run(compare, GPT, {"data": 2, "zero": {"stage": 2}}))
    for probe in pool2.run(_gradient_peak, 2):
        # no whole gradient outlives its own accumulation: none is held when the next comes
        assert probe["peak"] == 0, probe
        assert abs(probe["pieces"] - probe["whole"] / 2) <= 0.01 * probe["whole"] / 2, probe
    for probe in pool2.run(_gradient_peak, 1):  # stage 1 holds them to the backward's end
        assert probe["peak"] > probe["whole"] / 2, probe


def test_zero2_with_tensor_parallelism(pool4):
    assert_equal(pool4.run(compare, LLAMA, {"data": 2, "tensor": {"size": 2, "mode": "1d"},
                                            "zero": {"stage": 2}}))


def test_what_zero_cannot_run_yet_is_named():
    from autopar.plan import Plan

    with_pp = Plan.from_dict({"pipeline": 2, "data": 2, "zero": {"stage": 2}}, 4)
    assert any("ZeRO stage 2 together with a pipeline" in m for m in with_pp.unsupported())
    assert Plan.from_dict({"data": 4, "zero": {"stage": 3}}, 4).unsupported() == \
        ["ZeRO stage 3"]
    assert Plan.from_dict({"pipeline": 2, "data": 2, "zero": {"stage": 1}}, 4).unsupported() \
        == []


def test_zero_with_context_parallelism(pool4):
    """dp2 x cp2: the cp ranks sum their parameter gradients inside the backward, before
    ZeRO cuts them to pieces over dp."""
    for stage in (1, 2):
        assert_equal(pool4.run(compare, GPT, {"data": 2, "zero": {"stage": stage},
                                              "sequence": {"size": 2, "mode": "ring"}}))
