"""What a search prices per leaf before its states are chosen: the leaf itself (`Leaf`), the
layer states of one (mesh, placement, micro-batch) with their time and memory tables
(`Prepared`), and the dynamic programs that choose per-layer states under a memory budget.
`search.Search` walks the leaves and prices them with these."""

from __future__ import annotations

import weakref
from dataclasses import dataclass, field

import numpy as np

from autopar.cost.model import state_cost
from autopar.cost.step import ExpertSplit, conversion_s
from autopar.modes import CP, RECOMPUTE, TP
from autopar.search.partition import balance, choose_states


@dataclass(kw_only=True)
class Leaf:
    bound: float
    order: tuple  # (its group's place, its schedule's): ties of bounds go to the first
    mesh: dict
    pl: dict
    grad_pl: object
    cp_mode: str | None
    b: int
    m: int
    schedule: str
    v: int
    prep: Prepared
    zeros: list
    dp_cache: dict  # collective seconds by parameter bytes over grad_pl
    split: ExpertSplit | None = None  # expert parallelism (None: experts on every rank)
    stage_of: list | None = None
    device_of: list | None = None
    transfer: float | None = None  # seconds of one stage-boundary crossing
    fast: Fast | None = None  # its numbers with every layer in its fastest state


@dataclass(eq=False)
class Pending:
    """A leaf group not made yet (`Search._run`): one group of a mesh's walk (cp mode, expert
    split, micro-batch, ZeRO options, group number: `search._mesh_walk`), whose leaves are
    made (and its Prepared priced) only once its floor (`floors.group_floor`) comes first,
    itself read only once the floor of its work (`floors.state_work`) comes first."""

    mesh: dict
    walk: tuple
    group: tuple
    seq: int  # its place in leaf order
    pipe: float = 0.0  # a lower bound of its leaves' pipeline seconds
    full: bool = True  # whether `pipe` is read from the state floors (False: their work)
    dp: tuple | None = None  # (parameter bytes, their least sync) once its floor adds them


@dataclass
class Fast:
    """What a leaf's ZeRO options share while every layer keeps its fastest state."""

    device_of: np.ndarray
    params_dev: np.ndarray  # parameter bytes per pipeline rank
    acts_dev: np.ndarray  # activation bytes per micro-batch per pipeline rank
    temps_dev: np.ndarray  # the for-loop optimizer step's temporaries per pipeline rank
    pipeline: tuple | None = None  # `pipeline_time` of the fastest path
    _layers: dict = field(default_factory=dict)
    _groups: dict = field(default_factory=dict)
    fitted: dict = field(default_factory=dict)  # `Search._fitted` by the states chosen

    def groups_of(self, rank: int, prep: Prepared) -> tuple:
        """`Prepared._groups` of the layers pipeline rank ``rank`` holds, in their fastest
        states (what every ZeRO option's `fit` of that rank starts from)."""
        hit = self._groups.get(rank)
        if hit is None:
            hit = self._groups[rank] = prep._groups(prep.fast, self.layers_of(rank))
        return hit

    def layers_of(self, rank: int) -> list[int]:
        """The layers pipeline rank ``rank`` holds, in order."""
        if not self._layers:  # every rank's at once, in one pass
            for i, d in enumerate(self.device_of.tolist()):
                self._layers.setdefault(d, []).append(i)
        return self._layers.get(rank, [])


class Priced:
    """A candidate as the search ranks it (`Search._priced`): its step seconds, whether it
    fits, its worst device's bytes, whether fitting memory moved a layer off its fastest
    state, and the states chosen per layer; the whole `Candidate` made only when asked
    (`candidate`), as few of those priced are kept."""

    __slots__ = ("step_time", "fits", "memory_per_device", "moved", "leaf", "chosen", "_make",
                 "_whole")

    def __init__(self, step_time: float, fits: bool, memory: float, moved: bool, leaf,
                 chosen: np.ndarray, make):
        self.step_time, self.fits, self.memory_per_device, self.moved = \
            step_time, fits, memory, moved
        self.leaf, self.chosen = leaf, chosen
        self._make = make  # () -> the Candidate (`result.candidate_of` and what it reads)
        self._whole = None

    def candidate(self):
        """The `search.Candidate`, made once."""
        if self._whole is None:
            self._whole, self._make = self._make(), None
        return self._whole

    def states(self) -> list:
        """The LayerState of each layer."""
        return self.leaf.prep.states_of(self.chosen.tolist())


class Prepared:
    """One tp/cp placement and micro-batch: per-layer state costs along the chain."""

    def __init__(self, search, kinds, pl, b, context, base=None):  # search: the search.Search
        """``kinds``: (layer kind, its states) in chain-type order; ``context``: the cost
        Context and the shared costs under it (`cost_table`); ``base``: the Prepared
        of a search whose states of each kind begin these (their costs are its). The lower
        bound prices only each layout's state with the least recomputation, its fastest
        (recomputing adds compute and reruns collectives, never takes any away) and with the
        same parameters and workspace; `build` the rest."""
        order = search.chain.order
        # no reference cycle with the search that caches it: both go by reference counting
        # when the search is dropped, with no collection to walk them
        self.search = weakref.proxy(search)
        self.kinds, self.context, self.base = kinds, context, base
        self.per_type = [(states, [None] * len(states)) for _, states in kinds]
        for (_, costs), (_, known) in zip(self.per_type, base.per_type if base else ()):
            costs[:len(known)] = known
        self.order = order
        self.pl, self.b = pl, b
        # per kind: (least seconds, parameter and expert bytes, most workspace)
        self.least = [self._least(t, base) for t in range(len(kinds))]
        self.counts = counts = base.counts if base else np.bincount(order,
                                                                     minlength=len(kinds))
        # the kinds the chain holds, in the order of their first layer
        self.present = base.present if base else list(dict.fromkeys(order))
        fastest = [least[0] for least in self.least]
        self.min_total = float(np.dot(counts, fastest))
        self.min_single = max(fastest[t] for t in self.present)
        self.min_params = float(np.dot(counts, [least[1] for least in self.least]))
        self.min_experts = float(np.dot(counts, [least[2] for least in self.least]))
        self.workspace = max(least[3] for least in self.least)
        self.built = False
        self._stages: dict = {}
        self._layouts: dict = {}
        self._fast_key: tuple | None = None  # `fast_key`, once asked
        self._adds_nothing: bool | None = None  # `adds_nothing`, once asked
        self._runs: dict = {}  # `relayout`'s paths by run and the states at its ends
        self._unfitted: dict = {}  # `_unfitted_times` by layer
        self._least_mem: dict = {}  # `_least_memory` by layer
        # `_counts_one`'s answers by the values that decide them, shared by every Prepared of
        # the search (and its grid searches): other meshes price a kind alike
        self._counts_memo: dict = search._shared.setdefault("counts", {})
        self.splits: dict = {}  # `Search._memory_split`'s, by schedule, pp, m and ZeRO option
        self.state_rows = [states for _, states in kinds]
        self.state_rows = [self.state_rows[t] for t in order]  # per layer: its kind's states

    def _least(self, t: int, base) -> tuple:
        """Kind ``t``'s least seconds, parameter and expert bytes and its most workspace over
        each layout's state with the least recomputation; from the `base` Prepared's where
        these states begin its, pricing only the layouts it lacks (`least_states`)."""
        which, joined = least_states(self.search, self.kinds, base)[t]
        if which is None:
            return base.least[t]
        costs = self._price(which, t)
        least = (min(c.time for c in costs), min(c.params for c in costs),
                 min(c.expert_params for c in costs), max(c.workspace for c in costs))
        if not joined:
            return least
        had = base.least[t]
        return (min(had[0], least[0]), min(had[1], least[1]), min(had[2], least[2]),
                max(had[3], least[3]))

    def _price(self, which, t: int) -> list:
        """The costs of kind ``t``'s states at the indices ``which``, each priced once."""
        lt, states = self.kinds[t]
        costs = self.per_type[t][1]
        todo = [k for k in which if costs[k] is None]
        for k, c in zip(todo, state_costs_of(lt, [states[k] for k in todo], self.b,
                                             *self.context)):
            costs[k] = c
        return [costs[k] for k in which]

    def build(self) -> Prepared:
        """The chain arrays, the fastest path and its numbers: only for leaves that are
        priced (the lower bounds need none of it)."""
        if self.built:
            return self
        self.built = True
        for t, (_, states) in enumerate(self.kinds):
            self._price(range(len(states)), t)
        search, per_type, order, pl, b = self.search, self.per_type, self.order, self.pl, self.b
        self.t_layers = [np.array([c.time for c in per_type[t][1]]) for t in order]
        self.mem_layers = [np.array([c.activations for c in per_type[t][1]]) for t in order]
        self.conv = [None]
        for i in range(1, len(order)):
            self.conv.append(self._conversion(search, order[i - 1], order[i], pl, b))
        self._tables(search)
        self.fast, _ = choose_states([len(t) for t in self.t_layers], self.t_layers,
                                     self.mem_layers, self.conv, 0.0)
        self.layer_time = self.path_time(self.fast)
        self.params = self.take(self.param_table, self.fast)
        self.acts = self.take(self.act_table, self.fast)
        self.temps = tuple(self.take(t, self.fast) for t in self.temp_tables)
        self.biggest = float(self.params.max()) if len(self.params) else 0.0
        self.held = self.take(self.held_table, self.fast)
        return self

    def _tables(self, search) -> None:
        """(layer, state) tables of the costs the pricing reads, padded to the most states,
        and per layer its layout ids and the seconds of a conversion before it."""
        per_type, order = self.per_type, self.order
        n, width = len(order), max(len(states) for states, _ in per_type)
        self.rows = np.arange(n)
        layout_ids: dict = {}
        kinds = []
        for (lt, _), (states, costs) in zip(self.kinds, per_type):
            table = np.zeros((13, width))
            tied = lt.held_bytes / lt.param_bytes if lt.param_bytes else 0.0  # (of c.params)
            for k, c in enumerate(costs):
                table[:, k] = (c.time, c.activations, c.params, c.forward + c.backward +
                               c.recompute, c.comm, c.comm_bytes, c.expert_params, c.ep_comm,
                               c.step_temps.peak, c.step_temps.first, c.step_temps.last,
                               c.split_backward, c.params * tied)
            layouts = np.full(width, -1)
            layouts[:len(states)] = [layout_ids.setdefault(st.layout, len(layout_ids))
                                     for st in states]
            kinds.append((table, layouts))
        tables = np.stack([kinds[t][0] for t in order])  # (layer, quantity, state)
        self.time_table, self.act_table, self.param_table, self.compute_table, \
            self.comm_table, self.comm_bytes_table, self.expert_table, self.ep_comm_table = (
                tables[:, q, :] for q in range(8))
        self.temp_tables = tuple(tables[:, q, :] for q in range(8, 11))  # StepTemps' fields
        self.split_table = tables[:, 11, :]  # zero-bubble's split backward (StateCost)
        self.held_table = tables[:, 12, :]  # params a later layer reads too (held_bytes)
        self.layout_table = np.stack([kinds[t][1] for t in order])
        self.gather = np.array([0.0] + [float(c.max()) if c.size else 0.0
                                        for c in self.conv[1:]])
        self.mem_lists = [m.tolist() for m in self.mem_layers]
        layers = search.layers
        self.boundaries = np.array([layers[i].boundary(self.b) for i in range(n - 1)])
        self.time_lists = [t.tolist() for t in self.t_layers]

    def take(self, table, chosen) -> np.ndarray:
        """One value per layer: `table` at each layer's chosen state."""
        return table[self.rows, chosen]

    def _conversion(self, search, a, b_type, pl, b):
        key = ("conv", a, b_type, b, pl[TP], pl[CP])
        mat = search._cost_cache.get(key)
        if mat is None:
            prev_states, cur_states = self.per_type[a][0], self.per_type[b_type][0]
            gather = conversion_s(search.chain.types[a].boundary(b), pl, search.hw)
            mat = np.array([[0.0 if sa.layout == sb.layout else gather for sb in cur_states]
                            for sa in prev_states])
            search._cost_cache[key] = mat
        return mat

    def _by_layout(self, t: int, times, mems) -> list:
        """(layout, `_count_order` of its states) of one kind of layer, in the order `fit`
        tries them; `times`, `mems`: that kind's, per state."""
        hit = self._layouts.get(t)
        if hit is None:
            states = self.per_type[t][0]
            hit = self._layouts[t] = [
                (lay, _count_order([k for k, s in enumerate(states) if s.layout == lay],
                                   times, mems)) for lay in {s.layout for s in states}]
        return hit

    def states_of(self, chosen):
        """The LayerState of each layer at its chosen state index."""
        return [states[c] for states, c in zip(self.state_rows, chosen)]

    def fast_key(self) -> tuple:
        """The fastest path's states as plain values, which other searches' states (equal,
        not the same objects) compare to cheaply (once built)."""
        if self._fast_key is None:
            self._fast_key = tuple((s.mode.name, s.mode.size, s.mode.q, s.mode.d, s.sp,
                                    s.recompute) for s in self.states_of(self.fast))
        return self._fast_key

    def adds_nothing(self) -> bool:
        """Whether no candidate takes a state past the `base` Prepared's, so each is the base
        search's: of each kind, every layout of them has a layout of the base's states (two
        or more, the same first ones; `fit` leaves a kind of one as it is) that beats it state
        by state (`_beats`: faster, no more activations), and they raise no workspace.
        Decided before the tables and the fastest path are built where one base layout beats
        the new ones of every kind (the grid's layouts are one value across kinds, the base's
        another): putting it in their place wherever a path takes them is faster and adds no
        conversion, so neither the fastest path, nor `fit` (its exact counts per layout find a
        faster fit in that layout, whose conversion costs no more; its fallback to the least
        memory finds a base state first), nor `relayout` (it keeps each layer's tensor mode)
        takes one. Else the leaf is built and its fastest path asked."""
        if self._adds_nothing is None:
            self._adds_nothing = self.base is not None and self._beaten(self.base)
        return self._adds_nothing

    def _beaten(self, base) -> bool:
        if self.workspace > base.workspace:
            return False
        common = None  # the base layouts that beat every new layout of every kind
        for t, ((states, costs), (had, _)) in enumerate(zip(self.per_type, base.per_type)):
            n = len(had)
            if len(states) == n:
                continue
            if not self.built:  # (once built, every state is priced)
                self._price(range(len(states)), t)
            layouts: dict = {}
            for st, c in zip(states, costs):
                layouts.setdefault(st.layout, []).append(c)
            own = {st.layout for st in had}
            new = {st.layout for st in states[n:]}
            if n < 2 or own & new:
                return False
            beating = [{lay for lay in own if all(any(_beats(b, c) for b in layouts[lay])
                                                  for c in layouts[extra])} for extra in new]
            if not all(beating):
                return False
            for lays in beating:
                common = lays if common is None else common & lays
        if common:
            return True
        self.build()
        return not any(k >= len(had) for k, had in zip(self.fast, base.state_rows))

    def path_time(self, chosen) -> np.ndarray:
        """Each layer's seconds in its chosen state, plus a conversion where its layout is not
        its predecessor's."""
        chosen = np.asarray(chosen)
        out = self.time_table[self.rows, chosen]
        layouts = self.layout_table[self.rows, chosen]
        out[1:] += np.where(layouts[1:] != layouts[:-1], self.gather[1:], 0.0)
        return out

    def stages(self, k: int, split: bool = False) -> list[int]:
        """``k`` stages balanced by the fastest path's time; `split`: with the seconds a
        zero-bubble schedule adds where it splits a backward (`split_table`: the chunked
        loss's logits made once more), as `Search._priced` times that stage."""
        hit = self._stages.get((k, split))
        if hit is None:
            time = self.layer_time + self.take(self.split_table, self.fast) if split else \
                self.layer_time
            hit = self._stages[(k, split)] = balance(time, k)
        return hit

    def fit_ranks(self, chosen, fast: Fast, total, fixed, capacity, in_flight) -> None:
        """`fit` each pipeline rank whose ``total`` bytes pass ``capacity`` in what its
        ``fixed`` bytes leave for its ``in_flight`` micro-batches' activations, then
        `relayout` the layers beside the ones moved."""
        fitted: set = set()
        # (in plain floats: the same values, and `fit`'s loops then run on floats, not on
        # numpy scalars)
        fixed, in_flight = fixed.tolist(), in_flight.tolist()
        for d, held in enumerate(total.tolist()):
            if held > capacity:
                self.fit(chosen, fast.layers_of(d), (capacity - fixed[d]) / in_flight[d],
                         fitted, fast.groups_of(d, self))
        self.relayout(chosen, fitted)

    def fit(self, chosen, idx, budget, fixed: set | None = None, groups=None) -> None:
        """Fit one device's layers in ``budget`` activation bytes at the least extra time:
        layers of one kind keep one layout and choose their recompute (`_counts`); the
        layers it moves off their fastest-path state go into ``fixed`` (for `relayout`).
        ``groups``: `_groups` of ``idx`` where every layer of it is in its fastest-path
        state (a `Fast`'s, kept per rank)."""
        if groups is None:
            groups = self._groups(chosen, idx)
        held, kinds = groups
        spare = budget - held
        if spare >= 0:
            return
        for members, used, layout, times, row, layouts in kinds:
            if spare >= 0:
                break
            best = None
            for lay, order in layouts:
                counts = _count_with(order, times, row, len(members), used + spare,
                                     self._counts_memo)
                if counts is None:
                    continue
                # leaving the neighbours' layout costs a conversion in and one out
                penalty = 0.0 if lay == layout else 2 * float(self.gather[members[0]])
                time_, mem, assignment = counts
                if best is None or time_ + penalty < best[0]:
                    best = (time_ + penalty, mem, assignment)
            if best is None:  # nothing fits: take the least memory there is
                k = self._least_memory(members[0])
                best = (0.0, len(members) * self.mem_layers[members[0]][k], [k] * len(members))
            for i, k in zip(members, best[2]):
                chosen[i] = k
            if fixed is not None:
                fixed.update(i for i in members if chosen[i] != self.fast[i])
            spare = used + spare - best[1]

    def _groups(self, chosen, idx) -> tuple:
        """What `fit` reads of ``idx`` before any budget: the activation bytes its layers
        hold in ``chosen`` (summed in layer order), and per kind holding a choice, the
        biggest groups first: (its layers, their bytes, their layout, the kind's seconds and
        bytes per state, `_by_layout`)."""
        mems = self.mem_lists
        held = sum(mems[i][chosen[i]] for i in idx)
        groups: dict = {}
        for i in idx:
            groups.setdefault(self.order[i], []).append(i)
        kinds = []
        # shrink the biggest groups first: each gets the share of the deficit it can cover
        for t, members in sorted(groups.items(), key=lambda g: -len(g[1])):
            states = self.per_type[t][0]
            if len(states) <= 1:
                continue
            times = self.time_lists[members[0]]
            kinds.append((members, sum(mems[i][chosen[i]] for i in members),
                          states[chosen[members[0]]].layout, times, mems[members[0]],
                          self._by_layout(t, times, mems[members[0]])))
        return held, kinds

    def _least_memory(self, i: int) -> int:
        """The state of layer i holding the fewest activation bytes (the first of them)."""
        hit = self._least_mem.get(i)
        if hit is None:
            hit = self._least_mem[i] = int(np.argmin(self.mem_layers[i]))
        return hit

    def relayout(self, chosen, fixed: set) -> None:
        """After `fit` moved layers (``fixed``) to another layout: the layers it left choose
        their states again by the fastest path around the ones it set, each among its states
        of the same tensor mode holding no more activations, parameters or optimizer
        temporaries than its current one (so what fitted still fits), and their layouts
        follow: the path pays no conversion the memory does not force. Exact and local: the
        fastest path's choices along a run of layers left stay the fastest while the fitted
        layers at its ends keep their layouts, so only the runs beside a layer that changed
        layout are searched again, each once per Prepared and pair of states at its ends."""
        layouts, n = self.layout_table, len(chosen)
        runs = set()
        for i in fixed:
            if layouts[i, chosen[i]] == layouts[i, self.fast[i]]:
                continue
            for j, step in ((i - 1, -1), (i + 1, 1)):
                if 0 <= j < n and j not in fixed:
                    end = j
                    while 0 <= end + step < n and end + step not in fixed:
                        end += step
                    runs.add((min(j, end), max(j, end) + 1))
        for start, stop in sorted(runs):
            left = chosen[start - 1] if start > 0 else None
            right = chosen[stop] if stop < n else None
            key = (start, stop, left, right)
            path = self._runs.get(key)
            if path is None:
                path = self._runs[key] = self._run_path(start, stop, left, right)
            chosen[start:stop] = path

    def _run_path(self, start, stop, left, right) -> list[int]:
        """The fastest states of layers start..stop-1 (each among `_unfitted_times`) between
        the layers before and after them in states ``left`` and ``right`` (None: the chain's
        end)."""
        lo, hi = start - (left is not None), stop + (right is not None)
        times = []
        for i in range(lo, hi):
            if start <= i < stop:
                times.append(self._unfitted_times(i))
            else:
                k = left if i < start else right
                times.append(np.where(np.arange(len(self.t_layers[i])) == k,
                                      self.t_layers[i], np.inf))
        path, _ = choose_states([len(t) for t in times], times, self.mem_layers[lo:hi],
                                [None] + self.conv[lo + 1:hi], 0.0)
        return path[start - lo:stop - lo]

    def _unfitted_times(self, i: int) -> np.ndarray:
        """Layer i's seconds per state where its state keeps the tensor mode of its
        fastest-path state (a layout of another sequence split) and holds no more memory of
        any kind, else infinity."""
        hit = self._unfitted.get(i)
        if hit is None:
            k, n = self.fast[i], len(self.t_layers[i])
            states = self.state_rows[i]
            tables = (self.act_table, self.param_table, self.expert_table) + self.temp_tables
            allowed = np.logical_and.reduce([t[i, :n] <= t[i, k] for t in tables] + [
                np.array([s.mode == states[k].mode for s in states])])
            hit = self._unfitted[i] = np.where(allowed, self.t_layers[i], np.inf)
        return hit


def state_costs_of(lt, states, b: int, ctx, table, plain=None) -> list:
    """`state_cost` of each state, from the shared costs where given (`table`: the
    `cost_table` of this micro-batch and context; None: not shared). `plain`: the costs of
    layer kinds with no attention and no experts under this micro-batch, tensor placement
    and number of cp ranks (`plain_table`), shared by the contexts that differ only in the cp
    mode or the cp ranks' placement: such a layer's price reads neither."""
    if plain is not None and not lt.attention and lt.experts is None:
        table = plain
    elif table is None:
        return [state_cost(lt, s, b, ctx) for s in states]
    out = []
    for s in states:
        # by identity (each value is one object, `space._state`), the objects held
        key = (id(lt), id(s))
        hit = table.get(key)
        if hit is None or hit[0] is not lt or hit[1] is not s:
            hit = table[key] = (lt, s, state_cost(lt, s, b, ctx))
        out.append(hit[2])
    return out


def plain_table(shared: dict, b: int, pl) -> dict:
    """`state_costs_of`'s ``plain`` costs of one micro-batch, tensor placement and number
    of cp ranks (of placements ``pl``), kept in `shared` (a search's caches)."""
    key = ("plain costs", b, pl[TP], pl[CP].size)
    table = shared.get(key)
    if table is None:
        table = shared[key] = {}
    return table


def cost_table(shared: dict | None, b: int, ctx_key) -> dict | None:
    """The `shared` state costs (a search's `state_costs`) of one micro-batch and context
    (None: not shared), found once per Prepared: its key, which holds the placements, is
    hashed once, not per state."""
    if shared is None:
        return None
    table = shared.get((b, ctx_key))
    if table is None:
        table = shared[(b, ctx_key)] = {}
    return table


def least_states(search, kinds, base) -> list:
    """Per kind of ``kinds``, (the indices of the states `Prepared._least` prices, whether the
    `base` Prepared's figures join theirs): (None, True) where its states are the base's
    (`search._base_of` found them its prefix), the layouts the base lacks where they are all
    new, else every layout. Once per state list and search: it follows from the lists alone."""
    key = ("least states", id(kinds))
    hit = search._cost_cache.get(key)
    if hit is None:
        hit = search._cost_cache[key] = []
        for t, (_, states) in enumerate(kinds):
            n = len(base.kinds[t][1]) if base is not None else 0
            if n and len(states) == n:
                hit.append((None, True))
            elif n and not {s.layout for s in states[n:]} & {s.layout for s in states[:n]}:
                hit.append(([n + k for k in least_recompute(states[n:])], True))
            else:
                hit.append((least_recompute(states), False))
    return hit


def least_total(search, kinds, b: int, context, base) -> float:
    """The ``min_total`` the Prepared of these arguments (`Prepared`'s) has, from its kinds'
    least seconds alone, without making it: a search under a cutoff asks it first, and makes
    the Prepared only where a leaf's first bound (every layer at its fastest, the work spread
    evenly over the stages) is under the cutoff. The same states priced, the same sum."""
    fastest = []
    for t, (which, joined) in enumerate(least_states(search, kinds, base)):
        if which is None:
            fastest.append(base.least[t][0])
            continue
        lt, states = kinds[t]
        costs = state_costs_of(lt, [states[k] for k in which], b, *context)
        least = min(c.time for c in costs)
        fastest.append(min(base.least[t][0], least) if joined else least)
    counts = base.counts if base else np.bincount(search.chain.order, minlength=len(kinds))
    return float(np.dot(counts, fastest))


def _beats(b, c) -> bool:
    """State cost `b` is faster than `c` and holds no more activations."""
    return b.time < c.time and b.activations <= c.activations


def least_recompute(states) -> list[int]:
    """Per layout, the index of its state with the least recomputation, in state order."""
    best: dict = {}
    for k, s in enumerate(states):
        rank = RECOMPUTE.index(s.recompute)
        if s.layout not in best or rank < best[s.layout][0]:
            best[s.layout] = (rank, k)
    return sorted(k for _, k in best.values())


def _counts(options, times, mems, n, budget):
    """Exact cheapest assignment of ``options`` (state indices) to ``n`` identical layers
    within ``budget`` bytes: enumerate the counts of all options but the two cheapest in
    time, which split the rest (as many as fit on the faster one)."""
    return _count_with(_count_order(options, times, mems), times, mems, n, budget)


def _count_order(options, times, mems):
    """(fastest, the least memory of the rest, the others) of ``options``; None if empty."""
    opts = sorted(options, key=lambda k: (times[k], mems[k]))
    if not opts:
        return None
    fast, rest = opts[0], opts[1:]
    if not rest:
        return fast, None, []
    second = min(rest, key=lambda k: mems[k])
    return fast, second, [k for k in rest if k != second]


def _count_with(order, times, mems, n, budget, memo: dict | None = None):
    """`_counts` from the `_count_order` of its options (`_counts_one`'s answers kept in
    ``memo``; callers only read the assignments)."""
    if order is None:
        return None
    fast, second, others = order
    if second is None:
        mem = n * mems[fast]
        return (n * times[fast], mem, [fast] * n) if mem <= budget else None
    if len(others) == 1:  # three recompute levels: one loop, as below
        other = others[0]
        if memo is None:
            return _counts_one(fast, second, other, times, mems, n, budget)
        key = (fast, second, other, times[fast], times[second], times[other], mems[fast],
               mems[second], mems[other], n, budget)
        hit = memo.get(key, memo)
        if hit is memo:
            hit = memo[key] = _counts_one(fast, second, other, times, mems, n, budget)
        return hit
    best = None
    # each "other" option gets a count; with three recompute levels that is one loop
    for combo in _compositions(n, len(others)):
        used_n = sum(combo)
        mem_o = sum(c * mems[k] for c, k in zip(combo, others))
        time_o = sum(c * times[k] for c, k in zip(combo, others))
        left = n - used_n
        room = budget - mem_o - left * min(mems[fast], mems[second])
        if room < -1e-9:
            continue
        gap = mems[fast] - mems[second]
        n_fast = left if gap <= 0 else min(left, int((room + 1e-9) // gap))
        t = time_o + n_fast * times[fast] + (left - n_fast) * times[second]
        mem = mem_o + n_fast * mems[fast] + (left - n_fast) * mems[second]
        if best is None or t < best[0] - 1e-15:
            assignment = [fast] * n_fast + [second] * (left - n_fast)
            for c, k in zip(combo, others):
                assignment += [k] * c
            best = (t, mem, assignment)
    return best


def _counts_one(fast, second, other, times, mems, n, budget):
    """`_counts` with one option besides the two cheapest, its count enumerated in a plain
    loop (the same arithmetic in the same order)."""
    best = None
    t_fast, t_second, t_other = times[fast], times[second], times[other]
    m_fast, m_second, m_other = mems[fast], mems[second], mems[other]
    least = min(m_fast, m_second)
    gap = m_fast - m_second
    beat = float("inf")  # what a count's seconds must be under to be the best so far
    for c in range(n + 1):
        mem_o = 0 + c * m_other
        left = n - c
        room = budget - mem_o - left * least
        if room < -1e-9:
            continue
        n_fast = left if gap <= 0 else min(left, int((room + 1e-9) // gap))
        t = 0 + c * t_other + n_fast * t_fast + (left - n_fast) * t_second
        if t < beat or best is None:
            best = (t, mem_o + n_fast * m_fast + (left - n_fast) * m_second, c, n_fast)
            beat = t - 1e-15
    if best is None:
        return None
    t, mem, c, n_fast = best
    return t, mem, [fast] * n_fast + [second] * (n - c - n_fast) + [other] * c


def _compositions(n, k):
    """Every tuple of k non-negative counts with sum <= n (k is 0, 1 or 2 here)."""
    if k == 0:
        yield ()
        return
    for first in range(n + 1):
        for tail in _compositions(n - first, k - 1):
            yield (first, *tail)


