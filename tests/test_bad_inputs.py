"""Every bad input a user is likely to give is refused in one sentence naming it.

Tables of cases per surface: the command line (exit 2, one line on stderr, no traceback
unless --debug), the Python API (`parallelize`, `plan`, `train_step`, plan files, hardware
profiles, tracing), and two-process jobs whose ranks disagree (refused on every rank at
once, within the pool's time limit: no hang). Each case asserts the error type and the key
words of its sentence.
"""

from __future__ import annotations

import copy
import functools
import json

import pytest
import torch
import torch.nn.functional as F
from distributed import dist_pool_fixture
from equivalence import build
from torch import nn

import autopar
from autopar.cli import main
from autopar.cost.hardware import load_hardware
from autopar.errors import BatchError, PlanError, TokenIdError, TraceError, WorldError
from autopar.graph.trace import trace
from autopar.plans import Plan

SMALL = "gpt:layers=2,hidden=64,heads=8,vocab=256,seq=32"  # 8 heads
SGD = functools.partial(torch.optim.SGD, lr=0.1)

pool2 = dist_pool_fixture(2, timeout_s=180)  # a hang fails the test, it does not stall CI


def _lm_loss(logits, y):
    return F.cross_entropy(logits.reshape(-1, logits.size(-1)), y.reshape(-1))


# ------------------------------------------------------------------ files the cases read
def _profile(tmp_path, **changes):
    data = load_hardware("a100-80gb").to_json()
    data.update(changes)
    path = tmp_path / "profile.json"
    path.write_text(json.dumps(data))
    return str(path)


def _plan_file(tmp_path, **changes):
    data = Plan(mesh={"dp": 8}).to_json()
    data.update(changes)
    path = tmp_path / "plan.json"
    path.write_text(json.dumps(data))
    return str(path)


def _bad_mesh_type(tmp_path):
    return _plan_file(tmp_path, mesh=[1, 8, 1, 1])


def _bad_axis_size(tmp_path):
    return _plan_file(tmp_path, mesh={"pp": 1, "dp": "8", "cp": 1, "tp": 1})


# ------------------------------------------------------------------ command line
CLI = [  # (argv, files made in tmp_path, key words of the sentence)
    (["explain", SMALL, "--tp", "0"], None, ["--tp 0", ">= 1"]),
    (["explain", SMALL, "--world", "0"], None, ["--world 0"]),
    (["explain", SMALL, "--batch", "0"], None, ["--batch 0"]),
    (["explain", SMALL, "--microbatches", "0"], None, ["--microbatches 0"]),
    (["explain", SMALL, "--world", "4", "--dp", "2", "--pp", "2", "--microbatches", "3",
      "--batch", "8"], None, ["--microbatches 3", "4 sample(s) per data-parallel replica"]),
    (["explain", SMALL, "--world", "2", "--pp", "2", "--microbatches", "3", "--batch", "4"],
     None, ["microbatches 3 does not divide", "4 sample(s)"]),
    (["explain", SMALL, "--world", "8", "--tp-mode", "2d", "--tp", "8"], None,
     ["--tp 8 cannot run --tp-mode 2d", "square", "4 or 16"]),
    (["explain", SMALL, "--sp", "megatron", "--tp", "1"], None, ["--sp megatron", "--tp 2"]),
    (["explain", SMALL, "--sp", "ring", "--cp", "1"], None, ["--sp ring", "--cp 2"]),
    (["explain", SMALL, "--world", "8", "--dp", "3"], None, ["cannot tile a world of 8"]),
    (["explain", SMALL, "--world", "3", "--tp", "3", "--batch", "6"], None,
     ["tensor size 3", "8 heads", "(1, 2, 4, 8)"]),
    (["explain", "gpt:layers=48,hidden=1600,heads=25,vocab=50257,seq=1024", "--world", "2",
      "--tp", "2"], None, ["25 heads", "tensor size 2"]),  # GPT-2 XL's heads
    (["explain", SMALL, "--device", "{zero_bandwidth}"], "zero_bandwidth",
     ["inter_node_bandwidth is 0", "positive"]),
    (["explain", SMALL, "--plan", "{bad_mesh}"], "bad_mesh", ["mesh maps axis names"]),
    (["explain", SMALL, "--plan", "{bad_axis}"], "bad_axis", ["mesh axis 'dp'", "'8'"]),
    (["search", SMALL, "-o", "{missing}/plan.json"], None, ["does not exist"]),
    (["explain", SMALL, "-o", "{tmp}"], None, ["is a directory"]),
    (["calibrate", "--quick", "-o", "{missing}/profile.json"], None, ["does not exist"]),
]


def _argv(argv, tmp_path):
    files = {"zero_bandwidth": lambda: _profile(tmp_path, inter_node_bandwidth=0),
             "bad_mesh": lambda: _bad_mesh_type(tmp_path),
             "bad_axis": lambda: _bad_axis_size(tmp_path)}
    names = {k: make() for k, make in files.items() if any("{" + k + "}" in a for a in argv)}
    names.update(missing=str(tmp_path / "missing"), tmp=str(tmp_path))
    return [a.format(**names) for a in argv]


@pytest.mark.parametrize("argv, _, words", CLI, ids=[" ".join(c[0][2:]) or c[0][0] for c in CLI])
def test_command_line_refuses_in_one_sentence(tmp_path, capsys, monkeypatch, argv, _, words):
    import autopar.cli as cli

    if "-o" in argv:  # an output path is checked before any work
        monkeypatch.setattr(cli, "_plan", lambda *a, **k: pytest.fail("planned before -o"))
    assert main(_argv(argv, tmp_path)) == 2
    err = capsys.readouterr().err
    assert err.startswith("autopar: ") and err.count("\n") == 1, err
    assert "Traceback" not in err
    for w in words:
        assert w in err, (w, err)


def test_debug_shows_the_traceback(capsys):
    assert main(["explain", SMALL, "--tp", "0", "--debug"]) == 2
    err = capsys.readouterr().err
    assert "Traceback" in err and "autopar: --tp 0" in err


def test_an_unexpected_error_is_one_sentence_pointing_at_debug(capsys, monkeypatch):
    import autopar.cli as cli

    def broken(*args, **kwargs):
        return 1 // 0

    monkeypatch.setattr(cli, "_plan", broken)
    assert main(["explain", SMALL]) == 1
    err = capsys.readouterr().err
    assert "unexpected ZeroDivisionError" in err and "--debug" in err
    assert "Traceback" not in err
    with pytest.raises(ZeroDivisionError):
        main(["explain", SMALL, "--debug"])


# ------------------------------------------------------------------ Python API
class _DictOut(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(8, 4)

    def forward(self, x):
        return {"out": self.lin(x)}


class _BadView(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(8, 4)

    def forward(self, x):
        return self.lin(x.view(-1, 7))


class _FloatIds(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(8, 4)

    def forward(self, x):
        return self.emb(x)


class _Branch(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(8, 4)

    def forward(self, x):
        if x.sum() > 0:
            return self.lin(x)
        return self.lin(-x)


@pytest.fixture(scope="module")
def gpt():
    """gpt-tiny (8 heads, 256 tokens, 32 positions): model, ids, targets."""
    model, (x,), y, _ = build("gpt-tiny", 4)
    return model, x, y


def _engine(gpt, **kwargs):
    model, x, _ = gpt
    args = dict(example_inputs=(x,), loss_fn=_lm_loss, optimizer=SGD, plan={"data": 1})
    args.update(kwargs)
    return autopar.parallelize(model, 1, **args)


def _parallelize(gpt, **kwargs):
    return lambda: _engine(gpt, **kwargs)


API = {  # name -> (call, error type, key words)
    "max_grad_norm as a string": (lambda g: _parallelize(g, max_grad_norm="1.0")(), PlanError,
                                  ["max_grad_norm", "'1.0'"]),
    "optimizer instance": (lambda g: _parallelize(
        g, optimizer=torch.optim.SGD(g[0].parameters(), lr=0.1))(), PlanError,
        ["optimizer must be a factory", "SGD instance"]),
    "optimizer name": (lambda g: _parallelize(g, optimizer="adam")(), PlanError,
                       ["optimizer must be a factory", "'adam'"]),
    "loss class": (lambda g: _parallelize(g, loss_fn=nn.CrossEntropyLoss)(), PlanError,
                   ["class CrossEntropyLoss", "CrossEntropyLoss()"]),
    "model not a module": (lambda g: autopar.parallelize("gpt", 1, example_inputs=(g[1],)),
                           PlanError, ["torch.nn.Module"]),
    "example inputs not tensors": (lambda g: autopar.parallelize(g[0], 1, example_inputs=[None]),
                                   PlanError, ["example_inputs must be tensors", "NoneType"]),
    "longer than the positions": (lambda g: _parallelize(
        g, example_inputs=(torch.zeros(2, 64, dtype=torch.long),))(), PlanError,
        ["64 positions", "wpe has 32 rows", "at most 32 tokens"]),
    "world 0": (lambda g: autopar.parallelize(g[0], 0, example_inputs=(g[1],)), WorldError,
                ["positive int"]),
    "targets None": (lambda g: _engine(g).train_step(g[1], None), BatchError,
                     ["targets must be a tensor", "None"]),
    "targets of another batch": (lambda g: _engine(g).train_step(g[1], g[2][:2]), BatchError,
                                 ["4 inputs but 2 targets"]),
    "inputs on the meta device": (lambda g: _engine(g).train_step(g[1].to("meta"), g[2]),
                                  BatchError, ["input on the meta device", "real tensors"]),
    "targets on the meta device": (lambda g: _engine(g).train_step(g[1], g[2].to("meta")),
                                   BatchError, ["targets are on the meta device"]),
    "inputs on the meta device at inference": (lambda g: _engine(g)(g[1].to("meta")),
                                               BatchError, ["input on the meta device"]),
    "inputs not tensors": (lambda g: _engine(g).train_step([[1, 2]], g[2]), BatchError,
                           ["takes tensors", "a list"]),
    "more inputs than examples": (lambda g: _engine(g).train_step((g[1], g[1]), g[2]),
                                  BatchError, ["2 input tensor(s)", "built for 1"]),
    "another shape after the first step": (lambda g: _step_then(g, g[1][None]), BatchError,
                                           ["(1, 4, 32)", "traced for (*, 32)"]),
    "token id past the vocabulary": (lambda g: _engine(g).train_step(g[1] + 1000, g[2]),
                                     TokenIdError, ["token ids of wte", "outside [0, 256)"]),
    "negative token id": (lambda g: _engine(g).train_step(g[1] - 1000, g[2]), IndexError,
                          ["outside [0, 256)"]),
    "token id past the vocabulary at inference": (lambda g: _engine(g)(g[1] + 1000),
                                                  TokenIdError, ["outside [0, 256)"]),
    "constraint tp 0": (lambda g: autopar.plan(g[0], (g[1],), 8, constraints={"tp": 0}),
                        PlanError, ["tp=0", ">= 1"]),
    "constraint tp as a string": (lambda g: autopar.plan(g[0], (g[1],), 8,
                                                         constraints={"tp": "2"}),
                                  PlanError, ["tp='2'"]),
    "constraint megatron on tp 1": (lambda g: autopar.plan(
        g[0], (g[1],), 8, constraints={"sp": "megatron", "tp": 1}), PlanError,
        ["sp='megatron'", "tp is fixed to 1"]),
    "constraint 2d on 8": (lambda g: autopar.plan(g[0], (g[1],), 8,
                                                  constraints={"tp_mode": "2d", "tp": 8}),
                           PlanError, ["tp_mode='2d'", "square"]),
    "constraint tp 3 on 8 heads": (lambda g: autopar.plan(g[0], (g[1],), 3, global_batch=6,
                                                          constraints={"tp": 3}),
                                   PlanError, ["tensor size 3", "8 heads"]),
    "engine at tensor size 3 on 8 heads": (lambda g: _engine_at_tp(g, 3), PlanError,
                                           ["8 heads", "tensor size 3", "(1, 2, 4, 8)"]),
    "plan mesh as a list": (lambda g: Plan.from_json({**Plan().to_json(), "mesh": [1, 2]}),
                            PlanError, ["mesh maps axis names"]),
    "plan axis size as a string": (lambda g: Plan.from_json(
        {**Plan().to_json(), "mesh": {"tp": "2"}}), PlanError, ["mesh axis 'tp'", "'2'"]),
    "plan layer mode unknown": (lambda g: Plan.from_json(
        {**Plan().to_json(), "layers": [{"name": "blocks.0", "tp_mode": "4d"}]}), PlanError,
        ["tensor mode of layer blocks.0", "'4d'"]),
    "plan microbatches 0": (lambda g: Plan.from_json(
        {**Plan().to_json(), "pipeline": {"microbatches": 0}}), PlanError,
        ["pipeline microbatches", "0"]),
    "loss class to trace": (lambda g: trace(g[0], (g[1],), loss_fn=nn.CrossEntropyLoss,
                                            example_target=g[2]), TraceError,
                            ["class CrossEntropyLoss"]),
    "trace: a shape error": (lambda g: trace(_BadView(), (torch.randn(4, 8),)), TraceError,
                             ["test_bad_inputs.py", "aten.view", "shape the model expects"]),
    "trace: a dtype error": (lambda g: trace(_FloatIds(), (torch.randn(4, 8),)), TraceError,
                             ["aten.embedding", "dtype the model expects"]),
    "trace: data-dependent control flow": (lambda g: trace(_Branch(), (torch.randn(4, 8),)),
                                           TraceError, ["x.sum() > 0", "control flow"]),
}


def _step_then(gpt, inputs):
    engine = _engine(gpt)
    engine.train_step(gpt[1], gpt[2])
    return engine.train_step(inputs, gpt[2])


def _engine_at_tp(gpt, tp):
    """An engine over a tensor group of `tp` that is never called (one process)."""
    from autopar.kernels.collectives import AxisGroup
    from autopar.runtime.engine import Engine
    from autopar.runtime.mesh import axis_groups

    groups = axis_groups({"dp": 1, "tp": 1})
    groups["tp"] = AxisGroup("tp", tp, 0, None, groups["tp"].log)
    return Engine(gpt[0], Plan(mesh={"tp": tp}), groups, (gpt[1][:2],), None, None)


@pytest.mark.parametrize("name", sorted(API))
def test_python_api_refuses_in_one_sentence(gpt, name):
    call, error, words = API[name]
    with pytest.raises(error) as caught:
        call(gpt)
    text = str(caught.value)
    for w in words:
        assert w in text, (w, text)
    assert "--" not in text.replace("-->", ""), f"the Python API names a CLI flag: {text}"


def test_hardware_profile_with_zero_bandwidth_is_refused(tmp_path):
    path = _profile(tmp_path, intra_node_bandwidth=0.0)
    with pytest.raises(WorldError, match="intra_node_bandwidth is 0.0; it must be a positive"):
        load_hardware(path)
    path = _profile(tmp_path, gemm_efficiency=1.5)
    with pytest.raises(WorldError, match=r"gemm_efficiency is 1.5; it must be a number in \(0"):
        load_hardware(path)


def test_truncated_checkpoint_files_are_named(gpt, tmp_path):
    """Each file of a checkpoint cut in half: a CheckpointError naming that file."""
    import os
    import shutil

    from autopar.errors import CheckpointError

    engine = _engine(gpt)
    saved = engine.save(str(tmp_path / "good"))
    names = sorted(n for n in os.listdir(saved) if os.path.isfile(os.path.join(saved, n)))
    assert {".metadata", "autopar.json"} <= set(names)
    for name in names:
        bad = tmp_path / f"cut-{name}"
        shutil.copytree(tmp_path / "good", bad)
        target = bad / os.path.basename(saved) / name
        data = target.read_bytes()
        target.write_bytes(data[: len(data) // 2])
        with pytest.raises(CheckpointError) as caught:
            engine.load(str(bad))
        text = str(caught.value)
        assert str(target) in text and ("truncated" in text or "not valid JSON" in text), text


def test_out_of_range_ids_and_targets_in_the_split_kernels():
    """Each rank of a vocabulary-parallel embedding or cross-entropy holds a slice of the
    table, where a missing row would read as zeros: both refuse as one device does."""
    from autopar.kernels.collectives import AxisGroup, CommLog
    from autopar.kernels.modules import VocabParallelCrossEntropy, VocabParallelEmbedding
    from autopar.kernels.multid import VocabParallelCE

    group = AxisGroup("tp", 2, 0, None, CommLog())  # rank 0 of 2: refused before any send
    emb = VocabParallelEmbedding("tp")
    emb.bind({"tp": group})
    with pytest.raises(TokenIdError, match=r"holds 64, outside \[0, 64\)"):
        emb(torch.randn(32, 4), torch.tensor([[1, 64]]))
    ce = VocabParallelCrossEntropy("tp")
    ce.bind({"tp": group})
    with pytest.raises(IndexError, match=r"target holds 80, outside \[0, 64\)"):
        ce(torch.randn(3, 32), torch.tensor([1, 80, -100]))
    with pytest.raises(TokenIdError, match=r"holds -3, outside \[0, 16\)"):
        VocabParallelCE.apply(torch.randn(3, 16), torch.tensor([1, -3, 2]), None, (), -100)


def test_a_dict_output_searches_a_plan(gpt):
    """plan=None guesses a target from the output: a dict's tensor (it crashed on .shape)."""
    torch.manual_seed(0)
    model = _DictOut()
    reference = copy.deepcopy(model)
    engine = autopar.parallelize(model, 1, example_inputs=(torch.randn(4, 8),), optimizer=SGD,
                                 loss_fn=lambda out, t: F.mse_loss(out["out"], t))
    x, y = torch.randn(4, 8), torch.randn(4, 4)
    assert engine.train_step([x], y) == pytest.approx(F.mse_loss(reference(x)["out"], y).item())


def test_the_planner_never_picks_a_tensor_size_the_heads_refuse(gpt):
    """At world 3 an 8-head model takes no tensor size 3: the runtime's search (executable)
    and the offline planner both pick another split; GPT-2 XL's 25 heads take no tp 2."""
    model, x, _ = gpt
    for executable in (True, False):
        chosen = autopar.plan(model, (x[:3].repeat(2, 1),), 3, executable=executable)
        assert chosen.mesh["tp"] == 1, chosen.mesh
        assert not any("8 heads" in n for n in chosen.notes)  # notes: the chosen plan only


# ------------------------------------------------------------------ two processes
def _refusal(fn, *args):
    """(error type, message) of what `fn` raised on this rank, or None: the pool survives."""
    try:
        fn(*args)
    except Exception as e:  # noqa: BLE001
        return type(e).__name__, str(e)
    return None


def _rank():
    import torch.distributed as dist

    return dist.get_rank()


def _world_engine(plan, seed=0, **kwargs):
    model, (x,), y, _ = build("gpt-tiny", 4, seed=seed)
    return autopar.parallelize(model, 2, example_inputs=(x,), loss_fn=_lm_loss, optimizer=SGD,
                               plan=plan, **kwargs), x, y


def _different_plans():
    plan = {"data": 2} if _rank() == 0 else {"tensor": {"size": 2}}
    return _refusal(_world_engine, plan)


def _different_weights():
    return _refusal(_world_engine, {"data": 2}, _rank())


def _one_rank_bad_plan():
    plan = {"data": 2} if _rank() == 0 else {"tensor": {"size": 2, "mode": "2d"}}
    return _refusal(_world_engine, plan)


def _per_rank_batches_later():
    engine, x, y = _world_engine({"tensor": {"size": 2}}, check_batches=True)
    first = _refusal(engine.train_step, x, y)  # the same global batch: accepted
    mine = x.roll(_rank(), dims=0)  # then each rank its own batch
    return first, _refusal(engine.train_step, mine, y)


def _ids_out_of_range():
    engine, x, y = _world_engine({"tensor": {"size": 2}})
    return _refusal(engine.train_step, x + 1000, y), engine.train_step(x, y) > 0


class _TwoArgumentError(PlanError):
    """An autopar error whose arguments do not rebuild it (its one message from two)."""

    def __init__(self, first, second):
        super().__init__(f"{first} and {second}")


def _on_rank_zero_errors():
    from autopar.runtime.agree import on_rank_zero

    def fail(error):
        if _rank() != 0:
            raise AssertionError("only rank 0 computes")
        raise error

    answers = [on_rank_zero("sum", lambda a, b: a + b, 2, b=3)]
    for error in (PlanError("no plan fits."), _TwoArgumentError("a", "b"), KeyError("x")):
        answers.append(_refusal(on_rank_zero, "plan search", fail, error))
    return answers


def test_rank_zeros_answer_and_error_are_every_ranks(pool2):
    """on_rank_zero: rank 0 alone computes; an autopar error reaches the others as raised,
    one that cannot travel (or any other error) as a PlanError naming it."""
    zero, one = pool2.run(_on_rank_zero_errors)
    assert zero[:2] == one[:2] == [5, ("PlanError", "no plan fits.")]
    assert zero[2] == ("_TwoArgumentError", "a and b")
    assert one[2] == ("PlanError", "rank 0's plan search failed (_TwoArgumentError: a and b).")
    assert zero[3] == ("KeyError", "'x'")
    assert one[3] == ("PlanError", "rank 0's plan search failed (KeyError: 'x').")


def test_ranks_given_different_plans_stop_together(pool2):
    for kind, message in pool2.run(_different_plans):
        assert kind == "WorldError"
        assert "rank 0 and rank 1 disagree on the plan" in message


def test_ranks_with_different_initial_weights_stop_together(pool2):
    for kind, message in pool2.run(_different_weights):
        assert kind == "WorldError" and "initial weights" in message
        assert "torch.manual_seed" in message


def test_a_rank_that_cannot_set_up_stops_the_others(pool2):
    zero, one = pool2.run(_one_rank_bad_plan)
    assert one[0] == "PlanError" and "2d needs a square tensor size" in one[1]
    assert zero[0] == "WorldError" and "rank 1 could not set up parallelize" in zero[1]


def test_per_rank_batches_at_a_later_step_are_refused_with_check_batches(pool2):
    for first, second in pool2.run(_per_rank_batches_later):
        assert first is None
        assert second[0] == "BatchError" and "train_step 1 got a different batch" in second[1]
        assert "global batch" in second[1]


def _per_rank_first_batch():
    engine, x, y = _world_engine({"tensor": {"size": 2}})
    return _refusal(engine.train_step, x.roll(_rank(), dims=0), y)


def test_per_rank_batches_at_the_first_step_are_refused(pool2):
    results = pool2.run(_per_rank_first_batch)
    for kind, message in results:
        assert kind == "BatchError"
        assert "on rank 1 than on rank 0" in message and "DistributedSampler" in message


def test_out_of_range_ids_under_tensor_parallelism(pool2):
    for refused, trains in pool2.run(_ids_out_of_range):
        assert refused[0] == "TokenIdError" and "outside [0, 256)" in refused[1]
        assert trains  # nothing left waiting: the same engine trains on good ids
