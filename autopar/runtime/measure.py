"""What a training step really costs, per layer: time, saved activations, collectives.

`instrument(gm, recorder)` puts a `_Mark` module in front of every run of consecutive nodes
of one layer (a segment) and one at the graph's output. A mark returns its input unchanged
and nothing reads its output: it notes the time and, on a tensor that takes a gradient,
registers a hook on that tensor, which fires when its gradient is complete (all of its
readers' backward done), that is when the backward of everything after the mark is done.
The graph's values and autograd graph are untouched. So

    forward of segment k  = forward tick of mark k+1 - forward tick of mark k
    backward of segment k = backward tick of mark k - backward tick of mark k+1

(mark n, the last, sits on the output: its backward tick is the start of this graph's
backward). The probe of a mark is a floating input of the segment's first node made by an
earlier segment (the residual stream into a block), or, for a segment whose inputs take no
gradient (an embedding reading token ids), the first parameter it reads (not in a
pipeline stage, whose micro-batches would all fire one parameter's hook); a segment with
neither has no backward tick of its own: its backward is counted with the segment before
it in the backward, or, when the whole step is one graph, runs to the backward's end.
Under the zero-bubble schedule the ticks time the input gradients; the weight-gradient
pass that comes later is not split per layer.

The recorder also names the layer running now, so the comm log attributes each
collective to a layer (`CommRecord.layer`), and counts the bytes of the tensors autograd
saves per layer (each storage once per step). Each graph call (a micro-batch of a
pipeline stage, or the whole step) is one `_Call`; `Recorder.finish_step` folds the calls
of a step into per-layer totals. `Engine.explain()` puts them beside the plan's prediction.
"""

from __future__ import annotations

import contextlib
import dataclasses
import time
from dataclasses import dataclass, field

import torch
from torch import fx, nn

_COMPUTE = ("call_function", "call_module", "call_method")
STEP = "(step)"  # the layer of what a step sends outside the graph (gradient sync, ZeRO)


@dataclass
class LayerFigures:
    """One layer's measured totals over the recorded steps (seconds and bytes)."""

    forward_s: float = 0.0
    backward_s: float = 0.0
    saved_bytes: int = 0
    comm_bytes: int = 0
    comm_s: float = 0.0
    backward_timed: bool = True  # False: some segment had no backward tick of its own


@dataclass
class _Call:
    layers: list  # layer of each segment, then None for the output mark
    forward: list
    backward: list
    handles: list = field(default_factory=list)


class Recorder:
    """Per-layer time and saved bytes of the steps since `reset`, and the layer now running."""

    def __init__(self, warmup: int = 1):
        self.enabled = True
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
        self._saved_storages: set[int] = set()
        self._saved_step: dict[str, int] = {}  # layer -> bytes saved in this step
        self._backward_end: float | None = None

    def reset(self) -> None:
        """Forget the totals (the next step is counted: no second warm-up)."""
        self.steps = 0
        self.step_s = 0.0
        self.layers.clear()
        self.axes.clear()

    def begin_step(self, log) -> None:
        if not self.enabled:
            return
        self._start = time.perf_counter()
        self._log_mark = len(log.records)

    # ------------------------------------------------------------------ ticks
    def tick(self, key: int, k: int, layers: list, x) -> None:
        now = time.perf_counter()
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
                call.backward[k] = time.perf_counter()
                self.layer = before  # the backward goes on with the segment before
                return None

            call.handles.append(x.register_hook(hook))

    def backward_done(self) -> None:
        """The step's backward has returned (whole-graph steps): the first segment of a
        graph that had no probe of its own ends here."""
        self._backward_end = time.perf_counter()

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
                if ptr not in self._saved_storages:
                    self._saved_storages.add(ptr)
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
        if self._start is not None and counted:
            self.step_s += time.perf_counter() - self._start
        for call in self._calls:
            for h in call.handles:
                h.remove()
            if counted:
                self._fold(call)
        if counted:
            for name, nbytes in self._saved_step.items():
                self.layers.setdefault(name, LayerFigures()).saved_bytes += nbytes
        if counted:
            for r, sec in zip(log.records[self._log_mark:], log.seconds[self._log_mark:]):
                # the gradient sync, ZeRO and the world's norms belong to the step, even
                # when a hook sends them while some layer's backward runs
                layer = STEP if r.layer is None or r.axis in ("dp", "world") else r.layer
                fig = self.layers.setdefault(layer, LayerFigures())
                fig.comm_bytes += r.bytes
                fig.comm_s += sec
                axis = self.axes.setdefault(r.axis, [0, 0.0])
                axis[0] += r.bytes
                axis[1] += sec
            self.steps += 1
        self._calls.clear()
        self._open.clear()
        self._saved_storages.clear()
        self._saved_step.clear()
        self._backward_end = None
        self._start = None
        self.layer = None

    def _fold(self, call: _Call) -> None:
        """A call's forward splits at its forward ticks, its backward at its backward
        ticks: segment k's backward runs from the tick of the next segment that has one
        to its own (segments that run side by side, such as two embeddings of the same
        tokens, may finish in either order: a negative span counts as none; a segment
        whose probe aliases the next one's, such as a dropout with p = 0, gets none)."""
        n = len(call.layers) - 1  # the last mark is the output's
        if self._backward_end is not None and call.backward[0] is None and \
                call.backward[n] is not None:
            call.backward[0] = self._backward_end
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
    """Identity that ticks the recorder (see the module docstring)."""

    def __init__(self, recorder: Recorder, key: int, k: int, layers: list):
        super().__init__()
        self.recorder, self.key, self.k, self.layers = recorder, key, k, layers

    def forward(self, x=None):
        if self.recorder.enabled:
            self.recorder.tick(self.key, self.k, self.layers, x)
        return x


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
    """Put the marks into `gm` (in place, recompiled). Returns the number of segments.

    `parameter_probes=False` for a graph that runs several times before its backwards (a
    pipeline stage's micro-batches): a hook on a parameter would fire in every micro-batch's
    backward, so which one ended a segment would be ambiguous."""
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
    for k, (first, layer) in enumerate(starts):
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
