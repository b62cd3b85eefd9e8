"""The zoo's recent models: Llama 3.1 (128K) and 3.2, Qwen3, DeepSeek-V3 with multi-head latent
attention. Parameter counts equal the published ones; Llama 3.1's rotary frequencies equal
transformers'; MLA and Qwen3's QK-norm train at world 2 equal to one device."""

import pytest
import torch
from distributed import dist_pool_fixture
from equivalence import assert_equal, compare

from autopar.models import build, format_spec, get_config, parse_spec, workload
from autopar.models.llama import RopeScaling, rope_tables
from autopar.models.mla import MLAttention

pool2 = dist_pool_fixture(2)


def n_params(model) -> int:
    return sum(p.numel() for p in model.parameters())


# (zoo name, published count, the unit it is published to): Meta's Llama 3.1 and 3.2 model
# cards (405B; 1.23B and 3.21B), the Qwen3 model cards (8.2B, 32.8B), the DeepSeek-V3
# technical report (671B without its multi-token-prediction module)
PUBLISHED = [
    ("llama3.1-405b", 405.9e9, 0.1e9),
    ("llama3.2-1b", 1.24e9, 0.01e9),
    ("llama3.2-3b", 3.21e9, 0.01e9),
    ("qwen3-8b", 8.2e9, 0.1e9),
    ("qwen3-32b", 32.8e9, 0.1e9),
    ("deepseek-v3", 671e9, 1e9),
]


@pytest.mark.parametrize("name, published, unit", PUBLISHED)
def test_parameter_count_equals_the_published_one(name, published, unit):
    model, _ = build(name, seq=8)
    assert round(n_params(model) / unit) * unit == pytest.approx(published, rel=1e-9)


def test_deepseek_v3_activates_37b_parameters_per_token():
    cfg = get_config("deepseek-v3")
    model, _ = build(cfg, seq=8)
    idle_experts = (cfg.n_layer - cfg.dense_layers) * (cfg.n_experts - cfg.top_k)
    idle = idle_experts * 3 * cfg.dim * cfg.ffn_hidden + cfg.vocab_size * cfg.dim  # + lookup
    assert round((n_params(model) - idle) / 1e9) == 37
    # MLA's 187M a layer (report §2.1.1 shapes), as its projections are
    attention = model.blocks[0].attention
    assert isinstance(attention, MLAttention)
    assert {name: tuple(p.shape) for name, p in attention.named_parameters()} == {
        "wq_a.weight": (1536, 7168), "q_norm.weight": (1536,), "wq_b.weight": (128 * 192, 1536),
        "wkv_a.weight": (512 + 64, 7168), "kv_norm.weight": (512,),
        "wkv_b.weight": (128 * 256, 512), "wo.weight": (7168, 128 * 128)}


def test_llama_3_1_rotary_frequencies_equal_transformers():
    from transformers import LlamaConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    hf = LlamaConfig(hidden_size=4096, num_attention_heads=32, rope_theta=500000.0,
                     max_position_embeddings=131072,
                     rope_scaling=dict(rope_type="llama3", factor=8.0, low_freq_factor=1.0,
                                       high_freq_factor=4.0,
                                       original_max_position_embeddings=8192))
    inv_freq, _ = ROPE_INIT_FUNCTIONS["llama3"](hf, "cpu")
    positions = torch.tensor([0.0, 1.0, 8191.0, 131071.0])
    cos, sin = rope_tables(128, 131072, 500000.0, RopeScaling())
    angles = torch.outer(positions, inv_freq.float())
    torch.testing.assert_close(cos[positions.long()], angles.cos(), rtol=0, atol=1e-5)
    torch.testing.assert_close(sin[positions.long()], angles.sin(), rtol=0, atol=1e-5)
    assert get_config("llama3.1-8b").rope_scaling == RopeScaling()


@pytest.mark.parametrize("name, longest", [("llama3.1-8b", 131072), ("llama3.1-70b", 131072),
                                           ("llama3.1-405b", 131072), ("qwen3-32b", 32768)])
def test_long_context_models_trace_at_their_longest(name, longest):
    w = workload(name, seq=longest)
    assert tuple(w.inputs[0].shape) == (2, longest)


def test_new_spec_keys_round_trip():
    qwen = get_config("qwen3-32b")
    assert "head_dim=128,qk_norm=1" in format_spec(qwen)
    assert "tied=1" in format_spec(get_config("llama3.2-1b"))
    assert "q_lora=1536,kv_lora=512,nope_dim=128,rope_dim=64,v_dim=128" in \
        format_spec(get_config("deepseek-v3"))
    mla = parse_spec("moe:layers=2,hidden=64,heads=4,experts=4,top_k=2,kv_lora=16")
    assert (mla.qk_nope_head_dim, mla.qk_rope_head_dim, mla.v_head_dim) == (128, 64, 128)


MLA_TINY = ("moe:layers=2,hidden=64,heads=4,experts=4,top_k=2,ffn=32,vocab=256,seq=16,"
            "q_lora=24,kv_lora=16,nope_dim=8,rope_dim=8,v_dim=8")
QWEN3_TINY = "llama:layers=2,hidden=64,heads=8,kv_heads=4,ffn=96,vocab=256,seq=16,head_dim=16," \
             "qk_norm=1,tied=1"


@pytest.mark.parametrize("plan", [{"data": 2}, {"tensor": {"size": 2, "mode": "1d"}}],
                         ids=["data", "tensor"])
@pytest.mark.parametrize("spec", [MLA_TINY, QWEN3_TINY], ids=["mla", "qwen3"])
def test_mla_and_qk_norm_train_equal_to_one_device(pool2, spec, plan):
    assert_equal(pool2.run(compare, spec, plan))
