"""transformers models named by a config directory or a `config.json`, ready to plan.

The model is built from the config alone on the meta device (nothing is downloaded or
allocated) with two of its repeated blocks; the planner counts the rest, as it does for the
zoo's workloads, so a 70B config traces as fast as a 1B one.
"""

from __future__ import annotations

import os

import torch
from torch import nn

from autopar.models.zoo import Workload

TRACED_BLOCKS = 2  # identical blocks are priced once: two show what repeats


def config_file(spec: str | os.PathLike) -> str | None:
    """The config.json `spec` names (a directory holding one, or the file), None when `spec`
    is no path on disk."""
    path = os.fspath(spec)
    if os.path.isdir(path):
        found = os.path.join(path, "config.json")
        if not os.path.isfile(found):
            raise ValueError(f"directory {path} has no config.json; give a transformers model "
                             "directory (as save_pretrained writes it) or its config.json.")
        return found
    if path.endswith(".json") and os.path.isfile(path):
        return path
    return None


def load_config(path: str):
    """The transformers config in the file `path` (its model_type picks the class)."""
    import transformers

    from autopar.errors import AutoparError
    from autopar.json_file import read_json

    try:
        data = read_json(path, "transformers config", AutoparError,
                         "give a config.json as save_pretrained writes it")
        if not isinstance(data, dict):
            raise ValueError("its top level is not an object")
        model_type = data.pop("model_type")
        return transformers.AutoConfig.for_model(model_type, **data)
    except (AutoparError, KeyError, ValueError) as e:
        raise ValueError(f"cannot read a transformers config from {path} ({type(e).__name__}: "
                         f"{e}); give a config.json with a model_type that transformers "
                         "knows.") from e


def model_class(config) -> type[nn.Module]:
    """The class the config names (its `architectures`), else its masked-LM, causal-LM or
    image-classification model, in that order."""
    import transformers
    from transformers.models.auto import modeling_auto as auto

    for name in getattr(config, "architectures", None) or ():
        cls = getattr(transformers, name, None) if isinstance(name, str) else None
        # only a model class: a config must not make autopar call any other public object
        if isinstance(cls, type) and issubclass(cls, transformers.PreTrainedModel):
            return cls
    for mapping in (auto.MODEL_FOR_MASKED_LM_MAPPING_NAMES, auto.MODEL_FOR_CAUSAL_LM_MAPPING_NAMES,
                    auto.MODEL_FOR_IMAGE_CLASSIFICATION_MAPPING_NAMES):
        name = mapping.get(config.model_type)
        if name is not None and hasattr(transformers, name):
            return getattr(transformers, name)
    raise ValueError(f"no language-model or image-classification head for model_type "
                     f"{config.model_type!r}; name one in the config's \"architectures\".")


def blocks_of(config) -> int | None:
    """How many repeated blocks the config has (num_hidden_layers), None if it names none."""
    count = getattr(config, "num_hidden_layers", None)
    return count if isinstance(count, int) and count > 0 else None


def _per_layer(config) -> dict[str, list] | None:
    """The config's lists with one entry per block (layer_types), or None when their entries
    differ: then a few blocks would not stand for the rest."""
    real = blocks_of(config)
    lists = {key: value for key, value in config.to_dict().items()
             if isinstance(value, list) and len(value) == real}
    if any(v != value[0] for value in lists.values() for v in value):
        return None
    return lists


def shortened(config, blocks: int):
    """A copy of `config` with `blocks` blocks, or None when its blocks differ."""
    lists = _per_layer(config)
    if lists is None:
        return None
    data = {**config.to_dict(), **{key: value[:blocks] for key, value in lists.items()}}
    data[getattr(config, "attribute_map", {}).get("num_hidden_layers", "num_hidden_layers")] = \
        blocks
    return type(config).from_dict(data)


def keep_blocks(model: nn.Module, blocks: int = TRACED_BLOCKS) -> tuple[int, int] | None:
    """Cut a transformers model's repeated blocks (its one list of num_hidden_layers modules)
    to the first `blocks`, in place, for tracing; (blocks, real count) for the planner to
    count the rest, or None when there is no such list or its blocks differ."""
    config = getattr(model, "config", None)
    real = blocks_of(config) if config is not None else None
    if real is None or real <= blocks:
        return None
    found = [(name, m) for name, m in model.named_modules()
             if isinstance(m, nn.ModuleList) and len(m) == real]
    lists = _per_layer(config)
    if len(found) != 1 or lists is None or len({type(b) for b in found[0][1]}) != 1:
        return None
    name, layers = found[0]
    parent, _, attr = name.rpartition(".")
    setattr(model.get_submodule(parent), attr, nn.ModuleList(list(layers)[:blocks]))
    for key, value in lists.items():  # the forward reads these (layer_types)
        setattr(config, key, value[:blocks])
    config.num_hidden_layers = blocks
    return blocks, real


def token_loss(output, target: torch.Tensor) -> torch.Tensor:
    """Cross-entropy of the model's logits (a ModelOutput's, or a tensor) over every token."""
    logits = getattr(output, "logits", output)
    return nn.functional.cross_entropy(logits.reshape(-1, logits.size(-1)), target.reshape(-1))


def class_loss(output, target: torch.Tensor) -> torch.Tensor:
    """Cross-entropy of one class per sample."""
    return nn.functional.cross_entropy(getattr(output, "logits", output), target)


def example_batch(config, batch: int, seq: int | None, dtype: torch.dtype,
                  device: torch.device | str = "meta"):
    """(inputs, loss_fn, target, tokens per sample) on `device`: token ids of `seq` tokens
    (the config's context length when None), or images for a vision config."""
    image = getattr(config, "image_size", None)
    if image is not None and getattr(config, "vocab_size", None) is None:
        if seq is not None:
            raise ValueError(f"seq={seq} given, but {config.model_type} models take images, "
                             "not token sequences.")
        size = image if isinstance(image, int) else image[0]
        channels = getattr(config, "num_channels", 3)
        inputs = (torch.zeros(batch, channels, size, size, dtype=dtype, device=device),)
        return (inputs, *loss_for(inputs[0]), 1)
    longest = getattr(config, "max_position_embeddings", None)
    if seq is None and longest is None:
        raise ValueError(f"the {config.model_type} config names no max_position_embeddings; "
                         "give the sequence length (--seq).")
    seq = longest if seq is None else seq
    if seq < 1 or (longest is not None and seq > longest):
        raise ValueError(f"seq={seq} is out of range for this {config.model_type} config: "
                         f"1 <= seq <= {longest} (its max_position_embeddings).")
    inputs = (torch.zeros(batch, seq, dtype=torch.long, device=device),)
    return (inputs, *loss_for(inputs[0]), seq)


def loss_for(x: torch.Tensor):
    """(loss_fn, target) for a transformers model's first input: cross-entropy over every
    token of token ids [batch, seq], else over one class per sample."""
    if not x.dtype.is_floating_point and x.dim() == 2:
        return token_loss, torch.zeros(x.shape, dtype=torch.long, device=x.device)
    return class_loss, torch.zeros(x.shape[0], dtype=torch.long, device=x.device)


def workload(spec: str | os.PathLike, *, batch: int = 2, seq: int | None = None,
             dtype: torch.dtype = torch.bfloat16) -> Workload:
    """The transformers model a config directory or config.json describes, as the planner
    sees it: on meta, in `dtype`, with two blocks traced for the config's count."""
    path = config_file(spec)
    if path is None:
        raise ValueError(f"{os.fspath(spec)} is neither a directory with a config.json nor a "
                         "config.json file.")
    config = load_config(path)
    real = blocks_of(config)
    traced = real
    small = config
    if real is not None and real > TRACED_BLOCKS:
        small = shortened(config, TRACED_BLOCKS) or config
        traced = blocks_of(small)
    model = build(small, dtype)
    inputs, loss_fn, target, tokens = example_batch(config, batch, seq, dtype)
    return Workload(config, model, inputs, loss_fn, target, real or 1, traced or 1, tokens)


def build(config, dtype: torch.dtype = torch.bfloat16) -> nn.Module:
    """The model of `config` on the meta device, in `dtype`, without a generation cache."""
    if hasattr(config, "use_cache"):
        config.use_cache = False
    with torch.device("meta"):
        model = model_class(config)(config)
    return model.to(dtype=dtype)
