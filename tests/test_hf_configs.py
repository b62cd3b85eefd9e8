"""transformers models planned from a config directory: built on meta, two blocks traced."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest
import torch
import transformers

import autopar
from autopar.cli import main
from autopar.cost.memory import saved_activations
from autopar.graph.analysis import OpKind
from autopar.report.predicted import plan_text

# small configs of each family (4 blocks, so two are traced and two counted)
SMALL = {
    "llama": dict(architectures=["LlamaForCausalLM"], hidden_size=64, intermediate_size=128,
                  num_hidden_layers=4, num_attention_heads=8, num_key_value_heads=4,
                  vocab_size=256, max_position_embeddings=64),
    "mistral": dict(architectures=["MistralForCausalLM"], hidden_size=64, intermediate_size=128,
                    num_hidden_layers=4, num_attention_heads=8, num_key_value_heads=4,
                    vocab_size=256, max_position_embeddings=64, sliding_window=16),
    "qwen2": dict(architectures=["Qwen2ForCausalLM"], hidden_size=64, intermediate_size=128,
                  num_hidden_layers=4, num_attention_heads=8, num_key_value_heads=4,
                  vocab_size=256, max_position_embeddings=64),
    "gpt2": dict(architectures=["GPT2LMHeadModel"], n_embd=64, n_layer=4, n_head=8,
                 vocab_size=256, n_positions=64, bos_token_id=0, eos_token_id=0),
    "bert": dict(architectures=["BertForMaskedLM"], hidden_size=64, num_hidden_layers=4,
                 num_attention_heads=8, intermediate_size=128, vocab_size=256,
                 max_position_embeddings=64),
}

# Llama-3-8B as released (Meta's config: 32 layers of width 4096, 8 kv heads, 128256 tokens)
LLAMA3_8B = Path(__file__).resolve().parent.parent / "examples" / "llama3-8b"
LLAMA3_8B_SHAPE = dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                       num_attention_heads=32, num_key_value_heads=8, vocab_size=128256,
                       max_position_embeddings=8192, rope_theta=500000.0,
                       tie_word_embeddings=False)


def _write(tmp_path, model_type: str, values: dict):
    folder = tmp_path / model_type
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps({"model_type": model_type, **values}))
    return folder


def _parameters(folder) -> int:
    """Parameters of the whole model as transformers builds it (tied weights once)."""
    config = transformers.AutoConfig.from_pretrained(folder)
    with torch.device("meta"):
        model = getattr(transformers, config.architectures[0])(config)
    return sum(p.numel() for p in model.parameters())


@pytest.mark.parametrize("model_type", sorted(SMALL))
def test_explain_a_config_directory(tmp_path, capsys, model_type):
    folder = _write(tmp_path, model_type, SMALL[model_type])
    where = folder / "config.json" if model_type == "gpt2" else folder  # the file works too
    assert main(["explain", str(where), "--world", "8", "--batch", "8", "--seq", "32",
                 "--tp", "2", "--format", "json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["model"] == {"parameters": _parameters(folder), "tokens_per_sample": 32}
    blocks = [lp["name"] for lp in data["layers"] if lp["name"].rsplit(".", 1)[-1].isdigit()]
    assert len(blocks) == 4 and blocks[-1].endswith(".3")
    # the aranges and masks built from positions are replicated as they are, without a note
    assert data["notes"] == []
    assert not any("no catalog entry" in op for kind in data["layer_kinds"]
                   for op in kind["replicated_ops"])


def test_llama3_8b_config_counts_its_parameters(capsys):
    """The shipped Llama-3-8B config plans at 64 GPUs, sequence 8192, and counts 8.03e9
    parameters (untied 128256-token embedding and head)."""
    shipped = json.loads((LLAMA3_8B / "config.json").read_text())
    assert {k: shipped[k] for k in LLAMA3_8B_SHAPE} == LLAMA3_8B_SHAPE
    start = time.perf_counter()
    assert main(["explain", str(LLAMA3_8B), "--world", "64", "--batch", "512", "--seq", "8192",
                 "--format", "json"]) == 0
    elapsed = time.perf_counter() - start
    data = json.loads(capsys.readouterr().out)
    assert data["model"]["parameters"] == 8_030_261_248
    assert len([lp for lp in data["layers"] if ".layers." in lp["name"]]) == 32
    print(f"Llama-3-8B config planned in {elapsed:.1f} s")


def test_plan_takes_a_config_path(tmp_path):
    folder = _write(tmp_path, "llama", SMALL["llama"])
    plan = autopar.plan(folder, None, 8, global_batch=16, seq=16, constraints={"tp": 2})
    assert plan.mesh["tp"] == 2 and plan.predicted["step_time_s"] > 0
    assert plan.search["global_batch"] == 16
    assert f"model       {_parameters(folder):.3e} parameters, 16 tokens per sample" in \
        plan_text(plan.detail)
    with pytest.raises(autopar.PlanError, match="example_inputs=None"):
        autopar.plan(folder, (torch.zeros(2, 16, dtype=torch.long),), 8)


@pytest.mark.parametrize("make, message", [
    (lambda p: p, "has no config.json"),
    (lambda p: _write(p, "llama", {**SMALL["llama"], "max_position_embeddings": 16}),
     "seq=32 is out of range"),
])
def test_bad_config_paths_exit_2_with_one_sentence(tmp_path, capsys, make, message):
    assert main(["explain", str(make(tmp_path)), "--seq", "32"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("autopar: ") and message in err


def test_a_meta_transformers_model_is_planned_with_its_memory(tmp_path):
    """transformers bakes the input's device (meta) into its aranges; the memory analysis
    runs the graph on CPU fake tensors all the same."""
    config = transformers.LlamaConfig(**{k: v for k, v in SMALL["llama"].items()
                                         if k != "architectures"})
    with torch.device("meta"):
        model = transformers.LlamaForCausalLM(config)
    ids = torch.zeros(2, 16, dtype=torch.long, device="meta")
    traced = autopar.trace(model, (ids,), loss_fn=lambda out, t: torch.nn.functional.cross_entropy(
        out.logits.flatten(0, 1), t.flatten()), example_target=ids)
    assert any(n.target is torch.ops.aten.arange.default and n.kwargs["device"].type == "meta"
               for n in traced.graph.nodes)
    saved = saved_activations(traced)
    assert any(s.layer == "model.layers.0" for s in saved)
    infos = [n.meta["autopar"] for n in traced.graph.nodes]
    sized = [i for i in infos if i.from_sizes and i.kind is OpKind.OTHER]
    # position ids, the mask built from them, RoPE's angles
    assert sized and {i.layer for i in sized} == {"model", "model.rotary_emb"}
    # nothing that reads the token ids or a weight counts as made from sizes
    assert not any(i.from_sizes for i in infos if i.kind in (OpKind.EMBEDDING, OpKind.LINEAR,
                                                             OpKind.ATTENTION, OpKind.LOSS))


def test_a_config_names_only_model_classes(tmp_path):
    """`architectures` picks a model class; any other public name of transformers is ignored
    (the config's task default is used), so a crafted config cannot make autopar call it."""
    from autopar.models.hf import load_config, model_class

    path = tmp_path / "config.json"
    path.write_text(json.dumps({"model_type": "llama", "architectures": ["pipeline", 7],
                                "hidden_size": 32, "num_hidden_layers": 2,
                                "num_attention_heads": 4, "intermediate_size": 64,
                                "vocab_size": 64}))
    assert model_class(load_config(str(path))) is transformers.LlamaForCausalLM


def test_a_config_that_is_not_an_object_is_refused(tmp_path):
    from autopar.models.hf import load_config

    path = tmp_path / "config.json"
    path.write_text("[1, 2]")
    with pytest.raises(ValueError, match="not an object"):
        load_config(str(path))
