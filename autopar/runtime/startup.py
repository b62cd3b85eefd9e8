"""Starting a model that need not fit one device: parameters on the meta device get this
rank's slices only, from the model's own initialization (`materialize`) or from stored
weights (`weights`), streamed one module or one tensor at a time; and `export`, the
trained weights written back as safetensors shards, gathered one tensor at a time."""

from __future__ import annotations

import torch
import torch.fx as fx
from torch import nn
from torch.utils._pytree import tree_map

from autopar.errors import AutoparError, WeightsError
from autopar.passes.tensor_parallel import local_slice
from autopar.runtime.agree import agree_with_rank_zero, process_rank
from autopar.runtime.export import MAX_SHARD_BYTES, SafetensorsWriter
from autopar.runtime.gradients import zero_family, zero_sharded
from autopar.runtime.host_memory import give_back_large_frees, trim
from autopar.runtime.materialize import iter_initial_values
from autopar.runtime.regions import expert_runs, slice_runs
from autopar.runtime.weights import model_entries, open_weights, stored_layouts

META = torch.device("meta")


def on_meta(model: nn.Module) -> bool:
    """Whether any of the model's parameters or buffers lies on the meta device."""
    return any(t.is_meta for t in model.state_dict(keep_vars=True).values())


def check_weights(model: nn.Module, weights):
    """The opened source of `weights`, checked against the model's state_dict names,
    shapes and dtypes (one sentence naming the keys) before anything is read."""
    expected, tied = model_entries(model)
    source = open_weights(weights, tied)
    source.adopt_layouts(stored_layouts(model))  # experts stored one tensor per expert
    buffers = {n for n, _ in model.named_buffers(remove_duplicate=False)} - set(expected)
    source.check(expected, tied, optional=buffers)
    return source


class Startup:
    """Where this rank's slices come from when the model's own values are not used: the
    checked `source` (weights=), else the replayed initialization of a meta model under
    `seed` (None: the CPU random state at parallelize, as one device would draw it)."""

    def __init__(self, model: nn.Module, source, seed: int | None, device: torch.device):
        self.model, self.source, self.seed, self.device = model, source, seed, device
        give_back_large_frees()  # a model that need not fit: layer-sized frees given back
        self._rng = torch.random.get_rng_state() if seed is None else None
        self._replays = 0
        self.pieces_of: tuple[int, int] | None = None  # ZeRO-3's (dp size, dp rank) ...
        self.expert_pieces_of: tuple[int, int] | None = None  # ... and (edp size, rank)
        self._pieces: dict[int, torch.Tensor] = {}  # id(placeholder) -> this rank's piece
        groups: dict[int, list[str]] = {}
        for n, t in list(model.named_parameters(remove_duplicate=False)) + \
                list(model.named_buffers(remove_duplicate=False)):
            groups.setdefault(id(t), []).append(n)
        self._tied = {n: g for g in groups.values() for n in g}  # name -> all its names

    def slices(self, wanted: dict, untraced: list[str], mesh, coords,
               experts: dict | None = None) -> tuple[dict, dict]:
        """({key: this rank's slice} for `wanted` {key: (names, full meta tensor, layout)},
        {name: whole value} for the `untraced` state names), on this rank's device.
        `experts`: key -> (ep size, ep rank) of the stacked expert weights, of which this
        rank keeps only its own experts' block of dim 0 (and, under ZeRO-3, its pieces of
        that block over the expert-data group)."""
        out, whole = {}, {}
        experts = experts or {}
        if self.source is not None:  # what it stores; buffers (rope tables) as below
            state = self.model.state_dict(keep_vars=True)
            for key, (names, full, layout) in list(wanted.items()):
                cut = experts.get(key)
                if names[0] in self.source:
                    runs = slice_runs(layout, mesh, coords, tuple(full.shape))
                    rows = None if cut is not None else self._piece_rows(full, runs)
                    if cut is not None:  # only this rank's experts are read
                        runs = expert_runs(runs, *cut)
                        grid = [[slice(g, g + n) for g, n in dim] for dim in runs]
                        value = self.source.read_grid(names[0], grid, full.dtype)
                        out[key] = self._local(full, value.to(self.device), True)
                    elif rows is not None:  # ZeRO-3 of a whole tensor: its piece's rows only
                        first, last, skip, length = rows
                        value = self.source.read(names[0], (slice(first, last),), full.dtype)
                        out[key] = self._keep_piece(
                            full, full.shape, value.reshape(-1)[skip:skip + length].clone())
                    else:
                        grid = [[slice(g, g + n) for g, n in dim] for dim in runs]
                        value = self.source.read_grid(names[0], grid, full.dtype)
                        out[key] = self._local(full, value.to(self.device))
                    del value
                    self.source.release()  # the file pages it mapped: not kept resident
                elif not full.is_meta:  # a real model's own buffer
                    out[key] = _like(full, _own_rows(local_slice(full, layout, coords, mesh),
                                                     cut).to(self.device))
            for n in untraced:
                if n in self.source or not state[n].is_meta:
                    whole[n] = self.source.read(n, dtype=state[n].dtype).to(self.device) \
                        if n in self.source else state[n].detach().clone()
            wanted = {k: v for k, v in wanted.items() if k not in out}
            untraced = [n for n in untraced if n not in whole]
            if not wanted and not untraced:
                return out, whole
        key_of = {name: key for key, (names, _, _) in wanted.items() for name in names}
        left = set(untraced)
        for mod_name, values in self._replay():
            for attr, value in values.items():
                name = f"{mod_name}.{attr}" if mod_name else attr
                for other in self._tied.get(name, [name]):
                    if other in key_of and key_of[other] not in out:
                        _, full, layout = wanted[key_of[other]]
                        cut = experts.get(key_of[other])
                        if cut is None and self._piece_of_whole(full, layout):  # no whole copy
                            out[key_of[other]] = self._local(full, value)
                        else:
                            out[key_of[other]] = self._local(full, _own_rows(local_slice(
                                value, layout, coords, mesh), cut).to(self.device),
                                cut is not None)
                    if other in left:
                        whole[other] = value.clone().to(self.device)
                        left.discard(other)
            del values
            trim()  # this module's full values: given back, not kept resident
        missing = [wanted[k][0][0] for k in wanted if k not in out] + sorted(left)
        if missing:
            raise WeightsError(f"the initialization of {type(self.model).__name__} gave no "
                               f"value for {', '.join(missing[:6])}; pass weights.")
        return out, whole

    def _local(self, full: torch.Tensor, value: torch.Tensor, expert: bool = False) \
            -> torch.Tensor:
        """A slice as the engine holds it; under ZeRO-3 (`pieces_of`) a trained parameter
        keeps only its 1/dp piece (an `expert` weight: its 1/edp piece of this rank's
        experts), beside a placeholder of its shape that holds no data."""
        if self.pieces_of is None or not (isinstance(full, nn.Parameter) and full.requires_grad):
            return _like(full, value)
        size, rank = self.expert_pieces_of if expert else self.pieces_of
        flat = value.to(full.dtype).reshape(-1)
        k = -(-flat.numel() // size)
        return self._keep_piece(full, value.shape, flat[rank * k:rank * k + k].clone())

    def _keep_piece(self, full: torch.Tensor, shape, piece: torch.Tensor) -> nn.Parameter:
        """A placeholder of the local `shape` that holds no data; `piece` kept beside it."""
        placeholder = nn.Parameter(torch.zeros((), dtype=full.dtype, device=self.device)
                                   .expand(shape))
        self._pieces[id(placeholder)] = piece.to(self.device)
        return placeholder

    def _piece_of_whole(self, full: torch.Tensor, layout) -> bool:
        """Whether this rank keeps a ZeRO-3 piece of a parameter no tensor axis splits."""
        return self.pieces_of is not None and isinstance(full, nn.Parameter) and \
            full.requires_grad and (layout is None or layout.is_replicated)

    def _piece_rows(self, full: torch.Tensor, runs: list) -> tuple[int, int, int, int] | None:
        """Under ZeRO-3, for a trained parameter this rank holds whole (no tensor split):
        (first row, end row, elements to skip in them, piece length), so that a read of
        those rows of dim 0 holds this rank's piece and not the whole tensor."""
        if self.pieces_of is None or not (isinstance(full, nn.Parameter) and full.requires_grad) \
                or full.dim() == 0 or any(dim != [(0, n)] for dim, n in zip(runs, full.shape)):
            return None
        size, rank = self.pieces_of
        numel, row = full.numel(), full[0].numel()
        k = -(-numel // size)
        start, end = min(rank * k, numel), min(rank * k + k, numel)
        first, last = start // row, max(-(-end // row), start // row)
        return first, last, start - first * row, end - start

    def expect_zero(self, plan_zero, dp, pp_size: int, edp=None) -> None:
        """ZeRO-3 made at the engine's start (no pipeline): keep only this rank's pieces,
        of stacked expert weights over `edp` (the expert-data group, under an ep axis)."""
        if zero_sharded(plan_zero, dp.size) and zero_family(plan_zero).pieces_only \
                and pp_size == 1:
            self.pieces_of = (dp.size, dp.rank)
            if edp is not None:
                self.expert_pieces_of = (edp.size, edp.rank)

    def take_pieces(self) -> dict[int, torch.Tensor]:
        """The pieces kept aside (id(placeholder) -> this rank's piece), handed to ZeRO-3,
        which adopts each as its shard (`check_pieces` then refuses any left over)."""
        pieces, self._pieces, self.pieces_of = self._pieces, {}, None
        self.expert_pieces_of = None
        return pieces

    @staticmethod
    def check_pieces(pieces: dict) -> None:
        """Every piece the start made has become a ZeRO-3 shard."""
        if pieces:
            raise WeightsError(f"{len(pieces)} parameters of the meta start have no "
                               "ZeRO-3 piece; start the model without ZeRO-3.")

    def _replay(self):
        """The initial values, the same on every call (a later graph may need more)."""
        if self.seed is not None:
            yield from iter_initial_values(self.model, self.seed)
            return
        after = torch.random.get_rng_state() if self._replays else None
        torch.random.set_rng_state(self._rng)
        self._replays += 1
        try:
            yield from iter_initial_values(self.model, None)
        finally:
            if after is not None:  # a replay does not advance the caller's stream twice
                torch.random.set_rng_state(after)


def _own_rows(value: torch.Tensor, cut: tuple[int, int] | None) -> torch.Tensor:
    """This ep rank's block of a stacked expert weight's dim 0 (`cut`: (ep size, rank))."""
    if cut is None:
        return value
    n = value.size(0) // cut[0]
    return value[cut[1] * n:(cut[1] + 1) * n].clone()  # (not a view keeping every expert)


def _like(full: torch.Tensor, value: torch.Tensor) -> torch.Tensor:
    value = value.to(full.dtype).contiguous()
    if isinstance(full, nn.Parameter):
        return nn.Parameter(value, requires_grad=full.requires_grad)
    return value


def retarget(gm: fx.GraphModule, device: torch.device) -> None:
    """A graph traced on the meta device makes its constants (aten.arange's device=) on
    `device` instead."""
    if device.type == "meta":
        return

    def here(v):
        return device if isinstance(v, torch.device) and v.type == "meta" else v

    changed = False
    for node in gm.graph.nodes:
        if not (_names_meta(node.args) or _names_meta(node.kwargs)):
            continue  # (most nodes: the walk below costs a start 5-10% of its CPU)
        args, kwargs = tree_map(here, node.args), tree_map(here, dict(node.kwargs))
        if args != node.args or kwargs != node.kwargs:
            node.args, node.kwargs, changed = args, kwargs, True
    if changed:
        gm.recompile()


def _names_meta(value) -> bool:
    """Whether a node's arguments hold the meta device anywhere (in any tuple, list or dict
    under them: every container `tree_map` walks in them)."""
    if isinstance(value, torch.device):
        return value.type == "meta"
    if isinstance(value, (tuple, list)):
        return any(_names_meta(v) for v in value)
    if isinstance(value, dict):
        return any(_names_meta(v) for v in value.values())
    return False


class ModelCard:
    """What an export needs of the original model once the engine released it: its
    transformers config and generation config, and the names it re-ties on load."""

    def __init__(self, model: nn.Module):
        self.config = getattr(model, "config", None)
        self.generation_config = getattr(model, "generation_config", None)
        self._can_generate = bool(callable(getattr(model, "can_generate", None)) and
                                  model.can_generate())
        keys = getattr(model, "all_tied_weights_keys", None)
        self.all_tied_weights_keys = dict(keys) if isinstance(keys, dict) else None

    def can_generate(self) -> bool:
        return self._can_generate


def export(engine, directory, max_shard_bytes: int = MAX_SHARD_BYTES) -> str:
    """Every rank gathers each tensor in turn; rank 0 writes it into safetensors shards
    and publishes the directory by rename; rank 0's outcome is raised on every rank."""
    engine.fetch_pipeline_weights()
    writer, error = None, None
    if process_rank() == 0:
        try:
            writer = SafetensorsWriter(directory, max_shard_bytes, engine.model_card)
        except AutoparError as e:
            error = str(e)
    try:
        for name, value in engine.params.iter_full(engine.groups, engine.zero):
            if writer is not None and error is None:
                try:
                    writer.add(name, value)
                except Exception as e:  # noqa: BLE001 - shared below with every rank
                    error = f"{type(e).__name__}: {e}"
            del value
        if writer is not None and error is None:
            try:
                writer.commit()
            except Exception as e:  # noqa: BLE001
                error = f"{type(e).__name__}: {e}"
    finally:
        if writer is not None and error is not None:
            writer.abort()
    try:
        agree_with_rank_zero(error)
    except AutoparError as e:
        raise WeightsError(f"the export to {directory} failed on rank 0 ({error}); the "
                           "previous export there is untouched.") from e
    return str(writer.directory) if writer is not None else str(directory)
