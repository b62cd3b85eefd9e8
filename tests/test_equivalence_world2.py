"""World 2 (gloo): every zoo model and transformers' GPT-2 and BERT, data-only and tensor-only.

2 AdamW steps (the second on the state the first left); each loss and the final weights
equal the single-device run within 1e-5 relative, and the bytes of every collective equal
the plan's prediction exactly. Also: a concatenation along a split dimension, and a world
that does not match the process group.
"""

import copy
import functools

import pytest
import torch
import torch.nn.functional as F
from distributed import dist_pool_fixture
from equivalence import MODELS, assert_equal, compare, relative
from torch import nn

pool2 = dist_pool_fixture(2)

PLANS = {"data": {"data": 2}, "tensor": {"tensor": {"size": 2, "mode": "1d"}}}


@pytest.mark.parametrize("plan", sorted(PLANS))
@pytest.mark.parametrize("model", MODELS)
def test_equals_single_device(pool2, model, plan):
    results = pool2.run(compare, model, PLANS[plan], 2)
    assert_equal(results)
    for r in results:
        assert sum(r["measured"].values()) > 0
    axes = {axis for (_, axis) in results[0]["measured"]}
    assert axes == ({"dp"} if plan == "data" else {"tp"})


class _Joined(nn.Module):
    """Two column-split projections joined on their split features, then a row-split one."""

    def __init__(self):
        super().__init__()
        self.a = nn.Linear(16, 32)
        self.b = nn.Linear(16, 32)
        self.out = nn.Linear(64, 8)

    def forward(self, x):
        return self.out(torch.cat((torch.tanh(self.a(x)), self.b(x)), dim=-1))


def _joined_against_single_device(steps: int = 3) -> dict:
    import autopar

    torch.manual_seed(0)
    model = _Joined()
    reference = copy.deepcopy(model)
    x, y = torch.randn(8, 16), torch.randn(8, 8)
    opt = functools.partial(torch.optim.SGD, lr=0.1)
    engine = autopar.parallelize(model, 2, example_inputs=(x[:2],), loss_fn=F.mse_loss,
                                 optimizer=opt, plan={"tensor": {"size": 2, "mode": "1d"}})
    ref_opt = opt(reference.parameters())
    losses = []
    for step in range(steps):
        engine.comm_log.clear()
        loss = engine.train_step(x, y)
        if step == 0:
            measured = engine.comm_log.totals(phases=("forward", "backward", "step"))
            predicted = engine.predicted_comm(8)
        ref_opt.zero_grad()
        ref_loss = F.mse_loss(reference(x), y)
        ref_loss.backward()
        ref_opt.step()
        losses.append(abs(loss - ref_loss.item()) / ref_loss.item())
    full, ref_state = engine.full_state_dict(), reference.state_dict()
    cat = [s.name for n, s in engine.train_solution.strategies.items()
           if n.target is torch.ops.aten.cat.default]
    return {"loss": max(losses), "weights": max(relative(full[k], ref_state[k]) for k in ref_state),
            "cat": cat, "measured": measured, "predicted": predicted,
            "out_weight": engine.parameter_bytes()["out.weight"]}


def test_cat_on_the_split_dim_equals_single_device(pool2):
    for r in pool2.run(_joined_against_single_device):
        assert r["cat"] == ["blocks"]
        assert r["loss"] <= 1e-5 and r["weights"] <= 1e-5, r
        assert r["measured"] == r["predicted"]
        assert set(r["measured"]) == {("all_reduce", "tp")}
        held, whole = r["out_weight"]
        assert held * 2 == whole


def _parallelize_on_a_wrong_world(as_world: bool) -> str:
    import autopar
    from autopar.models import build

    model, (x,) = build("mlp-tiny", batch=2, device="cpu", seed=0)
    world, plan = (autopar.World(8), None) if as_world else \
        (4, {"tensor": {"size": 4, "mode": "1d"}})
    try:
        autopar.parallelize(model, world, example_inputs=(x,), plan=plan)
    except (autopar.WorldError, autopar.PlanError) as e:
        return str(e)
    return "no error"


@pytest.mark.parametrize("as_world", [False, True], ids=["int", "World"])
def test_a_world_that_does_not_match_the_process_group_is_refused(pool2, as_world):
    messages = pool2.run(_parallelize_on_a_wrong_world, as_world)
    assert len(set(messages)) == 1, messages
    message = messages[0]
    assert f"needs {8 if as_world else 4} processes but this job has 2" in message, message
    assert "--nproc-per-node" in message
    assert "\n" not in message and message.endswith(".") and ". " not in message
