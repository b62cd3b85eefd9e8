"""`engine.memory_snapshot(path)`: what this rank's memory holds, by layer.

On a GPU it is the CUDA caching allocator's own snapshot (`torch.cuda.memory._snapshot`),
with the allocation history recorded since the first call (that call starts the
recording): the pickle the pytorch.org/memory_viz viewer opens. On the CPU, which has no
such allocator, it is every live tensor storage of the process, attributed to the layer and
the kind of state that holds it (parameter, gradient, optimizer state, buffer) or to "other"
(the batch, the user's own tensors), written in the same snapshot form (one segment per
storage, its layer and kind as the frame) so the same viewer and torch's
`torch.cuda._memory_viz` tools read it. Beside the live bytes, each layer's activations
saved in a measured step (`engine.explain()`'s figure), which are not alive between steps.

The path's suffix picks the form: `.pickle` the snapshot, `.json` the table as data,
anything else the table as text."""

from __future__ import annotations

import gc
import json
import pickle
from dataclasses import dataclass, field

import torch

from autopar.errors import PlanError

KINDS = ("parameters", "gradients", "optimizer", "buffers")
OTHER = "other"  # live tensors no layer of the engine holds
_HISTORY_ENTRIES = 100_000
_RECORDING: list = []  # non-empty once this process records the CUDA allocator's history


@dataclass
class _Storage:
    key: int
    nbytes: int
    layer: str
    kind: str
    name: str


@dataclass
class Snapshot:
    """Live bytes per (layer, kind), the storages behind them, and saved activations."""

    device: str
    storages: list[_Storage] = field(default_factory=list)
    activations: dict[str, int] = field(default_factory=dict)  # per layer, a measured step

    def table(self) -> dict[str, dict[str, int]]:
        rows: dict[str, dict[str, int]] = {}
        for s in self.storages:
            row = rows.setdefault(s.layer, dict.fromkeys(KINDS + (OTHER,), 0))
            row[s.kind] += s.nbytes
        for layer in self.activations:
            rows.setdefault(layer, dict.fromkeys(KINDS + (OTHER,), 0))
        for layer, row in rows.items():
            row["live"] = sum(row[k] for k in KINDS + (OTHER,))
            row["saved_activations"] = self.activations.get(layer, 0)
        return rows

    def to_json(self) -> dict:
        rows = self.table()
        return {"device": self.device,
                "layers": [{"layer": layer, **row} for layer, row in rows.items()],
                "live_bytes": sum(s.nbytes for s in self.storages)}

    def text(self) -> str:
        cols = KINDS + (OTHER, "live", "saved_activations")
        head = ["layer", *cols]
        lines = [head]
        for layer, row in self.table().items():
            lines.append([layer, *(_mib(row[c]) for c in cols)])
        total = sum(s.nbytes for s in self.storages)
        widths = [max(len(r[i]) for r in lines) for i in range(len(head))]
        out = [f"live tensors of this rank on {self.device}, MiB (saved_activations: per "
               "measured step, not alive between steps)"]
        for r in lines:
            out.append("  ".join(c.ljust(w) if i == 0 else c.rjust(w)
                                 for i, (c, w) in enumerate(zip(r, widths))))
        out.append(f"total live: {_mib(total)} MiB")
        return "\n".join(out) + "\n"

    def allocator_form(self) -> dict:
        """The snapshot in the CUDA allocator's form: one segment per storage."""
        segments = []
        for s in self.storages:
            block = {"address": s.key, "size": s.nbytes, "requested_size": s.nbytes,
                     "state": "active_allocated",
                     "frames": [{"filename": s.layer, "line": 0, "name": f"{s.kind} {s.name}"}]}
            segments.append({"device": 0, "address": s.key, "total_size": s.nbytes,
                             "allocated_size": s.nbytes, "active_size": s.nbytes,
                             "requested_size": s.nbytes, "stream": 0, "segment_type": "large",
                             "segment_pool_id": (0, 0), "is_expandable": False,
                             "frames": [], "blocks": [block]})
        return {"segments": segments, "device_traces": [[]]}


def _mib(n: int) -> str:
    return f"{n / 2**20:.3f}"


def _layer_of(name: str, layers: list[str]) -> str:
    """The plan layer whose module holds `name` (the longest prefix), else the model."""
    best = ""
    for layer in layers:
        if (name == layer or name.startswith(layer + ".")) and len(layer) > len(best):
            best = layer
    return best or "(model)"


def _key(t: torch.Tensor) -> int:
    return t.untyped_storage().data_ptr()


def collect(engine) -> Snapshot:
    """The live storages of this process, attributed to the engine's layers and kinds."""
    layers = [lp.name for lp in engine.plan.layers]
    snap = Snapshot(str(engine.device))
    seen: set[int] = set()

    def add(t, layer: str, kind: str, name: str) -> None:
        if not isinstance(t, torch.Tensor) or t.device.type == "meta":
            return
        key, nbytes = _key(t), t.untyped_storage().nbytes()
        if nbytes == 0 or key in seen:
            return
        seen.add(key)
        snap.storages.append(_Storage(key, nbytes, layer, kind, name))

    named: list[tuple[str, torch.Tensor]] = []
    for names, local, _ in engine.params.entries():
        named.append((names[0], local))
    zero = engine.zero
    if zero is not None:
        by_id = {id(local): name for name, local in named}
        named += [(by_id.get(id(p), "(piece)"), s) for p, s in zip(zero.params, zero.shards)]
    optimizer = engine.optimizer
    state = optimizer.state if optimizer is not None else {}
    for name, t in named:
        layer = _layer_of(name, layers)
        add(t, layer, "parameters", name)
    for name, t in named:
        add(t.grad, _layer_of(name, layers), "gradients", name)
    for name, t in named:
        for k, v in state.get(t, {}).items():
            add(v, _layer_of(name, layers), "optimizer", f"{name}.{k}")
    for gm in (engine.forward_gm, engine.train_gm):
        if gm is not None:
            for name, b in gm.named_buffers():
                add(b, _layer_of(name, layers), "buffers", name)
    for obj in gc.get_objects():
        # real tensors only: fake and functional ones (tracing's) hold no memory
        if type(obj) in (torch.Tensor, torch.nn.Parameter):
            add(obj, OTHER, OTHER, f"{tuple(obj.shape)} {obj.dtype}")
    recorder = engine.recorder
    if recorder.steps:
        snap.activations = {layer: f.saved_bytes // recorder.steps
                            for layer, f in recorder.layers.items() if f.saved_bytes}
    return snap


def memory_snapshot(engine, path) -> dict:
    """Write this rank's memory at `path` (see the module's text); returns the table."""
    path = str(path)
    snap = collect(engine)
    device = engine.device
    if device.type == "cuda" and path.endswith(".pickle"):
        if not _RECORDING:  # history from now on; this first snapshot holds the state only
            torch.cuda.memory._record_memory_history(max_entries=_HISTORY_ENTRIES)
            _RECORDING.append(device.index)
        torch.cuda.memory._dump_snapshot(path)
        return snap.to_json()
    if path.endswith(".pickle"):
        with open(path, "wb") as f:
            pickle.dump(snap.allocator_form(), f)
    elif path.endswith(".json"):
        with open(path, "w") as f:
            json.dump(snap.to_json(), f, indent=1)
    elif path.endswith((".txt", ".md")) or "." not in path.rsplit("/", 1)[-1]:
        with open(path, "w") as f:
            f.write(snap.text())
    else:
        raise PlanError(f"memory_snapshot writes .pickle (the memory_viz snapshot), .json or "
                        f".txt, not {path!r}.")
    return snap.to_json()
