"""Attention forms of transformers' families under every sequence mode: multi-query attention
(one key/value head for every query head: Falcon's `multi_query`, Llama with
num_key_value_heads=1), grouped-query attention with fewer key/value heads than the cp size,
and partial rotary embeddings (rotary applied to part of each head: GPT-NeoX's rotary_pct,
Phi's and StableLM's partial_rotary_factor).

Each run trains tiny configs (no weights downloaded) for 2 AdamW steps in fp32 against the
same model on one device (tests/equivalence.py's `compare`): losses and weights within 1e-4
relative, a key bias (its exact gradient is 0: softmax ignores a constant added to every
score, so both runs move it by AdamW-amplified rounding) judged by absolute difference, and
the bytes every collective moved equal to the plan's prediction.
"""

from __future__ import annotations

import pytest
import torch
from equivalence import _lm_loss, compare
from pretraced import forked_pool_fixture

from autopar.kernels.collectives import AxisGroup, CommLog
from autopar.kernels.sequence import SequenceAttention

VOCAB, SEQ = 64, 16
RING = {"sequence": {"size": 2, "mode": "ring"}}  # zigzag, the ring's default layout
RING_CONTIGUOUS = {"sequence": {"size": 2, "mode": "ring", "layout": "contiguous"}}
ULYSSES = {"sequence": {"size": 2, "mode": "ulysses"}}
MEGATRON_SP = {"tensor": {"size": 2, "mode": "1d", "sequence_parallel": True}}


def _lm(model, batch):
    x = torch.randint(0, VOCAB, (batch, SEQ))
    return model, (x,), torch.randint(0, VOCAB, (batch, SEQ)), _lm_loss


def falcon_mqa(batch):
    """Falcon with multi_query: q [B, 4, S, D] against k, v [B, 1, S, D] in one SDPA call,
    torch broadcasting the one key/value head (no enable_gqa)."""
    from transformers import FalconConfig, FalconForCausalLM

    cfg = FalconConfig(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2,
                       num_attention_heads=4, multi_query=True, new_decoder_architecture=False,
                       parallel_attn=True, hidden_dropout=0.0, attention_dropout=0.0,
                       max_position_embeddings=64)
    return _lm(FalconForCausalLM(cfg), batch)


def llama_mqa(batch):
    """Llama with 4 query heads and one key/value head."""
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64,
                      num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=1,
                      max_position_embeddings=64)
    return _lm(LlamaForCausalLM(cfg), batch)


def stablelm_partial_mqa(batch):
    """StableLM: rotary on a quarter of each head (partial_rotary_factor 0.25) and one
    key/value head for 4 query heads."""
    from transformers import StableLmConfig, StableLmForCausalLM

    cfg = StableLmConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64,
                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=1,
                         partial_rotary_factor=0.25, max_position_embeddings=64,
                         hidden_dropout=0.0, attention_dropout=0.0)
    return _lm(StableLmForCausalLM(cfg), batch)


def neox_partial(batch):
    """GPT-NeoX with rotary_pct 0.25 (rotary on 2 of each head's 8 dims)."""
    from transformers import GPTNeoXConfig, GPTNeoXForCausalLM

    cfg = GPTNeoXConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64,
                        num_hidden_layers=2, num_attention_heads=4, rotary_pct=0.25,
                        max_position_embeddings=64, hidden_dropout=0.0, attention_dropout=0.0)
    return _lm(GPTNeoXForCausalLM(cfg), batch)


def phi_partial(batch):
    """Phi with partial_rotary_factor 0.5."""
    from transformers import PhiConfig, PhiForCausalLM

    cfg = PhiConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                    num_attention_heads=4, partial_rotary_factor=0.5, max_position_embeddings=64,
                    resid_pdrop=0.0, embd_pdrop=0.0, attention_dropout=0.0)
    return _lm(PhiForCausalLM(cfg), batch)


# each world forked from the test process once it traced the world's models (tests/pretraced.py)
pool2 = forked_pool_fixture(2, [falcon_mqa, llama_mqa, stablelm_partial_mqa, neox_partial,
                                phi_partial])
pool4 = forked_pool_fixture(4, [falcon_mqa, llama_mqa])


def _check(results, kernel_op=None):
    for r in results:
        assert r["keys_equal"]
        assert r["loss"] <= 1e-4, r["loss"]
        assert r["weights"] <= 1e-4, r["weights"]
        assert r["noise_abs"] <= 1e-6, r["noise_abs"]
        assert r["measured"] == r["predicted"]
        if kernel_op is not None:  # the sequence kernel ran (ring shifts or all-to-alls)
            assert r["measured"].get((kernel_op, "cp"), 0) > 0, r["measured"]
    assert all(r["measured"] == results[0]["measured"] for r in results)


def _kernel_op(plan):
    mode = plan.get("sequence", {}).get("mode")
    return {"ring": "p2p", "ulysses": "all_to_all"}.get(mode)


def test_one_kv_head_broadcasts_without_enable_gqa():
    """The sequence kernels' entry point takes k, v with one head against q's several as
    torch's SDPA does (broadcast, no enable_gqa): Falcon's multi-query attention. Two heads
    against four still need enable_gqa, as in torch."""
    torch.manual_seed(0)
    q, k, v = torch.randn(2, 4, 8, 8), torch.randn(2, 1, 8, 8), torch.randn(2, 1, 8, 8)
    expected = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
    for mode in ("ring", "ulysses"):
        attend = SequenceAttention("cp", mode, is_causal=True)
        attend.bind({"cp": AxisGroup("cp", 1, 0, None, CommLog())})
        torch.testing.assert_close(attend(q, k, v), expected, rtol=1e-5, atol=1e-6)
    with pytest.raises(ValueError, match="q has 4 heads and k 2; pass enable_gqa=True"):
        attend(q, k.expand(2, 2, 8, 8), v.expand(2, 2, 8, 8))


@pytest.mark.parametrize("plan", [RING, ULYSSES], ids=["ring", "ulysses"])
def test_falcon_multi_query_under_sequence_parallelism(pool2, plan):
    """Falcon's one key/value head under ring attention and Ulysses (refused before with
    "q has 4 heads and k 1; pass enable_gqa=True")."""
    _check(pool2.run(compare, falcon_mqa, plan, steps=2), _kernel_op(plan))


@pytest.mark.parametrize("plan", [RING_CONTIGUOUS, ULYSSES], ids=["ring-contiguous", "ulysses"])
def test_llama_one_kv_head_under_sequence_parallelism(pool2, plan):
    """transformers' Llama repeats its one key/value head to the 4 query heads before SDPA
    (`repeat_kv`: unsqueeze, expand, reshape); the kernels take the key/value before the
    repeat (enable_gqa), so ring attention sends one head per hop, not four: per layer and
    step, c - 1 hops of this rank's k and v forward, c - 1 backward and c hops of their
    gradient accumulators (before, four times these bytes). Ulysses repeats the head only
    to c = 2 heads for its all-to-all."""
    results = pool2.run(compare, llama_mqa, plan, steps=2)
    _check(results, _kernel_op(plan))
    if plan is RING_CONTIGUOUS:
        c, layers, batch, head_dim = 2, 2, 8, 8
        kv_bytes = 2 * batch * 1 * (SEQ // c) * head_dim * 4  # k and v, one head, fp32
        hops = (c - 1) + (c - 1) + c
        assert results[0]["measured"][("p2p", "cp")] == layers * hops * kv_bytes


@pytest.mark.parametrize("plan", [RING, RING_CONTIGUOUS, ULYSSES, MEGATRON_SP],
                         ids=["ring-zigzag", "ring-contiguous", "ulysses", "megatron-sp"])
def test_partial_rotary_with_one_kv_head_under_every_sequence_mode(pool2, plan):
    """StableLM: rotary on a quarter of each head and one key/value head, under ring
    attention (zigzag and contiguous: each rank's rotary tables cut to its own global
    positions), Ulysses and Megatron-SP."""
    _check(pool2.run(compare, stablelm_partial_mqa, plan, steps=2), _kernel_op(plan))


@pytest.mark.parametrize("build,plan", [(neox_partial, RING), (phi_partial, ULYSSES),
                                        (neox_partial, MEGATRON_SP)],
                         ids=["neox-ring", "phi-ulysses", "neox-megatron-sp"])
def test_partial_rotary_families(pool2, build, plan):
    _check(pool2.run(compare, build, plan, steps=2), _kernel_op(plan))


@pytest.mark.parametrize("build,mode", [(falcon_mqa, "ulysses"), (llama_mqa, "ring")],
                         ids=["falcon-ulysses", "llama-ring"])
def test_one_kv_head_over_cp4(pool4, build, mode):
    """One key/value head over 4 sequence ranks: Ulysses repeats it 4 times before its
    all-to-all (each rank's one query head meets its copy), ring passes it round as is."""
    plan = {"sequence": {"size": 4, "mode": mode}}
    _check(pool4.run(compare, build, plan, steps=2), _kernel_op(plan))
