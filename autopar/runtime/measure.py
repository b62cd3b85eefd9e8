"""What a training step really costs, per layer: time from marks in the graphs, saved
activations from autograd's hooks, collectives from the comm log (`Engine.explain()`); and
the memory of a step (`measure_saved_activations`, `measure_state_bytes`,
`measure_transient_bytes`)."""

from __future__ import annotations

import contextlib
import dataclasses
import time
import weakref
from dataclasses import dataclass, field
from typing import Callable, Iterable

import torch
from torch import fx, nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from autopar.cost.state import StateBytes
from autopar.kernels.chunked_loss import ChunkedCrossEntropy
from autopar.modes import DP, EDP, PP, STEP

_COMPUTE = ("call_function", "call_module", "call_method")


@dataclass
class LayerFigures:
    """One layer's measured totals over the recorded steps (seconds and bytes)."""

    forward_s: float = 0.0
    backward_s: float = 0.0
    saved_bytes: int = 0
    comm_bytes: int = 0
    comm_s: float = 0.0
    backward_timed: bool = True  # False: some segment had no backward tick of its own
    comm_by_axis: dict = field(default_factory=dict)  # mesh axis -> bytes of comm_bytes


@dataclass
class _Call:
    layers: list  # layer of each segment, then None for the output mark
    forward: list
    backward: list
    handles: list = field(default_factory=list)
    end: object = None  # when the backward that ran this call returned (whole-graph steps)


class _GpuStamp:
    """A point in a CUDA stream's work (an event recorded there), so that the difference of
    two is the GPU time between them, not the host's: on a GPU the host runs ahead of the
    kernels it queues. Read after the step's work is synchronized."""

    __slots__ = ("event",)

    def __init__(self):
        self.event = torch.cuda.Event(enable_timing=True)
        self.event.record()

    def __sub__(self, other: _GpuStamp) -> float:
        return other.event.elapsed_time(self.event) / 1e3


class Recorder:
    """Per-layer time and saved bytes of the steps since `reset`, and the layer now running.

    Time stamps are the host's clock on a CPU and CUDA events on a GPU (`device`)."""

    def __init__(self, warmup: int = 1, device: torch.device | None = None):
        self.enabled = True
        self.device = device
        self.layer: str | None = None  # the layer whose forward or backward runs now
        self.warmup = warmup  # the first steps are not counted (allocation, first gathers)
        self.seen = 0  # steps finished, warm-up included
        self.steps = 0  # steps counted in the totals below
        self.step_s = 0.0
        self.layers: dict[str, LayerFigures] = {}
        self.axes: dict[str, list] = {}  # axis -> [bytes, seconds]
        self._start: float | None = None
        self._log_mark = 0
        self._calls: list[_Call] = []
        self._open: dict[int, _Call] = {}  # graph key -> its call in progress (forward)
        self._saved_storages: dict[int, weakref.ref] = {}  # address -> its storage
        # storages of the parameters and buffers (the engine's, set each step): a saved view
        # of a weight is no activation, as the plan counts none (cost.memory)
        self.constant: frozenset[int] = frozenset()
        self._saved_step: dict[str, int] = {}  # layer -> bytes saved in this step
        self._backward_end: float | None = None
        self.kernels: dict[str, float] = {}  # tag -> seconds kernels timed themselves (`span`)
        self._spans: list = []  # (tag, start, end) of this step

    def reset(self) -> None:
        """Forget the totals (the next step is counted: no second warm-up)."""
        self.steps = 0
        self.step_s = 0.0
        self.layers.clear()
        self.axes.clear()
        self.kernels.clear()

    def _now(self):
        if self.device is not None and self.device.type == "cuda":
            return _GpuStamp()
        return time.perf_counter()

    def now(self):
        """A time stamp for `span` (a kernel timing part of its own work)."""
        return self._now()

    def span(self, tag: str, start) -> None:
        """Part of a kernel's work, tagged `tag`, ran from `start` (`now()`) until now: the
        chunked loss's logits its backward makes again (kernels.chunked_loss.REMADE)."""
        if self.enabled:
            self._spans.append((tag, start, self._now()))

    def begin_step(self, log) -> None:
        if not self.enabled:
            return
        self._start = self._now()
        self._log_mark = len(log.records)

    # ------------------------------------------------------------------ ticks
    def tick(self, key: int, k: int, layers: list, x) -> None:
        now = self._now()
        if k == 0:
            call = _Call(list(layers), [None] * len(layers), [None] * len(layers))
            self._open[key] = call
            self._calls.append(call)
        call = self._open.get(key)
        if call is None:
            return
        call.forward[k] = now
        self.layer = layers[k] if layers[k] is not None else self.layer
        if isinstance(x, torch.Tensor) and x.requires_grad:
            before = next((layers[j] for j in range(k - 1, -1, -1) if layers[j] is not None),
                          None)

            def hook(grad, call=call, k=k, before=before):
                if call.backward[k] is not None:  # a parameter's hook: a later micro-batch's
                    return None
                call.backward[k] = self._now()
                self.layer = before  # the backward goes on with the segment before
                return None

            call.handles.append(x.register_hook(hook))

    def backward_done(self) -> None:
        """The step's backward has returned (whole-graph steps): the first segment of a
        graph that had no probe of its own ends here."""
        self._backward_end = self._now()
        for call in self._calls:
            if call.end is None:
                call.end = self._backward_end

    def next_microbatch(self) -> None:
        """A micro-batch's backward is done (gradient accumulation): the next one's saved
        storages count again, even where the allocator gives back the same addresses."""
        self._saved_storages.clear()

    @contextlib.contextmanager
    def saving(self):
        """Count the bytes of every storage autograd saves, under the layer running. Hooks
        already installed (a memory measurement around train_step) still see every saved
        tensor: only the innermost pair runs, so this one calls them."""
        if not self.enabled:
            yield
            return
        outer = torch._C._autograd._top_saved_tensors_default_hooks(False)
        outer_pack, outer_unpack = outer if outer is not None else (None, None)

        def pack(t: torch.Tensor):
            if t.device.type != "meta":
                storage = t.untyped_storage()
                ptr = storage.data_ptr()
                held = self._saved_storages.get(ptr)
                if (held is None or held() is None) and ptr not in self.constant:
                    # (a storage freed since, whose address a later micro-batch's
                    # tensor reuses, counts again: a pipeline calls no next_microbatch)
                    self._saved_storages[ptr] = weakref.ref(storage)
                    layer = self.layer or "?"
                    self._saved_step[layer] = self._saved_step.get(layer, 0) + storage.nbytes()
            return t if outer_pack is None else _Outer(outer_pack(t))

        def unpack(x):
            return outer_unpack(x.packed) if isinstance(x, _Outer) else x

        with torch.autograd.graph.saved_tensors_hooks(pack, unpack):
            yield

    def finish_step(self, log) -> None:
        """Fold this step's calls and collectives into the per-layer and per-axis totals
        (after the warm-up steps). A step run while disabled is not counted."""
        if not self.enabled:
            self._calls.clear()
            self._open.clear()
            return
        self.seen += 1
        counted = self.seen > self.warmup
        end = self._now()
        if isinstance(end, _GpuStamp):  # every stamp of the step is read against the GPU's
            end.event.synchronize()
        if self._start is not None and counted:
            self.step_s += end - self._start
        for call in self._calls:
            for h in call.handles:
                h.remove()
            if counted:
                self._fold(call)
        if counted:
            for tag, start, stop in self._spans:
                self.kernels[tag] = self.kernels.get(tag, 0.0) + (stop - start)
            for name, nbytes in self._saved_step.items():
                self.layers.setdefault(name, LayerFigures()).saved_bytes += nbytes
        if counted:
            for r, sec in zip(log.records[self._log_mark:], log.seconds[self._log_mark:]):
                # the gradient sync (the experts' over edp too), ZeRO and the world's norms
                # belong to the step, even when a hook sends them while some layer's
                # backward runs
                # (and a pipeline's sends, tied gradients and loss)
                layer = STEP if r.layer is None or r.axis in (DP, EDP, "world", PP) \
                    else r.layer
                fig = self.layers.setdefault(layer, LayerFigures())
                fig.comm_bytes += r.bytes
                fig.comm_s += sec
                fig.comm_by_axis[r.axis] = fig.comm_by_axis.get(r.axis, 0) + r.bytes
                axis = self.axes.setdefault(r.axis, [0, 0.0])
                axis[0] += r.bytes
                axis[1] += sec
            self.steps += 1
        self._calls.clear()
        self._open.clear()
        self._saved_storages.clear()
        self._saved_step.clear()
        self._spans.clear()
        self._backward_end = None
        self._start = None
        self.layer = None

    def _fold(self, call: _Call) -> None:
        """Split a call's forward at its forward ticks and its backward at its backward
        ticks (segment k's backward: from the next segment's tick to its own; a negative
        span, from segments that run side by side, counts as none)."""
        n = len(call.layers) - 1  # the last mark is the output's
        end = call.end if call.end is not None else self._backward_end
        if end is not None and call.backward[0] is None and call.backward[n] is not None:
            call.backward[0] = end
        for k in range(n):
            fig = self.layers.setdefault(call.layers[k], LayerFigures())
            if call.forward[k] is not None and call.forward[k + 1] is not None:
                fig.forward_s += call.forward[k + 1] - call.forward[k]
            later = next((j for j in range(k + 1, n + 1) if call.backward[j] is not None),
                         None)
            if call.backward[k] is not None and later is not None:
                fig.backward_s += max(0.0, call.backward[k] - call.backward[later])
            elif call.backward[n] is not None:
                fig.backward_timed = False


class _Outer:
    """What an outer pack hook returned, to be given back to its unpack hook."""

    __slots__ = ("packed",)

    def __init__(self, packed):
        self.packed = packed


class _Mark(nn.Module):
    """Identity that notes the time its segment starts and, through a hook on its input's
    gradient, when the backward of everything after it is done."""

    def __init__(self, recorder: Recorder, key: int, k: int, layers: list):
        super().__init__()
        self.recorder, self.key, self.k, self.layers = recorder, key, k, layers

    def forward(self, x=None):
        if self.recorder.enabled:
            self.recorder.tick(self.key, self.k, self.layers, x)
        return x


def is_mark(module: nn.Module) -> bool:
    """Whether a graph's submodule is one of `instrument`'s marks."""
    return isinstance(module, _Mark)


def _layer(node: fx.Node) -> str | None:
    info = node.meta.get("autopar")
    return getattr(info, "layer", None)


def _floating(node: fx.Node) -> bool:
    info = node.meta.get("autopar")
    dtype = getattr(info, "dtype", None)
    if dtype is None:
        val = node.meta.get("val")
        dtype = getattr(val, "dtype", None)
    return dtype is not None and dtype.is_floating_point


def _is_parameter(gm: fx.GraphModule, node: fx.Node) -> bool:
    if node.op != "get_attr":
        return False
    try:
        value = gm.get_parameter(node.target)
    except AttributeError:
        return False
    return isinstance(value, nn.Parameter) and value.requires_grad


def instrument(gm: fx.GraphModule, recorder: Recorder, key: int,
               parameter_probes: bool = True) -> int:
    """Put the marks into `gm` (in place); returns the number of segments. No parameter
    probes for a graph run several times before its backwards (a pipeline stage): each
    micro-batch's backward would fire the same parameter's hook."""
    graph = gm.graph
    nodes = list(graph.nodes)
    order = {n: i for i, n in enumerate(nodes)}
    starts: list[tuple[fx.Node, str]] = []
    seen_segment: dict[fx.Node, int] = {}
    current = None
    for n in nodes:
        if n.op not in _COMPUTE:
            continue
        layer = _layer(n) or current
        if layer != current or not starts:
            starts.append((n, layer))
            current = layer
        seen_segment[n] = len(starts) - 1
    if not starts:
        return 0
    layers = [layer for _, layer in starts] + [None]
    for module in gm.modules():  # its backward's logits made again, timed for explain
        if isinstance(module, ChunkedCrossEntropy):
            module.timer = recorder
    for k, (first, _) in enumerate(starts):
        probe = next((a for a in first.all_input_nodes
                      if a.op in _COMPUTE + ("placeholder",) and _floating(a)
                      and seen_segment.get(a, -1) < k), None)
        if probe is None and parameter_probes:  # an embedding: its first parameter
            probe = next((a for m in nodes[order[first]:] if seen_segment.get(m) == k
                          for a in m.all_input_nodes if _is_parameter(gm, a)), None)
        name = f"autopar_mark_{key}_{k}"
        gm.add_submodule(name, _Mark(recorder, key, k, layers))
        with graph.inserting_before(first):
            mark = graph.call_module(name, (probe,) if probe is not None else ())
        mark.meta.update(first.meta if probe is None else probe.meta)
        if "autopar" in first.meta and "autopar" in mark.meta:
            mark.meta["autopar"] = dataclasses.replace(mark.meta["autopar"],
                                                       layer=first.meta["autopar"].layer)
    output = next(n for n in graph.nodes if n.op == "output")
    outs = output.args[0]
    flat = list(outs) if isinstance(outs, (tuple, list)) else [outs]
    end = next((i for i, v in enumerate(flat) if isinstance(v, fx.Node) and _floating(v)),
               None)
    name = f"autopar_mark_{key}_{len(starts)}"
    gm.add_submodule(name, _Mark(recorder, key, len(starts), layers))
    with graph.inserting_before(output):
        mark = graph.call_module(name, (flat[end],) if end is not None else ())
    if end is not None:
        mark.meta.update(flat[end].meta)
    gm.recompile()
    return len(starts)


# ------------------------------------------------------------------------ memory
def _storage_bytes(tensors: Iterable[torch.Tensor], exclude: frozenset = frozenset()) -> int:
    held: dict[int, int] = {}
    for t in tensors:
        storage = t.untyped_storage()
        if storage.data_ptr() not in exclude:
            held[storage.data_ptr()] = storage.nbytes()
    return sum(held.values())


def _span(t: torch.Tensor) -> tuple[int, int]:
    """The bytes of its storage a view reaches, as [start, end)."""
    if t.numel() == 0:
        return (0, 0)
    last = t.storage_offset() + sum((n - 1) * s for n, s in zip(t.shape, t.stride()))
    return (t.storage_offset() * t.element_size(), (last + 1) * t.element_size())


def _union(spans: list[tuple[int, int]]) -> int:
    total, end = 0, -1
    for a, b in sorted(spans):
        if b > end:
            total += b - max(a, end)
            end = b
    return total


class _NewStorages(TorchDispatchMode):
    """Counts the bytes of the storages the ops it sees make (an op's output whose storage
    is none of its inputs', each storage once), from each one's making to its freeing."""

    def __init__(self):
        super().__init__()
        self.live = self.peak = 0
        self._held: set[int] = set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        ins = {t.untyped_storage()._cdata for t in tree_leaves((args, kwargs))
               if isinstance(t, torch.Tensor)}
        out = func(*args, **kwargs)
        for t in tree_leaves(out):
            if not isinstance(t, torch.Tensor):
                continue
            storage = t.untyped_storage()
            key = storage._cdata
            if key in ins or key in self._held:
                continue  # in place, a view, or counted already
            self._held.add(key)
            self.live += storage.nbytes()
            self.peak = max(self.peak, self.live)
            weakref.finalize(storage, self._freed, key, storage.nbytes())
        return out

    def _freed(self, key: int, nbytes: int) -> None:
        self._held.discard(key)
        self.live -= nbytes


def measure_transient_bytes(fn: Callable[[], object]) -> int:
    """The most bytes of tensors `fn()` made that were alive at once (an optimizer step's
    temporaries: what it allocates beyond the tensors that existed before). Tensors an op
    allocates inside itself and frees before it returns are not seen."""
    mode = _NewStorages()
    with mode:
        fn()
    return mode.peak


def measure_saved_activations(fn: Callable[[], object], exclude: Iterable[torch.Tensor] = (),
                              inputs: Iterable[torch.Tensor] = ()) -> int:
    """Bytes of the distinct storages autograd saves while `fn()` runs, each once and whole;
    `exclude` (parameters, buffers) does not count, `inputs` only the bytes saved views reach."""
    skip = frozenset(t.untyped_storage().data_ptr() for t in exclude)
    batch = frozenset(t.untyped_storage().data_ptr() for t in inputs) - skip
    saved: list[torch.Tensor] = []

    def pack(t: torch.Tensor) -> torch.Tensor:
        saved.append(t)
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        fn()
    spans: dict[int, list] = {}
    for t in saved:
        ptr = t.untyped_storage().data_ptr()
        if ptr in batch:
            spans.setdefault(ptr, []).append(_span(t))
    return _storage_bytes(saved, skip | batch) + sum(_union(s) for s in spans.values())


def measure_peak_saved_activations(fn: Callable[[], object],
                                   exclude: Iterable[torch.Tensor] = (),
                                   inputs: Iterable[torch.Tensor] = ()) -> int:
    """The most bytes autograd holds saved at once while `fn()` runs: a storage counts from
    its first save until the last tensor saved on it is freed (arguments as above)."""
    skip = frozenset(t.untyped_storage().data_ptr() for t in exclude)
    batch = frozenset(t.untyped_storage().data_ptr() for t in inputs) - skip
    held: dict[int, list] = {}  # storage -> [bytes, [weak refs to the tensors saved on it]]
    peak = [0]

    def live() -> int:
        total = 0
        for ptr in list(held):
            nbytes, refs = held[ptr]
            refs[:] = [r for r in refs if r() is not None]
            if refs:
                total += nbytes
            else:
                del held[ptr]
        return total

    def pack(t: torch.Tensor) -> torch.Tensor:
        storage = t.untyped_storage()
        ptr = storage.data_ptr()
        if ptr not in skip:
            nbytes = _union([_span(t)]) if ptr in batch else storage.nbytes()
            key = (ptr, _span(t)) if ptr in batch else ptr
            entry = held.setdefault(key, [nbytes, []])
            entry[1].append(weakref.ref(t))
            peak[0] = max(peak[0], live())
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        fn()
    return peak[0]


def measure_state_bytes(engine, step: Callable[[], object] | None = None) -> StateBytes:
    """Bytes this rank of an Engine holds in parameters, gradients, optimizer state, buffers.

    With `step` (e.g. `lambda: engine.train_step(x, y)`) the gradients are the peak of two
    moments inside it: after the backward (`engine.after_backward`) and before the optimizer
    step; without, the gradients present now. ZeRO-3 counts its pieces as the parameters."""
    params = list(engine.parameters())
    pieces = list(engine.zero.shards) if engine.zero is not None else []
    grads: list[int] = []

    def held_grads() -> int:
        return _storage_bytes(p.grad for p in params + pieces if p.grad is not None)

    def before_step(optimizer, args, kwargs) -> None:
        grads.append(held_grads())

    if step is not None:
        def sample() -> None:
            grads.append(held_grads())

        engine.after_backward.append(sample)
        handle = engine.optimizer.register_step_pre_hook(before_step) \
            if engine.optimizer is not None else None
        try:
            step()
        finally:
            engine.after_backward.remove(sample)
            if handle is not None:
                handle.remove()
    if not grads:
        grads.append(held_grads())
    state = []
    if engine.optimizer is not None:
        for per_param in engine.optimizer.state.values():
            state.extend(v for v in per_param.values() if isinstance(v, torch.Tensor))
    graphs = [gm for gm in (engine.forward_gm, engine.train_gm) if gm is not None]
    buffers = [b for gm in graphs for b in gm.buffers()]
    param_storages = frozenset(p.untyped_storage().data_ptr() for p in params)
    return StateBytes(parameters=_storage_bytes(params + pieces), gradients=max(grads),
                      optimizer=_storage_bytes(state),
                      buffers=_storage_bytes(buffers, param_storages))
