"""Weight sources read slice by slice: safetensors files (one file, or the shards and
`model.safetensors.index.json` that transformers' `save_pretrained` writes), an autopar
checkpoint directory, or a mapping of names to tensors.

`open_weights(source)` lists the stored names, shapes and dtypes without reading any data;
`check` compares them with the model's before anything is read, in one sentence; `read`
returns only the region asked for. Safetensors regions come from
`safe_open(...).get_slice(name)[...]` on a memory map, so a rank touches only the bytes of
its own slices; checkpoint regions are read through DCP with the checkpoint's safe reader,
which reads the stored chunks they overlap. Names are the model's state_dict keys; a tied
weight stored under one of its names (transformers keeps `model.embed_tokens.weight` and
drops `lm_head.weight`) is read under any of them. A stacked expert weight the source stores
one tensor per expert (transformers' `save_pretrained` and Hub checkpoints of Mixtral and
Qwen2-MoE: `experts.{e}.w1/w3/w2` or `gate_proj/up_proj/down_proj`, Mixtral's under
`block_sparse_moe`) is read as the stacked tensor, only the experts and rows asked for
(`stored_layouts`, `WeightSource.adopt_layouts`).
"""

from __future__ import annotations

import abc
import itertools
import math
import os
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

import torch
from safetensors import safe_open

from autopar.errors import AutoparError, WeightsError
from autopar.json_file import read_json
from autopar.runtime.checkpoint import META, WEIGHT, read_weight_boxes, resolve
from autopar.runtime.safe_metadata import read_metadata

INDEX = "model.safetensors.index.json"
SINGLE = "model.safetensors"
Block = tuple[slice, ...]  # one box of a tensor: a slice per dim, step 1
_SHOWN = 6  # keys named per kind of mismatch before "and N more"

# The dtype names of the safetensors format (its header's "dtype" field).
_DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16,
           "BF16": torch.bfloat16, "F8_E4M3": torch.float8_e4m3fn,
           "F8_E5M2": torch.float8_e5m2, "I64": torch.int64, "I32": torch.int32,
           "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8, "BOOL": torch.bool,
           "C64": torch.complex64}


@dataclass(frozen=True)
class Entry:
    """A stored tensor's shape and dtype."""

    shape: tuple[int, ...]
    dtype: torch.dtype


def convertible(stored: torch.dtype, wanted: torch.dtype) -> bool:
    """Whether stored values become `wanted` without losing their kind: the same dtype, or
    floating point to floating point (bf16 weights into an fp32 model and back)."""
    return stored == wanted or (stored.is_floating_point and wanted.is_floating_point)


class WeightSource(abc.ABC):
    """Stored weights by name; subclasses say how a list of blocks of one key is read."""

    def __init__(self, where: str, entries: dict[str, Entry],
                 tied: Iterable[Iterable[str]] = ()):
        self.where = where
        self.entries = entries
        self._alias: dict[str, str] = {}
        # name -> (per expert, the stored keys joined along their dim 0; those keys' lengths
        # on dim 0): stacked expert weights stored one tensor per expert
        self._stacks: dict[str, tuple[tuple[tuple[str, ...], ...], tuple[int, ...]]] = {}
        self._used: set[str] = set()  # stored keys read under another layout's names
        self._tie(tied)

    # ------------------------------------------------------------------ listing
    def keys(self) -> list[str]:
        """The names the source reads, in the order it lists them (stored keys read under
        another layout's names are left out, those names come last)."""
        return [k for k in self.entries if k not in self._used]

    def adopt_layouts(self, alternatives: Mapping[str, list]) -> None:
        """Read names the source does not store under them from another layout: per name,
        the first alternative whose stored keys are all present and agree is used. An
        alternative is one stored key (a weight of a renamed module) or a list, per expert,
        of stored keys joined along their dim 0, the experts stacked on a new dim 0 (a
        stacked expert weight stored one tensor per expert). Reads no data."""
        for name, options in alternatives.items():
            if name in self:
                continue
            for option in options:
                if isinstance(option, str):
                    if option in self.entries:
                        self._alias[name] = option
                        self._used.add(option)
                        break
                    continue
                entry = self._stacked_entry(option)
                if entry is not None:
                    self.entries[name] = entry
                    self._stacks[name] = (tuple(tuple(keys) for keys in option),
                                          tuple(self.entries[k].shape[0] for k in option[0]))
                    self._used.update(k for keys in option for k in keys)
                    break

    def _stacked_entry(self, option: list) -> Entry | None:
        """The stacked tensor's entry, when every expert's keys are stored, 1-D or more,
        of one dtype, alike over the experts and agreeing beyond dim 0; else None."""
        if not option or not all(k in self.entries for keys in option for k in keys):
            return None
        first = [self.entries[k] for k in option[0]]
        if not first or any(not e.shape or e.shape[1:] != first[0].shape[1:]
                            or e.dtype != first[0].dtype for e in first):
            return None
        if any([self.entries[k] for k in keys] != first for keys in option):
            return None
        return Entry((len(option), sum(e.shape[0] for e in first)) + first[0].shape[1:],
                     first[0].dtype)

    def __contains__(self, name: str) -> bool:
        return name in self.entries or name in self._alias

    def entry(self, name: str) -> Entry:
        """Shape and dtype of `name` (or of the stored name a tied name reads)."""
        return self.entries[self._key(name)]

    def _tie(self, tied: Iterable[Iterable[str]]) -> None:
        for group in tied:
            group = list(group)
            stored = [n for n in group if n in self.entries]
            for name in group:
                if stored and name not in self.entries:
                    self._alias[name] = stored[0]

    def _key(self, name: str) -> str:
        key = name if name in self.entries else self._alias.get(name)
        if key is None:
            raise WeightsError(f"the weights in {self.where} have no {name}; pass weights "
                               "saved from this model.")
        return key

    # ------------------------------------------------------------------ checking
    def check(self, expected: Mapping[str, tuple], tied: Iterable[Iterable[str]] = (),
              optional: Iterable[str] = ()) -> None:
        """Refuse, in one sentence naming the keys, weights that do not match `expected`
        (name -> (shape, dtype)): missing or unexpected names, other shapes, dtypes that
        cannot be converted. `tied`: groups of names sharing one tensor, any one of which
        may be stored; `optional`: names the source may hold beside them (buffers outside
        the state_dict, such as a rotary table, which an autopar checkpoint keeps). Reads no
        data."""
        optional = set(optional)
        groups = [list(g) for g in tied]
        self._tie(groups)
        group_of = {n: g for g in groups for n in g}
        missing, shapes, dtypes = [], [], []
        for name, (shape, dtype) in expected.items():
            if name not in self:
                missing.append(name)
                continue
            got = self.entry(name)
            if tuple(got.shape) != tuple(shape):
                shapes.append(f"{name} has shape {tuple(got.shape)} where the model's is "
                              f"{tuple(shape)}")
            elif not convertible(got.dtype, dtype):
                dtypes.append(f"{name} is {_dtype(got.dtype)}, which cannot become the "
                              f"model's {_dtype(dtype)}")
        unexpected = [k for k in self.entries if k not in expected and k not in self._used
                      and k not in optional
                      and not any(n in expected for n in group_of.get(k, ()))]
        parts = []
        if missing:
            parts.append(f"missing {_listed(missing)}")
        if unexpected:
            parts.append(f"unexpected {_listed(unexpected)} (the model has no such weight)")
        parts += _shown(shapes) + _shown(dtypes)
        if parts:
            raise WeightsError(f"the weights in {self.where} do not match the model: "
                               f"{'; '.join(parts)}; pass weights saved from this model "
                               "(names as its state_dict keys).")

    # ------------------------------------------------------------------ reading
    def read(self, name: str, index: Block | list[Block] | None = None,
             dtype: torch.dtype | None = None):
        """The region `index` of `name` (None: the whole tensor; a tuple of slices, one per
        leading dim; or a list of such blocks, giving a list of tensors), as `dtype`."""
        key = self._key(name)
        entry = self.entries[key]
        if dtype is not None and not convertible(entry.dtype, dtype):
            raise WeightsError(f"{name} in {self.where} is {_dtype(entry.dtype)}, which cannot "
                               f"become {_dtype(dtype)}; pass weights of a floating dtype.")
        many = isinstance(index, list)
        blocks = [_block(name, b, entry.shape) for b in (index if many else [index])]
        try:
            out = self._read_stacked(key, blocks) if key in self._stacks else \
                self._read_blocks(key, blocks)
        except AutoparError:
            raise
        except Exception as e:  # a truncated or unreadable file
            raise WeightsError(f"{name} could not be read from {self.where} "
                               f"({type(e).__name__}: {e}); pass complete weights.") from e
        if dtype is not None:
            out = [t.to(dtype) for t in out]
        return out if many else out[0]

    def read_grid(self, name: str, runs: list, dtype: torch.dtype | None = None) \
            -> torch.Tensor:
        """A slice that takes several runs per dim (a blockwise q/k/v split, a zigzag token
        split, a 2D grid): `runs[d]` lists the slices of dim d it holds, in order (None: the
        whole dim); the result joins every combination in that order."""
        shape = self.entry(name).shape
        per_dim = [[slice(0, n)] if r is None else list(r) for r, n in
                   itertools.zip_longest(runs, shape)][:len(shape)]
        blocks = list(itertools.product(*per_dim))
        parts = self.read(name, [tuple(b) for b in blocks], dtype)
        return _join(parts, [len(r) for r in per_dim])

    def _read_stacked(self, name: str, blocks: list[Block]) -> list[torch.Tensor]:
        """Blocks of a stacked expert weight, each from the regions of the experts' stored
        tensors it covers (only those experts, only those rows, are read)."""
        parts, lengths = self._stacks[name]
        out = []
        for block in blocks:
            shape = [s.stop - s.start for s in block]
            if 0 in shape:
                out.append(torch.empty(shape, dtype=self.entries[name].dtype))
                continue
            rows = []
            for e in range(block[0].start, block[0].stop):
                pieces, offset = [], 0
                for key, n in zip(parts[e], lengths):
                    lo, hi = max(block[1].start, offset), min(block[1].stop, offset + n)
                    if lo < hi:
                        pieces += self._read_blocks(key, [(slice(lo - offset, hi - offset),)
                                                          + tuple(block[2:])])
                    offset += n
                rows.append(torch.cat(pieces))
            out.append(torch.stack(rows))
        return out

    @abc.abstractmethod
    def _read_blocks(self, key: str, blocks: list[Block]) -> list[torch.Tensor]:
        """The stored tensor `key`'s regions `blocks`, read from the source."""

    def close(self) -> None:
        """Release open files (a source is also a context manager); nothing to release by
        default (a mapping holds no file)."""
        return None

    def release(self) -> None:
        """Let go of what reads have mapped (the source stays usable); nothing by default."""
        return None

    def __enter__(self) -> WeightSource:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class SafetensorsSource(WeightSource):
    """Safetensors files, each opened lazily (a memory map; only the header is parsed)."""

    def __init__(self, where: str, files: dict[str, str], tied=()):
        self._files = files  # key -> path
        self._open: dict[str, object] = {}
        entries = {}
        for key, path in files.items():
            sl = self._handle(path).get_slice(key)
            dtype = _DTYPES.get(sl.get_dtype())
            if dtype is None:
                raise WeightsError(f"{key} in {path} has the safetensors dtype "
                                   f"{sl.get_dtype()}, which autopar does not read; convert "
                                   "it to a floating dtype.")
            entries[key] = Entry(tuple(sl.get_shape()), dtype)
        super().__init__(where, entries, tied)

    def _handle(self, path: str):
        if path not in self._open:
            try:
                self._open[path] = safe_open(path, framework="pt")
            except Exception as e:  # missing, truncated, or not safetensors
                raise WeightsError(f"{path} could not be opened as safetensors "
                                   f"({type(e).__name__}: {e}); pass complete weights.") from e
        return self._open[path]

    def _read_blocks(self, key: str, blocks: list[Block]) -> list[torch.Tensor]:
        handle = self._handle(self._files[key])
        if not self.entries[key].shape:
            return [handle.get_tensor(key) for _ in blocks]
        sl = handle.get_slice(key)
        return [sl[b] for b in blocks]

    def close(self) -> None:
        self._open.clear()

    def release(self) -> None:
        """Unmap the files (reopened at the next read): the pages a read touched count as
        this process's resident memory while their map is open."""
        self._open.clear()


class CheckpointSource(WeightSource):
    """The weights of an autopar checkpoint (engine.save), stored whole-tensor-keyed; a
    region is read through DCP from the stored chunks it overlaps."""

    def __init__(self, path: str):
        self._path = resolve(path)
        stored = read_metadata(self._path).state_dict_metadata
        entries = {fqn[len(WEIGHT):]: Entry(tuple(md.size), md.properties.dtype)
                   for fqn, md in stored.items() if fqn.startswith(WEIGHT)}
        record = read_json(os.path.join(self._path, META), "checkpoint record", WeightsError,
                           "save the checkpoint again or load an earlier one")
        names = record.get("names", {}) if isinstance(record, dict) else {}
        super().__init__(self._path, entries, [v for v in names.values()
                                              if isinstance(v, list)])

    def _read_blocks(self, key: str, blocks: list[Block]) -> list[torch.Tensor]:
        dtype = self.entries[key].dtype
        out = [torch.empty([s.stop - s.start for s in b], dtype=dtype) for b in blocks]
        pairs = [(tuple(s.start for s in b), t) for b, t in zip(blocks, out) if t.numel()]
        if pairs:
            read_weight_boxes(self._path, {key: pairs})
        return out


class MappingSource(WeightSource):
    """A mapping of names to (CPU or device) tensors; a region is copied out of it."""

    def __init__(self, tensors: Mapping[str, torch.Tensor], tied=()):
        self._tensors = dict(tensors)
        for k, v in self._tensors.items():
            if not isinstance(v, torch.Tensor):
                raise WeightsError(f"the weights mapping holds a {type(v).__name__} for {k}, "
                                   "not a tensor; pass a mapping of names to tensors.")
        entries = {k: Entry(tuple(v.shape), v.dtype) for k, v in self._tensors.items()}
        super().__init__("the given mapping", entries, tied)

    def _read_blocks(self, key: str, blocks: list[Block]) -> list[torch.Tensor]:
        t = self._tensors[key].detach()
        return [t[b].clone() for b in blocks]


def model_entries(model: torch.nn.Module) -> tuple[dict[str, tuple], list[list[str]]]:
    """What `check` compares a source with: the model's state_dict names -> (shape, dtype),
    read from its tensors (meta ones too, nothing allocated), and its tied groups (names
    of one shared parameter)."""
    expected = {k: (tuple(v.shape), v.dtype) for k, v in model.state_dict(keep_vars=True).items()}
    shared: dict[int, list[str]] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        shared.setdefault(id(p), []).append(name)
    return expected, [names for names in shared.values() if len(names) > 1]


def open_weights(source, tied: Iterable[Iterable[str]] = ()) -> WeightSource:
    """A weight source for `source`: a safetensors file; a directory with
    model.safetensors.index.json and its shards, or with one model.safetensors; an autopar
    checkpoint directory; or a mapping of names to tensors. `tied`: groups of names that
    share one tensor, any one of which may be stored."""
    if isinstance(source, Mapping):
        return MappingSource(source, tied)
    path = os.path.abspath(os.fspath(source))
    if os.path.isfile(path):
        return SafetensorsSource(path, _file_keys(path), tied)
    if not os.path.isdir(path):
        raise WeightsError(f"there are no weights at {path}; pass a safetensors file, a "
                           "directory save_pretrained or engine.save wrote, or a mapping.")
    index = os.path.join(path, INDEX)
    if os.path.isfile(index):
        return SafetensorsSource(path, _index_keys(path, index), tied)
    single = os.path.join(path, SINGLE)
    if os.path.isfile(single):
        return SafetensorsSource(path, _file_keys(single), tied)
    try:
        return CheckpointSource(path)
    except AutoparError as e:
        raise WeightsError(f"{path} holds neither {INDEX}, nor {SINGLE}, nor an autopar "
                           f"checkpoint ({str(e).rstrip('.')}); pass a directory "
                           "save_pretrained or engine.save wrote.") from e


def _file_keys(path: str) -> dict[str, str]:
    try:
        with safe_open(path, framework="pt") as f:
            return {k: path for k in f.keys()}
    except Exception as e:  # missing, truncated, or not safetensors
        raise WeightsError(f"{path} could not be opened as safetensors "
                           f"({type(e).__name__}: {e}); pass complete weights.") from e


def _index_keys(root: str, index: str) -> dict[str, str]:
    """key -> shard path from the index's weight_map; shards must lie beside it."""
    value = read_json(index, "safetensors index", WeightsError,
                      "write the weights again with save_pretrained or engine.export")
    weight_map = value.get("weight_map") if isinstance(value, dict) else None
    if not isinstance(weight_map, dict):
        raise WeightsError(f"the safetensors index {index} has no weight_map; write the "
                           "weights again with save_pretrained or engine.export.")
    out = {}
    for key, name in weight_map.items():
        if not isinstance(name, str) or not name or os.path.basename(name) != name or \
                name in (".", ".."):
            raise WeightsError(f"the safetensors index {index} names {name!r} as the file of "
                               f"{key}, which is not a file beside it; write the weights "
                               "again with save_pretrained or engine.export.")
        out[key] = os.path.join(root, name)
    return out


def _block(name: str, index, shape: tuple[int, ...]) -> Block:
    """`index` as one slice per dim, checked against `shape`."""
    index = () if index is None else tuple(index)
    if len(index) > len(shape):
        raise WeightsError(f"the region asked of {name} has {len(index)} dims but the tensor "
                           f"has {len(shape)}; ask for one slice per dim.")
    out = []
    for d, n in enumerate(shape):
        s = index[d] if d < len(index) else slice(None)
        if not isinstance(s, slice) or s.step not in (None, 1):
            raise WeightsError(f"the region asked of {name} has {s!r} on dim {d}; ask for "
                               "slices with step 1.")
        start, stop = 0 if s.start is None else s.start, n if s.stop is None else s.stop
        if not 0 <= start <= stop <= n:
            raise WeightsError(f"the region asked of {name} has {start}:{stop} on dim {d}, "
                               f"outside its size {n}; ask for a region of its shape "
                               f"{shape}.")
        out.append(slice(start, stop))
    return tuple(out)


def _join(parts: list[torch.Tensor], counts: list[int]) -> torch.Tensor:
    """Blocks listed in product order over dims with `counts` runs each, joined."""
    if not counts:
        return parts[0]
    step = math.prod(counts[1:])
    rows = [_join(parts[i * step:(i + 1) * step], counts[1:]) for i in range(counts[0])]
    return torch.cat(rows, dim=len(parts[0].shape) - len(counts))


def _listed(names: list[str]) -> str:
    shown = ", ".join(names[:_SHOWN])
    return shown if len(names) <= _SHOWN else f"{shown} and {len(names) - _SHOWN} more"


def _shown(items: list[str]) -> list[str]:
    if len(items) <= _SHOWN:
        return items
    return items[:_SHOWN] + [f"{len(items) - _SHOWN} more like these"]


def _dtype(dtype: torch.dtype) -> str:
    return str(dtype).replace("torch.", "")


def stored_layouts(model: torch.nn.Module) -> dict[str, list]:
    """The other layouts in which stored weights hold a model's stacked expert weights
    (transformers' fused `experts.gate_up_proj` [E, 2F, H] and `experts.down_proj`
    [E, H, F]): one tensor per expert as `save_pretrained` writes them and the Hub holds
    them (w1 and w3 joined, w2; or gate_proj and up_proj joined, down_proj), Mixtral's
    under `block_sparse_moe` with its router; per name, alternatives for `adopt_layouts`."""
    out: dict[str, list] = {}
    for path, module in model.named_modules():
        experts = getattr(module, "experts", None)
        fused = getattr(experts, "gate_up_proj", None)
        if not isinstance(fused, torch.Tensor) or fused.dim() != 3 or \
                not isinstance(getattr(experts, "down_proj", None), torch.Tensor):
            continue
        head, _, last = path.rpartition(".")
        prefixes = [path] + ([f"{head}.block_sparse_moe" if head else "block_sparse_moe"]
                             if last == "mlp" else [])

        def per_expert(*names, n=fused.shape[0], prefixes=prefixes):
            return [[[f"{p}.experts.{e}.{k}.weight" for k in names] for e in range(n)]
                    for p in prefixes]

        out[f"{path}.experts.gate_up_proj"] = per_expert("w1", "w3") + \
            per_expert("gate_proj", "up_proj")
        out[f"{path}.experts.down_proj"] = per_expert("w2") + per_expert("down_proj")
        out[f"{path}.gate.weight"] = [f"{p}.gate.weight" for p in prefixes[1:]]
    return out
