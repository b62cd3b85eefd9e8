"""The process-wide trace cache (autopar.graph.trace_cache): a hit equals a fresh trace and is
bound to the new model, every part of the key misses when it changes, it holds no model, and
training with it equals training without it bit for bit (world 2, tensor and pipeline)."""

import dataclasses
import functools
import gc
import os
import sys
import types
import weakref

import pytest
import torch
import torch.nn.functional as F
from distributed import dist_pool_fixture
from torch import nn
from torch.fx._lazy_graph_module import _LazyGraphModule

from autopar.graph import trace_cache
from autopar.graph.trace import trace
from autopar.models.zoo import build

pool2 = dist_pool_fixture(2)


@pytest.fixture(autouse=True)
def _empty_cache(monkeypatch):
    monkeypatch.delenv("AUTOPAR_TRACE_CACHE", raising=False)
    trace_cache.clear()
    yield
    trace_cache.clear()


def _lm_loss(out, target):
    return F.cross_entropy(out.reshape(-1, out.size(-1)), target.reshape(-1))


@dataclasses.dataclass
class _Config:
    width: int = 8
    act: str = "gelu"


def _scale(x):
    return x * 2


class _Net(nn.Module):
    """Small enough to fingerprint many times: a config, dropout, a tied head, a buffer."""

    def __init__(self, config=None, p=0.1, tied=True):
        super().__init__()
        self.config = config or _Config()
        w = self.config.width
        self.emb = nn.Embedding(16, w)
        self.drop = nn.Dropout(p)
        self.proj = nn.Linear(w, w)
        self.head = nn.Linear(w, 16, bias=False)
        if tied:
            self.head.weight = self.emb.weight
        self.register_buffer("shift", torch.zeros(w))

    def forward(self, x):
        h = self.drop(self.emb(x)) + self.shift + torch.tensor([1.0])  # a lifted constant
        h = F.gelu(self.proj(h)) if self.config.act == "gelu" else torch.relu(self.proj(h))
        return self.head(_scale(h))


_X = torch.randint(0, 16, (2, 4))


def _key(model, x=_X, loss_fn=None, train=True):
    inputs = (x,) if loss_fn is None else (x, x)
    k = trace_cache.key(model, inputs, loss_fn, train)
    assert k is not None, "the model could be fingerprinted"
    return k.value


def _structure(traced) -> list:
    """Every node as autopar reads it: op, target, arguments by name, meta keys and values."""
    def arg(a):
        return a.name if isinstance(a, torch.fx.Node) else repr(a)
    out = []
    for n in traced.graph.nodes:
        val = n.meta.get("val")
        out.append((n.op, n.name, str(n.target), str(torch.fx.node.map_arg(n.args, arg)),
                    str(torch.fx.node.map_arg(n.kwargs, arg)), sorted(n.meta),
                    n.meta.get("autopar"), n.meta.get("autopar_module"),
                    str(n.meta.get("nn_module_stack")),
                    str(val.shape) if isinstance(val, torch.Tensor) else None))
    return out


def _assert_same_graph(hit, fresh):
    assert _structure(hit) == _structure(fresh)
    assert hit.params == fresh.params
    assert (hit.tracer, hit.example_batch, hit.with_loss, hit.fallback_reason) == \
        (fresh.tracer, fresh.example_batch, fresh.with_loss, fresh.fallback_reason)
    assert [(la.name, la.group, [n.name for n in la.nodes]) for la in hit.layers] == \
        [(la.name, la.group, [n.name for n in la.nodes]) for la in fresh.layers]
    assert all(n.graph is hit.graph for la in hit.layers for n in la.nodes)
    assert sorted(hit.gm.meta) == sorted(fresh.gm.meta)
    assert hit.gm.meta["autopar_batch_symbol"] == fresh.gm.meta["autopar_batch_symbol"]
    # a hit generates its code when it first runs or its code is read, as _LazyGraphModule
    assert type(hit.gm).__mro__[1:] == (_LazyGraphModule,) + type(fresh.gm).__mro__[1:]
    assert type(hit.gm) is not type(fresh.gm)  # its own class: its own forward
    assert hit.gm.code == fresh.gm.code
    assert sorted(vars(hit.gm)) == sorted(vars(fresh.gm))
    for hooks in ("_forward_pre_hooks", "_forward_hooks", "_forward_hooks_always_called"):
        assert len(getattr(hit.gm, hooks)) == len(getattr(fresh.gm, hooks))
    assert [n for n, _ in hit.gm.named_parameters(remove_duplicate=False)] == \
        [n for n, _ in fresh.gm.named_parameters(remove_duplicate=False)]
    assert [n for n, _ in hit.gm.named_buffers(remove_duplicate=False)] == \
        [n for n, _ in fresh.gm.named_buffers(remove_duplicate=False)]
    assert hit.gm.train.__self__ is hit.gm  # export's methods bound to the copy


def _assert_bound(traced, model):
    """The graph holds the model's own parameters and buffers, as a fresh trace does, and
    its own constants."""
    tensors = dict(model.named_parameters(remove_duplicate=False))
    tensors.update(model.named_buffers(remove_duplicate=False))
    own = {id(t) for t in tensors.values()}
    for target, info in traced.params.items():
        value = functools.reduce(getattr, target.split("."), traced.gm)
        if info.names[0] in tensors:
            assert value is tensors[info.names[0]], target
        else:  # a constant export lifted
            assert id(value) not in own, target


def _fresh(model, *args, **kwargs):
    """A trace with the cache off."""
    os.environ["AUTOPAR_TRACE_CACHE"] = "0"
    try:
        return trace(model, *args, **kwargs)
    finally:
        del os.environ["AUTOPAR_TRACE_CACHE"]


def test_a_hit_equals_a_fresh_trace_and_is_bound_to_the_new_model():
    model, (x,) = build("gpt-tiny", batch=2, device="cpu", seed=0)
    args = dict(loss_fn=_lm_loss, example_target=x, train=True)
    first = trace(model, (x,), **args)
    again, _ = build("gpt-tiny", batch=2, device="cpu", seed=1)
    hit = trace(again, (x,), **args)
    assert trace_cache.info() == trace_cache.CacheInfo(hits=1, misses=1, entries=1)
    assert hit.gm is not first.gm and hit.graph is not first.graph
    _assert_same_graph(hit, _fresh(again, (x,), **args))
    _assert_bound(hit, again)
    _assert_bound(first, model)


def test_a_trace_of_another_batch_hits_and_equals_a_fresh_trace_of_that_batch():
    """The batch is a symbol in every graph export makes (it refuses a model that fixes it):
    the planner's trace of the global batch serves the engine's trace of a rank's share."""
    model, (x,) = build("gpt-tiny", batch=8, device="cpu", seed=0)
    trace(model, (x,), loss_fn=_lm_loss, example_target=x, train=True)
    again, (small,) = build("gpt-tiny", batch=3, device="cpu", seed=1)
    args = dict(loss_fn=_lm_loss, example_target=small, train=True)
    hit = trace(again, (small,), **args)
    assert trace_cache.info() == trace_cache.CacheInfo(hits=1, misses=1, entries=1)
    assert hit.example_batch == 3
    _assert_same_graph(hit, _fresh(again, (small,), **args))
    _assert_bound(hit, again)
    one, (single,) = build("gpt-tiny", batch=1, device="cpu", seed=2)
    assert trace(one, (single,), train=False).example_batch == 2  # (1 is traced as 2)


def test_the_graph_computes_with_the_new_model_weights():
    torch.manual_seed(0)
    model, other = _Net(p=0.0).eval(), _Net(p=0.0).eval()
    trace(model, (_X,), train=False)
    hit = trace(other, (_X,), train=False)
    assert trace_cache.info().hits == 1
    torch.testing.assert_close(hit.gm(_X), other(_X), rtol=0, atol=0)
    with torch.no_grad():
        other.proj.weight.add_(1.0)
        other.shift.fill_(0.5)
    torch.testing.assert_close(hit.gm(_X), other(_X), rtol=0, atol=0)
    assert not torch.equal(hit.gm(_X), model(_X))


def test_a_hit_is_its_own_graph():
    """Passes rewrite the graph they get (apply_solution, recompute, the stage split): what
    one caller changes reaches neither the cache nor the next hit."""
    model = _Net()
    first = trace(model, (_X,), train=False)
    for traced in (first, trace(_Net(), (_X,), train=False)):
        linear = next(n for n in traced.graph.nodes if n.target is torch.ops.aten.linear.default)
        linear.meta["val"] = None
        linear.meta["nn_module_stack"]["changed"] = ("x", nn.Module)
        traced.gm.meta["autopar_param_prefix"] = "changed"
        traced.graph.erase_node(next(n for n in traced.graph.nodes if n.op == "output"))
    again = trace(_Net(), (_X,), train=False)
    assert trace_cache.info().hits == 2
    _assert_same_graph(again, _fresh(_Net(), (_X,), train=False))


def test_a_hit_leaves_the_model_as_a_trace_does():
    """Tracing sets every module's mode to the root's as it ends; so does a hit."""
    def mixed():
        model = _Net()
        model.drop.eval()
        return model

    trace(mixed(), (_X,), train=False)
    model = mixed()
    trace(model, (_X,), train=False)
    assert trace_cache.info().hits == 1
    assert model.drop.training and all(m.training for m in model.modules())


def test_lifted_constants_are_cloned_for_each_hit():
    first = trace(_Net(), (_X,), train=False)
    hit = trace(_Net(), (_X,), train=False)
    lifted = [t for t, info in hit.params.items() if info.names == (t[len("model."):],)
              and "lifted" in t]
    assert lifted, "the forward's torch.tensor([1.0]) is lifted"
    for target in lifted:
        mine, theirs = (functools.reduce(getattr, target.split("."), t.gm) for t in (hit, first))
        assert mine is not theirs and torch.equal(mine, theirs)


def test_a_transformers_model_hits():
    from transformers import LlamaConfig, LlamaForCausalLM

    config = dict(vocab_size=64, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, intermediate_size=48, max_position_embeddings=32)
    x = torch.randint(0, 64, (2, 8))

    def loss(out, target):
        return _lm_loss(out.logits, target)

    args = dict(loss_fn=loss, example_target=x, train=True)
    trace(LlamaForCausalLM(LlamaConfig(**config)), (x,), **args)
    model = LlamaForCausalLM(LlamaConfig(**config))
    hit = trace(model, (x,), **args)
    assert trace_cache.info().hits == 1
    _assert_same_graph(hit, _fresh(model, (x,), **args))
    _assert_bound(hit, model)
    changed = LlamaForCausalLM(LlamaConfig(**{**config, "rms_norm_eps": 1e-3}))
    assert _key(changed, x, loss) != _key(model, x, loss)


def test_a_meta_model_hits_with_its_constants_on_meta():
    def meta_llama():
        return build("llama-tiny", batch=2, device="meta")

    model, (x,) = meta_llama()
    trace(model, (x,), train=False)
    other, _ = meta_llama()
    hit = trace(other, (x,), train=False)
    assert trace_cache.info().hits == 1
    _assert_bound(hit, other)
    assert {t.device.type for t in list(hit.gm.parameters()) + list(hit.gm.buffers())} == \
        {"meta"}
    real, (xr,) = build("llama-tiny", batch=2, device="cpu", seed=0)
    assert _key(real, xr) != _key(other, x), "the device type is in the key"


def test_every_part_of_the_key_misses_when_it_changes(monkeypatch):
    base = _key(_Net())
    assert _key(_Net()) == base, "two models built alike share a key"
    same_hook = [_Net(), _Net()]
    hook = lambda module, args, out: out  # noqa: E731
    for m in same_hook:
        m.proj.register_forward_hook(hook)
    assert _key(same_hook[0]) == _key(same_hook[1]), "hooks by function, not by handle"
    assert _key(same_hook[0]) != base, "a hook"
    assert _key(_Net(_Config(act="relu"))) != base, "a config value"
    assert _key(_Net(p=0.2)) != base, "dropout p"
    assert _key(_Net(tied=False)) != base, "tied weights"
    frozen = _Net()
    frozen.proj.weight.requires_grad_(False)
    assert _key(frozen) != base, "requires_grad"
    net = _Net()
    evaluating = _Net()
    evaluating.drop.eval()
    assert _key(evaluating) != base, "a module's training flag"
    replaced = _Net()
    replaced.forward = types.MethodType(lambda self, x: self.head(self.emb(x)), replaced)
    assert _key(replaced) != base, "a forward set on the instance"
    assert _key(_Net(), torch.randint(0, 16, (2, 5))) != base, "an input shape"
    assert _key(_Net(), torch.randint(0, 16, (3, 4))) == base, "the batch is symbolic"
    assert _key(_Net(), torch.randint(0, 16, (4, 2)).t()) != \
        _key(_Net(), torch.randint(0, 16, (2, 4)).t()), "the batch of an input not contiguous"
    assert _key(_Net(), _X.int()) != base, "an input dtype"
    assert _key(_Net(), train=False) != base, "train"
    assert _key(_Net(), loss_fn=_lm_loss) != _key(_Net(), loss_fn=F.mse_loss), "the loss"
    assert _key(_Net(), loss_fn=nn.CrossEntropyLoss()) == \
        _key(_Net(), loss_fn=nn.CrossEntropyLoss()), "a loss module by its attributes"
    assert _key(_Net(), loss_fn=nn.CrossEntropyLoss(label_smoothing=0.1)) != \
        _key(_Net(), loss_fn=nn.CrossEntropyLoss()), "a loss module's attribute"
    with torch.no_grad():
        assert _key(net) != base, "grad mode"
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert _key(net) != base, "autocast"
    net = _Net()
    torch.set_default_dtype(torch.float64)
    try:
        assert _key(net) != base, "the default dtype"
    finally:
        torch.set_default_dtype(torch.float32)
    with monkeypatch.context() as m:
        m.setattr(_Net, "forward", lambda self, x: self.head(self.emb(x)))
        assert _key(_Net()) != base, "the class's forward"
    with monkeypatch.context() as m:
        m.setattr(sys.modules[__name__], "_scale", lambda x: x * 3)
        assert _key(_Net()) != base, "a function the forward calls"
    with monkeypatch.context() as m:
        tracing = sys.modules["autopar.graph.trace"]
        m.setattr(tracing, "_via_export", lambda *a: None)
        assert _key(_Net()) != base, "autopar's tracing code"
    assert _key(_Net()) == base


def test_a_member_added_to_torch_module_later_leaves_the_key_and_a_replaced_one_is_in_it(
        monkeypatch):
    """transformers gives torch.nn.Module a helper when it builds its first model: a model
    traced before that build must still hit after it; a member of Module replaced misses."""
    base = _key(_Net())
    with monkeypatch.context() as m:
        m.setattr(nn.Module, "a_helper_added_later", lambda self: None, raising=False)
        assert _key(_Net()) == base, "a member added to Module"
    with monkeypatch.context() as m:
        m.setattr(nn.Module, "extra_repr", lambda self: "replaced")
        assert _key(_Net()) != base, "a member of Module replaced"
    assert _key(_Net()) == base


def test_dynamo_tagging_module_init_leaves_the_key(monkeypatch):
    """A process's first compile wraps Module's __init__ and __setstate__ (dynamo's
    generation tagging): a model traced before it must still hit after it."""
    from torch._dynamo.mutation_guard import install_generation_tagging_init

    base = _key(_Net())
    for name in ("__init__", "__setstate__"):
        monkeypatch.setattr(nn.Module, name, getattr(nn.Module, name))
    monkeypatch.setattr(nn.Module, "___needs_generation_tag_patch", True, raising=False)
    install_generation_tagging_init()
    assert nn.Module.__init__.__module__ == "torch._dynamo.mutation_guard"
    assert _key(_Net()) == base


def test_opaque_moe_is_in_the_key_by_what_it_stands_for():
    from autopar.kernels.moe_layers import find_moe_layers, opaque_moe

    def moe():
        model, (x,) = build("moe-tiny", batch=2, device="meta")
        return model, x

    model, x = moe()
    plain = _key(model, x)
    with opaque_moe(model, find_moe_layers(model)):
        opaque = _key(model, x)
    other, _ = moe()
    with opaque_moe(other, find_moe_layers(other)):
        assert _key(other, x) == opaque, "a stand-in by its description, not its identity"
    assert opaque != plain and _key(model, x) == plain


def test_an_moe_model_run_eagerly_hits_and_an_undeclared_tensor_attribute_misses():
    """An MoE model's eager forward leaves the rows each expert computed on its MoE layers
    (for the expert-load report; no trace reads them): the layer's class declares that
    attribute untraced, so a second model after its own eager forward hits. A tensor
    attribute no class declares is still in the key by identity."""
    from autopar.kernels.sparse_moe import SparseMoE

    def ran(seed):
        model, (x,) = build("moe-tiny", batch=2, device="cpu", seed=seed)
        model(x)
        return model, x

    model, x = ran(0)
    layers = [m for m in model.modules() if isinstance(m, SparseMoE)]
    assert layers and all(m.last_tokens_per_expert is not None for m in layers)
    trace(model, (x,), train=False)
    other, _ = ran(1)
    assert trace(other, (x,), train=False) is not None
    assert trace_cache.info().hits == 1
    third, _ = ran(2)
    next(m for m in third.modules() if isinstance(m, SparseMoE)).undeclared = torch.ones(2)
    trace(third, (x,), train=False)
    assert trace_cache.info().hits == 1


def test_the_cache_keeps_no_model_alive():
    model, (x,) = build("gpt-tiny", batch=2, device="cpu", seed=0)
    traced = trace(model, (x,), train=False)
    assert trace_cache.info().entries == 1
    refs = [weakref.ref(model), weakref.ref(model.wte.weight)]
    del model, traced
    gc.collect()
    assert all(r() is None for r in refs)
    assert trace_cache.info().entries == 1


def test_an_entry_whose_referents_died_never_hits():
    """A key names functions by identity: once one dies, its id may name a new object."""
    def make():
        fresh = _Net()
        fresh.act = lambda t: t  # an attribute the key names by identity
        return fresh

    model = make()
    trace(model, (_X,), train=False)
    key = trace_cache.key(model, (_X,), None, False)
    del model.act
    gc.collect()
    assert trace_cache.lookup(key, _Net()) is None and trace_cache.info().entries == 0


def test_the_switch_and_the_bound(monkeypatch):
    monkeypatch.setenv("AUTOPAR_TRACE_CACHE", "0")
    trace(_Net(), (_X,), train=False)
    trace(_Net(), (_X,), train=False)
    assert trace_cache.info() == trace_cache.CacheInfo(hits=0, misses=0, entries=0)
    monkeypatch.delenv("AUTOPAR_TRACE_CACHE")
    monkeypatch.setattr(trace_cache, "MAX_ENTRIES", 2)
    for p in (0.1, 0.2, 0.3):
        trace(_Net(p=p), (_X,), train=False)
    assert trace_cache.info().entries == 2
    trace(_Net(p=0.1), (_X,), train=False)  # the least recently used went first
    assert trace_cache.info().hits == 0
    trace(_Net(p=0.3), (_X,), train=False)
    assert trace_cache.info().hits == 1
    trace_cache.clear()
    assert trace_cache.info() == trace_cache.CacheInfo(hits=0, misses=0, entries=0)


def _train(plan: dict, steps: int = 3) -> dict:
    """On every rank: gpt-tiny under `plan` for `steps` AdamW steps; losses and the cache's
    hits during it."""
    import autopar

    before = trace_cache.info().hits
    torch.manual_seed(0)
    model, (x,) = build("gpt-tiny", batch=4, device="cpu", seed=0)
    target = torch.roll(x, 1, dims=1)
    engine = autopar.parallelize(model, 2, example_inputs=(x[:2],), loss_fn=_lm_loss,
                                 optimizer=functools.partial(torch.optim.AdamW, lr=1e-2),
                                 plan=plan)
    losses = [engine.train_step(x, target) for _ in range(steps)]
    return {"losses": losses, "hits": trace_cache.info().hits - before}


def _cold_then_warm(plan: dict) -> list:
    trace_cache.clear()
    cold = _train(plan)
    return [cold, _train(plan)]


@pytest.mark.parametrize("plan", [{"tensor": {"size": 2, "mode": "1d"}}, {"pipeline": 2}],
                         ids=["tensor", "pipeline"])
def test_training_from_cached_graphs_equals_fresh_ones_bit_for_bit(pool2, plan):
    for cold, warm in pool2.run(_cold_then_warm, plan):
        assert cold["hits"] == 0 and warm["hits"] == 2  # the inference and training graphs
        assert warm["losses"] == cold["losses"]
