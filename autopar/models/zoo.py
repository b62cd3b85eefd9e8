"""The model zoo: published configurations, a spec language, and ``build``.

A model is named either by a zoo name (``"llama2-70b"``, ``"gpt-tiny"``) or by a
spec such as ``"gpt:layers=48,hidden=8192,heads=64,vocab=51200"``. ``build``
turns either into a model and example inputs, on the meta device by default so
that planning for a trillion-parameter model allocates nothing.
"""

import dataclasses
import difflib
import re
from dataclasses import dataclass

import torch
from torch import nn

from autopar.kernels.routing import SIGMOID
from autopar.models.bert import Bert, BertConfig
from autopar.models.gpt import GPT, GPTConfig
from autopar.models.llama import Llama, LlamaConfig, RopeScaling
from autopar.models.mlp import MLP, MLPConfig
from autopar.models.moe import MoEConfig, MoETransformer
from autopar.models.vit import ViT, ViTConfig

ModelConfig = GPTConfig | LlamaConfig | BertConfig | ViTConfig | MLPConfig | MoEConfig


@dataclass(frozen=True)
class MegatronRun:
    """One row of Table 1 of Narayanan et al. 2021: a GPT size and how it was run.

    All runs used A100 GPUs (312 TFLOP/s peak in 16-bit), sequence length 2048 and
    vocabulary 51200; ``batch`` is the global batch in sequences.
    """

    name: str  # the zoo name of the matching configuration
    params_billion: float
    heads: int
    hidden: int
    layers: int
    tp: int
    pp: int
    gpus: int
    batch: int
    tflops_per_gpu: float
    percent_of_peak: float


# Narayanan et al., "Efficient Large-Scale Language Model Training on GPU Clusters
# Using Megatron-LM", SC 2021 (arXiv 2104.04473), Table 1: weak scaling of PTD-P.
MEGATRON_TABLE1: tuple[MegatronRun, ...] = (
    MegatronRun("megatron-1.7b", 1.7, 24, 2304, 24, 1, 1, 32, 512, 137, 44),
    MegatronRun("megatron-3.6b", 3.6, 32, 3072, 30, 2, 1, 64, 512, 138, 44),
    MegatronRun("megatron-7.5b", 7.5, 32, 4096, 36, 4, 1, 128, 512, 142, 46),
    MegatronRun("megatron-18.4b", 18.4, 48, 6144, 40, 8, 1, 256, 1024, 135, 43),
    MegatronRun("megatron-39.1b", 39.1, 64, 8192, 48, 8, 2, 512, 1536, 138, 44),
    MegatronRun("megatron-76.1b", 76.1, 80, 10240, 60, 8, 4, 1024, 1792, 140, 45),
    MegatronRun("megatron-145.6b", 145.6, 96, 12288, 80, 8, 8, 1536, 2304, 148, 47),
    MegatronRun("megatron-310.1b", 310.1, 128, 16384, 96, 8, 16, 1920, 2160, 155, 50),
    MegatronRun("megatron-529.6b", 529.6, 128, 20480, 105, 8, 35, 2520, 2520, 163, 52),
    MegatronRun("megatron-1t", 1008.0, 160, 25600, 128, 8, 64, 3072, 3072, 163, 52),
)

_ZOO: dict[str, ModelConfig] = {
    # Brown et al. 2020, "Language Models are Few-Shot Learners", Table 2.1 (GPT-3 175B).
    # Its 50257-token GPT-2 byte-pair vocabulary is padded to 51200, as Megatron-LM pads
    # it (to a multiple of 128 x the tensor size), so the embedding and classifier split
    # over any power-of-two tensor size up to 2048.
    "gpt3-175b": GPTConfig(vocab_size=51200, n_layer=96, n_head=96, n_embd=12288, block_size=2048),
    # Megatron Table 1 above; every run there uses sequence 2048 and vocabulary 51200.
    **{
        run.name: GPTConfig(
            vocab_size=51200,
            n_layer=run.layers,
            n_head=run.heads,
            n_embd=run.hidden,
            block_size=2048,
        )
        for run in MEGATRON_TABLE1
    },
    # Touvron et al. 2023, "Llama 2: Open Foundation and Fine-Tuned Chat Models" (4k context,
    # grouped-query attention for 70B); widths as in the released model parameters.
    "llama2-7b": LlamaConfig(
        vocab_size=32000,
        n_layer=32,
        n_head=32,
        n_kv_head=32,
        dim=4096,
        ffn_hidden=11008,
        max_seq=4096,
    ),
    "llama2-13b": LlamaConfig(
        vocab_size=32000,
        n_layer=40,
        n_head=40,
        n_kv_head=40,
        dim=5120,
        ffn_hidden=13824,
        max_seq=4096,
    ),
    "llama2-70b": LlamaConfig(
        vocab_size=32000,
        n_layer=80,
        n_head=64,
        n_kv_head=8,
        dim=8192,
        ffn_hidden=28672,
        max_seq=4096,
    ),
    # Llama Team 2024, "The Llama 3 Herd of Models" (arXiv 2407.21783), Table 3: 8B and 70B,
    # 128K-token vocabulary, grouped-query attention with 8 key/value heads, RoPE base 500000.
    "llama3-8b": LlamaConfig(
        vocab_size=128256,
        n_layer=32,
        n_head=32,
        n_kv_head=8,
        dim=4096,
        ffn_hidden=14336,
        max_seq=8192,
        rope_theta=500000.0,
    ),
    "llama3-70b": LlamaConfig(
        vocab_size=128256,
        n_layer=80,
        n_head=64,
        n_kv_head=8,
        dim=8192,
        ffn_hidden=28672,
        max_seq=8192,
        rope_theta=500000.0,
    ),
    # Llama 3.1 (Llama Team 2024, arXiv 2407.21783, Table 3): Llama 3's shapes trained on to a
    # 128K context (§3.4.2), with the rotary frequencies rescaled as its released
    # configuration does (rope_scaling: factor 8, low/high frequency factors 1 and 4, original
    # 8192). 405B: 126 layers of 16384 with 128 heads (8 key/value), FFN 53248; Meta's
    # model card gives 405B (this counts 405.85e9, embeddings and head untied).
    "llama3.1-8b": LlamaConfig(
        vocab_size=128256,
        n_layer=32,
        n_head=32,
        n_kv_head=8,
        dim=4096,
        ffn_hidden=14336,
        max_seq=131072,
        rope_theta=500000.0,
        rope_scaling=RopeScaling(),
    ),
    "llama3.1-70b": LlamaConfig(
        vocab_size=128256,
        n_layer=80,
        n_head=64,
        n_kv_head=8,
        dim=8192,
        ffn_hidden=28672,
        max_seq=131072,
        rope_theta=500000.0,
        rope_scaling=RopeScaling(),
    ),
    "llama3.1-405b": LlamaConfig(
        vocab_size=128256,
        n_layer=126,
        n_head=128,
        n_kv_head=8,
        dim=16384,
        ffn_hidden=53248,
        max_seq=131072,
        rope_theta=500000.0,
        rope_scaling=RopeScaling(),
    ),
    # Llama 3.2 1B and 3B (Meta's model card and released configurations, September 2024):
    # Llama 3.1's layout with tied input and output embeddings, rescaled RoPE (factor 32) and a
    # 128K context; the card lists 1.23B and 3.21B (these count 1.236e9, 1.24B to two
    # places, and 3.213e9).
    "llama3.2-1b": LlamaConfig(
        vocab_size=128256,
        n_layer=16,
        n_head=32,
        n_kv_head=8,
        dim=2048,
        ffn_hidden=8192,
        max_seq=131072,
        rope_theta=500000.0,
        tie_embeddings=True,
        rope_scaling=RopeScaling(factor=32.0),
    ),
    "llama3.2-3b": LlamaConfig(
        vocab_size=128256,
        n_layer=28,
        n_head=24,
        n_kv_head=8,
        dim=3072,
        ffn_hidden=8192,
        max_seq=131072,
        rope_theta=500000.0,
        tie_embeddings=True,
        rope_scaling=RopeScaling(factor=32.0),
    ),
    # Qwen Team 2025, "Qwen3 Technical Report" (arXiv 2505.09388), Table 1, with the released
    # configurations: heads of 128 (wider than dim / heads for 32B), RMSNorm over each query
    # and key head (QK-norm, no attention bias), RoPE base 1e6, 32K native context, the
    # 151936-token vocabulary, untied embeddings; the model cards give 8.2B and 32.8B.
    "qwen3-8b": LlamaConfig(
        vocab_size=151936,
        n_layer=36,
        n_head=32,
        n_kv_head=8,
        dim=4096,
        ffn_hidden=12288,
        max_seq=32768,
        rope_theta=1000000.0,
        norm_eps=1e-6,
        head_dim=128,
        qk_norm=True,
    ),
    "qwen3-32b": LlamaConfig(
        vocab_size=151936,
        n_layer=64,
        n_head=64,
        n_kv_head=8,
        dim=5120,
        ffn_hidden=25600,
        max_seq=32768,
        rope_theta=1000000.0,
        norm_eps=1e-6,
        head_dim=128,
        qk_norm=True,
    ),
    # Jiang et al. 2024, "Mixtral of Experts" (arXiv 2401.04088), Table 1: Mistral 7B's
    # shapes with 8 SwiGLU experts per layer, 2 active per token, 32k context; RoPE base 1e6
    # as in the released configuration.
    "mixtral-8x7b": MoEConfig(
        vocab_size=32000,
        n_layer=32,
        n_head=32,
        n_kv_head=8,
        dim=4096,
        ffn_hidden=14336,
        n_experts=8,
        top_k=2,
        max_seq=32768,
    ),
    # DeepSeek-AI 2024, "DeepSeek-V3 Technical Report" (arXiv 2412.19437), §4.2: 61 layers of
    # hidden 7168 and 128 heads; every FFN but those of the first three layers is an MoE of
    # 1 shared and 256 routed experts of width 2048, 8 routed per token, by sigmoid affinity
    # normalised over the chosen ones (§2.1.2); 128K-token vocabulary (129280 in the released
    # configuration, as the dense FFN width 18432 = (8 + 1) x 2048), 4K pre-training sequence.
    # Not DeepSeek-V3 itself: its attention is this family's (multi-head, 128 heads of 56)
    # rather than MLA, its shared expert sits behind the family's sigmoid gate, and it has no
    # multi-token-prediction module, so it holds 6.72e11 parameters, not the report's 671B
    # (whose MLA is 187M a layer where this attention is 206M).
    "deepseek-v3-moe": MoEConfig(
        vocab_size=129280,
        n_layer=61,
        n_head=128,
        n_kv_head=128,
        dim=7168,
        ffn_hidden=2048,
        n_experts=256,
        top_k=8,
        max_seq=4096,
        shared_ffn=2048,
        score=SIGMOID,
        rope_theta=10000.0,
        dense_layers=3,
        dense_ffn=18432,
    ),
    # DeepSeek-V3 itself (arXiv 2412.19437, §2.1.1 and §4.2, with the released configuration):
    # deepseek-v3-moe's blocks with multi-head latent attention, query rank 1536, key/value
    # rank 512, heads of 128 + 64 rotary for queries and keys and 128 for values. The report
    # gives 671B parameters, 37B activated per token, without the multi-token-prediction
    # module (the released checkpoint's 685B include it); this counts 6.710e11, and 3.66e10
    # weights that a token's computation multiplies (the input embedding, a lookup, left
    # out). It keeps the family's sigmoid gate on the shared expert, 7168
    # weights a layer that DeepSeek-V3 has not (0.4M in all), and the 4K pre-training length
    # (its 128K came from YaRN stages after pre-training).
    "deepseek-v3": MoEConfig(
        vocab_size=129280,
        n_layer=61,
        n_head=128,
        n_kv_head=128,
        dim=7168,
        ffn_hidden=2048,
        n_experts=256,
        top_k=8,
        max_seq=4096,
        shared_ffn=2048,
        score=SIGMOID,
        rope_theta=10000.0,
        dense_layers=3,
        dense_ffn=18432,
        q_lora_rank=1536,
        kv_lora_rank=512,
        qk_nope_head_dim=128,
        qk_rope_head_dim=64,
        v_head_dim=128,
    ),
    # Devlin et al. 2019, "BERT: Pre-training of Deep Bidirectional Transformers", BERT-LARGE
    # (L=24, H=1024, A=16, feed-forward 4H), with the 30522-token uncased WordPiece vocabulary.
    "bert-large": BertConfig(
        vocab_size=30522, n_layer=24, n_head=16, hidden=1024, intermediate=4096, max_position=512
    ),
    # Dosovitskiy et al. 2021, "An Image is Worth 16x16 Words", Table 1: ViT-L/16 and ViT-H/14
    # at 224x224 resolution with an ImageNet-1k head.
    "vit-large": ViTConfig(
        image_size=224,
        patch_size=16,
        n_layer=24,
        n_head=16,
        hidden=1024,
        mlp_dim=4096,
        num_classes=1000,
    ),
    "vit-huge": ViTConfig(
        image_size=224,
        patch_size=14,
        n_layer=32,
        n_head=16,
        hidden=1280,
        mlp_dim=5120,
        num_classes=1000,
    ),
    # Test sizes: a few CPU milliseconds per step, with widths divisible by 8 so that
    # every tensor-parallel degree up to 8 divides them (llama-tiny's 4 kv heads up to 4).
    "gpt-tiny": GPTConfig(vocab_size=256, n_layer=2, n_head=8, n_embd=64, block_size=32),
    "llama-tiny": LlamaConfig(
        vocab_size=256, n_layer=2, n_head=8, n_kv_head=4, dim=64, ffn_hidden=192, max_seq=32
    ),
    "bert-tiny": BertConfig(
        vocab_size=256, n_layer=2, n_head=8, hidden=64, intermediate=256, max_position=32
    ),
    "vit-tiny": ViTConfig(
        image_size=32, patch_size=8, n_layer=2, n_head=8, hidden=64, mlp_dim=256, num_classes=16
    ),
    "mlp-tiny": MLPConfig(in_features=32, hidden=64, out_features=16, n_layer=3),
    "moe-tiny": MoEConfig(
        vocab_size=256, n_layer=2, n_head=8, n_kv_head=4, dim=64, ffn_hidden=32, n_experts=8,
        top_k=2, max_seq=32
    ),
}

ZOO_NAMES: list[str] = sorted(_ZOO)


@dataclass(frozen=True)
class _Family:
    """What a spec family name stands for: its config, its model, and its spec keys."""

    config: type
    model: type[nn.Module]
    keys: dict[str, str]  # spec key -> config field, in the order format_spec writes them
    required: tuple[str, ...]


_FAMILIES: dict[str, _Family] = {
    "gpt": _Family(
        GPTConfig,
        GPT,
        {
            "layers": "n_layer",
            "hidden": "n_embd",
            "heads": "n_head",
            "vocab": "vocab_size",
            "seq": "block_size",
        },
        ("layers", "hidden", "heads"),
    ),
    "llama": _Family(
        LlamaConfig,
        Llama,
        {
            "layers": "n_layer",
            "hidden": "dim",
            "heads": "n_head",
            "kv_heads": "n_kv_head",
            "ffn": "ffn_hidden",
            "vocab": "vocab_size",
            "seq": "max_seq",
            "head_dim": "head_dim",
            "qk_norm": "qk_norm",
            "tied": "tie_embeddings",
        },
        ("layers", "hidden", "heads"),
    ),
    "bert": _Family(
        BertConfig,
        Bert,
        {
            "layers": "n_layer",
            "hidden": "hidden",
            "heads": "n_head",
            "intermediate": "intermediate",
            "vocab": "vocab_size",
            "seq": "max_position",
        },
        ("layers", "hidden", "heads"),
    ),
    "vit": _Family(
        ViTConfig,
        ViT,
        {
            "layers": "n_layer",
            "hidden": "hidden",
            "heads": "n_head",
            "mlp": "mlp_dim",
            "image": "image_size",
            "patch": "patch_size",
            "channels": "channels",
            "classes": "num_classes",
        },
        ("layers", "hidden", "heads"),
    ),
    "mlp": _Family(
        MLPConfig,
        MLP,
        {"in": "in_features", "hidden": "hidden", "out": "out_features", "layers": "n_layer"},
        ("in", "hidden", "out", "layers"),
    ),
    "moe": _Family(
        MoEConfig,
        MoETransformer,
        {
            "layers": "n_layer",
            "hidden": "dim",
            "heads": "n_head",
            "kv_heads": "n_kv_head",
            "ffn": "ffn_hidden",
            "experts": "n_experts",
            "top_k": "top_k",
            "vocab": "vocab_size",
            "seq": "max_seq",
            "shared_ffn": "shared_ffn",
            "dense": "dense_layers",
            "dense_ffn": "dense_ffn",
            "q_lora": "q_lora_rank",
            "kv_lora": "kv_lora_rank",
            "nope_dim": "qk_nope_head_dim",
            "rope_dim": "qk_rope_head_dim",
            "v_dim": "v_head_dim",
        },
        ("layers", "hidden", "experts", "top_k"),
    ),
}


def _spec_defaults(family: str, given: dict[str, int]) -> dict[str, int]:
    """Values for the optional spec keys: those of the family's original published model."""
    hidden = given["hidden"]
    if family == "gpt":
        return {"vocab": 50257, "seq": 2048}
    if family == "llama":
        # LLaMA's SwiGLU width: two thirds of 4 * hidden, rounded up to a multiple of 256.
        ffn = -(-(2 * 4 * hidden // 3) // 256) * 256
        return {"kv_heads": given["heads"], "ffn": ffn, "vocab": 32000, "seq": 4096}
    if family == "bert":
        return {"intermediate": 4 * hidden, "vocab": 30522, "seq": 512}
    if family == "moe":
        # Mixtral's proportions: heads of width 128, expert width 3.5 x hidden
        heads = given.get("heads", max(1, hidden // 128))
        ffn = given.get("ffn", 7 * hidden // 2)
        defaults = {"heads": heads, "kv_heads": heads, "ffn": ffn, "vocab": 32000,
                    "seq": 32768}
        if "dense" in given:
            # a dense layer as wide as an MoE layer's active experts, as DeepSeek-V3's
            # 18432 = 8 x 2048 routed + 2048 shared
            defaults["dense_ffn"] = given["top_k"] * ffn + given.get("shared_ffn", 0)
        if "kv_lora" in given:  # multi-head latent attention: DeepSeek-V3's head widths
            defaults.update(nope_dim=128, rope_dim=64, v_dim=128)
        return defaults
    if family == "vit":
        return {"mlp": 4 * hidden, "image": 224, "patch": 16, "channels": 3, "classes": 1000}
    return {}


def _family_of(cfg: ModelConfig) -> str:
    for name, family in _FAMILIES.items():
        if type(cfg) is family.config:
            return name
    expected = ", ".join(family.config.__name__ for family in _FAMILIES.values())
    raise TypeError(f"{type(cfg).__name__} is not a zoo config; expected one of {expected}.")


def parse_spec(spec: str) -> ModelConfig:
    """Parse ``family:key=value,...`` into a config; optional keys take published defaults.

    Families and keys: gpt (layers, hidden, heads, vocab, seq), llama (also kv_heads, ffn),
    bert (also intermediate), vit (layers, hidden, heads, mlp, image, patch, channels,
    classes), mlp (in, hidden, out, layers), moe (layers, hidden, experts, top_k; heads,
    kv_heads, ffn, vocab, seq, shared_ffn: a shared expert's width, dense: how many of the
    first layers keep a dense FFN, dense_ffn: its width, by default top_k x ffn +
    shared_ffn; kv_lora, q_lora, nope_dim, rope_dim, v_dim: multi-head latent attention's
    ranks and head widths, DeepSeek-V3's widths by default). Llama also takes head_dim,
    qk_norm=1 (Qwen3's per-head norms) and tied=1 (one embedding for input and output).
    Every value is a positive integer.
    """
    family_name, colon, body = spec.partition(":")
    family_name = family_name.strip()
    if not colon:
        raise ValueError(
            f"Spec {spec!r} has no ':'; write family:key=value,... (e.g. "
            f"'gpt:layers=2,hidden=64,heads=8') with family one of {', '.join(sorted(_FAMILIES))}."
        )
    if family_name not in _FAMILIES:
        raise ValueError(
            f"Unknown model family {family_name!r} in spec {spec!r}; "
            f"valid families: {', '.join(sorted(_FAMILIES))}."
        )
    family = _FAMILIES[family_name]
    valid_keys = ", ".join(family.keys)
    given: dict[str, int] = {}
    for item in body.split(","):
        key, eq, value = (part.strip() for part in item.partition("="))
        if not eq or not key:
            raise ValueError(
                f"Malformed item {item!r} in spec {spec!r}: expected key=value "
                f"with key one of {valid_keys}."
            )
        if key not in family.keys:
            raise ValueError(
                f"Unknown key {key!r} in spec {spec!r}; valid keys for {family_name}: {valid_keys}."
            )
        if key in given:
            raise ValueError(f"Key {key!r} is given twice in spec {spec!r}.")
        if not re.fullmatch(r"[1-9][0-9]*", value):
            raise ValueError(
                f"Value {value!r} of key {key!r} in spec {spec!r} is not a positive integer."
            )
        given[key] = int(value)
    missing = [key for key in family.required if key not in given]
    if missing:
        raise ValueError(
            f"Spec {spec!r} lacks required key(s) {', '.join(missing)}; "
            f"{family_name} needs {', '.join(family.required)}."
        )
    values = {**_spec_defaults(family_name, given), **given}
    try:
        return family.config(**{family.keys[key]: value for key, value in values.items()})
    except ValueError as err:
        raise ValueError(f"Spec {spec!r} is inconsistent: {err}") from None


def format_spec(cfg: ModelConfig) -> str:
    """The spec that ``parse_spec`` turns back into ``cfg``.

    The spec covers the shape of the model; fields it has no key for (dropout, bias,
    tied embeddings, rope_theta, norm_eps, an MoE router's score) come back at their
    defaults. Keys whose value is 0 (an MoE model without shared expert or dense layers)
    are left out, as a spec value is positive.
    """
    family_name = _family_of(cfg)
    keys = _FAMILIES[family_name].keys
    return family_name + ":" + ",".join(f"{key}={int(getattr(cfg, field))}"
                                        for key, field in keys.items() if getattr(cfg, field))


def get_config(name: str) -> ModelConfig:
    """The published or test configuration registered under ``name``."""
    if name not in _ZOO:
        close = difflib.get_close_matches(name, ZOO_NAMES, n=3, cutoff=0.5)
        hint = f"closest: {', '.join(close)}; " if close else ""
        raise ValueError(
            f"Unknown model {name!r}; {hint}zoo names: {', '.join(ZOO_NAMES)} "
            f"(or write a spec such as 'gpt:layers=2,hidden=64,heads=8')."
        )
    return _ZOO[name]


def _example_inputs(
    cfg: ModelConfig,
    batch: int,
    seq: int | None,
    device: torch.device,
    dtype: torch.dtype,
    seed: int,
) -> tuple[torch.Tensor, ...]:
    family_name = _family_of(cfg)
    seq_field = _FAMILIES[family_name].keys.get("seq")  # seq checked by `check_seq`
    if seq_field is not None:
        seq = getattr(cfg, seq_field) if seq is None else seq
        shape, int_high = (batch, seq), cfg.vocab_size
    elif family_name == "vit":
        shape, int_high = (batch, cfg.channels, cfg.image_size, cfg.image_size), None
    else:
        shape, int_high = (batch, cfg.in_features), None
    if device.type == "meta":
        return (torch.empty(shape, dtype=torch.long if int_high else dtype, device=device),)
    # Drawn on the CPU from a private generator: the same inputs on every device,
    # and the caller's random streams are left alone.
    gen = torch.Generator().manual_seed(seed)
    if int_high:
        x = torch.randint(0, int_high, shape, generator=gen)
    else:
        x = torch.randn(shape, generator=gen, dtype=dtype)
    return (x.to(device),)


def longest_seq(cfg: ModelConfig) -> int | None:
    """The longest sequence the model takes (None: a model that takes no sequence)."""
    field = _FAMILIES[_family_of(cfg)].keys.get("seq")
    return None if field is None else getattr(cfg, field)


# what a longer context changes besides its length: the rotary frequencies
_CONTEXT_FIELDS = ("rope_theta", "rope_scaling")


def _same_shapes(a: ModelConfig, b: ModelConfig) -> bool:
    if type(a) is not type(b):
        return False
    field = _FAMILIES[_family_of(a)].keys["seq"]
    free = {f: getattr(a, f) for f in (field, *_CONTEXT_FIELDS) if hasattr(a, f)}
    return dataclasses.replace(b, **free) == a


def check_seq(name_or_spec: str | ModelConfig, seq: int | None) -> None:
    """Refuse a sequence length the model does not take, naming its longest and the zoo
    models of the same shapes that take ``seq``; cheap, so callers check before any work."""
    cfg = config_of(name_or_spec)
    longest = longest_seq(cfg)
    if seq is None:
        return
    family = _family_of(cfg)
    if longest is None:
        raise ValueError(f"seq={seq} given, but {family} models take no sequence length; "
                         "leave it out.")
    if 1 <= seq <= longest:
        return
    what = name_or_spec if isinstance(name_or_spec, str) else f"this {family} model"
    if seq < 1:
        raise ValueError(f"seq={seq} is out of range for {what}: give 1 <= seq <= {longest}.")
    longer = [name for name in ZOO_NAMES if _same_shapes(cfg, _ZOO[name])
              and longest_seq(_ZOO[name]) >= seq]
    hint = (f", or plan {' or '.join(longer)}, the same shapes at up to "
            f"{longest_seq(_ZOO[longer[0]])}" if longer else "")
    raise ValueError(f"seq={seq} is longer than {what} takes ({longest} at most); give "
                     f"seq <= {longest}{hint}.")


def config_of(name_or_spec: str | ModelConfig) -> ModelConfig:
    """The configuration a zoo name, a spec or a config stands for."""
    if isinstance(name_or_spec, str):
        return parse_spec(name_or_spec) if ":" in name_or_spec else get_config(name_or_spec)
    return name_or_spec


def build(
    name_or_spec: str | ModelConfig,
    *,
    batch: int = 2,
    seq: int | None = None,
    device: str | torch.device = "meta",
    dtype: torch.dtype = torch.float32,
    seed: int | None = None,
) -> tuple[nn.Module, tuple[torch.Tensor, ...]]:
    """Build a zoo model and example inputs for its forward.

    ``name_or_spec`` is a zoo name, a spec (see ``parse_spec``) or a config. On the meta
    device nothing is allocated. With ``seed`` on a real device the weights are
    initialised on the CPU under that seed and then moved, so a seed gives the same
    weights on every device, and the caller's random state is left untouched; the
    example inputs are seeded with ``seed`` (0 when not given) in the same way. ``seq``
    (sequence models only) defaults to the longest the config supports.
    """
    cfg = config_of(name_or_spec)
    if batch < 1:
        raise ValueError(f"batch={batch} must be at least 1.")
    check_seq(name_or_spec, seq)
    model_cls = _FAMILIES[_family_of(cfg)].model
    device = torch.device(device)
    inputs = _example_inputs(cfg, batch, seq, device, dtype, 0 if seed is None else seed)
    if seed is not None and device.type != "meta":
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            model = model_cls(cfg)
        model = model.to(device=device, dtype=dtype)
    else:
        with device:
            model = model_cls(cfg)
        model = model.to(dtype=dtype)
    return model, inputs


def _token_loss(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.cross_entropy(logits.reshape(-1, logits.size(-1)), target.reshape(-1))


def _class_loss(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.cross_entropy(logits, target)


@dataclass
class Workload:
    """A zoo model ready to plan: model and inputs on the meta device, its training loss,
    and how many times its repeated block really occurs.

    ``model`` may be built with fewer blocks than the configuration has (``traced_layers``),
    since identical blocks are priced once; ``layers`` is the configuration's true count.
    A model whose blocks are of two kinds (an MoE model's first dense layers) names in
    ``repeat`` the traced block that stands for each kind's copies.
    """

    config: ModelConfig
    model: nn.Module
    inputs: tuple
    loss_fn: object
    target: torch.Tensor
    layers: int
    traced_layers: int
    tokens_per_sample: int
    repeat: dict[str, int] | None = None  # traced block name -> real copies it stands for

    @property
    def layer_counts(self) -> tuple[int, int] | dict[str, int]:
        """What `autopar.search.planner.prepare(layers=...)` takes: ``repeat`` where the
        blocks differ, else (traced, real)."""
        return dict(self.repeat) if self.repeat else (self.traced_layers, self.layers)


def _traced_blocks(cfg: ModelConfig, max_layers: int | None) -> tuple[ModelConfig, dict | None]:
    """The config to trace and, for an MoE model with dense first layers, the block repeat:
    with ``max_layers`` one dense and one MoE block are traced, the first standing for the
    ``dense_layers`` dense blocks and the second for the rest."""
    dense = getattr(cfg, "dense_layers", 0)
    if not dense or max_layers is None or cfg.n_layer == 2:
        traced = cfg.n_layer if max_layers is None else min(cfg.n_layer, max_layers)
        return dataclasses.replace(cfg, n_layer=traced), None
    small = dataclasses.replace(cfg, n_layer=2, dense_layers=1)
    return small, {"blocks.0": dense, "blocks.1": cfg.n_layer - dense}


def workload(
    name_or_spec: str | ModelConfig,
    *,
    batch: int = 2,
    seq: int | None = None,
    dtype: torch.dtype = torch.bfloat16,
    max_layers: int | None = 2,
) -> Workload:
    """The model as the planner sees it: on the meta device with its training loss.

    Language models (GPT, LLaMA, MoE, BERT's masked-LM head) train with cross-entropy over every
    token, ViT and MLP with cross-entropy over one class per sample. With ``max_layers``
    only that many blocks are built: they are structurally identical, so pricing two and
    counting the configuration's number is exact and keeps a 96-layer model's trace short.
    An MoE model with dense first layers is traced as one dense and one MoE block
    (``Workload.repeat`` counts each kind), whatever ``max_layers`` (None: the whole model).
    """
    cfg = config_of(name_or_spec)
    layers = cfg.n_layer
    small, repeat = _traced_blocks(cfg, max_layers)
    model, inputs = build(small, batch=batch, seq=seq, device="meta", dtype=dtype)
    family = _family_of(cfg)
    x = inputs[0]
    if family in ("gpt", "llama", "bert", "moe"):
        loss_fn, target = _token_loss, torch.empty(x.shape, dtype=torch.long, device="meta")
        tokens = int(x.shape[1])
    else:
        loss_fn, target = _class_loss, torch.empty((x.shape[0],), dtype=torch.long, device="meta")
        tokens = 1
    return Workload(cfg, model, inputs, loss_fn, target, layers, small.n_layer, tokens, repeat)
