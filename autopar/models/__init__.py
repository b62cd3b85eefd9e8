"""The model zoo: readable reference models and the configurations to plan them at."""

from autopar.models.bert import Bert, BertConfig
from autopar.models.gpt import GPT, GPTConfig
from autopar.models.llama import Llama, LlamaConfig
from autopar.models.mlp import MLP, MLPConfig
from autopar.models.moe import MoEConfig, MoETransformer
from autopar.models.vit import ViT, ViTConfig
from autopar.models.zoo import (
    MEGATRON_TABLE1,
    ZOO_NAMES,
    MegatronRun,
    ModelConfig,
    Workload,
    build,
    check_seq,
    format_spec,
    get_config,
    parse_spec,
    workload,
)

__all__ = [
    "GPT",
    "GPTConfig",
    "Llama",
    "LlamaConfig",
    "Bert",
    "BertConfig",
    "ViT",
    "ViTConfig",
    "MLP",
    "MLPConfig",
    "MoEConfig",
    "MoETransformer",
    "ModelConfig",
    "MegatronRun",
    "MEGATRON_TABLE1",
    "ZOO_NAMES",
    "build",
    "check_seq",
    "format_spec",
    "get_config",
    "parse_spec",
    "Workload",
    "workload",
]
