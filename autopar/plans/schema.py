"""A parallel plan as plain data: mesh, per-layer strategy, pipeline, ZeRO, recompute.

A plan is read from JSON, from a Colossal-AI style `parallel` dict, or produced by the
planner; it is validated when made, and written back as the JSON of the public contract.
"""

from __future__ import annotations

import json
import numbers
import os
from dataclasses import asdict, dataclass, field

from autopar.errors import PlanError
from autopar.json_file import read_json
from autopar.modes import (
    AXES,
    CP,
    DP,
    EP,
    LAYER_SP,
    MEGATRON_SP,
    NO_RECOMPUTE,
    NO_SP,
    ONE_F_ONE_B,
    PP,
    RECOMPUTE,
    RUNTIME,
    SCHEDULES,
    SEQUENCE_LAYOUTS,
    SEQUENCE_MODES,
    TP,
    TP_1D,
    TP_MODES,
    ZERO_STAGES,
    cp_layout,
)
from autopar.plans.capabilities import missing
from autopar.plans.views import views
from autopar.sharding.axes import MULTI_D, TensorMesh, grid_size_error
from autopar.world import World

__all__ = ["LayerPlan", "PipelinePlan", "Plan", "ZeroPlan", "cp_layout"]
REPLICATE = "replicate"  # a layer's tensor mode when it runs whole on every rank
_TOP_KEYS = {"pipeline", "tensor", "sequence", "zero", "recompute", "data", "expert",
             "microbatches"}


@dataclass
class LayerPlan:
    name: str
    tp_mode: str = TP_1D  # or REPLICATE
    sp: str = NO_SP
    recompute: str = NO_RECOMPUTE
    stage: int = 0


@dataclass
class PipelinePlan:
    schedule: str = ONE_F_ONE_B
    microbatches: int = 1
    chunks: int = 1
    micro_batch_size: int | None = None


@dataclass
class ZeroPlan:
    stage: int = 0
    offload: bool = False
    # hybrid sharding (HSDP): the state is cut over groups of `shard` neighbouring dp ranks
    # and replicated over dp / shard such groups; None: cut over all of dp
    shard: int | None = None


@dataclass
class Plan:
    """How a model is split over a world. `mesh` sizes multiply to the world size; `ep`
    (given as mesh["ep"] or ep=) splits MoE experts over ranks inside dp x cp."""

    mesh: dict = field(default_factory=lambda: {PP: 1, DP: 1, CP: 1, TP: 1})
    tp_mode: str = TP_1D
    tp_depth: int = 1
    sequence_parallel: bool = False
    sequence_mode: str | None = None
    # how tokens lie over cp: "zigzag" (rank r holds chunks r and 2c-1-r of 2c, so causal
    # attention costs every rank the same) or "contiguous"; None: zigzag under ring
    # attention, contiguous under Ulysses (which gathers the whole sequence per head anyway)
    sequence_layout: str | None = None
    layers: list[LayerPlan] = field(default_factory=list)
    pipeline: PipelinePlan = field(default_factory=PipelinePlan)
    zero: ZeroPlan = field(default_factory=ZeroPlan)
    recompute: str = NO_RECOMPUTE
    world: World | None = None
    predicted: dict = field(default_factory=dict)
    search: dict = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)
    # the planner's full report (per-kind costs), kept in memory only; see explain()
    detail: dict | None = field(default=None, repr=False, compare=False)
    ep: int = 1  # expert-parallel size: no factor of the world, it divides dp x cp

    def __post_init__(self):
        if not isinstance(self.mesh, dict) or set(self.mesh) - set(AXES + (EP,)):
            raise PlanError(f"a plan's mesh maps axis names ({', '.join(AXES + (EP,))}) to "
                            f"sizes, such as {{\"dp\": 2, \"tp\": 4}}, not {self.mesh!r}.")
        if EP in self.mesh:  # the JSON's spelling: kept apart, as ep is no factor of the world
            self.mesh = dict(self.mesh)
            self.ep = self.mesh.pop(EP)
        for axis, v in self.mesh.items():
            if isinstance(v, bool) or not isinstance(v, numbers.Integral):
                raise PlanError(f"mesh axis '{axis}' has size {v!r}; every axis needs a whole "
                                "number >= 1.")
        self.mesh = {axis: int(self.mesh.get(axis, 1)) for axis in AXES}
        self.validate()

    @property
    def world_size(self) -> int:
        out = 1
        for v in self.mesh.values():
            out *= v
        return out

    def validate(self) -> None:
        for axis, v in self.mesh.items():
            if v < 1:
                raise PlanError(f"mesh axis '{axis}' has size {v}; every axis needs size >= 1.")
        _choice("tensor mode", self.tp_mode, TP_MODES)
        _choice("recompute", self.recompute, RECOMPUTE)
        _choice("pipeline schedule", self.pipeline.schedule, SCHEDULES)
        if self.sequence_mode is not None:
            _choice("sequence mode", self.sequence_mode, SEQUENCE_MODES)
        if self.sequence_layout is not None:
            _choice("sequence layout", self.sequence_layout, SEQUENCE_LAYOUTS)
        if isinstance(self.zero.stage, bool) or self.zero.stage not in ZERO_STAGES:
            raise PlanError(f"zero stage must be 0, 1, 2 or 3, not {self.zero.stage!r}.")
        if not isinstance(self.zero.offload, bool):
            raise PlanError(f"zero offload must be true or false, not {self.zero.offload!r}.")
        self.check_shard()
        if not isinstance(self.sequence_parallel, bool):
            raise PlanError(f"sequence_parallel must be true or false, not "
                            f"{self.sequence_parallel!r}.")
        _int(self.tp_depth, "tensor depth")
        _int(self.pipeline.microbatches, "pipeline microbatches")
        _int(self.pipeline.chunks, "pipeline chunks")
        if self.pipeline.micro_batch_size is not None:
            _int(self.pipeline.micro_batch_size, "pipeline micro_batch_size")
        for lp in self.layers:
            _choice(f"tensor mode of layer {lp.name}", lp.tp_mode, TP_MODES + (REPLICATE,))
            _choice(f"recompute of layer {lp.name}", lp.recompute, RECOMPUTE)
            _choice(f"sp of layer {lp.name}", lp.sp, LAYER_SP)
        self.check_expert()
        if self.world is not None and self.world.devices != self.world_size:
            raise PlanError(f"the plan's mesh {self._mesh_text()} uses {self.world_size} devices "
                            f"but the world has {self.world.devices}.")

    def check_shard(self) -> None:
        """A hybrid shard size is a whole number >= 2 dividing dp, under a ZeRO stage."""
        shard = self.zero.shard
        if shard is None:
            return
        _int(shard, "data shard size")
        dp = self.mesh[DP]
        if shard < 2 or dp % shard:
            raise PlanError(f"data shard size {shard} must be 2 or more and divide the data-"
                            f"parallel size {dp}; choose a divisor of {dp} (or drop shard to "
                            "shard over all of dp).")
        if self.zero.stage == 0:
            raise PlanError(f"data shard size {shard} cuts ZeRO's state over {shard} ranks, but "
                            "the plan has no ZeRO stage; give zero=dict(stage=1, 2 or 3), or "
                            "drop shard.")

    @property
    def dp_shard(self) -> int:
        """The ranks ZeRO cuts its state over: the shard group (all of dp without HSDP)."""
        return self.zero.shard or self.mesh[DP]

    @property
    def dp_replicate(self) -> int:
        """How many shard groups hold copies of the same state (1 without HSDP)."""
        return self.mesh[DP] // self.dp_shard

    def check_expert(self) -> None:
        """ep must be a whole number dividing the data (and context) ranks it lies inside."""
        _int(self.ep, "expert size")
        data = self.mesh[DP] * self.mesh[CP]
        if data % self.ep:
            raise PlanError(f"expert size {self.ep} does not divide the data x sequence ranks "
                            f"({self.mesh[DP]} x {self.mesh[CP]} = {data}) that hold the experts; "
                            f"choose an expert size dividing {data}.")

    def splits_experts(self) -> bool:
        """Whether the engine runs a model's MoE layers as autopar's kernel: over an ep axis,
        or, with ep 1, under a 1D tensor axis (not beside cp) that splits each expert."""
        return self.ep > 1 or (self.mesh[TP] > 1 and self.tp_mode == TP_1D and
                               self.mesh[CP] == 1)

    def check_experts(self, experts: int, top_k: int, where: str = "the model") -> None:
        """An MoE layer of `experts` experts, `top_k` per token, under this plan's ep."""
        if not 1 <= top_k <= experts:
            raise PlanError(f"{where} routes each token to top_k={top_k} experts but has "
                            f"{experts}; top_k must be between 1 and the number of experts.")
        if experts % self.ep:
            raise PlanError(f"{where} has {experts} experts, which do not split over expert "
                            f"size {self.ep}; choose an expert size dividing {experts}.")

    def _mesh_text(self) -> str:
        return " x ".join(f"{a}{v}" for a, v in self.mesh.items() if v > 1) or "1 device"

    def layer_modes(self) -> dict[str, str]:
        return {lp.name: lp.tp_mode for lp in self.layers}

    def recompute_modes(self, names) -> dict[str, str]:
        """Each named layer's recompute mode: the plan's own for a layer it lists, else
        `recompute` for a transformer block (a name ending in an index: Megatron recomputes
        whole blocks) and none for any other layer, as the planner prices them."""
        listed = {lp.name: lp.recompute for lp in self.layers}
        return {n: listed.get(n, _block_mode(n, self.recompute)) for n in names}

    def set_layer_modes(self, modes: dict[str, str]) -> None:
        """Name each layer and its tensor mode (the rest of each layer's plan at defaults)."""
        self.layers = [LayerPlan(name, tp_mode=mode) for name, mode in modes.items()]

    def grid_mode(self) -> str:
        """The 2D, 2.5D or 3D mode the plan's layers use ("1d" when none does)."""
        modes = [m for m in [self.tp_mode] + [lp.tp_mode for lp in self.layers] if m in MULTI_D]
        return modes[0] if modes else TP_1D

    def check_grid(self) -> None:
        """Refuse a tensor size that is no grid of the plan's mode, with the nearest that are."""
        modes = sorted({m for m in [self.tp_mode] + [lp.tp_mode for lp in self.layers]
                        if m in MULTI_D})
        if len(modes) > 1:
            raise PlanError(f"a plan's layers may mix 1d with one of 2d, 2.5d and 3d, not "
                            f"{' and '.join(modes)}; give every multi-dimensional layer the same "
                            "mode.")
        if modes and self.mesh[TP] > 1:
            error = grid_size_error(modes[0], self.mesh[TP], self.tp_depth)
            if error:
                raise PlanError(error)

    def cp_layout(self) -> str:
        """The token layout over cp this plan runs (see `sequence_layout`)."""
        return cp_layout(self.sequence_mode, self.sequence_layout)

    def sequence_parallel_layers(self) -> bool | frozenset:
        """Where Megatron sequence parallelism runs: True for every 1d layer (the plan's
        flag), else the layers whose plan says sp="megatron" (empty: nowhere)."""
        if self.sequence_parallel:
            return True
        return frozenset(lp.name for lp in self.layers if lp.sp == MEGATRON_SP)

    def check_sequence_parallel(self) -> None:
        """Refuse Megatron sequence parallelism where it cannot run: it splits the sequence
        over the 1d tensor axis, so it needs tensor size > 1 and 1d layers."""
        layers = [lp for lp in self.layers if lp.sp == MEGATRON_SP]
        if not self.sequence_parallel and not layers:
            return
        if self.mesh[TP] == 1:
            raise PlanError("sequence_parallel splits the sequence over the tensor axis, which "
                            "has size 1 in this plan; use a tensor size of 2 or more, such as "
                            "tensor=dict(size=4, mode='1d', sequence_parallel=True), or drop "
                            "sequence_parallel.")
        if self.sequence_parallel and self.tp_mode != TP_1D:
            raise PlanError(f"sequence_parallel runs with 1d tensor parallelism, not "
                            f"{self.tp_mode} (whose activations are already split on batch "
                            "and hidden); use mode='1d', or drop sequence_parallel.")
        bad = [lp.name for lp in layers if lp.tp_mode != TP_1D]
        if bad:
            raise PlanError(f"layers {', '.join(bad)} ask for sp='megatron' but are not 1d "
                            "tensor-parallel; Megatron sequence parallelism runs in 1d layers "
                            "only: make them 1d or set sp='none'.")

    def tensor_mesh(self) -> TensorMesh:
        """The tensor axes this plan runs on (see `autopar.sharding.axes`); a 2D, 2.5D or 3D
        grid beside a cp axis holds cp as its outermost dim."""
        mesh = TensorMesh.for_mode(self.grid_mode(), self.mesh[TP], self.tp_depth)
        return mesh.beside_cp(self.mesh[CP]) if mesh.mode in MULTI_D and self.mesh[CP] > 1 \
            else mesh

    def unsupported(self, runtime=RUNTIME) -> list[str]:
        """Parts of this plan `runtime` (an `autopar.modes.Capabilities`) cannot execute yet
        (they can still be planned), in the capability table's words
        (autopar.plans.capabilities)."""
        out = []
        if self.zero.offload and self.zero.stage == 0:
            out.append("offload without ZeRO (the offloaded optimizer runs on the pieces ZeRO "
                       "cuts; use zero=dict(stage=1, 2 or 3, offload=True))")
        return out + missing(self, runtime)

    def refusal(self, runtime=RUNTIME) -> str | None:
        """One sentence refusing the parts of this plan `runtime` cannot execute, each with
        what to choose instead (None when it runs them all)."""
        missing_parts = self.unsupported(runtime)
        if not missing_parts:
            return None
        return (f"this plan uses {'; and '.join(missing_parts)}, which the runtime cannot "
                "execute yet; change each part as it says, or plan it offline with "
                "autopar.plan.")

    def explain(self, top: int | None = None) -> str:
        """The plan as text a person reads: strategy, predicted time and memory, and why it
        beat the alternatives (per-kind costs when the planner made it in this process)."""
        if top is not None and (isinstance(top, bool) or not isinstance(top, int) or top < 1):
            raise PlanError(f"explain(top={top!r}): top is how many layer rows to show, a whole "
                            "number >= 1 (or None for all).")
        if self.detail is not None:
            return views().plan_text(self.detail, top)
        data = self.to_json()
        data["layer_kinds"] = []
        return views().plan_text(data, top)

    # ------------------------------------------------------------------ JSON
    def to_json(self) -> dict:
        return {
            "version": 1,
            "world": self.world.to_json() if self.world else None,
            "mesh": dict(self.mesh, **({EP: self.ep} if self.ep > 1 else {})),
            "tensor": {"mode": self.tp_mode, "depth": self.tp_depth,
                       "sequence_parallel": self.sequence_parallel},
            "sequence": {"mode": self.sequence_mode, "layout": self.sequence_layout},
            "layers": [asdict(lp) for lp in self.layers],
            "pipeline": asdict(self.pipeline),
            "zero": asdict(self.zero),
            "recompute": self.recompute,
            "predicted": dict(self.predicted),
            "search": dict(self.search),
            "notes": list(self.notes),
        }

    @classmethod
    def from_json(cls, data: dict) -> Plan:
        if not isinstance(data, dict) or data.get("version") != 1:
            raise PlanError("a plan file must be a JSON object with \"version\": 1, as written by "
                            "Plan.save or `autopar search -o`.")
        _check_file_keys(data)
        try:
            tensor = data.get("tensor") or {}
            return cls(mesh=data["mesh"], tp_mode=tensor.get("mode", TP_1D),
                       tp_depth=tensor.get("depth", 1),
                       sequence_parallel=tensor.get("sequence_parallel", False),
                       sequence_mode=(data.get("sequence") or {}).get("mode"),
                       sequence_layout=(data.get("sequence") or {}).get("layout"),
                       layers=[LayerPlan(**lp) for lp in data.get("layers") or []],
                       pipeline=PipelinePlan(**data.get("pipeline", {})),
                       zero=ZeroPlan(**data.get("zero", {})),
                       recompute=data.get("recompute", NO_RECOMPUTE),
                       world=World(**data["world"]) if data.get("world") else None,
                       predicted=data.get("predicted", {}), search=data.get("search", {}),
                       notes=data.get("notes", []))
        except (KeyError, TypeError, AttributeError, ValueError) as e:
            what = f"no {e}" if isinstance(e, KeyError) else str(e)
            raise PlanError(f"the plan file is malformed ({what}); write it with Plan.save or "
                            "`autopar search -o`.") from e

    def save(self, path) -> None:
        with open(path, "w") as f:
            json.dump(self.to_json(), f, indent=2)

    @classmethod
    def load(cls, path) -> Plan:
        if not os.path.exists(path):
            raise PlanError(f"no plan file at {path}; write one with `autopar search -o {path}`.")
        data = read_json(path, "plan file", PlanError,
                         f"write it with Plan.save or `autopar search -o {path}`")
        return cls.from_json(data)

    # ------------------------------------------------------- Colossal-AI style
    @classmethod
    def from_dict(cls, spec: dict, world_size: int) -> Plan:
        """A plan from Colossal-AI's `parallel` dict; data-parallel size is inferred."""
        if not isinstance(spec, dict):
            raise PlanError(f"a plan dict must be a dict, not {type(spec).__name__}.")
        unknown = set(spec) - _TOP_KEYS
        if unknown:
            raise PlanError(f"unknown plan key(s) {sorted(unknown)}; valid keys are "
                            f"{sorted(_TOP_KEYS)}.")
        pipeline = _sub(spec, "pipeline", {"size", "schedule", "microbatches", "chunks"})
        tensor = _sub(spec, "tensor", {"size", "mode", "depth", "sequence_parallel", "layers"})
        sequence = _sub(spec, "sequence", {"size", "mode", "layout"})
        zero = _sub(spec, "zero", {"stage", "offload"})
        expert = _sub(spec, "expert", {"size"})
        data = _sub(spec, "data", {"size", "shard"})
        pp = _int(pipeline.get("size", 1), "pipeline size")
        tp = _int(tensor.get("size", 1), "tensor size")
        cp = _int(sequence.get("size", 1), "sequence size")
        model_parallel = pp * tp * cp
        if world_size % model_parallel:
            raise PlanError(f"pipeline x tensor x sequence = {pp} x {tp} x {cp} = {model_parallel} "
                            f"does not divide the world size {world_size}; choose sizes whose "
                            f"product divides {world_size}.")
        dp = world_size // model_parallel
        if "size" in data and _int(data["size"], "data size") != dp:
            raise PlanError(f"data size {data['size']} does not match world {world_size} / "
                            f"(pipeline x tensor x sequence = {model_parallel}) = {dp}.")
        microbatches = _int(pipeline.get("microbatches", 1), "microbatches")
        if "microbatches" in spec:  # each replica's batch in micro-batches, with or without
            top = _int(spec["microbatches"], "microbatches")  # a pipeline
            if "microbatches" in pipeline and top != microbatches:
                raise PlanError(f"microbatches={top} and pipeline microbatches={microbatches} "
                                "disagree; give the number of micro-batches once.")
            microbatches = top
        recompute = spec.get("recompute", NO_RECOMPUTE)
        layers = tensor.get("layers", {})
        if not isinstance(layers, dict):
            raise PlanError(f"tensor 'layers' must map layer names to modes, e.g. "
                            f"{{'blocks.0': '1d'}}, not {layers!r}.")
        for name, mode in layers.items():
            _choice(f"tensor mode of layer {name}", mode, TP_MODES + (REPLICATE,))
        return cls(mesh={PP: pp, DP: dp, CP: cp, TP: tp},
                   layers=[LayerPlan(name, tp_mode=mode, recompute=_block_mode(name, recompute))
                           for name, mode in layers.items()],
                   tp_mode=str(tensor.get("mode", TP_1D)),
                   tp_depth=_int(tensor.get("depth", 1), "tensor depth"),
                   sequence_parallel=bool(tensor.get("sequence_parallel", False)),
                   sequence_mode=sequence.get("mode") if cp > 1 or "mode" in sequence else None,
                   sequence_layout=sequence.get("layout"),
                   pipeline=PipelinePlan(schedule=pipeline.get("schedule", ONE_F_ONE_B),
                                         microbatches=microbatches,
                                         chunks=_int(pipeline.get("chunks", 1), "chunks")),
                   zero=ZeroPlan(stage=_int(zero.get("stage", 0), "zero stage"),
                                 offload=bool(zero.get("offload", False)),
                                 shard=data.get("shard")),
                   recompute=recompute, ep=_int(expert.get("size", 1), "expert size"))


def _block_mode(name: str, recompute: str) -> str:
    """A plan-wide recompute mode as one layer takes it: blocks only."""
    return recompute if name.rsplit(".", 1)[-1].isdigit() else NO_RECOMPUTE


def _file_keys() -> dict:
    """The keys a plan file may hold: the top level's (None) and each nested object's,
    as `Plan.to_json` writes them; `layers` holds a list of such objects."""
    written = Plan().to_json()
    nested = {key: set(value) for key, value in written.items() if isinstance(value, dict)
              and key not in ("mesh", "predicted", "search")}  # free maps
    nested["layers"] = set(LayerPlan.__dataclass_fields__)
    nested["world"] = set(World.__dataclass_fields__)
    return {None: set(written), **nested}


def _check_file_keys(data: dict) -> None:
    """Refuse a key a plan file cannot hold, at the top or nested, as `from_dict` does."""
    keys = _file_keys()
    unknown = set(data) - keys[None]
    if unknown:
        raise PlanError(f"unknown plan file key(s) {sorted(unknown)}; valid keys are "
                        f"{sorted(keys[None])}.")
    for key, allowed in keys.items():
        value = data.get(key) if key else None
        items = value if key == "layers" and isinstance(value, list) else [value]
        for item in items:
            if isinstance(item, dict) and set(item) - allowed:
                raise PlanError(f"unknown key(s) {sorted(set(item) - allowed)} under '{key}'; "
                                f"valid keys are {sorted(allowed)}.")


def _sub(spec: dict, key: str, allowed: set) -> dict:
    value = spec.get(key, {})
    if isinstance(value, int) and not isinstance(value, bool) and "size" in allowed:
        return {"size": value}
    if not isinstance(value, dict):
        raise PlanError(f"plan key '{key}' must be a size or a dict with keys {sorted(allowed)}, "
                        f"not {value!r}.")
    unknown = set(value) - allowed
    if unknown:
        raise PlanError(f"unknown key(s) {sorted(unknown)} under '{key}'; valid keys are "
                        f"{sorted(allowed)}.")
    return value


def _int(value, what: str) -> int:
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or \
            value < 1 and what != "zero stage":
        raise PlanError(f"{what} must be a positive whole number, not {value!r}.")
    return value


def _choice(what: str, value, options) -> None:
    if value not in options:
        raise PlanError(f"unknown {what} {value!r}; choose one of {', '.join(options)}.")
