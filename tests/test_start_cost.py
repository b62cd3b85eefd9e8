"""What an engine start does once rather than at every use: a rewritten graph's Python code,
the code of the graphs export makes on the way, and the sympy work of the reshape rule
(docs/testing.md, "Where the CPU goes")."""

import functools

import sympy
import torch
import torch.fx as fx
import torch.nn.functional as F
from torch import nn

import autopar
from autopar.graph.ir import BATCH
from autopar.graph.trace import trace
from autopar.models import build
from autopar.passes.tensor_parallel import clone_graph_module
from autopar.runtime import engine as engine_module
from autopar.sharding.layout import Shard
from autopar.sharding.rules import context, views


class _Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.linear = nn.Linear(4, 4)

    def forward(self, x):
        return self.linear(x).relu() + 1


def test_a_cloned_graph_generates_its_code_once_when_it_first_runs(monkeypatch):
    """A pass's recompile() after each edit only marks the code stale: the code is generated
    when the graph runs (or its code is read), once, and computes what the original does."""
    gm = fx.symbolic_trace(_Net())
    made = _count_code(monkeypatch)
    out, mapping = clone_graph_module(gm)
    out.recompile()
    out.recompile()
    assert made == [] and set(mapping) == set(gm.graph.nodes)
    x = torch.randn(3, 4)
    assert torch.equal(out(x), gm(x)) and torch.equal(out(x), gm(x))
    assert len(made) == 1 and "relu" in out.code


def test_a_cloned_graph_is_graph_copys_copy():
    """The clone sets each node's arguments after making it (create_node would walk them all
    for symbolic values): the same nodes, names, arguments, types and meta values as
    Graph.graph_copy gives, on an exported graph with keyword arguments."""
    model, (x,) = build("gpt-tiny", batch=2, device="cpu", seed=0)
    gm = trace(model, (x,), train=False).gm
    want = fx.Graph()
    copied: dict = {}
    want.output(want.graph_copy(gm.graph, copied))
    got, mapping = clone_graph_module(gm)
    assert any(n.kwargs for n in gm.graph.nodes)
    assert len(got.graph.nodes) == len(want.nodes) == len(mapping)
    for old, new in zip(gm.graph.nodes, got.graph.nodes):
        ref = copied.get(old) or next(n for n in want.nodes if n.op == "output")
        assert mapping[old] is new and (new.name, new.op, new.target, new.type) == \
            (ref.name, ref.op, ref.target, ref.type)
        assert repr(new.args) == repr(ref.args) and repr(new.kwargs) == repr(ref.kwargs)
        assert new.meta == old.meta and new.meta is not old.meta
        assert all(new.meta[k] is old.meta[k] for k in old.meta)
    assert torch.equal(got(x)[0], gm(x)[0])


def _lm_loss(out, y):
    return F.cross_entropy(out.reshape(-1, out.size(-1)), y.reshape(-1))


def test_a_training_start_rewrites_the_inference_graph_only_when_it_is_read(monkeypatch):
    """A training run never executes the inference graph: the start cuts its parameter slices
    but rewrites it at the first read (`engine(x)` here), which computes the model's output."""
    rewrites = []
    real = engine_module.apply_solution

    def counted(gm, solution):
        rewrites.append(gm)
        return real(gm, solution)

    monkeypatch.setattr(engine_module, "apply_solution", counted)
    model, (x,) = build("gpt-tiny", batch=4, device="cpu", seed=0)
    y = torch.randint(0, 64, x.shape)
    engine = autopar.parallelize(model, 1, example_inputs=(x,), loss_fn=_lm_loss,
                                 optimizer=functools.partial(torch.optim.SGD, lr=0.0))
    assert rewrites == [] and len(list(engine.parameters())) == len(list(model.parameters()))
    engine.train_step(x, y)
    assert len(rewrites) == 1 and engine.chunked_losses == 1  # the training graph's
    torch.testing.assert_close(engine(x), model(x))  # (lr 0: the weights are the model's)
    assert len(rewrites) == 2 and engine.chunked_losses == 1


def _count_code(monkeypatch) -> list:
    """The graphs whose Python code is generated from now on, in order."""
    made = []
    real = fx.Graph.python_code

    def counted(self, *args, **kwargs):
        made.append(self)
        return real(self, *args, **kwargs)

    monkeypatch.setattr(fx.Graph, "python_code", counted)
    return made


def test_a_trace_generates_code_only_for_the_graphs_export_hands_back(monkeypatch):
    """torch.export builds graph modules on the way (11 code generations a trace before):
    made lazy, and with no input-guard function to generate and then drop, a trace generates
    Python code only for the program and the unlifted module it returns. The graph is the
    same: no guard pins the traced batch, and it computes what the model does."""
    model = _Net()
    monkeypatch.setenv("AUTOPAR_TRACE_CACHE", "0")  # (a hit would copy, not trace)
    made = _count_code(monkeypatch)
    traced = trace(model, (torch.randn(3, 4),), train=False)
    assert len(made) <= 4, len(made)
    assert not hasattr(traced.gm, "_guards_fn")
    assert all(n.target != "_guards_fn" for n in traced.gm.graph.nodes)
    x = torch.randn(5, 4)  # another batch than the traced one
    assert torch.equal(traced.gm(x), model(x))


def test_a_trace_cache_hit_generates_code_only_when_it_runs(monkeypatch):
    """A hit of the trace cache (as is every start of a model after its first in a process)
    and the entry it is copied from generate no Python code: the engine runs its rewritten
    copies, not the traced graph. Run, the hit generates its code once and computes what
    the model does."""
    model = _Net()
    first = trace(model, (torch.randn(3, 4),), train=False)
    made = _count_code(monkeypatch)
    hit = trace(model, (torch.randn(3, 4),), train=False)
    assert hit.gm is not first.gm and made == []
    x = torch.randn(5, 4)
    assert torch.equal(hit.gm(x), model(x)) and torch.equal(hit.gm(x), model(x))
    assert made == [hit.graph]


def test_a_reshape_of_whole_numbers_and_the_batch_needs_no_simplify(monkeypatch):
    """The runs of a reshape over whole numbers and multiples of the batch are told apart by
    sympy's assumptions alone (simplify costs a tenth of a second on its first call), and the
    same pair of shapes is worked out once for every layer and solve of a start."""
    def refused(*args, **kwargs):
        raise AssertionError("simplify called")

    views._runs.cache_clear()
    monkeypatch.setattr(sympy, "simplify", refused)
    shapes = ((BATCH, 8, 32), (BATCH, 8, 4, 8))
    assert views._matching_runs(*shapes) == (((0,), (0,)), ((1,), (1,)), ((2,), (2, 3)))
    assert views._matching_runs((BATCH, 8, 32), (8 * BATCH, 32)) == (((0, 1), (0,)),
                                                                      ((2,), (1,)))
    new, _ = views.reshape_shard(*shapes, Shard(2, "tp", 1), 2)
    assert new == Shard(2, "tp", 1)
    hits = views._runs.cache_info().hits
    assert views.reshape_shard(*shapes, Shard(2, "tp", 1), 2) == (new, None)
    assert views._runs.cache_info().hits == hits + 1


def test_batch_like_sizes_are_decided_once_per_size():
    context._batch_like.cache_clear()
    assert context.batch_like(4 * BATCH) and not context.batch_like(BATCH / 2)
    assert not context.batch_like(8) and context.batch_like(BATCH)
    assert context.batch_like(4 * BATCH) and context._batch_like.cache_info().hits == 1


def test_a_mesh_names_its_physical_dims_once():
    """The rules ask a mesh for its physical dims at every op and axis of every solve."""
    from autopar.sharding.axes import TensorMesh

    mesh = TensorMesh.for_mode("2d", 4)
    assert mesh.physical is mesh.physical and mesh.physical == tuple(n for n, _ in mesh.dims)
    assert mesh.components("tp") == mesh.physical and mesh == TensorMesh.for_mode("2d", 4)
    assert hash(mesh) == hash(TensorMesh.for_mode("2d", 4))
