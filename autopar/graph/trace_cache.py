"""A process-wide cache of traced graphs: a model traced again with the same structure gets a
copy of the first graph, bound to its own tensors, instead of seconds of torch.export.

The key is a structural fingerprint of everything the graph can depend on: each module's
class (its members across the MRO and the functions and flags their code reads from its
module's globals), its attributes (values by content; functions, tensors held as plain
attributes and unknown objects by identity), hooks and `training` flag; every parameter's
and buffer's name, shape, stride, dtype, requires_grad, device type and aliasing; the
example inputs'; the loss; `train`; the stand-ins `opaque_moe` installs (by the description
they stand for); torch's global state that changes tracing; and autopar's own tracing code.
What the key names by identity is held by weak reference, so the cache keeps no model
alive, and an entry whose referents died is dropped (an id reused by a new object never
hits). Only torch.export's graphs are kept (the fx fallback lifts tensors it may have
copied). `AUTOPAR_TRACE_CACHE=0` turns the cache off; `clear()` empties it.
"""

from __future__ import annotations

import copy
import dataclasses
import enum
import functools
import os
import sys
import types
import weakref
from collections import OrderedDict

import torch
import torch.fx as fx
from torch import nn
from torch.fx._lazy_graph_module import _LazyGraphModule

from autopar.graph.analysis import Layer
from autopar.graph.ir import TracedGraph, copy_nodes
from autopar.graph.opaque import STANDS_FOR

__all__ = ["MAX_ENTRIES", "CacheInfo", "clear", "enabled", "info", "key", "lookup", "stand_in_for",
           "store"]

MAX_ENTRIES = 16
"""Graphs kept, least recently used dropped first."""

# (the pool reset of tests/distributed.py puts back rebound module globals only: these
# objects are mutated in place, so the cache outlives a reset, which is sound because
# autopar's tracing code is part of the key)
_ENTRIES: OrderedDict = OrderedDict()
_STATS = {"hits": 0, "misses": 0}

_TRACING_MODULES = ("autopar.graph.trace", "autopar.graph.analysis", "autopar.graph.ir",
                    "autopar.graph.linear_forms", "autopar.graph.inplace", "autopar.graph.opaque")
_ATOMS = (int, float, bool, complex, str, bytes, type(None), torch.dtype, torch.device,
          torch.layout, torch.memory_format)
_DEPTH = 12  # nesting walked by content before a value is called uncacheable
_SKIPPED_MEMBERS = ("__dict__", "__weakref__", "__doc__", "__module__", "__qualname__")
# torch.nn.Module's own members when this module was imported: one another library adds to
# the class later (transformers gives it its init helper, `smart_apply`, when it builds its
# first model) is no member any forward reaches through `Module`, and keying it would make
# every model traced before that build miss after it. A member of these replaced is keyed.
_MODULE_MEMBERS = frozenset(vars(nn.Module))


@dataclasses.dataclass(frozen=True)
class CacheInfo:
    hits: int
    misses: int
    entries: int


class _Uncacheable(Exception):
    """The model holds something the fingerprint cannot name safely."""


def enabled() -> bool:
    """Whether tracing uses the cache (`AUTOPAR_TRACE_CACHE=0` turns it off)."""
    return os.environ.get("AUTOPAR_TRACE_CACHE", "1") != "0"


def clear() -> None:
    """Drop every cached graph and reset the counts."""
    _ENTRIES.clear()
    _STATS.update(hits=0, misses=0)


def info() -> CacheInfo:
    """Hits and misses since the last `clear()`, and the graphs held."""
    return CacheInfo(_STATS["hits"], _STATS["misses"], len(_ENTRIES))


class _Key:
    """A fingerprint and the weak references to what it names by identity."""

    def __init__(self, value: tuple, refs: list, pins: list):
        self.value, self.refs, self.pins = value, refs, pins


def key(model: nn.Module, inputs: tuple, loss_fn, train: bool) -> _Key | None:
    """The cache key of tracing `model` on `inputs` (the target last when `loss_fn` is
    given), or None when the cache is off or the model cannot be fingerprinted safely."""
    if not enabled():
        return None
    fp = _Fingerprint()
    try:
        value = (fp.model(model), tuple(fp.example(t) for t in inputs), fp.loss(loss_fn),
                 bool(train), fp.torch_state(), fp.tracing_code())
        value += (tuple(fp.classes.values()),)  # what the modules' class indices name
    except (_Uncacheable, RecursionError):
        return None
    return _Key(value, fp.refs, fp.pins)


def lookup(k: _Key, model: nn.Module) -> TracedGraph | None:
    """A fresh copy of the graph cached under `k`, bound to `model`'s tensors, or None."""
    entry = _ENTRIES.get(k.value)
    if entry is not None and not all(r() is not None for r in entry.refs):
        del _ENTRIES[k.value]  # a referent died: its id may now name another object
        entry = None
    if entry is None:
        _STATS["misses"] += 1
        return None
    tensors = _model_tensors(model)
    if any(name not in tensors for _, name in entry.stand_ins):
        _STATS["misses"] += 1
        return None
    _ENTRIES.move_to_end(k.value)
    _STATS["hits"] += 1
    return entry.copy({id(s): tensors[name] for s, name in entry.stand_ins})


def store(k: _Key, model: nn.Module, traced: TracedGraph) -> None:
    """Keep a copy of `traced` (just traced from `model`) under `k`, holding stand-ins in
    place of the model's tensors."""
    if traced.tracer != "export":
        return
    names = {id(t): name for name, t in _model_tensors(model).items()}
    storages = {_storage(t) for t in _model_tensors(model).values()} - {None}
    stand_ins, substitute = [], {}
    for t in _graph_tensors(traced.gm):
        if id(t) in names:
            if id(t) not in substitute:
                stand_in = stand_in_for(t)
                substitute[id(t)] = stand_in
                stand_ins.append((stand_in, names[id(t)]))
        elif _storage(t) in storages or type(t) not in (torch.Tensor, nn.Parameter):
            return  # a view or copy of a model tensor, or a subclass: not bound safely
    _ENTRIES[k.value] = _Entry(traced, substitute, stand_ins, k)
    _ENTRIES.move_to_end(k.value)
    for dead in [v for v, e in _ENTRIES.items() if not all(r() is not None for r in e.refs)]:
        del _ENTRIES[dead]
    while len(_ENTRIES) > MAX_ENTRIES:
        _ENTRIES.popitem(last=False)


class _Entry:
    """A traced graph with stand-ins for the model's tensors, and what names them."""

    def __init__(self, traced: TracedGraph, substitute: dict, stand_ins: list, k: _Key):
        self.stand_ins = stand_ins  # (stand-in tensor, the model's name for the tensor)
        self.refs, self.pins = k.refs, k.pins
        self.traced = _copy(traced, substitute)

    def copy(self, substitute: dict) -> TracedGraph:
        return _copy(self.traced, substitute)


def _copy(traced: TracedGraph, substitute: dict) -> TracedGraph:
    """`traced` with its own graph and module tree: tensors in `substitute` (by id) replaced,
    constants cloned, node meta copied one level, layers on the new nodes."""
    gm, nodes = _copy_graph_module(traced.gm, substitute)
    layers = [Layer(layer.name, [nodes[n] for n in layer.nodes], layer.group)
              for layer in traced.layers]
    return TracedGraph(gm=gm, tracer=traced.tracer, example_batch=traced.example_batch,
                       params=dict(traced.params), with_loss=traced.with_loss,
                       fallback_reason=traced.fallback_reason, layers=layers)


def _copy_graph_module(gm: fx.GraphModule, substitute: dict):
    """A new GraphModule of `gm`'s class, as export's `module()` builds one: the same
    attributes (methods rebound), hooks and meta; a copied graph; a copied module tree. Its
    Python code is generated when it first runs or its code is read (`_lazy_class`): the
    engine runs its rewritten copies of a traced graph, not the traced graph itself."""
    graph = fx.Graph(tracer_cls=gm.graph._tracer_cls)
    nodes = copy_nodes(gm.graph, graph, _shallow)
    graph._codegen = copy.copy(gm.graph._codegen)  # (its specs are read only)
    clones: dict = {}
    res = object.__new__(_lazy_class(type(gm)))
    _copy_module_state(gm, res, substitute, clones)
    res.meta = {k: _shallow(v) for k, v in gm.meta.items()}
    res.graph = graph  # (the setter marks the code for generation at the first read)
    return res, nodes


def _lazy_class(cls: type) -> type:
    """A class for one copy of a `cls` instance, as GraphModule makes one per instance (its
    `forward` is set on its class), that generates its code lazily as `_LazyGraphModule`
    does: `_LazyGraphModule` before the first class of `cls`'s order that is neither such a
    per-instance class nor lazy (export's `_StatefulGraphModule`, or GraphModule)."""
    base = next(t for t in cls.__mro__ if t is not _LazyGraphModule
                and t.__qualname__.split(".")[-1] != "GraphModuleImpl")
    bases = (_LazyGraphModule,) if base is fx.GraphModule else (_LazyGraphModule, base)

    class GraphModuleImpl(*bases):  # (the name GraphModule.__new__ looks past)
        pass

    return GraphModuleImpl


def _copy_module_state(src: nn.Module, dst: nn.Module, substitute: dict, clones: dict) -> None:
    state = dict(vars(src))
    for name in ("_graph", "_code", "_lineno_map", "_prologue_start", "meta"):
        state.pop(name, None)
    for name, value in state.items():
        if isinstance(value, types.MethodType) and value.__self__ is src:
            state[name] = types.MethodType(value.__func__, dst)
        elif isinstance(value, torch.Tensor):
            state[name] = _tensor(value, substitute, clones)
        elif name in ("_parameters", "_buffers"):
            state[name] = {k: _tensor(v, substitute, clones) if v is not None else None
                           for k, v in value.items()}
        elif name == "_modules":
            state[name] = {k: _copy_module(m, substitute, clones) if m is not None else None
                           for k, m in value.items()}
        elif isinstance(value, (dict, set, list)):
            state[name] = type(value)(value)  # hooks and name sets: the copy's own
    dst.__dict__.update(state)


def _copy_module(module: nn.Module, substitute: dict, clones: dict) -> nn.Module:
    if id(module) in clones:
        return clones[id(module)]
    res = type(module).__new__(type(module))
    clones[id(module)] = res
    _copy_module_state(module, res, substitute, clones)
    return res


def _tensor(t: torch.Tensor, substitute: dict, clones: dict) -> torch.Tensor:
    """The model's tensor for a stand-in, or the copy's own clone of a constant."""
    if id(t) in substitute:
        return substitute[id(t)]
    if id(t) not in clones:
        clone = t.detach().clone()
        clones[id(t)] = nn.Parameter(clone, t.requires_grad) if isinstance(t, nn.Parameter) \
            else clone
    return clones[id(t)]


def _shallow(value):
    return type(value)(value) if type(value) in (dict, list, OrderedDict) else value


def stand_in_for(t: torch.Tensor) -> torch.Tensor:
    """A meta tensor of `t`'s kind (a parameter or not, requires_grad) holding its place."""
    meta = torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device="meta")
    return nn.Parameter(meta, t.requires_grad) if isinstance(t, nn.Parameter) else meta


def _storage(t: torch.Tensor):
    if t.device.type == "meta":
        return None
    try:
        return t.untyped_storage().data_ptr() or None
    except (RuntimeError, NotImplementedError):
        return None


def _graph_tensors(gm: nn.Module):
    """Every tensor a GraphModule's module tree holds: parameters, buffers, plain attributes."""
    for module in gm.modules():
        for name, value in vars(module).items():
            if isinstance(value, torch.Tensor):
                yield value
            elif name in ("_parameters", "_buffers"):
                yield from (v for v in value.values() if v is not None)


def _model_tensors(model: nn.Module) -> dict[str, torch.Tensor]:
    """The model's tensors by name (the first of aliases): parameters, buffers and tensors
    held as plain attributes (which export keeps as they are)."""
    out: dict[str, torch.Tensor] = {}
    for name, t in list(model.named_parameters(remove_duplicate=False)) + \
            list(model.named_buffers(remove_duplicate=False)):
        out.setdefault(name, t)
    for path, module in model.named_modules(remove_duplicate=False):
        for attr, value in vars(module).items():
            if isinstance(value, torch.Tensor):
                out.setdefault(f"{path}.{attr}" if path else attr, value)
    return out


class _Fingerprint:
    """Builds a key value; what it names by identity is kept weakly in `refs` (or strongly
    in `pins`: class members and builtins that cannot be weakly referenced)."""

    def __init__(self):
        self.refs: list = []
        self.pins: list = []
        self.classes: dict = {}  # class -> its fingerprint, in the order first met
        self._index: dict = {}
        self._walked: dict = {}  # id -> fingerprint of objects walked by content
        self._members: dict = {}  # class -> `members`, once a key (nn.Module is in every MRO)

    def ident(self, obj, pin: bool = False) -> int:
        try:
            self.refs.append(weakref.ref(obj))
        except TypeError:
            if not pin and not isinstance(obj, types.BuiltinFunctionType):
                raise _Uncacheable(type(obj).__qualname__) from None
            self.pins.append(obj)
        return id(obj)

    # -- the model
    def model(self, model: nn.Module) -> tuple:
        modules = tuple((name, self.klass(type(m)), self.module_state(m))
                        for name, m in model.named_modules(remove_duplicate=False))
        first: dict[int, str] = {}
        tensors = []
        for kind, named in (("param", model.named_parameters(remove_duplicate=False)),
                            ("buffer", model.named_buffers(remove_duplicate=False))):
            for name, t in named:
                tensors.append((kind, name, first.setdefault(id(t), name)) + self.tensor(t))
        return modules, tuple(tensors)

    def module_state(self, m: nn.Module) -> tuple:
        hook_ids = sorted({k for name, v in vars(m).items() if "hook" in name
                           and isinstance(v, dict) for k in v if isinstance(k, int)})
        rank = {h: i for i, h in enumerate(hook_ids)}
        # attributes the module's class declares its forward writes but never reads
        # (statistics for a report, such as the rows each expert computed last)
        untraced = getattr(type(m), "autopar_untraced_state", frozenset())
        out = []
        for name, value in vars(m).items():
            if name in untraced:
                continue
            if name in ("_parameters", "_buffers", "_modules"):
                out.append((name, tuple((k, v is None) for k, v in value.items())))
            elif "hook" in name and isinstance(value, dict):
                out.append((name, tuple((rank.get(k, k), self.value(v)) for k, v in value.items())))
            elif isinstance(value, torch.Tensor):
                out.append((name, "tensor", self.ident(value)) + self.tensor(value))
            else:
                out.append((name, self.value(value)))
        return tuple(out)

    def tensor(self, t) -> tuple:
        if not isinstance(t, torch.Tensor) or t.layout is not torch.strided:
            raise _Uncacheable("not a strided tensor")
        return (type(t).__qualname__, self.ident(type(t)), tuple(t.shape), t.stride(), t.dtype,
                t.requires_grad, t.device.type)

    def example(self, t) -> tuple:
        """An example input or target as `tensor` fingerprints it, less its batch (dimension
        0, which every graph of the trace holds as a symbol) when its strides are the
        contiguous ones of its shape (so they follow from the other dimensions)."""
        out = self.tensor(t)
        if t.dim() and t.stride() == _contiguous_strides(t.shape):
            kind, ident, shape, _, *rest = out
            out = (kind, ident, ("batch",) + shape[1:], None, *rest)  # strides: the shape's
        return out

    def loss(self, loss_fn) -> tuple:
        if isinstance(loss_fn, nn.Module):
            if any(True for _ in loss_fn.parameters()) or any(True for _ in loss_fn.buffers()):
                raise _Uncacheable("a loss holding tensors")
            return ("module",) + self.model(loss_fn)
        return ("fn", self.value(loss_fn))

    # -- classes and values
    def klass(self, cls: type) -> int:
        """An index into the class fingerprints of this key (each class walked once)."""
        if cls not in self._index:
            self._index[cls] = len(self._index)
            self.classes[cls] = tuple((c.__qualname__, self.ident(c), self.members(c))
                                      for c in cls.__mro__[:-1])
        return self._index[cls]

    def members(self, cls: type) -> tuple:
        if cls not in self._members:
            self._members[cls] = self._walk_members(cls)
        return self._members[cls]

    def _walk_members(self, cls: type) -> tuple:
        out = []
        for name, value in vars(cls).items():
            if name in _SKIPPED_MEMBERS or (cls is nn.Module and name not in _MODULE_MEMBERS):
                continue
            inner = value.__func__ if isinstance(value, (staticmethod, classmethod)) else value
            if cls is nn.Module:
                inner = _untagged(inner)
            if isinstance(inner, types.FunctionType):
                out.append((name, self.function(inner), self.globals_read(inner)))
            elif isinstance(inner, property):
                out.append((name, tuple(self.value(f) for f in (inner.fget, inner.fset))))
            elif type(inner) in _ATOMS:
                out.append((name, type(inner).__name__, inner))
            else:
                out.append((name, type(inner).__qualname__, self.ident(inner, pin=True)))
        return tuple(out)

    def globals_read(self, fn: types.FunctionType) -> tuple:
        """The functions, classes and flags `fn` reads from its module's globals."""
        out = []
        for name in fn.__code__.co_names:
            value = fn.__globals__.get(name, _ABSENT)
            if type(value) in _ATOMS:
                out.append((name, type(value).__name__, value))
            elif isinstance(value, (types.FunctionType, type)):
                out.append((name, self.ident(value)))
        return tuple(out)

    def function(self, fn: types.FunctionType) -> tuple:
        stands_for = getattr(fn, STANDS_FOR, None)
        if stands_for is not None:  # opaque_moe's stand-in: its code and what it stands for
            return ("stand-in", stands_for, self.ident(fn.__code__))
        return ("fn", fn.__module__, fn.__qualname__, self.ident(fn),
                self.value(fn.__defaults__), self.value(fn.__kwdefaults__))

    def value(self, x, depth: int = 0):
        kind = type(x)
        if kind in _ATOMS:
            return (kind.__name__, x)
        if depth > _DEPTH:
            raise _Uncacheable("nested too deep")
        if isinstance(x, enum.Enum):
            return ("enum", self.ident(kind), x.name)
        if kind in (tuple, list, torch.Size):
            return (kind.__name__,) + tuple(self.value(v, depth + 1) for v in x)
        if kind in (dict, OrderedDict):
            return (kind.__name__,) + tuple((self.value(k, depth + 1), self.value(v, depth + 1))
                                            for k, v in x.items())
        if kind in (set, frozenset):
            return (kind.__name__, frozenset(self.value(v, depth + 1) for v in x))
        if isinstance(x, torch.Tensor):
            return ("tensor", self.ident(x)) + self.tensor(x)
        if isinstance(x, types.FunctionType):
            return self.function(x)
        if isinstance(x, types.MethodType):
            return ("method", self.value(x.__func__, depth + 1), self.ident(x.__self__))
        if isinstance(x, functools.partial):
            return ("partial", self.value(x.func, depth + 1), self.value(x.args, depth + 1),
                    self.value(x.keywords, depth + 1))
        if isinstance(x, type):
            return ("type", x.__qualname__, self.ident(x))
        if _by_content(x):  # a transformers config or a dataclass: its fields, recursively
            if id(x) not in self._walked:
                self._walked[id(x)] = ("cycle", len(self._walked))  # (by content: no ident)
                fields = {k: v for k, v in vars(x).items() if k not in _UNREAD} \
                    if not dataclasses.is_dataclass(x) else \
                    {f.name: getattr(x, f.name) for f in dataclasses.fields(x)}
                self._walked[id(x)] = ("content", kind.__qualname__, self.ident(kind),
                                       self.value(dict(fields), depth + 1))
            return self._walked[id(x)]
        return ("object", kind.__qualname__, self.ident(x))

    # -- the process
    def torch_state(self) -> tuple:
        from torch.overrides import _get_current_function_mode_stack
        from torch.utils._python_dispatch import _get_current_dispatch_mode_stack

        if _get_current_function_mode_stack() or _get_current_dispatch_mode_stack():
            raise _Uncacheable("a torch function or dispatch mode is active")
        autocast = tuple((d, torch.is_autocast_enabled(d), torch.get_autocast_dtype(d))
                         for d in ("cpu", "cuda"))
        hooks = tuple((name, self.value(list(v.values())))
                      for name, v in sorted(vars(nn.modules.module).items())
                      if name.startswith("_global_") and isinstance(v, dict))
        return (torch.get_default_dtype(), torch.is_grad_enabled(),
                torch.is_inference_mode_enabled(), autocast, str(torch.get_default_device()),
                hooks, self.ident(torch.export.export))

    def tracing_code(self) -> tuple:
        """autopar's tracing functions as they are now (a test may wrap one)."""
        out = []
        for name in _TRACING_MODULES:
            module = sys.modules.get(name)
            if module is None:
                continue
            out.append((name,) + tuple((k, self.ident(v)) for k, v in vars(module).items()
                                       if isinstance(v, (types.FunctionType, type))))
        return tuple(out)


_ABSENT = object()
_DYNAMO_TAGGING = "torch._dynamo.mutation_guard"


def _untagged(fn):
    """nn.Module's `__init__` or `__setstate__` without dynamo's generation tagging: a
    process's first compile wraps both once (the wrapper calls the original, then tags the
    module: nothing a trace reads), which would make every graph traced before it miss
    after it."""
    while isinstance(fn, types.FunctionType) and fn.__module__ == _DYNAMO_TAGGING \
            and fn.__closure__:
        free = dict(zip(fn.__code__.co_freevars, (c.cell_contents for c in fn.__closure__)))
        wrapped = free.get("init", free.get("setstate"))
        if not isinstance(wrapped, types.FunctionType):
            break
        fn = wrapped
    return fn


_CONFIGS = ("PretrainedConfig", "PreTrainedConfig", "GenerationConfig")  # transformers'
_UNREAD = ("_original_object_hash",)  # a generation config's hash of itself, per instance


def _contiguous_strides(shape) -> tuple:
    strides, step = [], 1
    for size in reversed(shape):
        strides.append(step)
        step *= max(size, 1)
    return tuple(reversed(strides))


def _by_content(x) -> bool:
    if dataclasses.is_dataclass(x):
        return True
    return any(c.__name__ in _CONFIGS and c.__module__.startswith("transformers.")
               for c in type(x).__mro__)
