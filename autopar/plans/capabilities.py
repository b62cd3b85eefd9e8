"""One capability table: for every field of `autopar.modes.Capabilities`, the words naming
what it allows and what of it a plan uses. `Plan.unsupported()` reads it for one plan and
`autopar.search.why.not_executable` for a runtime (what the executable search and the CLI's
`--executable` leave out), so both say a missing capability in the same words; the search
space (autopar.search.space) filters its choices by the same fields."""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Callable

from autopar.modes import (
    AXES,
    CP,
    DP,
    MEGATRON_SP,
    NO_RECOMPUTE,
    PP,
    TP,
    TP_1D,
    TP_25D,
    Capabilities,
)

AXIS_WORDS = {PP: "pipeline parallelism (pp > 1)", DP: "data parallelism (dp > 1)",
              CP: "sequence parallelism over a cp axis (Ulysses, ring)",
              TP: "tensor parallelism (tp > 1)"}


@dataclass(frozen=True)
class Row:
    """One capability: `words(value)` name it (a value of a tuple field; True for a flag),
    `uses(plan)` lists the values a plan uses, `hint(plan, value, runtime)` says how a plan
    does without it (after the words, in Plan.unsupported)."""

    field: str
    words: Callable
    uses: Callable
    hint: Callable = lambda plan, value, runtime: ""

    def refuses(self, runtime: Capabilities, value) -> bool:
        """Whether `runtime` lacks `value` of this capability."""
        have = getattr(runtime, self.field)
        if isinstance(have, tuple):
            return value not in have
        if self.field == "tp_depth":
            return have is not None and value != have
        return not have

    def lacking(self, runtime: Capabilities) -> list:
        """The values of this capability `runtime` lacks (of those the planner prices)."""
        have, full = getattr(runtime, self.field), getattr(Capabilities(), self.field)
        if isinstance(full, tuple):
            return [v for v in full if v not in have]
        if self.field == "tp_depth":
            return [have] if have is not None else []
        return [] if have else [True]


def _grid(plan) -> list[str]:
    return [plan.grid_mode()] if plan.mesh[TP] > 1 else []


def _zero_with(plan, *needs) -> list[int]:
    return [plan.zero.stage] if all(needs) else []


def _flag(*needs) -> list[bool]:
    return [True] if all(needs) else []


def _sp_layers(plan) -> bool:
    return plan.mesh[TP] > 1 and bool(plan.sequence_parallel_layers())


TABLE: tuple[Row, ...] = (
    Row("tp_modes", lambda m: f"{m} tensor parallelism",
        lambda p: sorted({m for m in [p.tp_mode] + [lp.tp_mode for lp in p.layers]
                          if m != TP_1D}) if p.mesh[TP] > 1 else []),
    Row("axes", lambda a: AXIS_WORDS[a], lambda p: [a for a in AXES if p.mesh[a] > 1],
        lambda p, a, rt: f"(use {a} size 1)"),
    Row("cp_with_tp",
        lambda m: f"sequence parallelism over a cp axis together with {m} tensor parallelism",
        lambda p: _grid(p) if p.mesh[CP] > 1 else [],
        lambda p, m, rt: f"(cp runs with {'/'.join(rt.cp_with_tp)} tensor parallelism only: "
                         "use one of those, or sequence size 1)"),
    Row("cp_with_megatron_sp", lambda _: "sequence parallelism over a cp axis together with "
        "Megatron sequence parallelism", lambda p: _flag(p.mesh[CP] > 1, _sp_layers(p)),
        lambda p, v, rt: "(use sequence_parallel=False, or sequence size 1)"),
    Row("recompute", lambda r: f"{r} recomputation",
        lambda p: sorted({r for r in [p.recompute] + [lp.recompute for lp in p.layers]
                          if r != NO_RECOMPUTE}),
        lambda p, r, rt: f"(runs {', '.join(rt.recompute)}; use one of those)"),
    Row("zero", lambda z: f"ZeRO stage {z}", lambda p: _zero_with(p, p.zero.stage)),
    Row("zero_with_pp", lambda z: f"ZeRO stage {z} together with a pipeline",
        lambda p: _zero_with(p, p.zero.stage, p.mesh[PP] > 1)),
    Row("sequence_parallel", lambda s: "Megatron sequence parallelism",
        lambda p: [MEGATRON_SP] if _sp_layers(p) else [],
        lambda p, v, rt: "(drop sequence_parallel)"),
    Row("schedules", lambda s: f"the {s} pipeline schedule",
        lambda p: [p.pipeline.schedule] if p.mesh[PP] > 1 else []),
    Row("offload", lambda _: "optimizer offload",
        lambda p: _flag(p.zero.offload, p.zero.stage)),
    Row("offload_zero3_single_rank", lambda _: "ZeRO-3 offload over one data-parallel rank",
        lambda p: _flag(p.zero.offload, p.zero.stage == 3, p.mesh[DP] == 1),
        lambda p, v, rt: "(no parameter to cut; use zero=dict(stage=1, offload=True) to "
                         "offload the optimizer)"),
    Row("accumulation", lambda _: "gradient accumulation over micro-batches without a "
        "pipeline", lambda p: _flag(p.mesh[PP] == 1, p.pipeline.microbatches > 1),
        lambda p, v, rt: f"({p.pipeline.microbatches} of them; use microbatches=1, or a "
                         "pipeline of 2 or more stages)"),
    Row("tp_depth", lambda _: "2.5d tensor parallelism at another depth",
        lambda p: [p.tp_depth] if p.mesh[TP] > 1 and p.grid_mode() == TP_25D else [],
        lambda p, d, rt: f"(depth {d}; use depth {rt.tp_depth})"),
    Row("expert", lambda _: "expert parallelism (an ep axis)", lambda p: _flag(p.ep > 1),
        lambda p, v, rt: "(use expert size 1)"),
    Row("expert_with_cp", lambda _: "expert parallelism beside a cp axis",
        lambda p: _flag(p.ep > 1, p.mesh[CP] > 1),
        lambda p, v, rt: "(the expert groups lie inside dp; use sequence size 1)"),
    Row("expert_cp_extras", lambda _: "tensor, pipeline or ZeRO beside both expert "
        "parallelism and a cp axis", lambda p: _flag(p.ep > 1, p.mesh[CP] > 1, (
            p.mesh[TP] > 1 or p.mesh[PP] > 1 or p.zero.stage > 0)),
        lambda p, v, rt: "(ep beside cp runs with data and sequence ranks alone)"),
    Row("expert_zero", lambda z: f"ZeRO stage {z} beside expert parallelism",
        lambda p: [p.zero.stage] if p.ep > 1 else [],
        lambda p, z, rt: f"(stages {', '.join(map(str, rt.expert_zero))} run with an ep "
                         "axis)"),
    Row("expert_with_pp", lambda _: "expert parallelism beside a pipeline",
        lambda p: _flag(p.ep > 1, p.mesh[PP] > 1),
        lambda p, v, rt: "(use pipeline size 1, or expert size 1)"),
    Row("expert_zero_with_pp", lambda _: "ZeRO beside both expert parallelism and a pipeline",
        lambda p: [p.zero.stage] if p.ep > 1 and p.mesh[PP] > 1 else [],
        lambda p, z, rt: "(drop one of the three)"),
    Row("hybrid_shard", lambda _: "hybrid sharding (a data shard size below the "
        "data-parallel size)", lambda p: _flag(p.dp_replicate > 1),
        lambda p, v, rt: "(drop the data shard size)"),
    Row("hybrid_with_pp", lambda _: "hybrid sharding beside a pipeline",
        lambda p: _flag(p.dp_replicate > 1, p.mesh[PP] > 1),
        lambda p, v, rt: "(use pipeline size 1, or drop the data shard size)"),
    Row("hybrid_with_ep", lambda _: "hybrid sharding beside expert parallelism",
        lambda p: _flag(p.dp_replicate > 1, p.ep > 1),
        lambda p, v, rt: "(use expert size 1, or drop the data shard size)"),
)
ROWS = {row.field: row for row in TABLE}
assert set(ROWS) == {f.name for f in fields(Capabilities)}, "a Capabilities field has no row"


def missing(plan, runtime: Capabilities) -> list[str]:
    """What of `plan` `runtime` lacks, each as the capability's words and how to do without
    it (Plan.unsupported)."""
    out = []
    for row in TABLE:
        for value in row.uses(plan):
            if row.refuses(runtime, value):
                hint = row.hint(plan, value, runtime)
                line = row.words(value) + (f" {hint}" if hint else "")
                if line not in out:
                    out.append(line)
    return out


def lacking(runtime: Capabilities) -> list[tuple[str, str]]:
    """(field, the words naming it) for every capability `runtime` lacks (search.why)."""
    out = []
    for row in TABLE:
        for value in row.lacking(runtime):
            if (row.field, row.words(value)) not in out:
                out.append((row.field, row.words(value)))
    return out
