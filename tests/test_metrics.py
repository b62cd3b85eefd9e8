"""Per-step metrics (`parallelize(..., metrics=...)`, autopar.runtime.metrics): one JSON line
per step with the measured step time, tokens/s, MFU, peak memory, gradient norm and bytes
sent per axis beside the plan's prediction; rank 0 writes; the metrics' own traffic is in
the comm log and in the prediction, so measured still equals predicted."""

import functools
import json
import os

import pytest
import torch
import torch.nn.functional as F
from distributed import dist_pool_fixture

import autopar
from autopar.errors import PlanError
from autopar.models import build
from autopar.runtime.metrics import batch_tokens, console_line

pool2 = dist_pool_fixture(2)

GPT = "gpt:layers=2,hidden=32,heads=4,vocab=64,seq=16"


def _loss(logits, target):
    return F.cross_entropy(logits.reshape(-1, logits.size(-1)), target.reshape(-1))


def _train(path, plan, steps=3, max_grad_norm=None, world=1):
    model, (x,) = build(GPT, batch=4, device="cpu", seed=0)
    lines = []
    engine = autopar.parallelize(model, world, example_inputs=(x,), loss_fn=_loss,
                                 optimizer=functools.partial(torch.optim.AdamW, lr=1e-3),
                                 plan=plan, max_grad_norm=max_grad_norm,
                                 metrics=path if path else lines.append, metrics_every=2)
    y = x.roll(-1, 1)
    losses = [engine.train_step(x, y) for _ in range(steps)]
    return engine, losses, lines, x


def test_a_searched_plan_fills_every_column(tmp_path, capsys):
    path = str(tmp_path / "metrics.jsonl")
    engine, losses, _, x = _train(path, None)
    with open(path) as f:
        rows = [json.loads(line) for line in f]
    assert [r["step"] for r in rows] == [1, 2, 3]
    assert [r["loss"] for r in rows] == losses
    for r in rows:
        assert r["step_s"] > 0 and r["step_s_predicted"] > 0
        assert r["tokens_per_s"] == pytest.approx(x.numel() / r["step_s"])
        assert 0 < r["mfu"] and 0 < r["mfu_predicted"]
        assert r["peak_memory_bytes"][0] > 0 and r["peak_memory_bytes_predicted"] > 0
        assert r["grad_norm"] > 0
    # MFU: the model's FLOPs per step over the measured time and the device's peak
    pred = engine.step_prediction()
    assert rows[-1]["mfu"] == pytest.approx(
        pred["model_flops_per_step"] / (rows[-1]["step_s"] * pred["peak_flops"]))
    out = capsys.readouterr().out.splitlines()
    assert out == [console_line(rows[1])]  # every 2 steps
    assert out[0].startswith("step 2 | loss ") and "tok/s" in out[0] and "(plan " in out[0]


def test_the_norm_without_clipping_equals_the_clipped_runs_norm():
    _, _, free, _ = _train(None, {"data": 1}, steps=2)
    clipped, _, lines, _ = _train(None, {"data": 1}, steps=2, max_grad_norm=1e9)
    assert [r["grad_norm"] for r in free] == [r["grad_norm"] for r in lines]
    assert lines[-1]["grad_norm"] == clipped.last_grad_norm


def test_tensorboard_scalars_beside_the_json(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    path = str(tmp_path / "m.jsonl")
    _train(path, {"data": 1}, steps=2)
    acc = EventAccumulator(path + ".tb")
    acc.Reload()
    assert {"loss", "step_s", "tokens_per_s", "grad_norm"} <= set(acc.Tags()["scalars"])
    assert [e.step for e in acc.Scalars("loss")] == [1, 2]


def test_bad_metrics_arguments_are_refused_in_one_sentence():
    model, (x,) = build(GPT, batch=4, device="cpu", seed=0)
    with pytest.raises(PlanError, match="metrics must be a file path or a callable"):
        autopar.parallelize(model, 1, example_inputs=(x,), metrics=3)
    with pytest.raises(PlanError, match="metrics_every must be a whole number >= 0"):
        autopar.parallelize(model, 1, example_inputs=(x,), metrics=print, metrics_every=-1)


def test_tokens_of_a_batch():
    assert batch_tokens((torch.zeros(4, 16, dtype=torch.long),)) == (4, 64)
    assert batch_tokens(torch.zeros(4, 3, 32, 32)) == (4, 4)


def _two_ranks(tmp, plan):
    path = os.path.join(tmp, "metrics.jsonl")
    engine, losses, _, x = _train(path, plan, steps=2, world=2)
    batch = x.shape[0]
    measured = engine.comm_log.totals()
    predicted = engine.predicted_comm(batch)
    rows = None
    if engine.global_rank() == 0:
        with open(path) as f:
            rows = [json.loads(line) for line in f]
    return {"measured": {str(k): v // 2 for k, v in measured.items()},
            "predicted": {str(k): v for k, v in predicted.items()}, "rows": rows}


@pytest.mark.parametrize("plan", [{"data": 2}, {"tensor": {"size": 2, "mode": "1d"}}])
def test_rank_zero_writes_every_ranks_figures_and_comm_stays_exact(pool2, tmp_path, plan):
    first, second = pool2.run(_two_ranks, str(tmp_path), plan)
    assert second["rows"] is None
    rows = first["rows"]
    assert [r["step"] for r in rows] == [1, 2]
    assert all(len(r["peak_memory_bytes"]) == 2 and min(r["peak_memory_bytes"]) > 0
               for r in rows)
    axis = "dp" if "data" in plan else "tp"
    assert rows[-1]["sent_bytes"][axis] > 0 and "world" in rows[-1]["sent_bytes"]
    for result in (first, second):
        assert result["measured"] == result["predicted"]
