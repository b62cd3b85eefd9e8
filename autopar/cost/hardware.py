"""Hardware profiles as data: what one accelerator and its links can do.

Profiles live as JSON files in ``autopar/cost/profiles/``; ``autopar calibrate`` writes
a file of the same shape for the machine it runs on, and every place that takes a
device name (``World(device=...)``, ``--device``) also takes such a file's path.
"""

from __future__ import annotations

import difflib
import json
import math
import os
from dataclasses import asdict, dataclass, field
from importlib import resources

from autopar.errors import WorldError
from autopar.json_file import read_json
from autopar.modes import BF16, FP8, FP16, FP32, TF32

GiB = 1024 ** 3
OPTIMIZER_IMPLEMENTATIONS = ("for_loop", "foreach", "fused")  # torch.optim's three


@dataclass(frozen=True)
class Hardware:
    """Facts of one accelerator kind and the machines it sits in.

    Bandwidths are bytes per second in one direction per device; latencies are seconds
    per message (the alpha of an alpha-beta model). Matrix multiplications reach
    ``gemm_efficiency`` of peak for large problems and half of that at
    ``gemm_half_flops`` FLOPs (efficiency = max * F / (F + half)); memory-bound ops reach
    ``memory_efficiency`` of ``memory_bandwidth``. A calibrated profile may carry each
    collective's own fitted alpha and beta (``collectives``, see
    :func:`autopar.cost.comm.collective_time`) and, for CPU ranks sharing fewer cores,
    ``compute_share`` (see :func:`autopar.cost.schedule.time_shared`).
    """

    name: str
    memory_bytes: int
    peak_flops: dict  # dtype name ("fp32", "tf32", "bf16", "fp16") -> dense FLOP/s
    memory_bandwidth: float
    intra_node_bandwidth: float
    intra_node_latency: float
    inter_node_bandwidth: float
    inter_node_latency: float
    per_node: int = 8
    gemm_efficiency: float = 0.8
    gemm_half_flops: float = 1e9
    memory_efficiency: float = 0.8
    host_bandwidth: float = 25e9  # device <-> host (offload), bytes/s per device
    # per node, shared by its devices: what ZeRO-Offload's host copies must fit in
    host_memory_bytes: int = 1024 * GiB
    # op -> {"algorithm", "alpha", "beta"}: a collective's own latency and seconds per
    # byte inside a node, fitted by `autopar calibrate` to its formula (backends run
    # collectives unequally well); empty: every collective sees the link's alpha and beta
    collectives: dict = field(default_factory=dict)
    # the share of one device's full speed it computes at while every device of its node
    # computes: 1 for accelerators; cores / (ranks x threads) for CPU ranks that outnumber
    # the cores they share. Peak FLOP/s and bandwidths are the rates with all busy.
    compute_share: float = 1.0
    # A fused (flash) attention kernel over S keys per query runs at
    # peak * attention_efficiency * S / (S + attention_half_tokens) on the FLOPs it does
    # (half the full count under a causal mask: masked blocks are skipped). None: priced
    # as a GEMM of the full FLOPs (a profile with no measured attention curve, e.g. CPU).
    attention_efficiency: float | None = None
    attention_half_tokens: float = 0.0
    # other fused attention kernels by name ("flash1": FlashAttention v1), each
    # {"efficiency", "half_tokens"} as above; "flash" is the pair of fields above
    attention_kernels: dict = field(default_factory=dict)
    # the least time one kernel takes however little it does (launch and ramp-up): small
    # per-rank shapes hit it; 0 = not modelled
    kernel_floor_s: float = 0.0
    # the share of the device's compute a collective takes while it overlaps compute (its
    # kernels occupy SMs): overlapped compute runs 1 / (1 - share) slower
    comm_sm_share: float = 0.0
    # the share of a GEMM's operand and result bytes whose HBM time adds to its math time
    # (1: the additive roofline, autopar.cost.model.gemm_traffic_s); 0 = not modelled
    gemm_operand_traffic: float = 0.0
    # how torch.optim steps here by default, which sets the step's temporaries
    # (autopar.cost.state.step_workspace): "foreach" where every tensor is on CUDA or a
    # device like it, "for_loop" on the CPU; "fused" where the run asks for fused=True
    optimizer_implementation: str = "foreach"
    source: str = ""
    extra: dict = field(default_factory=dict)

    def flops(self, dtype: str) -> float:
        if dtype in self.peak_flops:
            return float(self.peak_flops[dtype])
        raise WorldError(f"device '{self.name}' has no peak FLOP/s for dtype '{dtype}'; it knows "
                         f"{', '.join(sorted(self.peak_flops))}.")

    def to_json(self) -> dict:
        return asdict(self)

    @classmethod
    def from_json(cls, data: dict) -> Hardware:
        if not isinstance(data, dict):
            raise WorldError(f"a hardware profile is a JSON object of fields, not a "
                             f"{type(data).__name__}; write one with `autopar calibrate`.")
        names = set(cls.__dataclass_fields__)
        unknown = set(data) - names
        if unknown:
            raise WorldError(f"unknown hardware profile field(s) {sorted(unknown)}; valid fields "
                             f"are {sorted(names)}.")
        try:
            hw = cls(**data)
        except TypeError as e:
            raise WorldError(f"malformed hardware profile: {e}.") from e
        hw.check()
        return hw

    def check(self) -> None:
        """Refuse a value the cost model cannot price (a zero bandwidth divides by zero),
        field by field, the nested tables (peak rates, collective fits, attention kernels)
        entry by entry."""
        for name, value in vars(self).items():
            if name in ("name", "source"):
                if not isinstance(value, str):
                    _refuse(name, value, "a string")
            elif name == "extra":
                if not isinstance(value, dict):
                    _refuse(name, value, "a JSON object of notes")
            elif name == "peak_flops":
                _check_peak_flops(value)
            elif name == "collectives":
                _check_collectives(value)
            elif name == "attention_kernels":
                _check_attention_kernels(value)
            elif name in _WHOLE and (isinstance(value, bool) or not isinstance(value, int)
                                     or value < 1):
                _refuse(name, value, "a whole number >= 1")
            elif name == "optimizer_implementation":
                if value not in OPTIMIZER_IMPLEMENTATIONS:
                    raise WorldError(f"hardware profile field {name} is {value!r}; it must be "
                                     f"one of {', '.join(OPTIMIZER_IMPLEMENTATIONS)}.")
            elif value is None and name == "attention_efficiency":
                continue
            else:
                _check_number(name, value, positive=name not in _MAY_BE_ZERO,
                              fraction=name.endswith(("efficiency", "_share"))
                              or name == "gemm_operand_traffic",
                              below_one=name in _BELOW_ONE)

    def save(self, path) -> None:
        with open(path, "w") as f:
            json.dump(self.to_json(), f, indent=2)


# fields where 0 means "not modelled" or "free" (every other number must be positive)
_MAY_BE_ZERO = {"intra_node_latency", "inter_node_latency", "attention_half_tokens",
                "gemm_half_flops",  # a calibration whose matmuls all ran at one rate
                "kernel_floor_s", "comm_sm_share", "gemm_operand_traffic"}
_BELOW_ONE = {"comm_sm_share"}  # overlapped compute runs 1 / (1 - share) slower


_WHOLE = {"memory_bytes", "per_node", "host_memory_bytes"}
PEAK_DTYPES = (FP32, TF32, BF16, FP16, FP8)  # the dtypes a peak rate may be given for


def _refuse(name: str, value, need: str) -> None:
    raise WorldError(f"hardware profile field {name} is {value!r}; it must be {need} "
                     "(fix the profile, or write a new one with `autopar calibrate`).")


def _table(name: str, value, example: str) -> dict:
    if not isinstance(value, dict):
        _refuse(name, value, f"a JSON object such as {example}")
    return value


def _check_peak_flops(value) -> None:
    table = _table("peak_flops", value, '{"bf16": 3.12e14}')
    if not table:
        _refuse("peak_flops", value, 'at least one dtype\'s rate, such as {"bf16": 3.12e14}')
    for dtype, rate in table.items():
        if dtype not in PEAK_DTYPES:
            _refuse("peak_flops", value, f"keyed by dtype names ({', '.join(PEAK_DTYPES)}), "
                    f"not {dtype!r}")
        _check_number(f"peak_flops.{dtype}", rate, positive=True)


# What a profile's `collectives` table may name: each collective and the algorithms
# autopar.cost.comm prices it with (tests/test_cost_comm.py holds the two equal; comm
# imports this module, so the names are written out here rather than imported).
ALGORITHMS: dict[str, tuple[str, ...]] = {
    "all_reduce": ("ring", "tree", "hierarchical"),
    "all_gather": ("ring", "tree", "hierarchical"),
    "reduce_scatter": ("ring", "tree", "hierarchical"),
    "all_to_all": ("ring", "tree"),
    "broadcast": ("ring", "tree"),
    "p2p": ("direct",),
}


def _check_collectives(value) -> None:
    table = _table("collectives", value, '{"all_reduce": {"algorithm": "ring", "alpha": 1e-5, '
                   '"beta": 1e-10}}')
    for op, fit in table.items():
        where = f"collectives.{op}"
        if op not in ALGORITHMS:
            _refuse("collectives", value, f"keyed by collective ({', '.join(ALGORITHMS)}), "
                    f"not {op!r}")
        fit = _table(where, fit, '{"algorithm": "ring", "alpha": 1e-5, "beta": 1e-10}')
        if set(fit) != {"algorithm", "alpha", "beta"}:
            _refuse(where, fit, "an object of exactly algorithm, alpha and beta")
        if fit["algorithm"] not in ALGORITHMS[op]:
            _refuse(f"{where}.algorithm", fit["algorithm"],
                    f"one of {', '.join(ALGORITHMS[op])}")
        _check_number(f"{where}.alpha", fit["alpha"], positive=False)
        _check_number(f"{where}.beta", fit["beta"], positive=True)


def _check_attention_kernels(value) -> None:
    table = _table("attention_kernels", value, '{"flash1": {"efficiency": 0.22, '
                   '"half_tokens": 263}}')
    for kernel, fit in table.items():
        where = f"attention_kernels.{kernel}"
        fit = _table(where, fit, '{"efficiency": 0.22, "half_tokens": 263}')
        if set(fit) != {"efficiency", "half_tokens"}:
            _refuse(where, fit, "an object of exactly efficiency and half_tokens")
        _check_number(f"{where}.efficiency", fit["efficiency"], positive=True, fraction=True)
        _check_number(f"{where}.half_tokens", fit["half_tokens"], positive=False)


def _check_number(name: str, value, positive: bool, fraction: bool = False,
                  below_one: bool = False) -> None:
    ok = isinstance(value, (int, float)) and not isinstance(value, bool) and \
        math.isfinite(value) and (value > 0 if positive else value >= 0) and \
        (not fraction or value <= 1) and (not below_one or value < 1)
    if not ok:
        need = "a number in (0, 1]" if fraction and positive else \
            "a number in [0, 1)" if below_one else \
            "a number in [0, 1]" if fraction else \
            "a positive number" if positive else "a number >= 0"
        raise WorldError(f"hardware profile field {name} is {value!r}; it must be {need} "
                         "(fix the profile, or write a new one with `autopar calibrate`).")


def builtin_names() -> list[str]:
    folder = resources.files("autopar.cost") / "profiles"
    return sorted(p.name[:-5] for p in folder.iterdir() if p.name.endswith(".json"))


_CACHE: dict[str, Hardware] = {}


def load_hardware(name_or_path: str) -> Hardware:
    """A built-in profile by name (``a100-80gb``) or a profile JSON file by path."""
    if name_or_path in _CACHE:
        return _CACHE[name_or_path]
    if name_or_path.endswith(".json") or os.sep in name_or_path:
        if not os.path.exists(name_or_path):
            raise WorldError(f"no hardware profile file at {name_or_path}; write one with "
                             "`autopar calibrate -o profile.json`.")
        data = read_json(name_or_path, "hardware profile", WorldError,
                         "write one with `autopar calibrate -o FILE`")
        try:
            hw = Hardware.from_json(data)
        except WorldError as e:
            raise WorldError(f"{name_or_path}: {e}") from e
    else:
        names = builtin_names()
        if name_or_path not in names:
            close = difflib.get_close_matches(name_or_path, names, n=1)
            hint = f" Did you mean '{close[0]}'?" if close else ""
            raise WorldError(f"unknown device '{name_or_path}'; known devices are "
                             f"{', '.join(names)}, or a profile file written by "
                             f"`autopar calibrate`.{hint}")
        text = (resources.files("autopar.cost") / "profiles" / f"{name_or_path}.json").read_text()
        hw = Hardware.from_json(json.loads(text))
    _CACHE[name_or_path] = hw
    return hw
