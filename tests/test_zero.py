"""ZeRO stages 1 and 2 (`autopar.runtime.zero`): each data-parallel rank keeps 1/dp of the
optimizer state and updates only its piece of every parameter; with stage 2 each
gradient is cut to that piece as soon as the backward has made it.

Equivalence as in [1/7] (2 AdamW steps, the second on the state the first left; loss and
final weights within 1e-5 of one device, every collective's bytes as the plan predicts: the
data-parallel all-reduce becomes a reduce-scatter of the gradients and an all-gather of the
updated pieces), alone and with tensor and pipeline parallelism; the optimizer state one
rank holds is 1/dp of the unsharded one (to the padding of each parameter to a multiple of
dp).
"""

from equivalence import assert_equal, compare
from pretraced import forked_pool_fixture

GPT = "gpt:layers=2,hidden=32,heads=4,vocab=64,seq=16"
GPT4 = "gpt:layers=4,hidden=32,heads=4,vocab=64,seq=16"  # a block per stage of ZB-V at pp 2
GPT8 = "gpt:layers=8,hidden=32,heads=4,vocab=64,seq=16"
LLAMA = "llama:layers=2,hidden=32,heads=4,kv_heads=2,ffn=64,vocab=64,seq=16"

# each world forked from the test process once it traced the world's models (tests/pretraced.py)
pool2 = forked_pool_fixture(2, [GPT, GPT8])
pool4 = forked_pool_fixture(4, [GPT, GPT4, LLAMA])


def _optimizer_bytes(engine, inputs, target) -> dict:
    state = [v for per in engine.optimizer.state.values() for v in per.values()
             if hasattr(v, "numel") and v.numel() > 1]
    params = [p for p in engine.parameters() if p.requires_grad]
    return {"state": sum(v.numel() * v.element_size() for v in state),
            "whole": 2 * sum(p.numel() * p.element_size() for p in params)}


def test_zero1_data_parallel_equals_single_device(pool2):
    results = pool2.run(compare, GPT, {"data": 2, "zero": {"stage": 1}}, 2, 8,
                        _optimizer_bytes)
    assert_equal(results)
    for r in results:
        assert r["measured"][("reduce_scatter", "dp")] > 0
        assert ("all_reduce", "dp") in r["measured"]  # the loss, 4 bytes
        probe = r["probe"]  # AdamW's two moments: half of them on each of 2 ranks
        assert abs(probe["state"] - probe["whole"] / 2) <= 0.01 * probe["whole"] / 2, probe


def test_zero1_with_tensor_parallelism(pool4):
    assert_equal(pool4.run(compare, LLAMA, {"data": 2, "tensor": {"size": 2, "mode": "1d"},
                                            "zero": {"stage": 1}}, 2))


def test_zero1_with_pipeline_parallelism(pool4):
    assert_equal(pool4.run(compare, GPT, {"data": 2, "zero": {"stage": 1},
                                          "pipeline": {"size": 2, "microbatches": 2}}, 2))


def test_zero1_at_dp4_keeps_a_quarter_of_the_state(pool4):
    results = pool4.run(compare, GPT, {"data": 4, "zero": {"stage": 1}}, 2, 8,
                        _optimizer_bytes)
    assert_equal(results)
    for r in results:
        probe = r["probe"]
        assert abs(probe["state"] - probe["whole"] / 4) <= 0.02 * probe["whole"] / 4, probe


def _gradient_peak(stage: int, bucket_bytes: int | None = None) -> dict:
    """After a warm-up step, the most bytes of whole gradients held at once during one
    train_step (sampled each time a parameter's gradient is about to accumulate), and the
    bytes of this rank's gradient pieces when the optimizer steps. `bucket_bytes`: stage
    2's bucket size for this engine."""
    import torch
    import torch.distributed as dist
    from equivalence import build

    import autopar
    from autopar.runtime import zero

    default = zero.BUCKET_BYTES
    if bucket_bytes is not None:
        zero.BUCKET_BYTES = bucket_bytes
    model, inputs, target, loss_fn = build(GPT, 8)
    engine = autopar.parallelize(model, dist.get_world_size(),
                                 example_inputs=tuple(t[:2] for t in inputs), loss_fn=loss_fn,
                                 optimizer=lambda ps: torch.optim.AdamW(ps, lr=1e-3),
                                 plan={"data": 2, "zero": {"stage": stage}})
    zero.BUCKET_BYTES = default
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
        s.grad.numel() * s.grad.element_size() for s in engine.zero.shards
        if s.grad is not None)))
    engine.train_step(inputs, target)
    for h in handles + [pre]:
        h.remove()
    whole = sum(p.numel() * p.element_size() for p in params)
    buckets = [sum(params[i].numel() * 4 for i in b) for b in getattr(engine.zero, "buckets", [])]
    return {"peak": peak[0], "pieces": pieces[0], "whole": whole, "buckets": buckets}


def test_zero2_equals_single_device_and_never_holds_every_gradient(pool2):
    assert_equal(pool2.run(compare, GPT, {"data": 2, "zero": {"stage": 2}}, 2))
    # buckets of 16 KiB: whole gradients pile up to one bucket, never to the model's
    for probe in pool2.run(_gradient_peak, 2, 16 << 10):
        assert len(probe["buckets"]) > 3, probe
        assert probe["peak"] <= max(probe["buckets"]) < probe["whole"] / 3, probe
        assert abs(probe["pieces"] - probe["whole"] / 2) <= 0.01 * probe["whole"] / 2, probe
    for probe in pool2.run(_gradient_peak, 1):  # stage 1 holds them to the backward's end
        assert probe["peak"] > probe["whole"] / 2, probe


def test_zero2_with_pipeline_parallelism(pool4):
    """Each micro-batch's backward reduce-scatters its stage's gradients into the pieces
    (bucketed by stage); under ZB-V rank 0 runs the first and the last stage, whose tied
    embedding is a bucket sent once both stages have added to it (the weight-gradient
    pass writes .grad itself, so the stage says when it is done)."""
    assert_equal(pool4.run(compare, GPT4, {"data": 2, "zero": {"stage": 2}, "pipeline": {
        "size": 2, "microbatches": 4, "schedule": "zero_bubble"}}, 2))


def test_zero3_with_pipeline_parallelism(pool4):
    """Each stage gathers its layers for every micro-batch's forward and again where its
    backward needs them, and reduce-scatters each micro-batch's gradients into the pieces;
    the tied embedding's pieces are summed between the first and last stage's members (four
    blocks: one per stage of the V, as many as the schedule needs)."""
    assert_equal(pool4.run(compare, GPT4, {"data": 2, "zero": {"stage": 3}, "pipeline": {
        "size": 2, "microbatches": 4, "schedule": "zero_bubble"}}, 2))


def test_zero2_with_tensor_parallelism(pool4):
    assert_equal(pool4.run(compare, LLAMA, {"data": 2, "tensor": {"size": 2, "mode": "1d"},
                                            "zero": {"stage": 2}}, 2))


def test_every_stage_runs_with_a_pipeline():
    from autopar.plans import Plan

    for stage in (1, 2, 3):
        assert Plan.from_dict({"pipeline": 2, "data": 2, "zero": {"stage": stage}},
                              4).unsupported() == []
    assert Plan.from_dict({"data": 4, "zero": {"stage": 3}}, 4).unsupported() == []
    assert Plan.from_dict({"pipeline": 2, "data": 2, "zero": {"stage": 1}}, 4).unsupported() \
        == []


def test_zero_with_context_parallelism(pool4):
    """dp2 x cp2: the cp ranks sum their parameter gradients inside the backward, before
    ZeRO cuts them to pieces over dp."""
    for stage in (1, 2, 3):
        assert_equal(pool4.run(compare, GPT, {"data": 2, "zero": {"stage": stage},
                                              "sequence": {"size": 2, "mode": "ring"}}, 2))


def _data_parallel_buckets(bucket_bytes: int) -> dict:
    """Plain dp with buckets of `bucket_bytes`: the all-reduces one step sends during the
    backward (each bucket's, started as its last gradient is accumulated), their sizes,
    and the mean gradient one bucket's parameters end up with, against a whole all-reduce."""
    import torch
    import torch.distributed as dist
    from equivalence import build

    import autopar
    from autopar.runtime import buckets

    default, buckets.BUCKET_BYTES = buckets.BUCKET_BYTES, bucket_bytes
    model, inputs, target, loss_fn = build(GPT, 8)
    engine = autopar.parallelize(model, dist.get_world_size(),
                                 example_inputs=tuple(t[:2] for t in inputs), loss_fn=loss_fn,
                                 optimizer=None, plan={"data": 2})
    engine.comm_log.clear()
    engine.train_step(inputs, target)  # (the buckets are made with the training graph)
    buckets.BUCKET_BYTES = default
    sent = [r.bytes for r in engine.comm_log.records
            if r.op == "all_reduce" and r.axis == "dp" and r.phase == "backward"]
    grads = [p.grad.clone() for p in engine.parameters()]
    # the same local gradients, averaged in one all-reduce
    for p in engine.parameters():
        p.grad = None
    local = inputs[0][dist.get_rank() * 4:(dist.get_rank() + 1) * 4], \
        target[dist.get_rank() * 4:(dist.get_rank() + 1) * 4]
    engine.train_gm(*local).backward()
    flat = torch.cat([p.grad.reshape(-1) for p in engine.parameters()])
    dist.all_reduce(flat)
    whole = torch.cat([g.reshape(-1) for g in grads])
    return {"sent": sent, "buckets": len(engine.grads.buckets.buckets),
            "error": float((whole - flat / 2).abs().max()),
            "grad_bytes": 4 * flat.numel()}


def test_data_parallel_all_reduces_buckets_during_the_backward(pool2):
    for r in pool2.run(_data_parallel_buckets, 16 << 10):
        assert r["buckets"] > 3 and len(r["sent"]) == r["buckets"], r
        assert sum(r["sent"]) == r["grad_bytes"], r
        assert r["error"] <= 1e-7, r


# ---------------------------------------------------------------------------- ZeRO-3


def _zero3_held(name: str, plan: dict) -> dict:
    """After a first step: bytes of the parameters a rank keeps (its pieces; the whole
    local parameters are emptied), of the whole parameters, and the most layers whose
    gathered parameters are alive at once during the next step's forward and backward."""
    import torch
    import torch.distributed as dist
    from equivalence import build

    import autopar

    model, inputs, target, loss_fn = build(name, 8)
    engine = autopar.parallelize(model, dist.get_world_size(),
                                 example_inputs=tuple(t[:2] for t in inputs), loss_fn=loss_fn,
                                 optimizer=lambda ps: torch.optim.AdamW(ps, lr=1e-3), plan=plan)
    engine.train_step(inputs, target)
    zero = engine.zero
    kept = sum(s.numel() * s.element_size() for s in zero.shards)
    emptied = sum(p.numel() for p in zero.params)
    whole = sum(n * 4 for n in zero.numels)
    most = [0]

    def counted(fn):
        def run(*args):
            out = fn(*args)
            most[0] = max(most[0], len(zero._live) + len(zero._cache) + len(zero._pending))
            return out
        return run

    zero.gather_forward = counted(zero.gather_forward)
    zero.gather_backward = counted(zero.gather_backward)
    engine.train_step(inputs, target)
    return {"kept": kept, "emptied": emptied, "whole": whole, "most_alive": most[0],
            "units": len(zero.units), "regathered": len(zero.backward_gathers),
            "train_units": len(engine.train_units)}


def test_zero3_data_parallel_equals_single_device(pool2):
    """Each layer's parameters are gathered before it runs and dropped after: the forward
    gathers every layer once, the backward again those an op saved (not the embedding),
    and each layer's gradients are reduce-scattered once; the plan predicts those bytes."""
    plan = {"data": 2, "zero": {"stage": 3}}
    results = pool2.run(compare, GPT8, plan, 2)
    assert_equal(results)
    for r in results:
        measured = r["measured"]
        assert measured[("all_gather", "dp")] > measured[("reduce_scatter", "dp")]
    for probe in pool2.run(_zero3_held, GPT8, plan):
        assert probe["emptied"] == 0, probe
        assert abs(probe["kept"] - probe["whole"] / 2) <= 0.01 * probe["whole"] / 2, probe
        # the current layer, the prefetched one, the one whose gather is being waited
        # for and the last block the forward keeps for the backward: never the 10 layers
        # of the model at once
        assert probe["most_alive"] <= 4, probe
        assert 0 < probe["regathered"] < probe["train_units"], probe


def _zero3_per_parameter(name: str, plan: dict, compile: bool = False) -> dict:
    """During a second step: how many times each parameter was all-gathered for the
    forward, for the backward, and reduce-scattered; and the bytes the step logged beside
    the plan's prediction."""
    from equivalence import stepped_once

    engine, model, inputs, target = stepped_once(name, plan, compile=compile)
    zero, counts = engine.zero, {}

    def counted(kind, fn):
        def run(u, *args):
            key = kind if kind == "reduced" else args[0]  # (_finish's phase)
            for i in zero.units[u].members:
                counts.setdefault(key, [0] * len(zero.params))[i] += 1
            return fn(u, *args)
        return run

    zero._finish = counted("gathered", zero._finish)
    zero.reduce = counted("reduced", zero.reduce)
    engine.comm_log.clear()
    engine.train_step(inputs, target)
    vocab = (model.config.vocab_size, model.config.n_embd)  # the embedding's = classifier's
    tied = [i for i, shape in enumerate(zero.shapes) if tuple(shape) == vocab]
    return {"counts": counts, "tied": tied, "n": len(zero.params),
            "measured": engine.comm_log.totals(phases=("forward", "backward", "step")),
            "predicted": engine.predicted_comm(8)}


def test_zero3_tied_weight_gathered_and_reduced_once(pool2):
    """The GPT's embedding and classifier share one weight: it belongs to the embedding's
    unit, whose gathered buffer serves the classifier too and stays saved for the
    classifier's backward (no gather again), and the two uses' gradients are summed before
    one reduce-scatter. Every parameter is gathered once a forward and reduce-scattered once
    a step, eager and compiled, and the plan predicts the bytes."""
    for compiled in (False, True):
        for r in pool2.run(_zero3_per_parameter, GPT, {"data": 2, "zero": {"stage": 3}},
                           compiled):
            assert len(r["tied"]) == 1, r
            assert r["counts"]["forward"] == [1] * r["n"], (compiled, r)
            assert r["counts"]["reduced"] == [1] * r["n"], (compiled, r)
            assert r["counts"]["backward"][r["tied"][0]] == 0, (compiled, r)
            assert r["measured"] == r["predicted"], (compiled, r)


def test_zero3_plan_holds_the_tied_weight_and_its_gradient():
    """The planner prices ZeRO-3's buffers as the runtime holds them: a tied embedding's
    weight gathered once and held to the classifier's backward, with its whole gradient
    summed there, beside the two layers gathered in turn (a block, the biggest of the rest);
    untied, the embedding and the classifier are two layers gathered in turn. (Beside both,
    the data-parallel sync's two flat buffers of the biggest layer.)"""
    import torch
    import torch.nn.functional as F

    from autopar.models.gpt import GPT, GPTConfig
    from autopar.search import planner
    from autopar.search.search import Constraints, Options, Search
    from autopar.world import World

    def lm_loss(logits, y):
        return F.cross_entropy(logits.flatten(0, 1), y.flatten())

    buffers = {}
    x = torch.zeros(2, 16, dtype=torch.long)
    for tie in (True, False):
        cfg = GPTConfig(vocab_size=512, n_layer=2, n_head=2, n_embd=32, block_size=16,
                        tie_embeddings=tie)
        chain = planner.prepare(GPT(cfg), (x,), loss_fn=lm_loss, example_target=x,
                                tp_sizes=[1])
        block = max(lt.param_bytes for lt in chain.layers() if lt.name.startswith("blocks."))
        table = cfg.vocab_size * cfg.n_embd * 4  # fp32: the gradient as many bytes again
        cand = Search(chain, World(2, per_node=2, device="cpu"), Options(global_batch=4),
                      Constraints(tp=1, pp=1, zero=3)).every()[0]
        buffers[tie] = (cand.memory["buffers"], table, block)
    got, table, block = buffers[True]
    assert got == 2 * table + 2 * table + 2 * block
    got, table, block = buffers[False]
    assert got == 2 * table + 2 * table


def _zero3_writes(name: str, plan: dict) -> dict:
    """Elements written by the ops (views and collectives aside) of ZeRO-3's gathers
    (each unit's pieces into its whole parameters) and of its gradient reduce-scatters
    (each unit's gradients into their padded buffer), against what each must write."""
    import torch
    from equivalence import counting_writes, stepped_once

    engine, _, _, _ = stepped_once(name, plan)  # (held: the engine owns what zero reads)
    zero, written = engine.zero, {}
    values = sum(u.numel for u in zero.units)
    with counting_writes(written, in_place_apart=False):
        for u in range(len(zero.units)):
            zero._finish(u, "forward")
    gathered, written = written, {}
    with counting_writes(written, in_place_apart=False):
        for u, unit in enumerate(zero.units):
            zero.reduce(u, tuple(torch.ones(zero.shapes[i]) for i in unit.members))
    zero._land_reduced()
    padding = sum(zero.chunks[i] * zero.dp.size - zero.numels[i]
                  for unit in zero.units for i in unit.members)
    return {"values": values, "padding": padding,
            "gathered": gathered, "reduced": written}


def test_zero3_gathers_and_reduces_write_each_value_once(pool2):
    """A gather copies each parameter's gathered values into the whole buffer once (no
    flattened copy of the strided columns first) and sends this rank's pieces as they lie
    (after the first step they are views of one flat piece per unit: no send buffer
    written), and a reduce-scatter's buffer is written once: the gradients, and zeros only
    where they pad (not the whole buffer zeroed first)."""
    for r in pool2.run(_zero3_writes, GPT8, {"data": 2, "zero": {"stage": 3}}):
        # the values into the whole buffers, nothing into a send buffer
        assert r["gathered"]["copy"] == r["values"], r
        assert "clone" not in r["gathered"], r
        assert sum(r["gathered"].get(k, 0) for k in ("fill", "zero", "zeros")) == 0, r
        assert sum(r["reduced"].get(k, 0) for k in ("fill", "zero", "zeros")) \
            == r["padding"], r


def test_zero3_with_tensor_parallelism(pool4):
    assert_equal(pool4.run(compare, LLAMA, {"data": 2, "tensor": {"size": 2, "mode": "1d"},
                                            "zero": {"stage": 3}}, 2))


def test_zero3_at_dp4_keeps_a_quarter(pool4):
    plan = {"data": 4, "zero": {"stage": 3}}
    assert_equal(pool4.run(compare, GPT, plan, 2, 8))
    for probe in pool4.run(_zero3_held, GPT, plan):
        assert abs(probe["kept"] - probe["whole"] / 4) <= 0.02 * probe["whole"] / 4, probe


# ---------------------------------------------------------------------------- offload


def _where_the_optimizer_lives(engine, inputs, target) -> dict:
    """Devices of the optimizer's pieces and state, and whether a piece shares storage
    with the parameters (ZeRO's pieces are views of them; offloaded ones are copies)."""
    params = {p.untyped_storage().data_ptr() for p in engine.zero.params}
    state = [v for per in engine.optimizer.state.values() for v in per.values()
             if hasattr(v, "device") and v.numel() > 1]
    return {"pieces": sorted({str(s.device) for s in engine.zero.shards}),
            "state": sorted({str(v.device) for v in state}),
            "state_tensors": len(state),
            "views": sum(s.untyped_storage().data_ptr() in params for s in engine.zero.shards)}


def test_offload_equals_single_device_for_every_stage(pool2):
    """ZeRO-Offload: the optimizer steps on host copies of the pieces; the results are
    those of one device, with the same bytes over dp (the host copies add none)."""
    for stage in (1, 2, 3):
        plan = {"data": 2, "zero": {"stage": stage, "offload": True}}
        results = pool2.run(compare, GPT, plan, 2, 8, _where_the_optimizer_lives)
        assert_equal(results)
        for r in results:
            probe = r["probe"]
            assert probe["pieces"] == ["cpu"] and probe["state"] == ["cpu"], probe
            assert probe["state_tensors"] > 0 and probe["views"] == 0, probe


def test_offload_needs_zero_and_runs_on_one_rank():
    """ZeRO-Offload's single-device case: one data-parallel rank, the optimizer on a host
    copy of each whole parameter (under ZeRO-3 the parameters too, each layer's copied up
    for its use), the single-device results, no collective."""
    from autopar.plans import Plan

    said = Plan.from_dict({"data": 2, "zero": {"stage": 0, "offload": True}}, 2).unsupported()
    assert any("offload without ZeRO" in m for m in said), said
    assert Plan.from_dict({"zero": {"stage": 3, "offload": True}}, 1).unsupported() == []
    for stage in (1, 2, 3):
        r = compare(GPT, {"zero": {"stage": stage, "offload": True}}, 2, 8,
                    _where_the_optimizer_lives)
        assert_equal([r])
        assert r["measured"] == {} and r["probe"]["views"] == 0, r
        assert r["probe"]["state"] == ["cpu"], r
