"""The rewrite protocol: every `Rewrite` the catalog can emit has a handler in the tensor-
parallel pass, and the catalog names its rewrites only through the enum."""

import ast
import functools
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from equivalence import build

import autopar.sharding
from autopar.graph.trace import trace
from autopar.kernels.modules import StreamCall, StreamDropout
from autopar.models.gpt import GPT, GPTConfig
from autopar.passes.tensor_parallel import LATE, REWRITES, apply_solution
from autopar.plans import Plan
from autopar.sharding.axes import TensorMesh
from autopar.sharding.solve import solve
from autopar.sharding.strategy import Rewrite

aten = torch.ops.aten
SHARDING = Path(autopar.sharding.__file__).parent


def test_every_rewrite_has_a_handler():
    assert set(REWRITES) == set(Rewrite)
    assert LATE <= set(REWRITES)


def _sharding_sources():
    for path in sorted(SHARDING.rglob("*.py")):
        yield path.name, ast.parse(path.read_text())


def test_the_catalog_names_rewrites_through_the_enum():
    named = set()
    for name, tree in _sharding_sources():
        for node in ast.walk(tree):
            if isinstance(node, ast.keyword) and node.arg == "rewrite":
                assert not isinstance(node.value, ast.Constant) or node.value.value is None, \
                    f"{name}:{node.value.lineno} passes a string as rewrite; use a Rewrite member"
            if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) \
                    and node.value.id == "Rewrite":
                assert node.attr in Rewrite.__members__, f"{name}:{node.lineno}: {node.attr}"
                named.add(Rewrite[node.attr])
    assert named == set(Rewrite), "a Rewrite member no rule emits"


@functools.lru_cache(maxsize=None)
def _traced(name: str):
    model, inputs, target, loss_fn = build(name, 2)
    return trace(model, inputs, loss_fn=loss_fn, example_target=target, train=True)


def _grid(traced, spec: dict, world: int):
    plan = Plan.from_dict({"tensor": spec}, world)
    return solve(traced, axis="tp", size=plan.mesh["tp"], modes=plan.layer_modes(),
                 default_mode=plan.tp_mode, mesh=plan.tensor_mesh())


SOLVES = {
    "1d": lambda t: solve(t, axis="tp", size=2),
    "1d+sp": lambda t: solve(t, axis="tp", size=2, sequence_parallel=True),
    "2d": lambda t: _grid(t, {"size": 4, "mode": "2d"}, 4),
    "3d": lambda t: _grid(t, {"size": 8, "mode": "3d"}, 8),
    "cp+tp": lambda t: solve(t, axis="tp", size=2, sequence_mode="ring",
                             mesh=TensorMesh("1d", (("cp", 2), ("tp", 2)))),
}
CASES = [("gpt-tiny", s) for s in SOLVES] + [
    ("llama-tiny", "1d+sp"), ("bert-tiny", "1d"), ("vit-tiny", "2d"), ("mlp-tiny", "1d"),
    ("hf-gpt2", "cp+tp")]


@pytest.mark.parametrize("model,how", CASES)
def test_every_strategy_of_the_zoo_is_handled(model, how):
    traced = _traced(model)
    solution = SOLVES[how](traced)
    tags = {s.rewrite for s in solution.strategies.values()} - {None}
    assert all(isinstance(t, Rewrite) and t in REWRITES for t in tags), tags
    apply_solution(traced.gm, solution)  # every handler runs on the real graph


class _Noisy(torch.nn.Module):
    """Dropout alone and inside attention, so both stream rewrites appear."""

    def __init__(self):
        super().__init__()
        self.gpt = GPT(GPTConfig(vocab_size=64, n_layer=1, n_head=4, n_embd=32, block_size=8,
                                 dropout=0.1))

    def forward(self, x):
        return self.gpt(x)


@pytest.mark.parametrize("size", [1, 2])
def test_random_ops_always_run_on_a_stream(size):
    x = torch.randint(0, 64, (2, 8))
    traced = trace(_Noisy(), (x,), loss_fn=lambda y, t: F.cross_entropy(y.flatten(0, 1),
                                                                        t.flatten()),
                   example_target=torch.randint(0, 64, (2, 8)), train=True)
    solution = solve(traced, axis="tp", size=size)
    tags = {n.target: s.rewrite for n, s in solution.strategies.items()
            if n.target in (aten.dropout.default, aten.scaled_dot_product_attention.default)}
    assert tags == {aten.dropout.default: Rewrite.STREAM_DROPOUT,
                    aten.scaled_dot_product_attention.default: Rewrite.STREAM_ATTENTION}
    gm = apply_solution(traced.gm, solution)
    kinds = {type(m) for m in gm.modules()}
    assert {StreamDropout, StreamCall} <= kinds
