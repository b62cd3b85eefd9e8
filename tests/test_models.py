"""Tests for autopar.models: zoo configurations, builds, training, tracing and specs."""

import dataclasses
import functools
import re

import pytest
import torch
import torch.nn.functional as F
from torch.export import Dim

from autopar.models import (
    GPT,
    MEGATRON_TABLE1,
    ZOO_NAMES,
    Bert,
    BertConfig,
    GPTConfig,
    Llama,
    LlamaConfig,
    ViT,
    ViTConfig,
    build,
    format_spec,
    get_config,
    parse_spec,
)

TINY = ["gpt-tiny", "llama-tiny", "bert-tiny", "vit-tiny", "mlp-tiny"]
SEQUENCE_FAMILIES = (GPTConfig, LlamaConfig, BertConfig)


@pytest.fixture(scope="module", autouse=True)
def one_intra_op_thread():
    """Run this module on one thread: the tiny models gain nothing from more, and on a
    busy machine spinning worker threads made the module several times slower."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@functools.cache
def meta_build(name: str) -> tuple[torch.nn.Module, tuple[torch.Tensor, ...]]:
    """One meta build per zoo name for the whole module: the big ones take a while to build."""
    return build(name)


def n_params(model: torch.nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())  # parameters() counts a tied weight once


def expected_output_shape(cfg, batch: int, seq: int) -> tuple[int, ...]:
    if isinstance(cfg, SEQUENCE_FAMILIES):
        return (batch, seq, cfg.vocab_size)
    if isinstance(cfg, ViTConfig):
        return (batch, cfg.num_classes)
    return (batch, cfg.out_features)


def loss_of(model: torch.nn.Module, inputs: tuple[torch.Tensor, ...]) -> torch.Tensor:
    """Cross-entropy against fixed targets (class = position mod classes), the same every call."""
    logits = model(*inputs)
    n_classes = logits.size(-1)
    targets = torch.arange(logits.numel() // n_classes) % n_classes
    return F.cross_entropy(logits.reshape(-1, n_classes), targets)


def test_zoo_names_cover_the_published_and_test_configurations():
    required = {
        "gpt3-175b",
        "megatron-1.7b",
        "megatron-3.6b",
        "megatron-7.5b",
        "megatron-18.4b",
        "megatron-39.1b",
        "megatron-76.1b",
        "megatron-145.6b",
        "megatron-310.1b",
        "megatron-529.6b",
        "megatron-1t",
        "llama2-7b",
        "llama2-13b",
        "llama2-70b",
        "llama3-8b",
        "llama3-70b",
        "bert-large",
        "vit-large",
        "vit-huge",
        "llama3.1-8b",
        "llama3.1-70b",
        "llama3.1-405b",
        "llama3.2-1b",
        "llama3.2-3b",
        "qwen3-8b",
        "qwen3-32b",
        "mixtral-8x7b",
        "deepseek-v3-moe",
        "deepseek-v3",
        "moe-tiny",
        *TINY,
    }
    assert ZOO_NAMES == sorted(ZOO_NAMES)
    assert set(ZOO_NAMES) == required


@pytest.mark.parametrize("name", ZOO_NAMES)
def test_zoo_entry_builds_on_meta(name):
    model, inputs = meta_build(name)
    assert all(t.is_meta for t in [*model.parameters(), *model.buffers(), *inputs])
    # Layers are grouped by module path, so each must sit at blocks.<i>.
    assert [n for n, _ in model.named_modules() if re.fullmatch(r"blocks\.\d+", n)] == [
        f"blocks.{i}" for i in range(get_config(name).n_layer)
    ]


# The largest of each family: the Megatron sizes are the same GPT class as gpt3-175b,
# and a meta forward costs about a millisecond per op, so they are left out here.
@pytest.mark.parametrize("name", ["gpt3-175b", "llama2-70b", "bert-large", "vit-huge", *TINY])
def test_meta_forward_gives_the_output_shape(name):
    model, inputs = meta_build(name)
    cfg = get_config(name)
    out = model(*inputs)
    seq = inputs[0].size(1) if isinstance(cfg, SEQUENCE_FAMILIES) else 0
    assert out.is_meta and tuple(out.shape) == expected_output_shape(cfg, 2, seq)


def test_gpt3_175b_parameter_count_matches_the_closed_form():
    cfg = get_config("gpt3-175b")
    model, _ = meta_build("gpt3-175b")
    L, h, V, S = cfg.n_layer, cfg.n_embd, cfg.vocab_size, cfg.block_size
    # Per block 12h^2 + 13h (weights and biases); embeddings (V + S)h; final norm 2h; head tied.
    assert n_params(model) == 12 * L * h**2 + 13 * L * h + (V + S) * h + 2 * h
    assert round(n_params(model) / 1e8) == 1746  # 174.6e9, the figure Narayanan et al. quote


@pytest.mark.parametrize("name", ["llama2-7b", "llama2-13b", "llama2-70b"])
def test_llama2_parameter_counts_match_the_closed_form(name):
    c = get_config(name)
    model, _ = meta_build(name)
    kv_width = c.n_kv_head * (c.dim // c.n_head)
    per_block = 2 * c.dim * c.dim + 2 * c.dim * kv_width + 3 * c.dim * c.ffn_hidden + 2 * c.dim
    assert n_params(model) == 2 * c.vocab_size * c.dim + c.n_layer * per_block + c.dim
    if name == "llama2-7b":
        assert round(n_params(model) / 1e7) == 674


@pytest.mark.parametrize("run", MEGATRON_TABLE1, ids=lambda run: run.name)
def test_megatron_configs_agree_with_table1(run):
    cfg = get_config(run.name)
    assert (cfg.n_head, cfg.n_embd, cfg.n_layer) == (run.heads, run.hidden, run.layers)
    assert (cfg.vocab_size, cfg.block_size) == (51200, 2048)
    model, _ = meta_build(run.name)
    assert round(n_params(model) / 1e9, 1) == run.params_billion
    # The published run must be a valid layout of this model on an A100 cluster.
    data_parallel = run.gpus // (run.tp * run.pp)
    assert data_parallel * run.tp * run.pp == run.gpus
    assert run.batch % data_parallel == 0
    assert run.heads % run.tp == 0 and run.layers % run.pp == 0
    assert round(100 * run.tflops_per_gpu / 312) == run.percent_of_peak


@pytest.fixture(scope="module")
def transformers():
    import transformers

    transformers.logging.set_verbosity_error()
    return transformers


def reference_model(transformers, cfg):
    """The transformers model with the same architecture as ``cfg``."""
    t = transformers
    if isinstance(cfg, GPTConfig):
        return t.GPT2LMHeadModel(
            t.GPT2Config(
                vocab_size=cfg.vocab_size,
                n_positions=cfg.block_size,
                n_embd=cfg.n_embd,
                n_layer=cfg.n_layer,
                n_head=cfg.n_head,
                activation_function="gelu",
                resid_pdrop=0.0,
                embd_pdrop=0.0,
                attn_pdrop=0.0,
            )
        )
    if isinstance(cfg, LlamaConfig):
        return t.LlamaForCausalLM(
            t.LlamaConfig(
                vocab_size=cfg.vocab_size,
                hidden_size=cfg.dim,
                intermediate_size=cfg.ffn_hidden,
                num_hidden_layers=cfg.n_layer,
                num_attention_heads=cfg.n_head,
                num_key_value_heads=cfg.n_kv_head,
                max_position_embeddings=cfg.max_seq,
                rms_norm_eps=cfg.norm_eps,
                rope_theta=cfg.rope_theta,
                tie_word_embeddings=False,
            )
        )
    if isinstance(cfg, BertConfig):
        return t.BertForMaskedLM(
            t.BertConfig(
                vocab_size=cfg.vocab_size,
                hidden_size=cfg.hidden,
                num_hidden_layers=cfg.n_layer,
                num_attention_heads=cfg.n_head,
                intermediate_size=cfg.intermediate,
                max_position_embeddings=cfg.max_position,
                hidden_dropout_prob=0.0,
                attention_probs_dropout_prob=0.0,
            )
        )
    return t.ViTForImageClassification(
        t.ViTConfig(
            image_size=cfg.image_size,
            patch_size=cfg.patch_size,
            num_channels=cfg.channels,
            hidden_size=cfg.hidden,
            num_hidden_layers=cfg.n_layer,
            num_attention_heads=cfg.n_head,
            intermediate_size=cfg.mlp_dim,
            num_labels=cfg.num_classes,
            layer_norm_eps=1e-6,
        )
    )


@pytest.mark.parametrize("name", ["llama2-70b", "bert-large", "vit-large", "vit-huge"])
def test_parameter_counts_match_transformers(transformers, name):
    with torch.device("meta"):
        reference = reference_model(transformers, get_config(name))
    assert n_params(meta_build(name)[0]) == n_params(reference)


# Our parameter names -> the transformers names: per model one table per naming scheme
# (ViT's were renamed in transformers 5), first matching pattern wins. A tuple replacement
# splits a fused q/k/v weight into the three linears transformers keeps.
REFERENCE_NAMES = {
    GPT: [
        [
            (r"^(wte|wpe|ln_f)\.", r"transformer.\1."),
            (r"^blocks\.", "transformer.h."),
        ]
    ],
    Llama: [
        [
            (r"^tok_embeddings\.", "model.embed_tokens."),
            (r"^norm\.", "model.norm."),
            (r"^output\.", "lm_head."),
            (r"^blocks\.(\d+)\.attention\.w([qkvo])\.", r"model.layers.\1.self_attn.\2_proj."),
            (r"^blocks\.(\d+)\.attention_norm\.", r"model.layers.\1.input_layernorm."),
            (r"^blocks\.(\d+)\.ffn_norm\.", r"model.layers.\1.post_attention_layernorm."),
            (r"^blocks\.(\d+)\.feed_forward\.w1\.", r"model.layers.\1.mlp.gate_proj."),
            (r"^blocks\.(\d+)\.feed_forward\.w3\.", r"model.layers.\1.mlp.up_proj."),
            (r"^blocks\.(\d+)\.feed_forward\.w2\.", r"model.layers.\1.mlp.down_proj."),
        ]
    ],
    Bert: [
        [
            (r"^(word|position|token_type)_embeddings\.", r"bert.embeddings.\1_embeddings."),
            (r"^embedding_norm\.", "bert.embeddings.LayerNorm."),
            (
                r"^blocks\.(\d+)\.attention\.(query|key|value)\.",
                r"bert.encoder.layer.\1.attention.self.\2.",
            ),
            (
                r"^blocks\.(\d+)\.attention\.output\.",
                r"bert.encoder.layer.\1.attention.output.dense.",
            ),
            (
                r"^blocks\.(\d+)\.attention_norm\.",
                r"bert.encoder.layer.\1.attention.output.LayerNorm.",
            ),
            (r"^blocks\.(\d+)\.intermediate\.", r"bert.encoder.layer.\1.intermediate.dense."),
            (r"^blocks\.(\d+)\.output_norm\.", r"bert.encoder.layer.\1.output.LayerNorm."),
            (r"^blocks\.(\d+)\.output\.", r"bert.encoder.layer.\1.output.dense."),
            (r"^mlm_dense\.", "cls.predictions.transform.dense."),
            (r"^mlm_norm\.", "cls.predictions.transform.LayerNorm."),
            (r"^mlm_decoder\.bias", "cls.predictions.bias"),
            (r"^mlm_decoder\.", "cls.predictions.decoder."),
        ]
    ],
    ViT: [
        [  # transformers 5
            (r"^cls_token", "vit.embeddings.cls_token"),
            (r"^pos_embed", "vit.embeddings.position_embeddings"),
            (r"^patch_embed\.", "vit.embeddings.patch_embeddings.projection."),
            (r"^blocks\.(\d+)\.norm1\.", r"vit.layers.\1.layernorm_before."),
            (r"^blocks\.(\d+)\.norm2\.", r"vit.layers.\1.layernorm_after."),
            (
                r"^blocks\.(\d+)\.attn\.qkv\.",
                tuple(rf"vit.layers.\1.attention.{p}_proj." for p in "qkv"),
            ),
            (r"^blocks\.(\d+)\.attn\.proj\.", r"vit.layers.\1.attention.o_proj."),
            (r"^blocks\.(\d+)\.mlp\.", r"vit.layers.\1.mlp."),
            (r"^norm\.", "vit.layernorm."),
            (r"^head\.", "classifier."),
        ],
        [  # transformers 4
            (r"^cls_token", "vit.embeddings.cls_token"),
            (r"^pos_embed", "vit.embeddings.position_embeddings"),
            (r"^patch_embed\.", "vit.embeddings.patch_embeddings.projection."),
            (r"^blocks\.(\d+)\.norm1\.", r"vit.encoder.layer.\1.layernorm_before."),
            (r"^blocks\.(\d+)\.norm2\.", r"vit.encoder.layer.\1.layernorm_after."),
            (
                r"^blocks\.(\d+)\.attn\.qkv\.",
                tuple(
                    rf"vit.encoder.layer.\1.attention.attention.{p}."
                    for p in ("query", "key", "value")
                ),
            ),
            (r"^blocks\.(\d+)\.attn\.proj\.", r"vit.encoder.layer.\1.attention.output.dense."),
            (r"^blocks\.(\d+)\.mlp\.fc1\.", r"vit.encoder.layer.\1.intermediate.dense."),
            (r"^blocks\.(\d+)\.mlp\.fc2\.", r"vit.encoder.layer.\1.output.dense."),
            (r"^norm\.", "vit.layernorm."),
            (r"^head\.", "classifier."),
        ],
    ],
}


def renamed_state(model: torch.nn.Module, table) -> dict[str, torch.Tensor]:
    state = {}
    for name, value in model.state_dict().items():
        for pattern, replacement in table:
            if not re.match(pattern, name):
                continue
            if isinstance(replacement, tuple):
                for part_name, part in zip(replacement, value.chunk(3, dim=0), strict=True):
                    state[re.sub(pattern, part_name, name)] = part
            else:
                state[re.sub(pattern, replacement, name)] = value
            break
        else:
            state[name] = value
    return state


def reference_state(model: torch.nn.Module, reference_keys) -> dict[str, torch.Tensor]:
    """Our weights under the names and layouts of the installed transformers."""
    for table in REFERENCE_NAMES[type(model)]:
        state = renamed_state(model, table)
        if state.keys() <= set(reference_keys):
            break
    else:
        raise AssertionError(f"no naming table for {type(model).__name__} fits transformers")
    if type(model) is GPT:
        # GPT-2's Conv1D stores its weight as [in, out], the transpose of nn.Linear's.
        for name in state:
            if re.search(r"\.(c_attn|c_proj|c_fc)\.weight$", name):
                state[name] = state[name].t()
    return state


@pytest.mark.parametrize("name", ["gpt-tiny", "llama-tiny", "bert-tiny", "vit-tiny"])
def test_tiny_model_computes_what_transformers_computes(transformers, name):
    model, inputs = build(name, device="cpu", seed=0)
    reference = reference_model(transformers, model.config).eval()
    state = reference_state(model, reference.state_dict().keys())
    result = reference.load_state_dict(state, strict=False)
    assert result.unexpected_keys == []
    # What was not loaded must be a tied alias of something that was.
    reference_tensors = reference.state_dict()
    loaded = {reference_tensors[k].data_ptr() for k in state}
    assert all(reference_tensors[k].data_ptr() in loaded for k in result.missing_keys)
    out = reference(*inputs).logits
    torch.testing.assert_close(model(*inputs), out, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("name", TINY)
def test_tiny_model_trains_on_cpu(name):
    model, inputs = build(name, device="cpu", seed=0)
    model.train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    losses = []
    for _ in range(5):
        optimizer.zero_grad()
        loss = loss_of(model, inputs)
        loss.backward()
        if not losses:
            for pname, p in model.named_parameters():
                assert p.grad is not None and p.grad.abs().sum() > 0, f"{pname} got no gradient"
        optimizer.step()
        losses.append(loss.item())
    assert all(torch.isfinite(torch.tensor(losses)))
    assert losses[-1] < losses[0]


@pytest.mark.parametrize("name", TINY)
def test_same_seed_gives_same_weights_and_outputs(name):
    rng_before = torch.random.get_rng_state()
    model_a, inputs_a = build(name, device="cpu", seed=3)
    model_b, inputs_b = build(name, device="cpu", seed=3)
    model_c, _ = build(name, device="cpu", seed=4)
    assert torch.equal(torch.random.get_rng_state(), rng_before), "build disturbed the global RNG"
    state_a, state_b, state_c = model_a.state_dict(), model_b.state_dict(), model_c.state_dict()
    assert all(torch.equal(state_a[k], state_b[k]) for k in state_a)
    assert not all(torch.equal(state_a[k], state_c[k]) for k in state_a)
    assert torch.equal(model_a(*inputs_a), model_b(*inputs_b))


@pytest.mark.parametrize("name", TINY)
def test_meta_model_materializes_with_init_weights(name):
    meta_model, _ = build(name)
    meta_model.to_empty(device="cpu")
    cpu_model, inputs = build(name, device="cpu", seed=0)
    for model in (meta_model, cpu_model):
        torch.manual_seed(11)
        model.init_weights()
    meta_state, cpu_state = meta_model.state_dict(), cpu_model.state_dict()
    assert all(torch.equal(meta_state[k], cpu_state[k]) for k in cpu_state)
    # Buffers (Llama's rotary tables) are not in the state dict; compare them directly.
    for (key, meta_buf), (_, cpu_buf) in zip(
        meta_model.named_buffers(), cpu_model.named_buffers(), strict=True
    ):
        assert torch.equal(meta_buf, cpu_buf), key
    assert n_params(meta_model) == n_params(cpu_model), "materializing untied a shared weight"
    torch.testing.assert_close(meta_model(*inputs), cpu_model(*inputs), rtol=0, atol=0)


def test_build_honours_dtype_and_keeps_tied_weights():
    model, (idx,) = build("gpt-tiny", device="cpu", dtype=torch.bfloat16, seed=0)
    assert all(p.dtype == torch.bfloat16 for p in model.parameters())
    assert model.lm_head.weight is model.wte.weight
    assert idx.dtype == torch.long and model(idx).dtype == torch.bfloat16
    _, (images,) = build("vit-tiny", device="cpu", dtype=torch.bfloat16, seed=0)
    assert images.dtype == torch.bfloat16


@pytest.mark.parametrize("name", TINY)
def test_export_has_a_dynamic_batch_and_runs_at_another_batch(name):
    model, inputs = build(name, device="cpu", seed=0, batch=2)
    exported = torch.export.export(model, inputs, dynamic_shapes=({0: Dim("batch")},), strict=False)
    user_input = exported.graph_signature.user_inputs[0]
    placeholder = next(
        n for n in exported.graph.nodes if n.op == "placeholder" and n.name == user_input
    )
    assert isinstance(placeholder.meta["val"].shape[0], torch.SymInt)
    _, other_inputs = build(name, device="cpu", seed=1, batch=3)
    out = exported.module()(*other_inputs)
    assert out.size(0) == 3
    torch.testing.assert_close(out, model(*other_inputs))


@pytest.mark.parametrize("name", TINY)
def test_fx_symbolic_trace_matches_eager(name):
    model, inputs = build(name, device="cpu", seed=0)
    traced = torch.fx.symbolic_trace(model)
    assert any(n.op == "call_module" and n.target.startswith("blocks.") for n in traced.graph.nodes)
    torch.testing.assert_close(traced(*inputs), model(*inputs), rtol=0, atol=0)


@pytest.mark.parametrize("name", ZOO_NAMES)
def test_spec_round_trips(name):
    cfg = get_config(name)
    back = parse_spec(format_spec(cfg))
    # a spec carries the shape; Llama 3's RoPE base and frequency scaling, norm epsilons and
    # an MoE router's score (not shapes) come back at their defaults
    unshaped = {f: getattr(back, f) for f in ("rope_theta", "rope_scaling", "norm_eps", "score")
                if hasattr(cfg, f)}
    assert back == dataclasses.replace(cfg, **unshaped)


@pytest.mark.parametrize(
    "spec, name",
    [
        ("gpt:layers=48,hidden=8192,heads=64,vocab=51200", "megatron-39.1b"),
        ("llama:layers=32,hidden=4096,heads=32", "llama2-7b"),
        ("llama:layers=80,hidden=8192,heads=64,kv_heads=8,ffn=28672", "llama2-70b"),
        ("bert:layers=24,hidden=1024,heads=16", "bert-large"),
        ("vit:layers=32,hidden=1280,heads=16,patch=14", "vit-huge"),
        ("mlp:in=32,hidden=64,out=16,layers=3", "mlp-tiny"),
        (" gpt : layers=2, hidden=64, heads=8, vocab=256, seq=32 ", "gpt-tiny"),
    ],
)
def test_spec_defaults_are_the_published_ones(spec, name):
    assert parse_spec(spec) == get_config(name)


def test_build_accepts_a_spec_or_a_config():
    spec = "llama:layers=3,hidden=32,heads=4,kv_heads=2,ffn=96,vocab=64,seq=16"
    model, (idx,) = build(spec, batch=5)
    assert isinstance(model, Llama) and len(model.blocks) == 3 and tuple(idx.shape) == (5, 16)
    assert build(parse_spec(spec))[0].config == model.config


@pytest.mark.parametrize(
    "spec, message",
    [
        ("gtp:layers=2,hidden=64,heads=8", r"family 'gtp'.*bert, gpt, llama, mlp, moe, vit"),
        (
            "gpt:layers=2,hidden=64,heads=8,depth=3",
            r"key 'depth'.*layers, hidden, heads, vocab, seq",
        ),
        ("gpt:layers=two,hidden=64,heads=8", r"'two' of key 'layers'.*positive integer"),
        ("gpt:layers=0,hidden=64,heads=8", r"'0' of key 'layers'.*positive integer"),
        ("gpt:layers=2,hidden=64,heads", r"item 'heads'.*key=value.*layers, hidden"),
        ("gpt:layers=2,hidden=64,heads=8,", r"item ''.*key=value"),
        ("gpt:layers=2,layers=3,hidden=64,heads=8", r"'layers' is given twice"),
        ("gpt:layers=2,hidden=64", r"lacks required key\(s\) heads"),
        ("gpt:layers=2,hidden=60,heads=8", r"n_embd=60 must be divisible by n_head=8"),
        (
            "llama:layers=2,hidden=64,heads=8,kv_heads=3",
            r"n_head=8 must be a multiple of n_kv_head=3",
        ),
        ("vit:layers=2,hidden=64,heads=8,image=30,patch=8", r"image_size=30.*patch_size=8"),
        ("gpt", r"no ':'.*family:key=value"),
    ],
)
def test_bad_spec_is_rejected_with_a_clear_message(spec, message):
    with pytest.raises(ValueError, match=message):
        parse_spec(spec)


def test_unknown_name_suggests_the_closest_zoo_names():
    with pytest.raises(ValueError, match=r"closest: gpt3-175b.*zoo names: .*vit-huge") as info:
        build("gpt3-175")
    assert all(name in str(info.value) for name in ZOO_NAMES)
    with pytest.raises(ValueError, match=r"closest: llama2-70b"):
        get_config("llama-2-70b")


def test_build_checks_batch_and_sequence_length():
    _, (idx,) = build("llama-tiny", batch=4, seq=8)
    assert tuple(idx.shape) == (4, 8)
    with pytest.raises(ValueError, match=r"seq=33 is longer than gpt-tiny takes \(32 at most\); give seq <= 32\.$"):
        build("gpt-tiny", seq=33)
    with pytest.raises(ValueError, match=r"seq=8 given, but vit models take no sequence length"):
        build("vit-tiny", seq=8)
    with pytest.raises(ValueError, match=r"batch=0 must be at least 1"):
        build("mlp-tiny", batch=0)
