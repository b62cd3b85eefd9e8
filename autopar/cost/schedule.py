"""Pipeline schedules as data: which stages each rank runs, in what order, and what that
costs in time (the bubble) and in activations held (micro-batches in flight).

    schedule       stages per rank   rank r holds         order of its work
    "gpipe"        1                 stage r              every forward, then every backward
    "1f1b"         1                 stage r              p - r forwards, then one backward
                                                          and one forward, then backwards
    "interleaved"  v (`chunks`)      r, r + p, ...        Megatron's interleaved 1F1B
    "zero_bubble"  2                 r and 2p - 1 - r     ZB-V: backward split into the
                                                          input gradient (I) and the weight
                                                          gradient (W), W filling bubbles

(p ranks, m micro-batches.) `order` gives each rank's list of actions, ("F"|"B"|"I"|"W",
stage, micro-batch), exactly as torch.distributed.pipelining runs them (the two
multi-stage schedules take their order from torch's own schedule classes, so the model
cannot drift from the runtime). `simulate` plays the orders against per-stage costs:
each action waits for the rank to be free and for what it reads (the previous stage's
forward, the next stage's input gradient, plus a point-to-point transfer when the two
stages are on different ranks). It returns the step time, each rank's busy and idle
time, when each action ran (what `autopar explain --format html` draws), and each
rank's peak of activations held: a micro-batch's activations on a stage
live from its forward to its backward (to the weight gradient, W, when the backward is
split), Narayanan et al. 2021 §2.2 and Qi et al. 2024 §2-3.

The search prices thousands of candidates and uses the closed forms in
`autopar.search.search` (tests check them against `simulate`); a plan's report and the
pipeline benchmark use `simulate` with the stages' own costs.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import lru_cache

from autopar.errors import PlanError
from autopar.modes import GPIPE, INTERLEAVED, ONE_F_ONE_B, SCHEDULES, ZERO_BUBBLE

_TORCH = {INTERLEAVED: "ScheduleInterleaved1F1B", ZERO_BUBBLE: "ScheduleZBVZeroBubble"}


def stage_count(schedule: str, members: int, chunks: int = 1) -> int:
    """How many stages a schedule runs on `members` pipeline ranks."""
    if schedule not in SCHEDULES:
        raise PlanError(f"unknown pipeline schedule {schedule!r}; choose one of "
                        f"{', '.join(SCHEDULES)}.")
    if schedule in (GPIPE, ONE_F_ONE_B):
        return members
    if schedule == ZERO_BUBBLE:
        return 2 * members
    if chunks < 2:
        raise PlanError("the interleaved schedule needs chunks >= 2 (virtual stages per rank); "
                        "use pipeline=dict(..., chunks=2) or the 1f1b schedule.")
    return chunks * members


def stage_owner(schedule: str, stage: int, members: int) -> int:
    """The pipeline rank that runs `stage`."""
    if schedule in (GPIPE, ONE_F_ONE_B):
        return stage
    if schedule == ZERO_BUBBLE:  # V shape: down the ranks, then back up
        return stage if stage < members else 2 * members - 1 - stage
    return stage % members


def stages_per_rank(schedule: str, chunks: int = 1) -> int:
    return {GPIPE: 1, ONE_F_ONE_B: 1, ZERO_BUBBLE: 2}.get(schedule, chunks)


def check_microbatches(schedule: str, members: int, microbatches: int, chunks: int = 1) -> None:
    """One sentence when the schedule cannot run `microbatches` on `members` ranks."""
    n = stage_count(schedule, members, chunks)
    if schedule == ONE_F_ONE_B and microbatches < n:
        raise PlanError(f"the 1f1b schedule over {n} stages needs at least {n} "
                        f"micro-batches, not {microbatches}; use pipeline=dict(..., "
                        f"microbatches={n}) or more, or the gpipe schedule.")
    if schedule == INTERLEAVED:
        rounds = max(1, microbatches // members)
        if microbatches % rounds:
            raise PlanError(f"the interleaved schedule on {members} ranks runs micro-batches in "
                            f"rounds of {microbatches // rounds}; {microbatches} is not a whole "
                            f"number of rounds: use a multiple of {members}.")


Action = tuple  # (kind, stage, micro-batch), kind in "F", "B", "I", "W"


@lru_cache(maxsize=256)
def order(schedule: str, members: int, microbatches: int, chunks: int = 1) -> tuple:
    """Per rank, its actions in the order the runtime runs them."""
    p, m = members, microbatches
    check_microbatches(schedule, p, m, chunks)
    if schedule == GPIPE:
        return tuple(tuple([("F", r, i) for i in range(m)] + [("B", r, i) for i in range(m)])
                     for r in range(p))
    if schedule == ONE_F_ONE_B:
        out = []
        for r in range(p):
            warm = min(m, p - r)
            ops = [("F", r, i) for i in range(warm)]
            f = warm
            for b in range(m):  # one backward, then the next forward
                ops.append(("B", r, b))
                if f < m:
                    ops.append(("F", r, f))
                    f += 1
            out.append(tuple(ops))
        return tuple(out)
    return _torch_order(schedule, p, m, stages_per_rank(schedule, chunks))


def _torch_order(schedule: str, p: int, m: int, v: int) -> tuple:
    """The compute actions torch's schedule class computes for every rank (its order needs
    only the sizes, not the stages)."""
    from torch.distributed.pipelining import schedules as torch_schedules

    cls = getattr(torch_schedules, _TORCH[schedule])
    sched = cls.__new__(cls)
    sched.pp_group_size, sched.n_local_stages, sched._n_microbatches = p, v, m
    sched._num_stages = sched.num_stages = p * v
    sched.number_of_rounds = max(1, m // p)
    sched.microbatches_per_round = m // sched.number_of_rounds
    sched.stage_index_to_group_rank = {s: stage_owner(schedule, s, p) for s in range(p * v)}
    try:
        ranks = [sched._calculate_single_rank_operations(r) for r in range(p)]
    except (AttributeError, TypeError) as e:  # torch changed the schedule's fields
        raise PlanError(f"cannot read the {schedule} schedule's order from torch "
                        f"{cls.__name__} ({e}); autopar's schedule model needs updating for "
                        "this torch version.") from e
    return tuple(tuple((a.computation_type.value, a.stage_index, a.microbatch_index)
                       for a in ops if a is not None) for ops in ranks)


@dataclass
class Timeline:
    step_s: float
    busy_s: list[float]  # per rank: seconds of its own work
    peak_bytes: list[float]  # per rank: most activation bytes held at once
    peak_microbatches: list[float]  # per rank: the same in micro-batches of its stages
    # per rank, its actions as played: (kind, stage, micro-batch, start_s, end_s), so a
    # report can draw the schedule as a Gantt chart
    spans: list[list[tuple]] = field(default_factory=list)

    @property
    def idle(self) -> list[float]:
        """Per rank, the share of the step it waits (the bubble, transfers included)."""
        return [1 - b / self.step_s if self.step_s else 0.0 for b in self.busy_s]


def simulate(schedule: str, members: int, microbatches: int, chunks: int = 1, *,
             forward, backward, weight_share=0.5, p2p=0.0, activations=None) -> Timeline:
    """Play the schedule. Per stage (lists of stage_count entries, or one number for all):
    `forward` and `backward` seconds of one micro-batch, `weight_share` the part of the
    backward that is the weight gradient (split off as W by zero_bubble), `activations`
    the bytes one micro-batch leaves saved on it; `p2p` seconds of one transfer between
    ranks (forward activations or their gradients)."""
    p, m = members, microbatches
    n = stage_count(schedule, p, chunks)

    def per_stage(x):
        return list(x) if isinstance(x, (list, tuple)) else [float(x)] * n

    fwd, bwd, share = per_stage(forward), per_stage(backward), per_stage(weight_share)
    acts = per_stage(activations if activations is not None else 1.0)
    link = per_stage(p2p)  # the transfer out of stage s (forward) or into it (backward)
    if len({len(fwd), len(bwd), len(share), len(acts), len(link), n}) != 1:
        raise ValueError(f"per-stage costs must have {n} entries (one per stage)")
    owner = [stage_owner(schedule, s, p) for s in range(n)]
    duration = {"F": lambda s: fwd[s], "B": lambda s: bwd[s],
                "I": lambda s: bwd[s] * (1 - share[s]), "W": lambda s: bwd[s] * share[s]}
    orders = order(schedule, p, m, chunks)
    done: dict = {}
    grad_kind = {}  # stage -> the action that makes its input gradient ("B" or "I")
    for ops in orders:
        for kind, s, _ in ops:
            if kind in ("B", "I"):
                grad_kind[s] = kind

    def ready(kind, s, i):
        """When the inputs of this action are here, or None if not yet made."""
        deps = []
        if kind == "F" and s > 0:
            deps.append((("F", s - 1, i), owner[s - 1] != owner[s], link[s - 1]))
        elif kind in ("B", "I"):
            deps.append((("F", s, i), False, 0.0))
            if s < n - 1:
                deps.append(((grad_kind[s + 1], s + 1, i), owner[s + 1] != owner[s], link[s]))
        elif kind == "W":
            deps.append((("I", s, i), False, 0.0))
        t = 0.0
        for dep, remote, cost in deps:
            if dep not in done:
                return None
            t = max(t, done[dep] + (cost if remote else 0.0))
        return t

    free, pos = [0.0] * p, [0] * p
    busy = [0.0] * p
    spans: list[list[tuple]] = [[] for _ in range(p)]
    left = sum(len(ops) for ops in orders)
    while left:
        moved = False
        for r in range(p):
            ops = orders[r]
            while pos[r] < len(ops):
                kind, s, i = ops[pos[r]]
                t = ready(kind, s, i)
                if t is None:
                    break
                d = duration[kind](s)
                begin = max(t, free[r])
                done[(kind, s, i)] = begin + d
                spans[r].append((kind, s, i, begin, begin + d))
                free[r] = done[(kind, s, i)]
                busy[r] += d
                pos[r] += 1
                left -= 1
                moved = True
        if not moved:
            raise RuntimeError(f"the {schedule} order deadlocks at {pos}")
    peak_b, peak_m = _peaks(orders, owner, grad_kind, acts)
    return Timeline(max(free), busy, peak_b, peak_m, spans)

def _peaks(orders: list, owner: list[int], grad_kind: dict, acts: list) -> tuple[list, list]:
    """Per rank, the most activation bytes (`acts` per stage) and the most micro-batches
    (a stage's weighing 1 / the rank's stages) held at once as its order runs: a forward
    saves them, the action that ends its stage's backward (W after a split I, else B)
    frees them."""
    peak_b, peak_m = [], []
    for r, ops in enumerate(orders):
        mine = [s for s in range(len(owner)) if owner[s] == r]
        weight = 1.0 / len(mine)
        held = held_m = best = best_m = 0.0
        frees = {s: ("W" if grad_kind.get(s) == "I" else "B") for s in mine}
        for kind, s, _ in ops:
            if kind == "F":
                held += acts[s]
                held_m += weight
                best, best_m = max(best, held), max(best_m, held_m)
            elif kind == frees[s]:
                held -= acts[s]
                held_m -= weight
        peak_b.append(best)
        peak_m.append(best_m)
    return peak_b, peak_m


@lru_cache(maxsize=1024)
def in_flight(schedule: str, members: int, microbatches: int, chunks: int = 1) -> tuple:
    """Per rank, the most micro-batches whose activations it holds at once, each of its
    stages weighing 1/(stages per rank) (its share of the rank's layers).

    Closed forms where they are exact (tests check them against `simulate`): GPipe holds
    all m; 1F1B holds p - r on rank r (Narayanan et al. 2021 §2.2.1); interleaved with v
    stages per rank p + (p - 1 - 2r)/v once m >= 2p; ZB-V p on every rank once m >= 2p
    (Qi et al. 2024 §6: the memory of 1F1B's first stage, everywhere). Otherwise the
    schedule is played."""
    p, m, v = members, microbatches, stages_per_rank(schedule, chunks)
    if schedule == GPIPE:
        return (float(m),) * p
    if schedule == ONE_F_ONE_B:
        return tuple(float(min(m, p - r)) for r in range(p))
    if m >= 2 * p and schedule == INTERLEAVED:
        return tuple(p + (p - 1 - 2 * r) / v for r in range(p))
    if m >= 2 * p and schedule == ZERO_BUBBLE:
        return (float(p),) * p
    return tuple(simulate(schedule, p, m, chunks, forward=1.0, backward=2.0).peak_microbatches)


def step_time(schedule: str, members: int, microbatches: int, device_s, chunks: int = 1) \
        -> float:
    """Closed-form step time of the pipeline, from each rank's seconds per micro-batch
    (forward + backward of its stages, transfers included; the backward taken as twice
    the forward): GPipe and 1F1B (m - 1) x slowest + sum (Huang et al. 2019); interleaved
    m x slowest + (p - 1) x slowest / v (Narayanan et al. 2021 §2.2.2); ZB-V m x slowest +
    (p - 1) x slowest / 6 once m >= 2p, twice that below (Qi et al. 2024 §6: one chunk's
    forward per rank of warm-up when forward, input gradient and weight gradient take
    equal time). Tests check these against `simulate`."""
    slowest, total = max(device_s), sum(device_s)
    p, m, v = members, microbatches, stages_per_rank(schedule, chunks)
    if p == 1:
        return m * slowest
    if schedule == INTERLEAVED:
        return m * slowest + (p - 1) * slowest / v
    if schedule == ZERO_BUBBLE:
        return m * slowest + (p - 1) * slowest / (6 if m >= 2 * p else 3)
    return (m - 1) * slowest + total



def time_shared(schedule: str, members: int, microbatches: int, stage_s, share: float,
                chunks: int = 1, weight_share: float = 0.5) -> float:
    """Step time of the pipeline when its ranks time-share fewer cores than they are (a
    CPU: ``share`` = cores / (ranks x threads) < 1), from each stage's seconds per
    micro-batch (forward + backward, transfers included, the backward twice the forward)
    at the rates measured with every rank busy.

    A rank that waits, in the bubble or because its stages are lighter, hands its cores to
    the busy ones. The schedule is played as a fluid: every replica of the pipeline runs
    alike, so one pipeline owns ``share x members`` cores; while k of its ranks can run,
    each gets min(1, cores / k) of a core, 1/share times the all-busy rate at a whole
    core. Without sharing (share >= 1) this is the schedule's own step."""
    p, m = members, microbatches
    n = stage_count(schedule, p, chunks)
    stage_s = [float(x) for x in stage_s]
    if len(stage_s) != n:
        raise ValueError(f"per-stage costs must have {n} entries (one per stage)")
    fwd = [x / 3 for x in stage_s]
    bwd = [2 * x / 3 for x in stage_s]
    work = {"F": fwd, "B": bwd, "I": [b * (1 - weight_share) for b in bwd],
            "W": [b * weight_share for b in bwd]}
    orders = order(schedule, p, m, chunks)
    grad_kind = {s: kind for ops in orders for kind, s, _ in ops if kind in ("B", "I")}

    def deps(kind, s, i):
        if kind == "F":
            return [("F", s - 1, i)] if s > 0 else []
        if kind in ("B", "I"):
            return [("F", s, i)] + ([(grad_kind[s + 1], s + 1, i)] if s < n - 1 else [])
        return [("I", s, i)]

    cores = min(1.0, share) * p
    tiny = 1e-12 * (max(stage_s) or 1.0)
    done: set = set()
    pos, left = [0] * p, [None] * p  # per rank: next action, all-busy seconds it still needs
    now, remaining = 0.0, sum(len(ops) for ops in orders)
    while remaining:
        running = []
        for r in range(p):
            if pos[r] < len(orders[r]) and all(d in done for d in deps(*orders[r][pos[r]])):
                if left[r] is None:
                    kind, s, _ = orders[r][pos[r]]
                    left[r] = work[kind][s]
                running.append(r)
        if not running:
            raise RuntimeError(f"the {schedule} order deadlocks at {pos}")
        rate = min(1.0, cores / len(running)) / min(1.0, share)  # all-busy seconds per second
        dt = min(left[r] for r in running) / rate
        now += dt
        for r in running:
            left[r] -= dt * rate
            if left[r] <= tiny:
                done.add(orders[r][pos[r]])
                pos[r] += 1
                left[r] = None
                remaining -= 1
    return now
