"""Export weights as safetensors shards the way transformers' `save_pretrained` lays them
out: `model-00001-of-0000N.safetensors` files of at most `max_shard_bytes` of tensor data
each, `model.safetensors.index.json` (metadata total_size and total_parameters, weight_map)
and, for a transformers model, config.json and generation_config.json, so
`AutoModelForCausalLM.from_pretrained(DIR)` loads them.

The writer takes (name, full tensor) pairs one at a time, as the caller gathers each layer
on the writing rank, and holds at most one shard's tensors. Shards are written into a
temporary directory beside DIR under provisional names (their count is known only at the
end), renamed once all are written, and the directory is swapped in by renames: the old
DIR is renamed aside, the new one renamed in, the old one removed. A crash before the swap
leaves the previous export untouched; the next export removes the leftover.
"""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Iterable

import torch
from safetensors.torch import save_file

from autopar.errors import WeightsError
from autopar.runtime.checkpoint import fsync_dir
from autopar.runtime.weights import INDEX

MAX_SHARD_BYTES = 5 * 10**9  # transformers' default max_shard_size, "5GB"
_TMP, _OLD = ".tmp-", ".old-"


class SafetensorsWriter:
    """Writes (name, tensor) pairs into shards under a temporary directory; `commit`
    publishes them as `directory`, `abort` (or an exception inside `with`) drops them."""

    def __init__(self, directory, max_shard_bytes: int = MAX_SHARD_BYTES, model=None,
                 tied=()):
        if max_shard_bytes < 1:
            raise WeightsError(f"max_shard_bytes must be at least 1 byte, not "
                               f"{max_shard_bytes}.")
        self.directory = os.path.abspath(os.fspath(directory))
        self.max_shard_bytes = max_shard_bytes
        self.model = model
        self._skip = _dropped_names(model, tied)
        parent, name = os.path.split(self.directory)
        self._tmp = os.path.join(parent, f"{_TMP}{name}")
        self._old = os.path.join(parent, f"{_OLD}{name}")
        self._shard: dict[str, torch.Tensor] = {}
        self._shard_bytes = 0
        self._storages: set[int] = set()
        self._files: list[list[str]] = []  # the names in each written shard
        self._sizes: dict[str, int] = {}
        self._params = 0
        try:
            os.makedirs(parent, exist_ok=True)
            for leftover in (self._tmp, self._old):
                if os.path.exists(leftover):  # a crashed export's; nobody writes it now
                    shutil.rmtree(leftover)
            os.makedirs(self._tmp)
        except OSError as e:
            raise WeightsError(f"the export directory beside {self.directory} could not be "
                               f"prepared ({e.strerror or e}); export to a writable "
                               "directory.") from e

    def add(self, name: str, tensor: torch.Tensor) -> None:
        """Queue one full tensor; a shard is written once the next tensor would overflow it."""
        if name in self._skip:
            return
        if name in self._sizes or name in self._shard:
            raise WeightsError(f"{name} was exported twice; pass each name once.")
        tensor = tensor.detach().to("cpu").contiguous()
        size = tensor.numel() * tensor.element_size()
        if self._shard and self._shard_bytes + size > self.max_shard_bytes:
            self._flush()
        if tensor.untyped_storage().data_ptr() in self._storages:
            tensor = tensor.clone()  # safetensors refuses two names on one storage
        self._storages.add(tensor.untyped_storage().data_ptr())
        self._shard[name] = tensor
        self._shard_bytes += size
        self._sizes[name] = size
        self._params += tensor.numel()

    def add_all(self, pairs: Iterable[tuple[str, torch.Tensor]]) -> None:
        for name, tensor in pairs:
            self.add(name, tensor)

    def _flush(self) -> None:
        path = os.path.join(self._tmp, f"shard-{len(self._files)}.part")
        save_file(self._shard, path, metadata={"format": "pt"})
        self._files.append(list(self._shard))
        self._shard, self._shard_bytes, self._storages = {}, 0, set()

    def commit(self) -> str:
        """Write the last shard, the index and the model's configs, then publish the
        directory; returns it."""
        if self._shard or not self._files:
            self._flush()
        n = len(self._files)
        weight_map = {}
        for i, names in enumerate(self._files):
            final = f"model-{i + 1:05d}-of-{n:05d}.safetensors"
            os.replace(os.path.join(self._tmp, f"shard-{i}.part"), os.path.join(self._tmp, final))
            weight_map.update(dict.fromkeys(names, final))
        index = {"metadata": {"total_parameters": self._params,
                              "total_size": sum(self._sizes.values())},
                 "weight_map": dict(sorted(weight_map.items()))}
        with open(os.path.join(self._tmp, INDEX), "w") as f:
            json.dump(index, f, indent=2, sort_keys=True)
            f.write("\n")
        _save_configs(self.model, self._tmp)
        _sync_tree(self._tmp)
        self._swap()
        return self.directory

    def _swap(self) -> None:
        """Rename the old directory aside, the new one in, then remove the old one."""
        parent = os.path.dirname(self.directory)
        had_old = os.path.exists(self.directory)
        if had_old:
            os.replace(self.directory, self._old)
        try:
            os.replace(self._tmp, self.directory)
        except OSError:
            if had_old:  # put the previous export back
                os.replace(self._old, self.directory)
            raise
        fsync_dir(parent)
        if had_old:
            shutil.rmtree(self._old, ignore_errors=True)

    def abort(self) -> None:
        """Drop what was written; the previous export stays as it was."""
        self._shard = {}
        shutil.rmtree(self._tmp, ignore_errors=True)

    def __enter__(self) -> SafetensorsWriter:
        return self

    def __exit__(self, kind, value, tb) -> None:
        if kind is None:
            self.commit()
        else:
            self.abort()


def export_safetensors(directory, pairs: Iterable[tuple[str, torch.Tensor]],
                       max_shard_bytes: int = MAX_SHARD_BYTES, model=None, tied=()) -> str:
    """Write (name, full tensor) pairs (a generator: one layer at a time) as safetensors
    shards plus the index under `directory`, replacing an earlier export only once all is
    written. `model`: a transformers model whose config (and generation config) go beside
    the weights and whose re-tied names are left out as save_pretrained leaves them out;
    `tied`: groups of names sharing one tensor, of which only the first is written."""
    with SafetensorsWriter(directory, max_shard_bytes, model, tied) as writer:
        writer.add_all(pairs)
    return writer.directory


def _dropped_names(model, tied) -> set[str]:
    """Names written only once: all but the first of each tied group, and what
    transformers re-ties on load (its `all_tied_weights_keys` targets)."""
    drop = {n for group in tied for n in list(group)[1:]}
    keys = getattr(model, "all_tied_weights_keys", None)
    if isinstance(keys, dict):
        drop |= set(keys)
    return drop


def _save_configs(model, directory: str) -> None:
    config = getattr(model, "config", None)
    if config is None or not hasattr(config, "save_pretrained"):
        return
    config.save_pretrained(directory)
    generation = getattr(model, "generation_config", None)
    can_generate = getattr(model, "can_generate", None)
    if generation is not None and callable(can_generate) and can_generate():
        generation.save_pretrained(directory)


def _sync_tree(path: str) -> None:
    for name in os.listdir(path):
        with open(os.path.join(path, name), "rb") as f:
            os.fsync(f.fileno())
    fsync_dir(path)
