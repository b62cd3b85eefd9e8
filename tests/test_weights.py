"""Weight sources (`autopar.runtime.weights`): safetensors files and the sharded directories
transformers' save_pretrained writes, autopar checkpoints and mappings, listed without
reading, checked in one sentence naming the keys, and read region by region (a region
equals the same region of the full tensor; a tied name reads the stored one)."""

import functools
import os

import pytest
import torch
from safetensors.torch import save_file

from autopar.errors import WeightsError
from autopar.runtime.weights import Entry, open_weights

transformers = pytest.importorskip("transformers")

TIED = [["lm_head.weight", "model.embed_tokens.weight"]]


def _llama(tie: bool = True, seed: int = 0):
    cfg = transformers.LlamaConfig(vocab_size=64, hidden_size=16, intermediate_size=32,
                                   num_hidden_layers=2, num_attention_heads=4,
                                   num_key_value_heads=2, max_position_embeddings=32,
                                   tie_word_embeddings=tie)
    torch.manual_seed(seed)
    return transformers.LlamaForCausalLM(cfg)


def _expected(model) -> dict:
    return {k: (tuple(v.shape), v.dtype) for k, v in model.state_dict().items()}


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """A tiny tied Llama saved by save_pretrained: sharded (index + 2 files) and single."""
    model = _llama()
    root = tmp_path_factory.mktemp("llama")
    model.save_pretrained(root / "sharded", max_shard_size="20KB")
    model.save_pretrained(root / "single")
    return model, root


def test_sharded_directory_lists_without_reading_and_reads_regions(saved):
    model, root = saved
    assert sorted(f for f in os.listdir(root / "sharded") if f.endswith(".safetensors")) == \
        ["model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"]
    full = model.state_dict()
    with open_weights(root / "sharded") as src:
        assert "lm_head.weight" not in src.keys()  # transformers drops the tied copy
        assert src.entry("model.layers.1.mlp.up_proj.weight") == Entry((32, 16), torch.float32)
        src.check(_expected(model), TIED)
        name = "model.layers.0.self_attn.q_proj.weight"
        assert torch.equal(src.read(name, (slice(4, 8), slice(2, 10))), full[name][4:8, 2:10])
        assert torch.equal(src.read(name, (slice(8, 12),)), full[name][8:12])
        assert torch.equal(src.read(name), full[name])
        blocks = src.read(name, [(slice(0, 2),), (slice(10, 12), slice(0, 3))])
        assert torch.equal(blocks[0], full[name][0:2]) and \
            torch.equal(blocks[1], full[name][10:12, 0:3])
        # the tied name reads the stored embedding
        assert torch.equal(src.read("lm_head.weight", (slice(60, 64),)),
                           full["lm_head.weight"][60:64])


def test_single_file_and_its_directory(saved):
    model, root = saved
    full = model.state_dict()
    for where in (root / "single", root / "single" / "model.safetensors"):
        with open_weights(where, tied=TIED) as src:
            src.check(_expected(model))
            assert torch.equal(src.read("model.norm.weight"), full["model.norm.weight"])


def test_grid_read_joins_runs_in_order(saved):
    """A slice of several runs per dim (a blockwise or zigzag split, a 2D grid) is the
    concatenation of the runs, as local_slice cuts it."""
    model, root = saved
    w = model.state_dict()["model.embed_tokens.weight"]  # (64, 16)
    with open_weights(root / "sharded", tied=TIED) as src:
        got = src.read_grid("lm_head.weight", [[slice(0, 4), slice(60, 64)],
                                               [slice(0, 2), slice(8, 12)]])
    rows = torch.cat([w[0:4], w[60:64]])
    assert torch.equal(got, torch.cat([rows[:, 0:2], rows[:, 8:12]], dim=1))


def test_dtype_is_converted_floating_to_floating(tmp_path):
    t = torch.randn(6, 4)
    save_file({"w": t.to(torch.bfloat16), "ids": torch.arange(6)}, tmp_path / "w.safetensors")
    with open_weights(tmp_path / "w.safetensors") as src:
        assert src.entry("w").dtype == torch.bfloat16
        src.check({"w": ((6, 4), torch.float32), "ids": ((6,), torch.int64)})
        got = src.read("w", (slice(1, 3),), dtype=torch.float32)
        assert got.dtype == torch.float32
        assert torch.equal(got, t.to(torch.bfloat16)[1:3].float())
        with pytest.raises(WeightsError, match=r"ids is int64, which cannot become .*float32"):
            src.check({"w": ((6, 4), torch.float32), "ids": ((6,), torch.float32)})


def test_mismatches_are_one_sentence_naming_the_keys(saved):
    model, root = saved
    expected = _expected(model)
    expected.pop("model.norm.weight")  # stored but not in the model: unexpected
    expected["model.extra.weight"] = ((3,), torch.float32)  # missing
    expected["model.layers.1.mlp.up_proj.weight"] = ((16, 32), torch.float32)  # shape
    with open_weights(root / "sharded") as src:
        with pytest.raises(WeightsError) as e:
            src.check(expected, TIED)
    text = str(e.value)
    assert text.count(".") >= 1 and text.endswith(".") and "\n" not in text
    assert "missing model.extra.weight" in text
    assert "unexpected model.norm.weight" in text
    assert "model.layers.1.mlp.up_proj.weight has shape (32, 16) where the model's is " \
           "(16, 32)" in text
    # without the tie, the stored embedding alone does not stand for lm_head.weight
    with open_weights(root / "sharded") as src, \
            pytest.raises(WeightsError, match="missing lm_head.weight"):
        src.check(_expected(model))


def test_regions_outside_the_tensor_are_refused(saved):
    _, root = saved
    with open_weights(root / "sharded") as src:
        with pytest.raises(WeightsError, match=r"model.norm.weight has 0:17 on dim 0"):
            src.read("model.norm.weight", (slice(0, 17),))
        with pytest.raises(WeightsError, match="have no model.nothing"):
            src.read("model.nothing")


def test_mapping_source():
    t = {"a": torch.arange(12.0).reshape(3, 4), "b": torch.ones(2)}
    src = open_weights(t, tied=[["a", "c"]])
    src.check({"a": ((3, 4), torch.float32), "b": ((2,), torch.float64),
               "c": ((3, 4), torch.float32)})
    got = src.read("c", (slice(1, 3), slice(2, 4)))
    assert torch.equal(got, t["a"][1:3, 2:4])
    got.zero_()  # a copy: the mapping is untouched
    assert t["a"][2, 3] == 11.0
    assert src.read("b", dtype=torch.float64).dtype == torch.float64


def test_not_weights_is_one_sentence(tmp_path):
    with pytest.raises(WeightsError, match="there are no weights at"):
        open_weights(tmp_path / "nothing")
    (tmp_path / "empty").mkdir()
    with pytest.raises(WeightsError, match="holds neither model.safetensors.index.json"):
        open_weights(tmp_path / "empty")
    (tmp_path / "bad.safetensors").write_bytes(b"not a safetensors file")
    with pytest.raises(WeightsError, match="could not be opened as safetensors"):
        open_weights(tmp_path / "bad.safetensors")


def test_autopar_checkpoint_regions(tmp_path):
    """An engine.save checkpoint (world 1) is a source: names as the model's state_dict,
    the tied name resolved from autopar.json, regions read through DCP."""
    import autopar
    from autopar.models import build

    model, (x,) = build("gpt:layers=2,hidden=32,heads=4,vocab=64,seq=16", batch=2,
                        device="cpu", seed=0)

    def loss_fn(logits, target):
        return torch.nn.functional.cross_entropy(logits.reshape(-1, 64), target.reshape(-1))

    engine = autopar.parallelize(model, 1, example_inputs=(x,), loss_fn=loss_fn,
                                 optimizer=functools.partial(torch.optim.AdamW, lr=1e-3))
    engine.train_step(x, x)
    engine.save(tmp_path / "ckpt")
    whole = engine.full_state_dict()
    with open_weights(tmp_path / "ckpt") as src:
        src.check({k: (tuple(v.shape), v.dtype) for k, v in whole.items()})
        name = "blocks.1.attn.c_attn.weight"
        assert torch.equal(src.read(name, (slice(5, 40), slice(3, 9))), whole[name][5:40, 3:9])
        assert torch.equal(src.read("lm_head.weight", (slice(60, 64),)),
                           whole["lm_head.weight"][60:64])


def test_model_entries_of_a_meta_model():
    """The expected names, shapes, dtypes and ties come from a meta model, nothing read."""
    from autopar.runtime.weights import model_entries

    with torch.device("meta"):
        model = _llama()
    expected, tied = model_entries(model)
    assert expected["model.layers.0.mlp.down_proj.weight"] == ((16, 32), torch.float32)
    assert "model.rotary_emb.inv_freq" not in expected  # not persistent: not stored
    assert [sorted(g) for g in tied] == [sorted(TIED[0])]
