"""Predicted beside measured (`Engine.explain()`, autopar.report.measured, autopar.runtime.measure):
after a few steps each layer and mesh axis shows the plan's time, bytes and memory beside
what this rank measured. The bytes are exact (the plan's collectives are the ones sent),
the times are the marks' (checked for consistency, never for speed), the activations are
what autograd saved."""

import functools

import pytest
import torch
import torch.nn.functional as F
from distributed import dist_pool_fixture
from equivalence import build
from torch import nn

from autopar.errors import PlanError
from autopar.runtime.measure import Recorder, _Call, instrument

pool2 = dist_pool_fixture(2)

GPT = "gpt:layers=2,hidden=32,heads=4,vocab=64,seq=16"
GPT4 = "gpt:layers=4,hidden=32,heads=4,vocab=64,seq=16"


# ---------------------------------------------------------------- the recorder alone
class _Log:
    def __init__(self):
        self.records, self.seconds = [], []


def _fold(forward, backward, backward_end=None) -> dict:
    rec = Recorder(warmup=0)
    layers = ["a", "b", "c", None]
    rec._calls.append(_Call(layers, forward, backward))
    rec._backward_end = backward_end
    rec.finish_step(_Log())
    return {k: (round(v.forward_s, 6), round(v.backward_s, 6), v.backward_timed)
            for k, v in rec.layers.items()}


def test_fold_splits_a_chain_at_its_ticks():
    # forward a 0-1, b 1-3, c 3-6; backward starts at 10: c 10-12, b 12-15, a 15-19
    got = _fold([0.0, 1.0, 3.0, 6.0], [19.0, 15.0, 12.0, 10.0])
    assert got == {"a": (1.0, 4.0, True), "b": (2.0, 3.0, True), "c": (3.0, 2.0, True)}


def test_fold_without_a_probe_uses_the_end_of_the_backward():
    # a reads token ids: no tick of its own; the step's backward returned at 19
    got = _fold([0.0, 1.0, 3.0, 6.0], [None, 15.0, 12.0, 10.0], backward_end=19.0)
    assert got["a"] == (1.0, 4.0, True)
    untimed = _fold([0.0, 1.0, 3.0, 6.0], [None, 15.0, 12.0, 10.0])
    assert untimed["a"][2] is False and untimed["a"][1] == 0.0


def test_fold_counts_an_aliased_or_side_by_side_tick_as_no_time():
    # b's probe aliases c's (a dropout with p = 0): both tick at 12; b gets nothing and
    # nothing is negative
    got = _fold([0.0, 1.0, 3.0, 6.0], [19.0, 12.0, 12.0, 10.0])
    assert got["b"][1] == 0.0 and got["c"][1] == 2.0 and got["a"][1] == 7.0


def test_warmup_steps_are_not_counted():
    rec = Recorder(warmup=1)
    rec._calls.append(_Call(["a", None], [0.0, 5.0], [None, None]))
    rec.finish_step(_Log())
    assert rec.steps == 0 and rec.layers == {}
    rec._calls.append(_Call(["a", None], [0.0, 2.0], [None, None]))
    rec.finish_step(_Log())
    assert rec.steps == 1 and rec.layers["a"].forward_s == 2.0


class _TwoLayers(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(16, 8)
        self.lin = nn.Linear(8, 8)

    def forward(self, ids):
        return self.lin(self.emb(ids)).square().mean()


def test_instrument_changes_no_value_and_ticks_every_segment():
    from autopar.graph.trace import trace

    torch.manual_seed(0)
    model = _TwoLayers()
    ids = torch.randint(0, 16, (4, 5))
    traced = trace(model, (ids,), train=True)
    gm = traced.gm
    plain = gm(ids)
    plain.backward()
    grads = {n: p.grad.clone() for n, p in gm.named_parameters()}
    gm.zero_grad()
    rec = Recorder(warmup=0)
    segments = instrument(gm, rec, 0)
    marks = [n for n in gm.graph.nodes if n.op == "call_module" and "autopar_mark" in n.target]
    assert len(marks) == segments + 1 and all(not n.users for n in marks)
    rec.begin_step(_Log())
    out = gm(ids)
    out.backward()
    rec.finish_step(_Log())
    assert torch.equal(out, plain)
    assert all(torch.equal(p.grad, grads[n]) for n, p in gm.named_parameters())
    assert {"emb", "lin"} <= set(rec.layers)
    # the embedding reads token ids: its mark probes its weight, so its backward is timed
    assert rec.layers["emb"].backward_timed and rec.layers["lin"].backward_timed


# ---------------------------------------------------------------- one process
def _lm_loss(logits, y):
    return F.cross_entropy(logits.reshape(-1, logits.size(-1)), y.reshape(-1))


def test_explain_before_measured_steps_says_what_to_do():
    import autopar

    model, inputs, target, loss_fn = build(GPT, 4)
    engine = autopar.parallelize(model, 1, example_inputs=inputs, loss_fn=loss_fn,
                                 optimizer=functools.partial(torch.optim.SGD, lr=0.1))
    with pytest.raises(PlanError, match="run train_step at least 2 times"):
        engine.explain()
    engine.train_step(inputs, target)
    with pytest.raises(PlanError, match="warm-up"):
        engine.explain()


def _explain(name, plan, steps=3, batch=8, precision="fp32"):
    import torch.distributed as dist

    import autopar

    model, inputs, target, loss_fn = build(name, batch)
    world = dist.get_world_size() if dist.is_initialized() else 1
    engine = autopar.parallelize(model, world, example_inputs=tuple(t[:2] for t in inputs),
                                 loss_fn=loss_fn, plan=plan, precision=precision,
                                 optimizer=functools.partial(torch.optim.AdamW, lr=1e-3))
    for _ in range(steps):
        engine.comm_log.clear()
        engine.train_step(inputs, target)
    one_step = engine.comm_log.totals()
    return {"data": engine.explain(format="json"), "text": engine.explain(),
            "one_step": {f"{op}/{axis}": b for (op, axis), b in one_step.items()},
            "layers": [layer.name for layer in engine.train_graph.layers]}


def _check(result):
    data, text = result["data"], result["text"]
    rows = {r["name"]: r for r in data["layers"]}
    assert set(result["layers"]) <= set(rows)  # every layer of the graph has a row
    here = [r for r in data["layers"] if r["here"]]
    for r in here:
        m = r["measured"]
        assert m["forward_s"] >= 0 and m["backward_s"] >= 0
        # the plan's collectives are the ones sent, layer by layer
        assert m["comm_bytes"] == r["predicted"]["comm_bytes"], r["name"]
    for a in data["axes"]:
        assert a["measured"]["bytes"] == a["predicted"]["bytes"], a["axis"]
    # the layers' spans lie inside the step
    spans = sum(r["measured"]["forward_s"] + r["measured"]["backward_s"] for r in here)
    assert 0 < spans <= data["step"]["measured_s"]
    assert data["step"]["predicted_s"] > 0
    blocks = [r for r in here if r["name"].startswith("blocks.")]
    assert blocks and all(r["measured"]["activation_bytes"] > 0 and
                          r["predicted"]["activation_bytes"] > 0 for r in blocks)
    assert all(r["measured"]["param_bytes"] > 0 for r in blocks)
    assert "per layer" in text and "per mesh axis" in text and "blocks.0" in text
    return rows


def test_explain_one_device():
    rows = _check(_explain(GPT, {"data": 1}))
    # one device: a block's parameters are held whole, as the plan prices them
    assert rows["blocks.0"]["measured"]["param_bytes"] == \
        rows["blocks.0"]["predicted"]["param_bytes"]


# ---------------------------------------------------------------- two processes
def test_explain_tensor_parallel(pool2):
    for result in pool2.run(_explain, GPT, {"tensor": {"size": 2, "mode": "1d"}}):
        rows = _check(result)
        # the blocks all-reduce over tp in their forward and backward, the step nothing
        assert rows["blocks.0"]["measured"]["comm_bytes"] > 0
        assert [a["axis"] for a in result["data"]["axes"]] == ["tp"]
        assert result["data"]["axes"][0]["measured"]["seconds"] > 0


def test_explain_data_parallel_puts_the_sync_under_the_step(pool2):
    for result in pool2.run(_explain, GPT, {"data": 2, "zero": {"stage": 3}}):
        rows = _check(result)
        assert rows["(step)"]["measured"]["comm_bytes"] > 0
        assert all(rows[n]["measured"]["comm_bytes"] == 0 for n in result["layers"])


def test_explain_pipeline_shows_each_rank_its_own_stages(pool2):
    results = pool2.run(_explain, GPT4, {"pipeline": {"size": 2, "schedule": "1f1b",
                                                      "microbatches": 2}})
    mine = []
    for result in results:
        rows = _check(result)
        mine.append({n for n in result["layers"] if rows[n]["here"]})
        assert result["data"]["microbatches"] == 2
    assert mine[0] and mine[1] and not mine[0] & mine[1]
    assert "blocks.0" in mine[0] and "blocks.3" in mine[1]
