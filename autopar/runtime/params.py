"""This rank's slices of a model's parameters and buffers, shared by the engine's graphs:
each slice with its names in the original model and its layout on the tensor axes."""

from __future__ import annotations

import math
import operator

import torch
from torch import nn

from autopar.errors import PlanError
from autopar.passes.tensor_parallel import local_slice, shard_steps
from autopar.sharding.layout import Layout


def param_key(pinfo) -> int:
    """The key of a traced parameter: tied names share one slice."""
    return hash(pinfo.names)


class ShardedParams:
    """Slices cut the first time a graph reads them; `state_keys` orders full state dicts."""

    def __init__(self, mesh, coords: dict[str, int], model: nn.Module, start=None):
        self.mesh, self.coords = mesh, coords
        self.start = start  # a runtime.startup.Startup: slices not cut from the model's values
        self._ready: dict[int, torch.Tensor] = {}  # slices `prepare` made, not yet read
        self.state_keys = list(model.state_dict().keys())
        self.local: dict[int, torch.Tensor] = {}  # key -> this rank's slice
        self.names: dict[int, tuple] = {}  # key -> its names in the original model
        self.layouts: dict[int, Layout | None] = {}
        self.untraced: dict[str, torch.Tensor] = {}  # state no graph reads, kept whole
        # a pipeline rank started from meta or weights= makes its parameters' slices once it
        # knows its stages (`fill`): until then each is a placeholder that holds no data
        self.defer = False
        self.deferred: dict[int, tuple] = {}  # key -> (names, full meta tensor, layout)
        self._key_of: dict[int, int] | None = None
        self._norm_index: dict[str, int] | None = None
        self.experts: frozenset[str] = frozenset()  # names of stacked expert weights ...
        self.ep = None  # ... split on dim 0 over this AxisGroup

    def split_experts(self, names: set[str], ep) -> None:
        """Stacked expert weights (`names`, [E, ...]) keep only this rank's E/ep experts."""
        self.experts, self.ep = frozenset(names), ep

    def is_expert(self, local: torch.Tensor) -> bool:
        return self.ep is not None and self.name_of(local) in self.experts

    def expert_cut(self, names: tuple) -> tuple[int, int] | None:
        """(ep size, ep rank) for a stacked expert weight's names: this rank keeps the
        ep-rank-th of ep equal blocks of its slice's dim 0; None for any other tensor."""
        if self.ep is None or names[0] not in self.experts:
            return None
        return self.ep.size, self.ep.rank

    def _own_experts(self, names: tuple, local: torch.Tensor) -> torch.Tensor:
        if self.expert_cut(names) is None:
            return local
        n = local.size(0) // self.ep.size
        data = local.detach()[self.ep.rank * n:(self.ep.rank + 1) * n].clone()
        return nn.Parameter(data, requires_grad=local.requires_grad) \
            if isinstance(local, nn.Parameter) else data

    def slice_for(self, gm, pinfo, layout: Layout | None) -> torch.Tensor:
        """This rank's slice of one traced parameter or buffer, cut at the first read."""
        key = param_key(pinfo)
        if key not in self.local:
            full = operator.attrgetter(pinfo.target)(gm)
            if key in self._ready:  # (a start's slices hold only this rank's experts)
                self.local[key] = self._ready.pop(key)
                self.names[key], self.layouts[key] = pinfo.names, layout
                self._key_of = self._norm_index = None
                return self.local[key]
            if full.device.type == "meta":
                raise PlanError(f"parameter {pinfo.names[0]} is on the meta device; "
                                "parallelize needs real weights (autopar.plan works on meta).")
            self.local[key] = self._own_experts(
                pinfo.names, local_slice(full, layout, self.coords, self.mesh))
            self.names[key], self.layouts[key] = pinfo.names, layout
            self._key_of = self._norm_index = None
        elif self.layouts[key] != layout:
            raise PlanError(f"parameter {pinfo.names[0]} is laid out as {self.layouts[key]} "
                            f"for inference but {layout} for training.")
        return self.local[key]

    def prepare(self, gm, params: dict, layouts: dict) -> None:
        """With a `start`: make the slices of a graph's parameters not cut yet in one
        streamed pass (`params`: target -> traced parameter, `layouts`: target -> layout);
        the first graph also fixes the state no graph reads."""
        if self.start is None:
            return
        wanted = {}
        for target, pinfo in params.items():
            key = param_key(pinfo)
            if key not in self.local and key not in wanted:
                wanted[key] = (pinfo.names, operator.attrgetter(pinfo.target)(gm),
                               layouts.get(target))
        first = not self.local and not self.untraced
        read = {name for names, _, _ in wanted.values() for name in names}
        untraced = [k for k in self.state_keys if k not in read] if first else []
        if self.defer:
            for key in [k for k, (_, full, _) in wanted.items() if isinstance(full, nn.Parameter)]:
                self.deferred[key] = wanted.pop(key)
                self._ready[key] = self._placeholder(*self.deferred[key])
        if wanted or untraced:
            ready, whole = self.start.slices(wanted, untraced, self.mesh, self.coords,
                                             self._cuts(wanted))
            self._ready.update(ready)
            self.untraced.update(whole)

    def _cuts(self, wanted: dict) -> dict[int, tuple[int, int]]:
        """key -> (ep size, ep rank) for the stacked expert weights among `wanted`."""
        return {key: cut for key, (names, _, _) in wanted.items()
                if (cut := self.expert_cut(names)) is not None}

    def _placeholder(self, names: tuple, full: torch.Tensor,
                     layout: Layout | None) -> nn.Parameter:
        """A parameter of this rank's slice's shape (its own experts') that holds one
        element."""
        shape = list(local_slice(full.detach().to("meta"), layout, self.coords,
                                 self.mesh).shape)
        cut = self.expert_cut(names)
        if cut is not None:
            shape[0] //= cut[0]
        device = self.start.device
        return nn.Parameter(torch.zeros((), dtype=full.dtype, device=device).expand(shape),
                            requires_grad=full.requires_grad)

    def fill(self, locals_: list[torch.Tensor] | None = None) -> None:
        """Make the deferred slices of `locals_` (None: every deferred one) in one streamed
        pass of the start's values; the others stay placeholders."""
        keys = list(self.deferred) if locals_ is None else \
            [k for k in (self.key_of.get(id(t)) for t in locals_) if k in self.deferred]
        if not keys:
            return
        wanted = {k: self.deferred[k] for k in keys}
        ready, _ = self.start.slices(wanted, [], self.mesh, self.coords, self._cuts(wanted))
        for key in keys:
            self.local[key].data = ready.pop(key).data
            del self.deferred[key]

    def keep_untraced(self, model: nn.Module) -> None:
        """State the graphs never read is kept whole, so full state dicts lose nothing."""
        read = {name for names in self.names.values() for name in names}
        for key, value in model.state_dict().items():
            if key not in read and key not in self.untraced:
                self.untraced[key] = value.detach().clone()

    def of(self, pinfo) -> torch.Tensor:
        """The slice of a traced parameter."""
        return self.local[param_key(pinfo)]

    def layout_for(self, pinfo) -> Layout | None:
        return self.layouts[param_key(pinfo)]

    def parameters(self) -> list[nn.Parameter]:
        """The slices that are parameters, each once."""
        return [p for p in self.local.values() if isinstance(p, nn.Parameter)]

    def holds(self, local: torch.Tensor) -> bool:
        return id(local) in self.key_of

    @property
    def key_of(self) -> dict[int, int]:
        """id of a slice -> its key."""
        if self._key_of is None:
            self._key_of = {id(t): key for key, t in self.local.items()}
        return self._key_of

    def names_of(self, local: torch.Tensor) -> tuple:
        return self.names[self.key_of[id(local)]]

    def name_of(self, local: torch.Tensor) -> str:
        """A slice's canonical name: the first of its names."""
        return self.names_of(local)[0]

    def layout_of(self, local: torch.Tensor) -> Layout | None:
        return self.layouts.get(self.key_of.get(id(local)))

    def entries(self):
        """(names, slice, layout) of every slice."""
        for key, local in self.local.items():
            yield self.names[key], local, self.layouts[key]

    @property
    def norm_index(self) -> dict[str, int]:
        """Every parameter's name (the same list on every rank) -> its slot in norm vectors."""
        if self._norm_index is None:
            names = sorted({self.names[key][0] for key, t in self.local.items()
                            if isinstance(t, nn.Parameter)})
            self._norm_index = {name: i for i, name in enumerate(names)}
        return self._norm_index

    def tensor_copies(self, local: torch.Tensor) -> int:
        """On how many ranks of the tensor mesh the same values of a slice lie."""
        layout = self.layout_of(local)
        return self.mesh.total // (layout.parts(self.mesh.sizes) if layout is not None else 1)

    def byte_counts(self, zero=None) -> dict[str, tuple[int, int]]:
        """Per parameter name: (bytes this rank holds, bytes of the whole parameter)."""
        out = {}
        for names, local, layout in self.entries():
            parts = layout.parts(self.mesh.sizes) if layout is not None else 1
            shape = zero.local_shape(local) if zero is not None else None  # (ZeRO-3)
            numel = local.numel() if shape is None else math.prod(shape)
            nbytes = numel * local.element_size()
            if self.ep is not None and names[0] in self.experts:
                parts *= self.ep.size
            out[names[0]] = (nbytes, nbytes * parts)
        return out

    def layouts_by_name(self) -> dict[str, Layout | None]:
        return {names[0]: layout for names, _, layout in self.entries()}

    def replicated(self) -> list[str]:
        """Names of the slices every tensor rank holds whole."""
        return sorted(names[0] for names, _, layout in self.entries()
                      if layout is None or not layout.shards)

    def full_state(self, groups: dict, zero=None) -> dict[str, torch.Tensor]:
        """Whole tensors on every rank (a collective), keyed and ordered as the model's."""
        whole = dict(self.iter_full(groups, zero))
        return {k: whole[k] for k in self.state_keys if k in whole}

    def iter_full(self, groups: dict, zero=None):
        """(name, whole tensor) one tensor at a time (a collective: every rank iterates it
        whole), each of a tied tensor's names, then the state no graph reads."""
        keep = set(self.state_keys)
        for names, local, layout in self.entries():
            value = local.detach()
            if _keeps_only_piece(zero, local):
                value = zero.whole(local)
            if layout is not None:
                for shard in layout.shards:  # composites: minor component first
                    for axis, steps in reversed(shard_steps(shard, self.mesh)):
                        value = groups[axis].all_gather(value, shard.dim, steps, "state")
            if self.ep is not None and names[0] in self.experts:  # every rank's experts
                value = self.ep.all_gather(value, 0, 1, "state")
            for name in names:
                if name in keep:
                    yield name, value.clone()
        yield from self.untraced.items()


def _keeps_only_piece(zero, local) -> bool:
    """Whether ZeRO keeps only this rank's piece of `local` (ZeRO-3)."""
    return zero is not None and zero.keeps_only_piece(local)
