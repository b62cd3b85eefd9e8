"""Every collective the runtime issues is logged, pipeline traffic included, and the plan
prices each one: `engine.comm_log.totals()` equals `engine.predicted_comm(batch)` for every
(op, axis) on every rank and every step (docs/communication.md). Outside the step, the
pipeline's weight fetch and torch's schedule handshake land in `engine.startup_log`.

Statically: no module of autopar.runtime or autopar.kernels calls a torch.distributed
communication function except the one logged path, autopar/kernels/collectives.py."""

from __future__ import annotations

import ast
import functools
import pathlib

import pytest
import torch
from distributed import dist_pool_fixture
from equivalence import build

import autopar

pool4 = dist_pool_fixture(4, timeout_s=300)

GPT4 = "gpt:layers=4,hidden=32,heads=4,vocab=64,seq=16"
BATCH = 8
ROOT = pathlib.Path(__file__).resolve().parent.parent

# torch.distributed's functions that move data between ranks
COMMUNICATION = {
    "all_reduce", "all_gather", "all_gather_into_tensor", "all_gather_single",
    "reduce_scatter", "reduce_scatter_tensor", "reduce_scatter_single", "all_to_all",
    "all_to_all_single", "broadcast", "reduce", "gather", "scatter", "send", "recv", "isend",
    "irecv", "batch_isend_irecv", "P2POp", "barrier", "monitored_barrier",
    "all_gather_object", "gather_object", "scatter_object_list", "broadcast_object_list",
    "send_object_list", "recv_object_list", "all_reduce_coalesced", "all_gather_coalesced",
}
# the logged path itself (AxisGroup, and the control exchanges beside it)
ALLOWED = {"autopar/kernels/collectives.py"}


def _steps(name: str, plan: dict, steps: int = 3) -> dict:
    """On every rank: each step's measured totals beside the plan's, and the startup log."""
    if name == "moe-tiny":
        from test_moe_runtime import build as moe_build

        model, idx, target, loss_fn = moe_build(name)
        inputs = (idx,)
    else:
        model, inputs, target, loss_fn = build(name, BATCH)
    engine = autopar.parallelize(model, 4, example_inputs=tuple(t[:2] for t in inputs),
                                 loss_fn=loss_fn, plan=plan,
                                 optimizer=functools.partial(torch.optim.AdamW, lr=1e-3))
    out = {"measured": [], "predicted": [], "ops": set()}
    for _ in range(steps):
        engine.comm_log.clear()
        engine.train_step(inputs, target)
        out["measured"].append(engine.comm_log.totals())
        out["predicted"].append(engine.predicted_comm(BATCH))
        out["ops"] |= {(r.op, r.axis, r.phase) for r in engine.comm_log}
    out["startup"] = engine.startup_log.totals()
    out["tied"] = len(engine.pipeline.tied()) if engine.pipeline is not None else 0
    return out


def _check(results: list[dict]) -> None:
    for rank, r in enumerate(results):
        for step, (measured, predicted) in enumerate(zip(r["measured"], r["predicted"])):
            assert measured == predicted, (rank, step, measured, predicted)
        # every rank sends its stages' activations or gradients, and gets the loss
        assert r["measured"][-1][("p2p", "pp")] > 0, rank
        assert r["measured"][-1][("broadcast", "pp")] == 4, rank
        assert {("p2p", "pp", "forward"), ("p2p", "pp", "backward")} & r["ops"], rank
        # the first step fetched the other stages' weights to find their shapes
        assert r["startup"][("broadcast", "pp")] > 0, rank
        assert r["startup"][("p2p", "pp")] > 0, rank  # torch's one-time handshake


def test_gpt_pipeline_2_tensor_2(pool4):
    results = pool4.run(_steps, GPT4, dict(pipeline=dict(size=2, microbatches=2), tensor=2))
    _check(results)
    for r in results:
        step = r["measured"][-1]
        assert step[("all_reduce", "tp")] > 0
        # the tied embedding's gradient, summed over the two members holding it
        assert r["tied"] == 1 and step[("all_reduce", "pp")] > 0


def test_gpt_pipeline_2_data_2_zero(pool4):
    results = pool4.run(_steps, GPT4, dict(pipeline=dict(size=2, microbatches=2), data=2,
                                           zero=dict(stage=2)))
    _check(results)
    for r in results:
        step = r["measured"][-1]
        assert step[("reduce_scatter", "dp")] > 0 and step[("all_gather", "dp")] > 0
        assert r["tied"] == 1 and step[("all_reduce", "pp")] > 0


def test_moe_pipeline_zero_experts(pool4):
    plan = dict(expert=2, pipeline=dict(size=2, microbatches=2, schedule="gpipe"),
                zero=dict(stage=3))
    results = pool4.run(_steps, "moe-tiny", plan)
    _check(results)
    for r in results:
        step = r["measured"][-1]
        assert step[("all_to_all", "ep")] > 0
        # the balance loss's step-wide correction is summed over the pipeline
        assert step[("all_reduce", "pp")] == 16


def test_a_diverted_log_hands_its_records_to_the_other():
    from autopar.kernels.collectives import AxisGroup, CommLog

    log, startup = CommLog(), CommLog()
    tp = AxisGroup("tp", 1, 0, None, log)
    with log.diverted(startup):
        tp.all_reduce(torch.ones(3), "init")
        tp.sent([torch.ones(2, dtype=torch.float64)], "init")
    tp.all_reduce(torch.ones(2), "forward")
    assert startup.totals() == {("all_reduce", "tp"): 12, ("p2p", "tp"): 16}
    assert log.totals() == {("all_reduce", "tp"): 8} and len(log.seconds) == 1


# ---------------------------------------------------------------- the one logged path
def _distributed_aliases(tree: ast.Module) -> tuple[set[str], dict[str, str]]:
    """(names bound to the torch.distributed module, name -> function imported from it)."""
    modules, functions = set(), {}
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for a in node.names:
                if a.name == "torch.distributed" and a.asname:
                    modules.add(a.asname)
        elif isinstance(node, ast.ImportFrom):
            for a in node.names:
                if node.module == "torch" and a.name == "distributed":
                    modules.add(a.asname or a.name)
                elif node.module in ("torch.distributed", "torch.distributed.distributed_c10d"):
                    functions[a.asname or a.name] = a.name
    return modules, functions


def _dotted(node: ast.AST) -> str | None:
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        base = _dotted(node.value)
        return f"{base}.{node.attr}" if base else None
    return None


def communication_uses(source: str) -> list[tuple[int, str]]:
    """(line, name) of every use of a torch.distributed communication function."""
    tree = ast.parse(source)
    modules, functions = _distributed_aliases(tree)
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and node.attr in COMMUNICATION:
            base = _dotted(node.value)
            if base in modules or base in ("torch.distributed", "torch.distributed.distributed_c10d"):
                found.append((node.lineno, f"{base}.{node.attr}"))
        elif isinstance(node, ast.Name) and functions.get(node.id) in COMMUNICATION:
            found.append((node.lineno, node.id))
        elif isinstance(node, ast.Call) and _dotted(node.func) == "getattr" and \
                len(node.args) >= 2 and _dotted(node.args[0]) in modules | {"torch.distributed"} \
                and isinstance(node.args[1], ast.Constant) and node.args[1].value in COMMUNICATION:
            found.append((node.lineno, f"getattr({_dotted(node.args[0])}, {node.args[1].value!r})"))
    return found


def test_the_scan_finds_each_way_of_calling_torch_distributed():
    source = ("import torch\nimport torch.distributed as dist\n"
              "from torch import distributed as d2\n"
              "from torch.distributed import all_gather_object as ago\n"
              "dist.all_reduce(x)\ntorch.distributed.broadcast(x, 0)\nd2.isend(x, 1)\n"
              "ago(every, mine)\ndist.P2POp(dist.irecv, x, 0)\n"
              "dist.get_rank()\ndist.new_group([0, 1])\n"
              "f = getattr(dist, 'reduce_scatter_single', None)\n")
    assert sorted(communication_uses(source)) == [
        (5, "dist.all_reduce"), (6, "torch.distributed.broadcast"), (7, "d2.isend"),
        (8, "ago"), (9, "dist.P2POp"), (9, "dist.irecv"),
        (12, "getattr(dist, 'reduce_scatter_single')")]


@pytest.mark.parametrize("package", ["autopar/runtime", "autopar/kernels"])
def test_only_the_logged_path_calls_torch_distributed(package):
    offenders = []
    files = sorted((ROOT / package).rglob("*.py"))
    assert files
    for path in files:
        rel = path.relative_to(ROOT).as_posix()
        if rel in ALLOWED:
            continue
        offenders += [f"{rel}:{line} {name}"
                      for line, name in communication_uses(path.read_text())]
    assert not offenders, ("call these through autopar.kernels.collectives (an AxisGroup "
                           "method, which logs op, axis and bytes): " + ", ".join(offenders))


def test_the_logged_path_does_call_torch_distributed():
    # the allow-list names a file that really is the logged path
    for rel in ALLOWED:
        assert communication_uses((ROOT / rel).read_text())
