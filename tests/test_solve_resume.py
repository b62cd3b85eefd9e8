"""A walk the solver repeats for a hint starts where the hinted layer starts, from a copy of
the last walk's state there (`solve(resume=True)`, the default): the solution is the one a
walk from the top finds, node by node, for every model and plan here."""

import pytest
import torch
import torch.nn.functional as F

from autopar.graph.trace import trace
from autopar.models import zoo
from autopar.modes import RING, TP
from autopar.plans.schema import Plan
from autopar.sharding import solve as solver
from autopar.sharding.axes import MULTI_D, TensorMesh

SEQ, VOCAB = 8, 128

PLANS = {  # world, plan (as parallelize takes it)
    "tensor-1d": (2, {"tensor": {"size": 2, "mode": "1d"}}),
    "tensor-1d x 4": (4, {"tensor": {"size": 4, "mode": "1d"}}),
    "megatron-sp": (2, {"tensor": {"size": 2, "mode": "1d", "sequence_parallel": True}}),
    "tensor-2d": (4, {"tensor": {"size": 4, "mode": "2d"}}),
    "ring": (2, {"sequence": {"size": 2, "mode": "ring"}}),
}


def _lm_loss(out, target):
    logits = out.logits if hasattr(out, "logits") else out
    return F.cross_entropy(logits.reshape(-1, logits.size(-1)), target.reshape(-1))


def _zoo(spec: str):
    model, (x,) = zoo.build(spec, batch=2, seq=SEQ, device="cpu", seed=0)
    return model, x


def _transformers(family: str):
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    if family == "gpt2":  # Conv1D, a fused QKV projection
        config = transformers.GPT2Config(n_embd=32, n_layer=2, n_head=4, vocab_size=VOCAB,
                                         n_positions=32)
        model = transformers.GPT2LMHeadModel(config)
    else:  # grouped-query attention
        config = transformers.LlamaConfig(hidden_size=32, intermediate_size=64,
                                          num_hidden_layers=2, num_attention_heads=4,
                                          num_key_value_heads=2, vocab_size=VOCAB,
                                          max_position_embeddings=32)
        model = transformers.LlamaForCausalLM(config)
    return model, torch.randint(2, VOCAB, (2, SEQ))


MODELS = {
    "zoo gpt": lambda: _zoo(f"gpt:layers=2,hidden=64,heads=4,vocab={VOCAB},seq={SEQ}"),
    "zoo llama": lambda: _zoo(f"llama:layers=2,hidden=64,heads=4,kv_heads=2,vocab={VOCAB},"
                              f"seq={SEQ}"),
    "gpt2": lambda: _transformers("gpt2"),
    "llama": lambda: _transformers("llama"),
}


@pytest.fixture(scope="module", params=sorted(MODELS))
def graphs(request):
    """(model, the inference graph an engine start traces or None, the training graph): the
    transformers models' training graphs alone (their inference graphs are the same ops
    without the loss, and each trace costs seconds of the suite's CPU)."""
    model, x = MODELS[request.param]()
    target = torch.randint(0, VOCAB, x.shape)
    forward = trace(model, (x,), train=False) if request.param.startswith("zoo") else None
    return (request.param, forward,
            trace(model, (x,), loss_fn=_lm_loss, example_target=target, train=True))


def _arguments(world: int, plan: dict) -> dict:
    """solve's arguments as `Engine._solve` gives them for this plan."""
    plan = Plan.from_dict(plan, world)
    tp, mesh = plan.mesh[TP], plan.tensor_mesh()
    cp = plan.mesh.get("cp", 1)
    if cp > 1 and mesh.mode not in MULTI_D:
        mesh = TensorMesh.with_cp(cp, tp)
    return dict(axis=TP, size=tp, modes=plan.layer_modes(), default_mode=plan.tp_mode,
                mesh=mesh if mesh.mode in MULTI_D or cp > 1 else None,
                sequence_parallel=plan.sequence_parallel_layers(),
                sequence_mode=(plan.sequence_mode or RING) if cp > 1 else None,
                sequence_layout=plan.cp_layout())


def _assert_same(got, want, where: str) -> None:
    assert list(got.strategies) == list(want.strategies), where
    for node, strategy in want.strategies.items():  # node by node, named when one differs
        assert got.strategies[node] == strategy, f"{where}: {node.name}"
        assert got.layouts.get(node) == want.layouts.get(node), f"{where}: {node.name}"
    assert got.layouts == want.layouts, where
    assert got.transitions == want.transitions, where
    assert got.params == want.params and list(got.params) == list(want.params), where
    assert got.requires_grad == want.requires_grad, where
    assert (got.hints, got.sp_failures, got.cp_partial) == \
        (want.hints, want.sp_failures, want.cp_partial), where
    assert got.comm == want.comm and got.notes() == want.notes(), where


@pytest.mark.parametrize("plan", sorted(PLANS))
def test_a_resumed_walk_finds_the_solution_a_walk_from_the_top_finds(graphs, plan,
                                                                     monkeypatch):
    name, forward, training = graphs
    kwargs = _arguments(*PLANS[plan])
    starts = []
    run = solver._Walk.run

    def counted(self):
        starts.append(self.start)
        return run(self)

    monkeypatch.setattr(solver._Walk, "run", counted)
    first = forward if forward is not None else training
    resumed = solver.solve(first, **kwargs)
    _assert_same(resumed, solver.solve(first, resume=False, **kwargs), f"{name} {plan}")
    fixed = {t: resumed.params.get(t) for t in first.params if t in training.params}
    for given in (fixed, None):  # the training graph with the layouts fixed, and free
        _assert_same(solver.solve(training, fixed_params=given, **kwargs),
                     solver.solve(training, fixed_params=given, resume=False, **kwargs),
                     f"{name} {plan} training, fixed={given is not None}")
    if name in ("zoo gpt", "gpt2") and plan != "ring":
        # the fused QKV projection's hint: the graph is walked again from its first attention
        # layer, not from the top (walks from the top start at 0)
        assert starts[0] == 0 and starts[1] > 0, starts
