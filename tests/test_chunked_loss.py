"""The chunked cross-entropy (autopar.kernels.chunked_loss, autopar.passes.chunked_loss):
the kernel against aten, the fused training graph against the unfused one and one device
under data, 1D tensor (vocabulary-parallel), Megatron-SP, pipeline and ZeRO-3 plans on the
zoo GPT and a transformers Llama whose loss is its own `loss_function`; the switch; the
memory model's named effect and the peak memory it predicts against the measured fall."""

import functools

import pytest
import torch
import torch.nn.functional as F
from distributed import dist_pool_fixture
from equivalence import compare

from autopar.graph import losses
from autopar.kernels.chunked_loss import ChunkedCrossEntropy

pool2 = dist_pool_fixture(2)

SMALL_CHUNKS = 4 * 64 * 4  # 4 tokens of a 64-class (hf-llama) or 16 of a 256/16 slice


def hf_llama(batch: int):
    """A tiny transformers Llama trained on its own loss function (ForCausalLMLoss: fp32
    upcast, labels shifted by one with -100 padding, mean over the counted tokens)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32)
    model = LlamaForCausalLM(cfg)
    x = torch.randint(0, 64, (batch, 8))

    def loss_fn(out, target):
        return model.loss_function(out.logits, target, cfg.vocab_size)

    return model, (x,), torch.randint(0, 64, (batch, 8)), loss_fn


class _WithLabels(torch.nn.Module):
    """A transformers model called with labels=: the loss inside its forward."""

    def __init__(self, model):
        super().__init__()
        self.model = model

    def forward(self, ids, labels):
        return self.model(input_ids=ids, labels=labels).loss


def hf_llama_labels(batch: int):
    model, (x,), target, _ = hf_llama(batch)
    return _WithLabels(model), (x, target), target, _own_loss


def _own_loss(loss, target):
    return loss


def test_kernel_equals_aten_in_many_chunks():
    torch.manual_seed(0)
    x = torch.randn(2, 13, 8, dtype=torch.float64).float().requires_grad_()
    w = torch.randn(40, 8).requires_grad_()
    b = torch.randn(40).requires_grad_()
    t = torch.randint(0, 40, (26,))
    t[3] = -100
    for reduction, name in ((1, "mean"), (2, "sum")):
        module = ChunkedCrossEntropy(None, reduction, -100, chunk_bytes=3 * 40 * 4)  # 3 rows
        got = module(x, w, t, b)
        grads = torch.autograd.grad(got, (x, w, b))
        want = F.cross_entropy((x @ w.t() + b).reshape(-1, 40), t, reduction=name)
        expected = torch.autograd.grad(want, (x, w, b))
        assert torch.allclose(got, want, rtol=1e-6, atol=1e-6)
        for g, e in zip(grads, expected):
            assert torch.allclose(g, e, rtol=1e-5, atol=1e-6)


def _chunked_run(name, plan, chunked: bool) -> dict:
    """compare() with small chunks (several per local batch), plus how many losses fused."""
    losses.CHUNK_BYTES = SMALL_CHUNKS
    model = {"hf-llama": hf_llama, "hf-llama-labels": hf_llama_labels}.get(name, name)
    return compare(model, plan, steps=3, probe=_fused, chunked_loss=chunked)


def _fused(engine, inputs, target) -> int:
    return engine.chunked_losses


PLANS = {"data": {"data": 2},
         "tensor": {"tensor": {"size": 2, "mode": "1d"}},
         "megatron-sp": {"tensor": {"size": 2, "mode": "1d", "sequence_parallel": True}},
         "pipeline": {"pipeline": 2},
         "zero3": {"data": 2, "zero": {"stage": 3}}}


@pytest.mark.parametrize("plan", list(PLANS))
@pytest.mark.parametrize("model", ["gpt-tiny", "hf-llama"])
def test_chunked_equals_one_device(pool2, model, plan):
    for r in pool2.run(_chunked_run, model, PLANS[plan], True):
        assert r["probe"] == 1, r["probe"]  # the loss ran chunked
        assert r["loss"] <= 1e-4 and r["weights"] <= 1e-4, (r["loss"], r["weights"])
        assert r["measured"] == r["predicted"]


@pytest.mark.parametrize("plan", ["data", "tensor"])
def test_loss_inside_the_forward_is_chunked(pool2, plan):
    for r in pool2.run(_chunked_run, "hf-llama-labels", PLANS[plan], True):
        assert r["probe"] == 1
        assert r["loss"] <= 1e-4 and r["weights"] <= 1e-4, (r["loss"], r["weights"])
        assert r["measured"] == r["predicted"]


def test_switch_off_keeps_the_traced_loss(pool2):
    for r in pool2.run(_chunked_run, "gpt-tiny", PLANS["tensor"], False):
        assert r["probe"] == 0
        assert r["loss"] <= 1e-5 and r["weights"] <= 1e-5


def test_switch_must_be_a_bool():
    import autopar
    from autopar.models import build

    model, (x,) = build("gpt-tiny", batch=2, device="cpu", seed=0)
    with pytest.raises(autopar.PlanError, match="chunked_loss must be True or False"):
        autopar.parallelize(model, 1, example_inputs=(x,), chunked_loss="yes",
                            optimizer=functools.partial(torch.optim.SGD, lr=0.1))
