"""Meta-device materialization (`autopar.runtime.materialize`): a model built on meta gets,
module by module, exactly the values one device gets from the same construction under the
same seed: the zoo models, plain torch.nn modules and transformers' LlamaForCausalLM (tied
and untied) built with from_config."""

import pytest
import torch
from torch import nn

from autopar.errors import WeightsError
from autopar.models import build
from autopar.runtime.materialize import iter_initial_values, materialize, materialize_module

ZOO = ["gpt:layers=2,hidden=32,heads=4,vocab=64,seq=16",
       "llama:layers=2,hidden=32,heads=4,vocab=64,seq=16",
       "bert:layers=2,hidden=32,heads=4,vocab=64,seq=16",
       "vit-tiny", "mlp-tiny"]


def _equal(real: nn.Module, other: nn.Module) -> list[str]:
    """Names whose values differ (state_dict and non-persistent buffers)."""
    a = dict(real.state_dict(), **dict(real.named_buffers()))
    b = dict(other.state_dict(), **dict(other.named_buffers()))
    assert sorted(a) == sorted(b)
    return [k for k in a if a[k].dtype != b[k].dtype or not torch.equal(a[k], b[k])]


@pytest.mark.parametrize("spec", ZOO)
def test_zoo_models_equal_a_cpu_build_under_the_same_seed(spec):
    real, _ = build(spec, device="cpu", seed=3)
    meta, _ = build(spec)  # the meta device
    assert all(p.is_meta for p in meta.parameters())
    materialize(meta, seed=3)
    assert not any(p.is_meta for p in meta.parameters())
    assert _equal(real, meta) == []
    assert _ties(meta) == _ties(real)  # lm_head.weight is still wte.weight


def _ties(model: nn.Module) -> list[list[str]]:
    by_tensor: dict[int, list[str]] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        by_tensor.setdefault(id(p), []).append(name)
    return sorted(sorted(names) for names in by_tensor.values() if len(names) > 1)


def test_values_come_one_module_at_a_time():
    """Each yield holds one module's own tensors (a tied one once), every tensor once."""
    meta, _ = build(ZOO[0])
    modules = dict(meta.named_modules())
    seen = []
    for name, values in iter_initial_values(meta, seed=0):
        own = {n for n, _ in modules[name].named_parameters(recurse=False)} | \
            {n for n, _ in modules[name].named_buffers(recurse=False)}
        assert set(values) <= own and values
        seen += [f"{name}.{k}" if name else k for k in values]
    assert sorted(seen) == sorted(n for n, _ in meta.named_parameters())
    assert meta.lm_head.weight is meta.wte.weight and meta.wte.weight.is_meta  # untouched


def _plain():
    return nn.Sequential(nn.Embedding(10, 8, padding_idx=1), nn.Linear(8, 16),
                         nn.LayerNorm(16), nn.Linear(16, 4, bias=False))


def test_plain_modules_from_the_global_random_state():
    """seed=None: from the current CPU random state, advanced as the construction does."""
    torch.manual_seed(7)
    real = _plain()
    after_real = torch.rand(3)
    with torch.device("meta"):
        meta = _plain()
    torch.manual_seed(7)
    materialize(meta)
    assert torch.equal(torch.rand(3), after_real)
    assert _equal(real, meta) == []
    assert meta[0].weight[1].eq(0).all()  # the padding row, as reset_parameters leaves it


@pytest.mark.parametrize("tie", [True, False])
def test_transformers_llama_from_config_on_meta(tie):
    transformers = pytest.importorskip("transformers")
    cfg = transformers.LlamaConfig(vocab_size=64, hidden_size=16, intermediate_size=32,
                                   num_hidden_layers=2, num_attention_heads=4,
                                   num_key_value_heads=2, max_position_embeddings=32,
                                   tie_word_embeddings=tie)
    torch.manual_seed(5)
    real = transformers.AutoModelForCausalLM.from_config(cfg)
    with torch.device("meta"):
        meta = transformers.AutoModelForCausalLM.from_config(cfg)
    materialize(meta, seed=5)
    assert _equal(real, meta) == []
    assert (meta.lm_head.weight is meta.model.embed_tokens.weight) is tie


def test_the_seed_does_not_disturb_the_callers_random_state():
    meta, _ = build(ZOO[1])
    torch.manual_seed(11)
    expected = torch.rand(2)
    torch.manual_seed(11)
    for _ in iter_initial_values(meta, seed=1):
        pass
    assert torch.equal(torch.rand(2), expected)


class _Scaled(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 4)
        self.scale = nn.Parameter(torch.ones(4))  # set by the constructor only


def test_a_value_only_the_constructor_knew_is_refused():
    with torch.device("meta"):
        meta = _Scaled()
    with pytest.raises(WeightsError, match="scale is written by neither its module's "
                                        "reset_parameters nor the model's init_weights"):
        iter_initial_values(meta, seed=0)


def test_materialize_module_keeps_requires_grad():
    with torch.device("meta"):
        lin = nn.Linear(3, 2)
    lin.bias.requires_grad_(False)
    materialize_module(lin, {"weight": torch.ones(2, 3), "bias": torch.zeros(2)})
    assert lin.weight.device.type == "cpu" and lin.weight.requires_grad
    assert not lin.bias.requires_grad and torch.equal(lin.weight, torch.ones(2, 3))


def test_never_the_whole_model_at_once(monkeypatch):
    """The replay allocates each tensor when it is first written and frees a value that a
    later init replaces whole: with the caller dropping each module's values, the bytes
    alive at any yield stay near one layer's, far below the model's."""
    import weakref

    meta, _ = build("gpt:layers=8,hidden=64,heads=4,vocab=64,seq=16")
    total = sum(p.numel() * p.element_size() for p in meta.parameters())
    made: list = []
    empty = torch.empty_strided

    def tracked(*args, **kwargs):
        t = empty(*args, **kwargs)
        made.append((weakref.ref(t), t.numel() * t.element_size()))
        return t

    monkeypatch.setattr(torch, "empty_strided", tracked)
    peak = 0
    for _, values in iter_initial_values(meta, seed=0):
        peak = max(peak, sum(n for ref, n in made if ref() is not None))
        del values
    largest = max(p.numel() * p.element_size() for p in meta.parameters())
    assert len(made) > len(list(meta.parameters()))  # both phases allocated
    # the largest weight plus at most the tied embedding (64 x 64) in flight
    assert peak <= largest + 64 * 64 * 4 < total / 16, (peak, largest, total)


@pytest.mark.parametrize("name", ["gpt2", "vit", "t5"])
def test_transformers_models_with_their_own_draws(name):
    """GPT-2's Conv1D draws in its own __init__ and ViT's init uses the truncated normal,
    which redraws depending on values: both are replayed as the constructor ran them."""
    transformers = pytest.importorskip("transformers")
    make = {
        "gpt2": lambda: transformers.GPT2LMHeadModel(transformers.GPT2Config(
            vocab_size=64, n_positions=16, n_embd=32, n_layer=2, n_head=4,
            bos_token_id=0, eos_token_id=0)),
        "vit": lambda: transformers.ViTForImageClassification(transformers.ViTConfig(
            image_size=16, patch_size=4, hidden_size=32, num_hidden_layers=2,
            num_attention_heads=4, intermediate_size=64)),
        "t5": lambda: transformers.T5ForConditionalGeneration(transformers.T5Config(
            vocab_size=64, d_model=16, d_kv=4, d_ff=32, num_layers=2, num_heads=4)),
    }[name]
    torch.manual_seed(1)
    real = make()
    with torch.device("meta"):
        meta = make()
    materialize(meta, seed=1)
    assert _equal(real, meta) == []


class _Custom(nn.Module):
    """A plain module whose own init uses torch.nn.init's value-dependent functions."""

    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(8, 8), nn.Linear(8, 6)
        self.c, self.d = nn.Conv2d(4, 4, 3), nn.Linear(10, 10)
        self.init_weights()

    def init_weights(self):
        nn.init.orthogonal_(self.a.weight)
        nn.init.trunc_normal_(self.b.weight, std=0.5)
        nn.init.dirac_(self.c.weight)
        nn.init.sparse_(self.d.weight, 0.5)


def test_init_functions_that_skip_meta_are_replayed_whole():
    torch.manual_seed(2)
    real = _Custom()
    with torch.device("meta"):
        meta = _Custom()
    materialize(meta, seed=2)
    assert _equal(real, meta) == []
