"""Export to safetensors (`autopar.runtime.export`): transformers' layout (shards named
model-0000k-of-0000N, the index, config.json and generation_config.json) that
`from_pretrained` loads back exactly, shards within max_shard_bytes, a tied weight written
once, and an interrupted export that leaves the previous one intact."""

import json
import os

import pytest
import torch
from safetensors import safe_open

from autopar.errors import WeightsError
from autopar.runtime.export import SafetensorsWriter, export_safetensors
from autopar.runtime.weights import INDEX, open_weights

transformers = pytest.importorskip("transformers")


def _llama(seed: int = 0, tie: bool = True):
    cfg = transformers.LlamaConfig(vocab_size=64, hidden_size=16, intermediate_size=32,
                                   num_hidden_layers=2, num_attention_heads=4,
                                   num_key_value_heads=2, max_position_embeddings=32,
                                   tie_word_embeddings=tie)
    torch.manual_seed(seed)
    return transformers.LlamaForCausalLM(cfg)


def _by_layer(model):
    """(name, tensor) pairs one module at a time, as a rank gathers them."""
    for prefix, module in model.named_modules():
        for name, t in list(module.named_parameters(recurse=False)) + \
                list(module.named_buffers(recurse=False)):
            key = f"{prefix}.{name}" if prefix else name
            if key in model.state_dict():
                yield key, t.detach().clone()


def _files(d):
    return {f: open(os.path.join(d, f), "rb").read() for f in sorted(os.listdir(d))}


@pytest.mark.parametrize("tie", [True, False])
def test_round_trip_through_from_pretrained(tmp_path, tie):
    model = _llama(tie=tie)
    out = export_safetensors(tmp_path / "out", _by_layer(model), model=model)
    names = sorted(os.listdir(out))
    assert names == ["config.json", "generation_config.json", "model-00001-of-00001.safetensors",
                     INDEX]
    index = json.load(open(os.path.join(out, INDEX)))
    assert ("lm_head.weight" in index["weight_map"]) is not tie  # as save_pretrained
    loaded = transformers.AutoModelForCausalLM.from_pretrained(out)
    assert (loaded.lm_head.weight is loaded.model.embed_tokens.weight) is tie
    want, got = model.state_dict(), loaded.state_dict()
    assert sorted(want) == sorted(got)
    assert all(torch.equal(want[k], got[k]) for k in want)


def test_shards_stay_within_max_bytes(tmp_path):
    model = _llama()
    limit = 3000
    out = export_safetensors(tmp_path / "out", _by_layer(model), max_shard_bytes=limit,
                             model=model)
    index = json.load(open(os.path.join(out, INDEX)))
    shards = sorted(set(index["weight_map"].values()))
    n = len(shards)
    assert n > 2 and shards == [f"model-{i:05d}-of-{n:05d}.safetensors" for i in range(1, n + 1)]
    total = 0
    for shard in shards:
        with safe_open(os.path.join(out, shard), "pt") as f:
            assert f.metadata() == {"format": "pt"}
            sizes = [f.get_tensor(k).numel() * f.get_tensor(k).element_size() for k in f.keys()]
        assert sum(sizes) <= limit or len(sizes) == 1  # one tensor larger than a shard
        total += sum(sizes)
    assert index["metadata"]["total_size"] == total
    loaded = transformers.AutoModelForCausalLM.from_pretrained(out)
    assert all(torch.equal(v, loaded.state_dict()[k]) for k, v in model.state_dict().items())


def test_an_interrupted_export_leaves_the_previous_one(tmp_path):
    first = _llama(seed=0)
    out = export_safetensors(tmp_path / "out", _by_layer(first), max_shard_bytes=3000,
                             model=first)
    before = _files(out)

    def failing():
        for i, pair in enumerate(_by_layer(_llama(seed=1))):
            if i == 5:
                raise RuntimeError("a rank died")
            yield pair

    with pytest.raises(RuntimeError, match="a rank died"):
        export_safetensors(out, failing(), max_shard_bytes=3000, model=first)
    assert _files(out) == before
    assert sorted(os.listdir(tmp_path)) == ["out"]  # the partial export is gone
    # a later export replaces it whole
    second = _llama(seed=1)
    export_safetensors(out, _by_layer(second), model=second)
    assert sorted(os.listdir(tmp_path)) == ["out"]
    assert "model-00001-of-00001.safetensors" in os.listdir(out)
    loaded = transformers.AutoModelForCausalLM.from_pretrained(out)
    assert all(torch.equal(v, loaded.state_dict()[k]) for k, v in second.state_dict().items())


def test_tied_groups_and_plain_models(tmp_path):
    """A model without a transformers config: names as given, a tied group written once,
    read back by open_weights with the same groups."""
    w = torch.randn(8, 4)
    pairs = [("wte.weight", w), ("blocks.0.fc.weight", torch.randn(4, 4)),
             ("lm_head.weight", w)]
    tied = [["wte.weight", "lm_head.weight"]]
    out = export_safetensors(tmp_path / "out", iter(pairs), tied=tied)
    assert sorted(os.listdir(out)) == ["model-00001-of-00001.safetensors", INDEX]
    with open_weights(out, tied=tied) as src:
        assert sorted(src.keys()) == ["blocks.0.fc.weight", "wte.weight"]
        assert torch.equal(src.read("lm_head.weight"), w)


def test_a_name_twice_is_refused(tmp_path):
    writer = SafetensorsWriter(tmp_path / "out")
    writer.add("a", torch.ones(2))
    with pytest.raises(WeightsError, match="a was exported twice"):
        writer.add("a", torch.ones(2))
    writer.abort()
    assert not os.path.exists(tmp_path / "out")
