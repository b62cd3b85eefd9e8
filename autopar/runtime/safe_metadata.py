"""A checkpoint's DCP metadata (`.metadata`, a pickle) read as data: loading never runs code.

torch.distributed.checkpoint writes `.metadata` with pickle and reads it back with plain
`pickle.load`, which runs whatever callable a crafted file names. Here the pickle is parsed
with an unpickler whose only globals are inert records made afresh for each read, one
kind per class DCP metadata holds (its dataclasses, torch.Size, dtypes, layouts, paths); no
real class, function or module object from the file is ever called or touched. The records
are then checked against DCP's metadata schema (types, tensor bounds, data files that exist
and are long enough, no stream transforms) and only then turned into DCP's own objects.
Every checkpoint DCP writes has this form, so checkpoints saved before this reader existed
load through it unchanged. DCP reads the data files with `torch.load` restricted to
weights (`weights_only=True`); `SafeReader` hands DCP the checked metadata and names the
data file when one fails.
"""

from __future__ import annotations

import io
import math
import os
import pickle

import torch
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.filesystem import _StorageInfo as StorageInfo
from torch.distributed.checkpoint.metadata import (
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    StorageMeta,
    TensorProperties,
    TensorStorageMetadata,
)
from torch.distributed.checkpoint.planner import LoadPlan
from torch.futures import Future

from autopar.errors import CheckpointError

METADATA = ".metadata"
_DCP = "torch.distributed.checkpoint.metadata"
# DCP's dataclasses (pickled as NEWOBJ + a dict of fields) -> the kind of record they become
_RECORDS = {(_DCP, "Metadata"): "Metadata", (_DCP, "StorageMeta"): "StorageMeta",
            (_DCP, "TensorStorageMetadata"): "TensorStorageMetadata",
            (_DCP, "TensorProperties"): "TensorProperties",
            (_DCP, "ChunkStorageMetadata"): "ChunkStorageMetadata",
            (_DCP, "MetadataIndex"): "MetadataIndex",
            ("torch.distributed.checkpoint.filesystem", "_StorageInfo"): "StorageInfo"}
# values pickled as a call of a constructor on plain data: a builtin makes the same data
_PLAIN = {("torch", "Size"): tuple, (_DCP, "_MEM_FORMAT_ENCODING"): int,
          ("torch.serialization", "_get_layout"): str}
_PATHS = {"PosixPath", "WindowsPath", "PurePosixPath", "PureWindowsPath", "PurePath", "Path"}
_MEMORY_FORMATS = {0: torch.contiguous_format, 1: torch.channels_last,
                   2: torch.preserve_format}  # DCP's _MEM_FORMAT_ENCODING values
# looked up in the module's own names: getattr(torch, name) could import a submodule
_DTYPES = {name: v for name, v in vars(torch).items() if isinstance(v, torch.dtype)}
_CHUNK_FIELDS = frozenset(("offsets", "sizes"))
_INDEX_FIELDS = frozenset(("fqn", "offset", "index"))
_STORAGE_FIELDS = frozenset(("relative_path", "offset", "length", "transform_descriptors"))


class _Refused(Exception):
    """The metadata is not DCP metadata: why, as a clause of the caller's sentence."""


def _keep_state(self, state) -> None:
    self.__dict__["state"] = state


def _keep_parts(self, *parts) -> None:
    self.__dict__["parts"] = parts


class _Unpickler(pickle.Unpickler):
    """Globals are records: plain classes made for this read (NEWOBJ and BUILD fill their
    __dict__ without calling anything; what a pickle sets on a class stays with the read),
    builtins for plain values and torch's dtypes (immutable); anything else is refused."""

    def __init__(self, file):
        super().__init__(file)
        self.kinds: dict[type, str] = {}
        self._classes = {key: self._record(kind) for key, kind in _RECORDS.items()}
        self._path = self._record("Path")

    def _record(self, kind: str) -> type:
        body = {"TensorProperties": {"__setstate__": _keep_state},  # a tuple state
                "Path": {"__init__": _keep_parts}}.get(kind, {})
        cls = type(kind, (), dict(body))
        self.kinds[cls] = kind
        return cls

    def find_class(self, module: str, name: str):
        if (module, name) in self._classes:
            return self._classes[(module, name)]
        if (module, name) in _PLAIN:
            return _PLAIN[(module, name)]
        if module in ("pathlib", "pathlib._local") and name in _PATHS:
            return self._path
        if module == "torch" and name in _DTYPES:
            return _DTYPES[name]
        raise _Refused(f"refers to {module}.{name}, which DCP metadata never holds and "
                       "which loading could run")

    def persistent_load(self, pid):
        raise _Refused("holds a persistent reference, which DCP metadata never holds")


def read_metadata(ckpt: str) -> Metadata:
    """The DCP metadata of the checkpoint directory `ckpt`, parsed without running code and
    checked against its data files; a CheckpointError naming the file otherwise."""
    path = os.path.join(ckpt, METADATA)
    try:
        with open(path, "rb") as f:
            raw = f.read()
    except OSError as e:
        raise CheckpointError(f"the checkpoint metadata {path} could not be read "
                              f"({e.strerror or e}); load a complete checkpoint.") from e
    try:
        unpickler = _Unpickler(io.BytesIO(raw))
        records = unpickler.load()
        metadata = _Schema(unpickler.kinds).metadata(records)
        _check_files(ckpt, metadata)
    except _Refused as e:
        raise CheckpointError(f"the checkpoint metadata {path} {e}, so it was refused "
                              "without running anything; load a checkpoint that engine.save "
                              "wrote.") from None
    except CheckpointError:
        raise
    except Exception as e:  # anything else the parse or the records raise: not DCP's form
        raise CheckpointError(f"the checkpoint metadata {path} is truncated or is not DCP "
                              f"metadata ({type(e).__name__}: {e}); save the checkpoint "
                              "again or load an earlier one.") from None
    return metadata


# ---------------------------------------------------------------------- records -> DCP
def _int(value, what: str) -> int:
    if type(value) is not int or value < 0:
        raise _Refused(f"has {value!r} for {what}, which is not a non-negative integer")
    return value


def _str(value, what: str, optional: bool = False) -> str | None:
    if (value is None and optional) or type(value) is str:
        return value
    raise _Refused(f"has a {type(value).__name__} for {what}, which is not a string")


class _Schema:
    """Records checked against DCP's metadata schema and turned into DCP's objects."""

    def __init__(self, kinds: dict[type, str]):
        self.kinds = kinds
        self.sizes: dict[int, torch.Size] = {}  # id(tuple) -> its Size: shared in a pickle

    def describe(self, obj) -> str:
        return f"a {self.kinds.get(type(obj)) or type(obj).__name__}"

    def fields(self, obj, kind: str, what: str, names: frozenset) -> dict:
        """A record's fields (what BUILD put in its __dict__), only those of `kind`."""
        if self.kinds.get(type(obj)) != kind:
            raise _Refused(f"has {self.describe(obj)} where {what} should be a {kind}")
        state = vars(obj)
        if not names.issuperset(state):
            unknown = sorted(map(repr, state.keys() - names))
            raise _Refused(f"has a {kind} with fields {unknown} that this reader does not "
                           "know (a DCP version newer than this autopar's)")
        return state

    def size(self, dims, what: str) -> torch.Size:
        size = self.sizes.get(id(dims))
        if size is not None:
            return size
        if type(dims) is not tuple or not set(map(type, dims)) <= {int} or \
                (dims and min(dims) < 0):
            raise _Refused(f"has a malformed torch.Size for {what}")
        self.sizes[id(dims)] = size = torch.Size(dims)
        return size

    def properties(self, obj, fqn: str) -> TensorProperties:
        state = self.fields(obj, "TensorProperties", f"the properties of {fqn}",
                            frozenset(("state",))).get("state")
        if type(state) is not tuple or len(state) != 5:
            raise _Refused(f"has malformed tensor properties for {fqn}")
        dtype, layout, requires_grad, memory, pin = state
        if type(dtype) is not torch.dtype:
            raise _Refused(f"has {self.describe(dtype)} for the dtype of {fqn}")
        if layout != "torch.strided":
            raise _Refused(f"has a layout for {fqn} other than torch.strided, which DCP "
                           "writes")
        if type(memory) is not int or memory not in _MEMORY_FORMATS:
            raise _Refused(f"has an unknown memory format for {fqn}")
        if type(requires_grad) is not bool or type(pin) is not bool:
            raise _Refused(f"has malformed tensor flags for {fqn}")
        return TensorProperties(dtype=dtype, layout=torch.strided, requires_grad=requires_grad,
                                memory_format=_MEMORY_FORMATS[memory], pin_memory=pin)

    def tensor(self, obj, fqn: str) -> TensorStorageMetadata:
        state = self.fields(obj, "TensorStorageMetadata", f"the entry of {fqn}",
                            frozenset(("properties", "size", "chunks")))
        size = self.size(state.get("size"), f"the size of {fqn}")
        chunks = state.get("chunks")
        if type(chunks) is not list:
            raise _Refused(f"has no list of chunks for {fqn}")
        out = []
        for chunk in chunks:
            c = self.fields(chunk, "ChunkStorageMetadata", f"a chunk of {fqn}", _CHUNK_FIELDS)
            offsets = self.size(c.get("offsets"), f"a chunk offset of {fqn}")
            sizes = self.size(c.get("sizes"), f"a chunk size of {fqn}")
            if len(offsets) != len(size) or len(sizes) != len(size) or \
                    any(o + n > s for o, n, s in zip(offsets, sizes, size)):
                raise _Refused(f"has a chunk of {fqn} at {tuple(offsets)} of {tuple(sizes)} "
                               f"outside its size {tuple(size)}")
            out.append(ChunkStorageMetadata(offsets=offsets, sizes=sizes))
        if sum(math.prod(c.sizes) for c in out) != math.prod(size) or _overlap(out):
            raise _Refused(f"has chunks of {fqn} that do not cover its size {tuple(size)} "
                           "once")
        return TensorStorageMetadata(properties=self.properties(state.get("properties"), fqn),
                                     size=size, chunks=out)

    def index(self, obj) -> MetadataIndex:
        state = self.fields(obj, "MetadataIndex", "a storage key", _INDEX_FIELDS)
        fqn = _str(state.get("fqn"), "a storage key's name")
        offset, index = state.get("offset"), state.get("index")
        return MetadataIndex(fqn=fqn, offset=None if offset is None else
                             self.size(offset, f"a storage offset of {fqn}"),
                             index=None if index is None else _int(index, f"an index of {fqn}"))

    def storage(self, obj, fqn: str) -> StorageInfo:
        state = self.fields(obj, "StorageInfo", f"the storage of {fqn}", _STORAGE_FIELDS)
        name = _str(state.get("relative_path"), f"the data file of {fqn}")
        if not name or name in (".", "..") or "/" in name or os.sep in name or \
                (os.altsep and os.altsep in name) or "\x00" in name:
            raise _Refused(f"names the data file {name!r} for {fqn}, which is not a file "
                           "beside it")
        if state.get("transform_descriptors"):  # a stream transform DCP would run
            raise _Refused(f"asks for stream transforms {state['transform_descriptors']!r} "
                           f"on {fqn}, which autopar never writes")
        return StorageInfo(relative_path=name,
                           offset=_int(state.get("offset"), f"an offset of {fqn}"),
                           length=_int(state.get("length"), f"a length of {fqn}"))

    def storage_meta(self, obj) -> StorageMeta | None:
        if obj is None:
            return None
        state = self.fields(obj, "StorageMeta", "the storage record",
                            frozenset(("checkpoint_id", "save_id", "load_id", "modules")))
        ckpt_id = state.get("checkpoint_id")
        if self.kinds.get(type(ckpt_id)) == "Path":
            parts = vars(ckpt_id).get("parts") or ("",)
            ckpt_id = os.path.join(*[_str(p, "the checkpoint id") for p in parts])
        modules = state.get("modules") or []
        if type(modules) is not list:
            raise _Refused("has a storage record whose modules are not a list")
        return StorageMeta(checkpoint_id=_str(ckpt_id, "the checkpoint id", optional=True),
                           save_id=_str(state.get("save_id"), "the save id", optional=True),
                           load_id=_str(state.get("load_id"), "the load id", optional=True),
                           modules=[_str(m, "a module name") for m in modules])

    def metadata(self, obj) -> Metadata:
        state = self.fields(obj, "Metadata", "the top level",
                            frozenset(("state_dict_metadata", "planner_data", "storage_data",
                                       "storage_meta", "version")))
        tensors = {}
        entries = state.get("state_dict_metadata")
        if type(entries) is not dict:
            raise _Refused(f"has {self.describe(entries)} for its entries, not a dict")
        for fqn, entry in entries.items():
            fqn = _str(fqn, "an entry's name")
            if self.kinds.get(type(entry)) != "TensorStorageMetadata":
                raise _Refused(f"has {self.describe(entry)} for {fqn}, where autopar writes "
                               "only tensors")
            tensors[fqn] = self.tensor(entry, fqn)
        storage = {}
        items = state.get("storage_data")
        if type(items) is not dict:
            raise _Refused(f"has {self.describe(items)} for its storage, not a dict")
        for key, info in items.items():
            index = self.index(key)
            storage[index] = self.storage(info, index.fqn)
        stored = {(index.fqn, index.offset) for index in storage}  # what MetadataIndex compares
        for fqn, md in tensors.items():
            for chunk in md.chunks:
                if (fqn, chunk.offsets) not in stored:
                    raise _Refused(f"has no data file for the chunk of {fqn} at "
                                   f"{tuple(chunk.offsets)}")
        return Metadata(state_dict_metadata=tensors, storage_data=storage,
                        planner_data=None,  # DCP's flattening map: autopar never reads it
                        storage_meta=self.storage_meta(state.get("storage_meta")),
                        version=_str(state.get("version"), "the version", optional=True))


def _overlap(chunks: list[ChunkStorageMetadata]) -> bool:
    """Whether two chunks share an element: a sweep along the dim where their offsets
    differ most, so a row, column or grid split is checked in about linear time."""
    if len(chunks) < 2 or not chunks[0].offsets:
        return len(chunks) > 1
    dim = max(range(len(chunks[0].offsets)), key=lambda d: len({c.offsets[d] for c in chunks}))
    order = sorted(chunks, key=lambda c: c.offsets[dim])
    for i, a in enumerate(order):
        for b in order[i + 1:]:
            if b.offsets[dim] >= a.offsets[dim] + a.sizes[dim]:
                break
            if all(b.offsets[d] < a.offsets[d] + a.sizes[d] and
                   a.offsets[d] < b.offsets[d] + b.sizes[d] for d in range(len(a.offsets))):
                return True
    return False


def _check_files(ckpt: str, metadata: Metadata) -> None:
    """Every data file the metadata names exists and holds the bytes it says: a truncated
    or missing file is named here, before any rank starts reading."""
    sizes: dict[str, int] = {}
    for index, info in metadata.storage_data.items():
        name = info.relative_path
        if name not in sizes:
            try:
                sizes[name] = os.stat(os.path.join(ckpt, name)).st_size
            except OSError as e:
                raise CheckpointError(f"the checkpoint data file {os.path.join(ckpt, name)} "
                                      f"could not be read ({e.strerror or e}); load a "
                                      "complete checkpoint.") from e
        if info.offset + info.length > sizes[name]:
            raise CheckpointError(f"the checkpoint data file {os.path.join(ckpt, name)} is "
                                  f"truncated ({sizes[name]} bytes, {index.fqn} ends at byte "
                                  f"{info.offset + info.length}); save the checkpoint again "
                                  "or load an earlier one.")


# ---------------------------------------------------------------------- DCP's reader
class SafeReader(FileSystemReader):
    """DCP's file reader given metadata read by `read_metadata` (DCP never unpickles the
    file itself); a data file that fails to load is named in the error."""

    def __init__(self, ckpt: str, metadata: Metadata):
        super().__init__(ckpt)
        self._checked = metadata

    def read_metadata(self, *args, **kwargs) -> Metadata:
        if self._checked.storage_meta is None:
            self._checked.storage_meta = StorageMeta()
        self._checked.storage_meta.load_id = self.load_id
        return self._checked

    def read_data(self, plan: LoadPlan, planner) -> Future[None]:
        by_file: dict[str, list] = {}
        for item in plan.items:
            by_file.setdefault(self.storage_data[item.storage_index].relative_path,
                               []).append(item)
        for name, items in by_file.items():
            try:
                super().read_data(LoadPlan(items, plan.storage_data, plan.planner_data),
                                  planner)
            except (OSError, EOFError, RuntimeError, ValueError, AssertionError,
                    pickle.UnpicklingError) as e:  # from the read or torch.load
                raise CheckpointError(
                    f"the checkpoint data file {os.path.join(str(self.path), name)} is "
                    f"truncated or unreadable ({type(e).__name__}: {e}); save the "
                    "checkpoint again or load an earlier one.") from e
        done: Future = Future()
        done.set_result(None)
        return done
