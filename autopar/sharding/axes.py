"""The tensor-parallel axes of a plan: physical mesh dims, and named groups of several of them.

1D tensor parallelism has one axis, `tp`. 2D, 2.5D and 3D factor the tensor group into a
grid, one physical mesh dim per grid index, laid out after `dp` on one DeviceMesh:

    2d     tp_i, tp_j              (q x q)         rank (i, j)
    2.5d   tp_k, tp_i, tp_j        (d x q x q)     rank (i, j, k)
    3d     tp_b, tp_a, tp_c        (q x q x q)     rank (a, b, c); b plays the weight role

A DeviceMesh dim's group varies that dim's index: group `tp_i` joins the ranks that differ
only in i, and its rank is i. A tensor dim split over two indices at once is split over a
*composite* axis, named after its components major first: the 2.5D batch over (k, i) is
`tp_ki` (slice k*q + i of d*q), the 3D batch over (b, a) is `tp_ba`, a 3D weight's output
features over (a, b) are `tp_ab`. `tp` is every tensor dim together (the group of 1D layers in
a plan that mixes modes). A composite whose components come in mesh order is a group of
ranks whose group rank is the composite index, so it has a process group of its own
(`has_group`); the others (`tp_ab`, `tp_cb`) only name parameter blocks, and the
redistribution steps on them run over their components one after the other.

A split over a composite axis that is a process group is one split over its composite
index (major * size(minor) + minor), blockwise in `groups` blocks like any axis. A split
over one without a group (`tp_ab`, `tp_cb`: 3D weights) is read component by component:
the dim is cut over the major component blockwise in `groups` blocks, then the rank's part
is cut over each further component as one block. With one block the two readings agree;
with `groups` blocks the second is the order a 3D kernel's all-gather over its weight group
reassembles a fused QKV weight in.

`grid(mode, role)` names the groups of the kernels in `autopar.kernels.multid`, so the
solver and the runtime read the block layouts of every tensor role from the same table.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass, field

from autopar.modes import CP, CP_TP, GRID_MODES, TP, TP_1D, TP_2D, TP_3D, TP_25D

MULTI_D = GRID_MODES
_PHYSICAL = {TP_2D: ("tp_i", "tp_j"), TP_25D: ("tp_k", "tp_i", "tp_j"),
             TP_3D: ("tp_b", "tp_a", "tp_c")}
_COMPOSITE = {TP_2D: {},
              TP_25D: {"tp_ki": ("tp_k", "tp_i")},
              TP_3D: {"tp_ba": ("tp_b", "tp_a"), "tp_bc": ("tp_b", "tp_c"),
                     "tp_ab": ("tp_a", "tp_b"), "tp_cb": ("tp_c", "tp_b")}}
# The grids of each mode, as the axis names of the roles of autopar.kernels.multid's Grid
# classes: Grid2D(row, col), Grid2p5D(row, col, dep), Grid3D(input, weight, output).
GRIDS = {TP_2D: (("tp_j", "tp_i"),),
         TP_25D: (("tp_j", "tp_i", "tp_k"),),
         TP_3D: (("tp_a", "tp_b", "tp_c"), ("tp_c", "tp_b", "tp_a"))}


@dataclass(frozen=True)
class TensorMesh:
    """The tensor-parallel axes: physical dims (mesh order) and composites of them.

    `mode` is the plan's multi-dimensional mode ("1d" when there is none), `dims` the sizes
    of the physical dims in mesh order.
    """

    mode: str
    dims: tuple[tuple[str, int], ...]
    composites: dict = field(default_factory=dict, compare=False, hash=False)

    @staticmethod
    def one_d(axis: str = TP, size: int = 1) -> TensorMesh:
        return TensorMesh(TP_1D, ((axis, size),))

    @staticmethod
    def with_cp(cp: int, tp: int) -> TensorMesh:
        """cp beside the 1D tensor axis; `CP_TP` names the tokens of a rank's cp block split
        again over tp (Megatron-SP beside cp), which only a tensor axis of 2 or more has."""
        if tp == 1:
            return TensorMesh(TP_1D, ((CP, cp), (TP, tp)))
        return TensorMesh(TP_1D, ((CP, cp), (TP, tp)), {CP_TP: (CP, TP)})

    def beside_cp(self, cp: int) -> TensorMesh:
        """This 2D, 2.5D or 3D grid with a cp axis of `cp` ranks outside it (cp major, as in
        the device order): the grid splits weights and activations, cp the tokens. A
        batch x tokens dim flattened into one lies over `cp_<batch axis>` (`cp_batch`)."""
        composites = dict(self.composites)
        for grid in GRIDS[self.mode]:
            batch = role_spec(self.mode, grid, "x")[0]
            composites[cp_batch(self.composite(batch))] = (CP,) + batch
        return TensorMesh(self.mode, ((CP, cp),) + self.dims, composites)

    @staticmethod
    def for_mode(mode: str, size: int, depth: int = 1) -> TensorMesh:
        """The mesh of `size` tensor ranks in `mode` (sizes already checked by the plan)."""
        if mode not in MULTI_D:
            return TensorMesh.one_d(TP, size)
        if mode == TP_3D:
            q = round(size ** (1 / 3))
            sizes = (q, q, q)
        elif mode == TP_25D:
            q = math.isqrt(size // depth)
            sizes = (depth, q, q)
        else:
            q = math.isqrt(size)
            sizes = (q, q)
        physical = _PHYSICAL[mode]
        composites = dict(_COMPOSITE[mode])
        composites[TP] = physical
        return TensorMesh(mode, tuple(zip(physical, sizes)), composites)

    # ----------------------------------------------------------------- axes
    @functools.cached_property
    def physical(self) -> tuple[str, ...]:
        """The physical dims' names (read tens of thousands of times a start: kept)."""
        return tuple(name for name, _ in self.dims)

    @functools.cached_property
    def axes(self) -> tuple[str, ...]:
        """Every axis name a layout may use: physical dims, then composites."""
        return self.physical + tuple(a for a in self.composites if a not in self.physical)

    @property
    def total(self) -> int:
        return math.prod(size for _, size in self.dims)

    def components(self, axis: str) -> tuple[str, ...]:
        """The physical dims an axis spans, major first."""
        if axis in self.composites:
            return self.composites[axis]
        if axis in self.physical:
            return (axis,)
        raise KeyError(f"unknown tensor axis {axis!r}; this mesh has {self.axes}")

    def size(self, axis: str) -> int:
        known = self._sizes.get(axis)
        if known is not None:
            return known
        sizes = dict(self.dims)
        return math.prod(sizes[c] for c in self.components(axis))

    @property
    def sizes(self) -> dict[str, int]:
        """Ranks on every axis (a new dict each call: callers may change theirs)."""
        return dict(self._sizes)

    @functools.cached_property
    def _sizes(self) -> dict[str, int]:
        dims = dict(self.dims)
        return {a: math.prod(dims[c] for c in self.components(a)) for a in self.axes}

    def overlap(self, a: str, b: str) -> bool:
        """True when two axes share a physical dim (a tensor cannot be split over both)."""
        return bool(set(self.components(a)) & set(self.components(b)))

    def has_group(self, axis: str) -> bool:
        """True when the axis is one process group (its components come in mesh order; the
        runtime makes none of cp x tp)."""
        if axis == CP_TP:
            return False
        comps = self.components(axis)
        if comps[0] == CP and len(comps) > 1:  # read component by component (`cp_batch`)
            return False
        order = [self.physical.index(c) for c in comps]
        return order == sorted(order)

    def index(self, axis: str, coords: dict[str, int]) -> int:
        """This rank's index on `axis` from its index on every physical dim (major first)."""
        sizes = dict(self.dims)
        out = 0
        for c in self.components(axis):
            out = out * sizes[c] + coords[c]
        return out

    def without_cp(self, axes: tuple[str, ...]) -> tuple[str, ...]:
        """`axes` with cp taken out: cp dropped, a `cp_batch` axis replaced by its batch axis
        (a gradient summed over them, its sum over cp left to the step's sync)."""
        out = []
        for a in axes:
            comps = self.components(a) if a in self.axes else (a,)
            if comps[0] == CP and len(comps) > 1:
                out.append(self.composite(comps[1:]))
            elif a != CP:
                out.append(a)
        return tuple(out)

    def composite(self, components: tuple[str, ...]) -> str:
        """The axis name of a tuple of physical dims (major first)."""
        if len(components) == 1:
            return components[0]
        for name, comps in self.composites.items():
            if comps == tuple(components):
                return name
        raise KeyError(f"no axis spans {components} in a {self.mode} mesh")

    def grids(self, mode: str) -> tuple[tuple[str, ...], ...]:
        """The role axes of the grids of `mode` (two for 3D: roles alternate by layer)."""
        return GRIDS[mode]


def cp_batch(batch: str) -> str:
    """The layout axis of a grid's batch x tokens dim beside cp (a language model's
    flattened logits and targets): the split over cp first, each sample's run of tokens
    (`groups` -r), then this rank's part over the grid's `batch` axis as one block, which
    is the rows a rank holds of [B, S] with B split over `batch` and S over cp, flattened.
    No process group: its steps run over cp, then `batch`."""
    return f"{CP}_{batch}"


def role_spec(mode: str, grid: tuple[str, ...], role: str) -> dict[int, tuple[str, ...]]:
    """Which physical axes split which dims of a tensor in `role` on `grid`, major first.

    The table of `autopar.kernels.multid` (tests check the two agree): roles x, ids, y,
    target, weight ([out, in]), bias, norm, embedding ([vocab, hidden]).
    """
    if mode == TP_3D:
        inp, wgt, out = grid
        batch, hidden, out_grid = (wgt, inp), out, (out, wgt, inp)
        weight, bias = {0: (inp, wgt), 1: (out,)}, {0: (inp,)}
    else:
        row, col = grid[0], grid[1]
        batch = (grid[2], col) if mode == TP_25D else (col,)
        hidden, out_grid = row, grid
        weight, bias = {0: (row,), 1: (col,)}, {0: (row,)}
    table = {"x": {0: batch, -1: (hidden,)}, "ids": {0: batch}, "weight": weight,
             "bias": bias, "norm": {0: (hidden,)}, "embedding": {1: (hidden,)}}
    if role in ("y", "target"):
        return role_spec(mode, out_grid, "x" if role == "y" else "ids")
    return table[role]


def grid_size_error(mode: str, size: int, depth: int = 1) -> str | None:
    """The sentence refusing a tensor size that is no grid of `mode`, or None when it is one."""
    if mode == TP_2D:
        if _is_power(size, 2):
            return None
        lo, hi = _neighbours(size, lambda q: q * q)
        return f"2d needs a square tensor size; {size} is not one: use {_either(lo, hi)}."
    if mode == TP_25D:
        if depth >= 1 and size % depth == 0 and _is_power(size // depth, 2):
            return None
        lo, hi = _neighbours(size, lambda q: q * q * depth)
        return (f"2.5d with depth {depth} needs a tensor size of q x q x {depth}; {size} is not "
                f"one: use {_either(lo, hi)}, or a depth that divides {size} and leaves a square.")
    if mode == TP_3D:
        if _is_power(size, 3):
            return None
        lo, hi = _neighbours(size, lambda q: q ** 3)
        return f"3d needs a cube tensor size; {size} is not one: use {_either(lo, hi)}."
    return None


def _is_power(n: int, k: int) -> bool:
    q = round(n ** (1 / k))
    return any((q + d) ** k == n and q + d >= 2 for d in (-1, 0, 1))


def _neighbours(n: int, grid) -> tuple[int | None, int]:
    """The largest grid size below n and the smallest above it, over power-of-two sides
    (device counts come in powers of two)."""
    lo, q = None, 2
    while grid(q) <= n:
        lo = grid(q)
        q *= 2
    return lo, grid(q)


def _either(lo: int | None, hi: int) -> str:
    return f"{lo} or {hi}" if lo is not None else str(hi)
