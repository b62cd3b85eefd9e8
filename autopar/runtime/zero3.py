"""ZeRO stage 3 over dp (Rajbhandari et al. 2019, §5.3): parameters, gradients and optimizer
state kept as 1/dp pieces; a graph pass gathers each layer's parameters before its first use
(prefetching the next), the backward gathers them again where saved tensors need them, and
each layer's gradients are reduce-scattered into the pieces."""

from __future__ import annotations

import operator
import weakref
from contextlib import contextmanager

import torch
import torch.distributed as dist
import torch.fx as fx
from torch import nn

from autopar.kernels.collectives import AxisGroup, Pending
from autopar.kernels.float8 import E4M3, Float8Linear, quantize, scale_for
from autopar.runtime.zero import host_copy, pieces_after_pipeline, read_padded, write_padded
from autopar.runtime.zero_state import ZeroState

# gradient reduce-scatters a backward keeps in flight (each holds a layer's whole gradients)
REDUCES_IN_FLIGHT = 1
# gathers' receive buffers a pass keeps for its next gather (dropped at the pass's end: one,
# which the next layer's prefetch takes at once; each more is resident beside the backward)
SPARE_BUFFERS = 1


class _Unit:
    """One layer's parameters: which of the engine's parameters, where in its buffer."""

    def __init__(self, layer: str, members: list[int], numels: list[int], chunks: list[int],
                 float8: list[bool] | None = None):
        self.layer, self.members = layer, members
        self.offsets, off = [], 0  # where each member lies in the whole (gathered) buffer
        for i in members:
            self.offsets.append(off)
            off += numels[i]
        self.numel = off
        self.chunks = [chunks[i] for i in members]  # each member's piece, padded
        self.chunk = sum(self.chunks)  # one rank's piece of the unit
        # fp8: the members gathered as e4m3 (1 byte each, the weights of float8 linears)
        self.float8 = float8 if float8 is not None and any(float8) else None
        # a later layer reads a member too (a tied weight): the gathered buffer lives from
        # this layer to that one, and what it saves keeps it to that one's backward
        self.held = False
        # among a training graph's last units, which the backward begins with: its forward's
        # gather is kept for the backward, not gathered again (`kept_after_forward`)
        self.kept = False
        # its members' shards as views of one flat piece, the all-gather's input as it is
        # (`send_piece`), and where each view lay when made
        self.flat: torch.Tensor | None = None
        self.flat_at: list[int] = []


class ZeroThree(ZeroState):
    """The pieces, the layer units, the gathers and the gradient reduce-scatters."""

    stage = 3
    pieces_only = reduces_in_backward = True

    def __init__(self, params: list[nn.Parameter], dp: AxisGroup, factory,
                 offload: bool = False, compute_dtype: torch.dtype | None = None,
                 divisor: float = 1, prefix: str = "zero3_gather",
                 pieces: dict[int, torch.Tensor] | None = None, float8: bool = False):
        self.params = [p for p in params if p.requires_grad]
        self.dp = dp
        self.prefix = prefix  # of its gather modules' names in a graph
        self.divisor = divisor  # the mean is the sum over dp / (dp.size * divisor)
        self.shapes = [p.shape for p in self.params]
        self.numels = [p.numel() for p in self.params]
        self.chunks = [-(-n // dp.size) for n in self.numels]
        self.total = sum(self.chunks)
        r = dp.rank
        self.lengths = [max(0, min(k, n - r * k)) for n, k in zip(self.numels, self.chunks)]
        # this rank's pieces own their storage; the whole local parameters are emptied.
        # `pieces` (id(parameter) -> this rank's piece, made by a start from meta or
        # weights= beside a placeholder that holds no values) become the shards themselves,
        # popped from the mapping: no second copy, and no placeholder made whole
        self.offload = offload  # pieces, optimizer and its step on the host
        own = host_copy if offload else torch.clone
        pieces = {} if pieces is None else pieces
        self.shards = []
        for p, k, length in zip(self.params, self.chunks, self.lengths):
            piece = pieces.pop(id(p), None)
            if piece is None:
                piece = own(p.detach().reshape(-1)[r * k:r * k + length])
            elif piece.numel() != length:
                raise ValueError(f"a ZeRO-3 piece of {piece.numel()} elements for {length}")
            elif offload:
                piece = host_copy(piece)
            self.shards.append(nn.Parameter(piece))
        self.dtype, self.device = self.params[0].dtype, self.params[0].device
        # mixed precision: layers are gathered in the compute dtype (half the bytes; the
        # graph's cast of a gathered parameter is then the same tensor, which the saved-
        # tensor hook recognises), gradients reduce-scattered in the masters' dtype
        self.gather_dtype = compute_dtype or self.dtype
        # precision="fp8": a float8 linear's weight is gathered in e4m3 with one scale from
        # the whole weight (its pieces' amax all-reduced over dp), about half bf16's bytes
        self.float8 = float8
        for p in self.params:
            p.data = torch.empty(0, dtype=p.dtype, device=p.device)
        self._index = {id(p): i for i, p in enumerate(self.params)}
        self.optimizer = factory(self.shards) if factory is not None else None
        self.units: list[_Unit] = []
        self._unit_of_layer: dict[str, int] = {}
        self._pending: dict = {}  # unit -> its all-gather in flight (a Pending)
        self._live: dict[int, tuple] = {}  # storage address -> (unit, weakref to buffer)
        self._cache: dict[int, torch.Tensor] = {}  # unit -> buffer re-gathered for backward
        self._backward_order: list[int] | None = None  # learnt in the first step
        self._grad_next = False  # whether the gather running now will have a backward
        self._saving = 0  # inside `saving` (a training forward)
        # reduce-scatter asynchronously, landing the pieces' gradients at `end_backward`;
        # not under a pipeline, whose zero-bubble weight pass wants them from autograd
        self.overlap = True
        self._reducing: list[tuple] = []
        self._spare = _Spares(SPARE_BUFFERS if dp.size > 1 else 0)  # (1 rank: out is its piece)
        self._seen_backward: list[int] = []
        self.homed: set[int] = set()  # the shards a unit's flat piece holds (`send_piece`)

    # ------------------------------------------------------------------ graph rewrite
    def index_of(self, param) -> int | None:
        return self._index.get(id(param))

    def local_shape(self, param) -> tuple[int, ...] | None:
        i = self.index_of(param)
        return None if i is None else tuple(self.shapes[i])

    def wire_pipeline(self, runner) -> list[int]:
        """This rank's stages (and the loss) gather; gradients land per micro-batch."""
        units = [u for _, module in runner.held_modules() for u in self.rewrite(module)]
        runner.saving = self.saving
        self.overlap = False
        return units

    def _unit(self, layer: str, members: list[int], float8: list[bool] | None = None) -> int:
        key = f"{layer}|{','.join(map(str, members))}"
        if key not in self._unit_of_layer:
            self._unit_of_layer[key] = len(self.units)
            self.units.append(_Unit(layer, members, self.numels, self.chunks, float8))
        return self._unit_of_layer[key]

    def rewrite(self, gm: fx.GraphModule) -> list[int]:
        """Replace every read of a sharded parameter by the output of its layer's gather
        node (one per layer, placed before the layer's first read), and drop the whole
        parameters from the graph module. Returns the units gathered, in graph order."""
        graph = gm.graph
        reads: dict[fx.Node, int] = {}
        for node in graph.nodes:
            if node.op == "get_attr":
                i = self.index_of(operator.attrgetter(node.target)(gm))
                if i is not None:
                    reads[node] = i
        if not reads:
            return []
        uses, first, spans = _layer_uses(graph, reads)
        order = [self._unit(layer, sorted(per_param), [
            self.float8 and all(_float8_weight(gm, user) for user in per_param[i])
            for i in sorted(per_param)]) for layer, per_param in uses.items()]
        for layer, u in zip(uses, order):
            self.units[u].held = layer in spans
        for u in kept_after_forward(order, [self.units[u].held for u in order],
                                    [self._unit_piece_bytes(u) for u in order]):
            self.units[u].kept = True
        for k, (layer, per_param) in enumerate(uses.items()):
            members, u = sorted(per_param), order[k]
            name = f"{self.prefix}_{u}"
            if not hasattr(gm, name):  # prefetches the graph's next layer when it runs
                gm.add_submodule(name, _GatherLayer(
                    self, u, order[k + 1] if k + 1 < len(order) else None))
            with graph.inserting_before(first[layer]):
                gathered = graph.call_module(name, ())
                _copy_layer_meta(gathered, first[layer])
                outs = {}
                for j, i in enumerate(members):
                    outs[i] = graph.call_function(operator.getitem, (gathered, j))
                    _copy_layer_meta(outs[i], first[layer])
            for i, users in per_param.items():
                for user in users:
                    for arg in list(user.all_input_nodes):
                        if reads.get(arg) == i:
                            user.replace_input_with(arg, outs[i])
                    if _casts_to(user, self.gather_dtype):  # gathered in that dtype already
                        user.replace_all_uses_with(outs[i])
                        graph.erase_node(user)
        for node in reads:
            if not node.users:
                target = node.target
                graph.erase_node(node)
                module, _, attr = target.rpartition(".")
                owner = gm.get_submodule(module)
                if hasattr(owner, attr):
                    delattr(owner, attr)
        graph.lint()
        gm.recompile()
        return order

    # ------------------------------------------------------------------ gathers
    def _start(self, u: int, phase: str) -> None:
        """Issue unit u's all-gather (asynchronously when dp > 1)."""
        if u in self._pending:
            return
        unit = self.units[u]
        if unit.float8 is not None:
            self._start_float8(u, phase)
            return
        send = send_piece(self, unit)
        if send is None:
            send = _send_buffer([self.shards[i] for i in unit.members], unit.chunks,
                                self.gather_dtype, self.device)
        # (one data-parallel rank: the piece is the whole unit, up from the host under
        # offload; no collective)
        self._pending[u] = self.dp.all_gather_async(send, phase, self._spare.take(
            self.dp.size * send.numel(), send.dtype)) if self.dp.size > 1 else Pending(send, [])

    def _start_float8(self, u: int, phase: str) -> None:
        """Unit u's gather as bytes: its float8 members in e4m3 at the scale of the whole
        weight (one all-reduce of their amaxes over dp), the rest in the gather dtype."""
        unit = self.units[u]
        pieces = [self.shards[i].detach().to(self.gather_dtype) for i in unit.members]
        amax = torch.stack([p.abs().max() if p.numel() else p.new_zeros(()) for p, f in
                            zip(pieces, unit.float8) if f]).float()
        scales = scale_for(self.dp.all_reduce(amax, phase, op=dist.ReduceOp.MAX), E4M3)
        send = torch.zeros(self._unit_piece_bytes(u), dtype=torch.uint8, device=self.device)
        off, k = 0, 0
        for i, piece, f in zip(unit.members, pieces, unit.float8):
            if f:
                piece, k = quantize(piece, scales[k], E4M3), k + 1
            raw = piece.reshape(-1).view(torch.uint8)
            send[off:off + raw.numel()] = raw
            off += self.chunks[i] * piece.element_size()
        self._pending[u] = _Scaled(self.dp.all_gather_async(send, phase), scales)

    def _finish(self, u: int, phase: str) -> torch.Tensor:
        """Unit u's whole parameters, one after the other in one flat buffer."""
        self._start(u, phase)
        pending = self._pending.pop(u)
        out = pending.wait()
        unit = self.units[u]
        if unit.float8 is not None:
            return self._whole_float8(u, out, pending.scales)
        pieces = out.view(self.dp.size, unit.chunk)
        whole = torch.empty(unit.numel, dtype=self.gather_dtype, device=self.device)
        col = 0
        for i, off in zip(unit.members, unit.offsets):
            k, n = self.chunks[i], self.numels[i]
            if n:
                read_padded(whole[off:off + n], pieces[:, col:col + k])
            col += k
        self._spare.give(out)
        return whole

    def _whole_float8(self, u: int, out: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
        """Unit u's whole parameters in the gather dtype from its gathered bytes (the e4m3
        members unscaled: the values the float8 linear quantizes again exactly)."""
        unit = self.units[u]
        pieces = out.view(self.dp.size, -1)
        whole = torch.empty(unit.numel, dtype=self.gather_dtype, device=self.device)
        col, k = 0, 0
        for i, off, f in zip(unit.members, unit.offsets, unit.float8):
            dtype = E4M3 if f else self.gather_dtype
            width = self.chunks[i] * _itemsize(dtype)
            values = pieces[:, col:col + width].contiguous().view(dtype).reshape(-1)
            values = values[:self.numels[i]]
            if f:
                values, k = (values.float() / scales[k]).to(self.gather_dtype), k + 1
            whole[off:off + self.numels[i]] = values
            col += width
        return whole

    def _unit_piece_bytes(self, u: int) -> int:
        """Bytes of one rank's piece of unit u as gathered."""
        unit = self.units[u]
        flags = unit.float8 or [False] * len(unit.members)
        return sum(self.chunks[i] * _itemsize(E4M3 if f else self.gather_dtype)
                   for i, f in zip(unit.members, flags))

    def amax_bytes(self, u: int) -> int:
        """Bytes of the amax all-reduce over dp before each gather of unit u (fp8)."""
        unit = self.units[u]
        return 4 * sum(unit.float8) if unit.float8 is not None else 0

    def _views(self, u: int, whole: torch.Tensor) -> tuple:
        unit = self.units[u]
        return tuple(whole[off:off + self.numels[i]].view(self.shapes[i])
                     for i, off in zip(unit.members, unit.offsets))

    def gather_forward(self, u: int, after: int | None) -> torch.Tensor:
        whole = self._finish(u, "forward")
        if after is not None:  # prefetch the graph's next layer
            self._start(after, "forward")
        # the graph's last layers are the backward's first: kept, not gathered again (all
        # but the very last only beside an overlapped backward: a pipeline's micro-batches
        # would each hold them)
        if self._grad_next and self._saving and \
                (after is None or self.units[u].kept and self.overlap):
            self._cache[u] = whole
        return whole

    def track(self, u: int, whole: torch.Tensor) -> None:
        """Remember that `whole`'s storage is unit u's, while it lives (for `saving`)."""
        ptr = whole.untyped_storage().data_ptr()
        self._live[ptr] = (u, weakref.ref(whole, lambda _, p=ptr: self._live.pop(p, None)))

    def gather_backward(self, u: int) -> torch.Tensor:
        if u not in self._cache:
            self._cache[u] = self._finish(u, "backward")
            self._seen_backward.append(u)
        elif len(self._cache) > 1:  # a layer the forward kept: the next gather is prefetched
            return self._cache[u]  # from the last one kept, one buffer at a time beside it
        # prefetch the gather that came next at the first step (a pipeline's backward
        # gathers a layer once per micro-batch: the order is a sequence, not a set)
        order, k = self._backward_order, len(self._seen_backward)
        if order is not None and k < len(order) and order[k] not in self._cache:
            self._start(order[k], "backward")
        return self._cache[u]

    def reduce(self, u: int, grads: tuple) -> list[torch.Tensor | None]:
        """The mean over dp of this rank's piece of each of unit u's gradients (one
        reduce-scatter); drops the unit's re-gathered buffer, whose uses are all done."""
        self._cache.pop(u, None)
        unit = self.units[u]
        buf = _reduce_buffer(grads, unit.chunks, self.dp.size, self.dtype, self.device)
        which = [g is not None for g in grads]
        if self.overlap and self.dp.size > 1:  # sent while the backward goes on
            self._reducing.append((u, which, self.dp.reduce_scatter_async(buf.reshape(-1),
                                                                          "backward")))
            # a reduce-scatter in flight holds its whole unit-sized input: at most
            # REDUCES_IN_FLIGHT of them, or the backward would hold every layer's gradients
            while len(self._reducing) > REDUCES_IN_FLIGHT:
                self._land(*self._reducing.pop(0))
            return [None] * len(grads)
        mine = self.dp.reduce_scatter(buf.reshape(-1), 0, 1, "backward") \
            if self.dp.size > 1 else buf.reshape(-1)
        return self._pieces(u, which, mine)

    def _pieces(self, u: int, which: list[bool], mine: torch.Tensor) -> list:
        """Unit u's reduce-scattered sums, as each member's piece of the mean over dp."""
        # (`mine` is the collective's own output, or the unit's reduce buffer at one rank:
        # scaled in place, and the pieces are views of it, not copies)
        mine = mine.div_(self.dp.size * self.divisor)
        out, col = [], 0
        for i, present in zip(self.units[u].members, which):
            piece = mine[col:col + self.lengths[i]]
            out.append(None if not present else host_copy(piece) if self.offload else piece)
            col += self.chunks[i]
        return out

    def _land(self, u: int, which: list[bool], pending) -> None:
        """Wait for one overlapped reduce-scatter; add its pieces to the gradients."""
        mine = pending.wait()
        for i, piece in zip(self.units[u].members, self._pieces(u, which, mine)):
            if piece is not None:
                shard = self.shards[i]
                shard.grad = piece if shard.grad is None else shard.grad + piece

    def _land_reduced(self) -> None:
        """The overlapped reduce-scatters still in flight, landed in order."""
        while self._reducing:
            self._land(*self._reducing.pop(0))

    # ------------------------------------------------------------------ saved tensors
    @contextmanager
    def saving(self):
        """Run a forward whose saved tensors that lie in gathered buffers are kept as
        references and re-gathered in the backward."""
        # hooks already installed (a memory measurement, a user's offloading) still see
        # every other saved tensor: only the innermost pair runs, so this one calls them
        outer = torch._C._autograd._top_saved_tensors_default_hooks(False)
        outer_pack, outer_unpack = outer if outer is not None else (None, None)

        def pack(t: torch.Tensor):
            entry = self._live.get(t.untyped_storage().data_ptr()) if t.device.type != "meta" \
                else None
            if entry is None or entry[1]() is None or self.units[entry[0]].held:
                return t if outer_pack is None else _Outer(outer_pack(t))
            return _Saved(entry[0], t.shape, t.stride(), t.storage_offset(), t.requires_grad)

        def unpack(x):
            if isinstance(x, _Outer):
                return outer_unpack(x.packed)
            if not isinstance(x, _Saved):
                return x
            whole = self.gather_backward(x.unit)
            return whole.as_strided(x.size, x.stride, x.offset)

        self._saving += 1
        try:
            with torch.autograd.graph.saved_tensors_hooks(pack, unpack):
                yield
        finally:
            self._saving -= 1

    def end_backward(self) -> None:
        """After the step's backward (every micro-batch's, under a pipeline): learn its
        gather order once, drop anything left over."""
        self._land_reduced()
        if self._backward_order is None:
            self._backward_order = list(self._seen_backward)
        self._seen_backward = []
        self._cache.clear()
        self.drain()

    def drain(self) -> None:
        """Wait for and drop gathers nobody used (none once the backward order is learnt):
        the pieces change at the step, so a gather never outlives the pass it began in."""
        for u in list(self._pending):
            self._pending.pop(u).wait()
        self._cache.clear()  # (an inference forward's last layer)
        self._spare.clear()  # (given back: the next pass makes its own)

    @property
    def backward_gathers(self) -> list[int] | None:
        """The units the backward gathers again, in its order (known after one step)."""
        return self._backward_order

    # ------------------------------------------------------------------ engine interface
    def unit_bytes(self, u: int) -> int:
        """Bytes of unit u's gradient reduce-scatter (the masters' dtype)."""
        return self.dp.size * self.units[u].chunk * self.params[0].element_size()

    def gather_bytes(self, u: int) -> int:
        """Bytes of one all-gather of unit u (the compute dtype; fp8 weights: 1 a value)."""
        return self.dp.size * self._unit_piece_bytes(u)

    def traffic(self, runs: int, units=()) -> tuple[int, int, int]:
        """`units` gathered per forward and where a backward needs them, reduce-scattered
        per micro-batch; fp8: the weights' amaxes all-reduced before each gather."""
        again = self.backward_gathers or ()
        return (runs * sum(self.unit_bytes(u) for u in units),
                runs * sum(self.gather_bytes(u) for u in units) +
                sum(self.gather_bytes(u) for u in again),
                runs * sum(self.amax_bytes(u) for u in units) +
                sum(self.amax_bytes(u) for u in again))

    def reduce_gradients(self) -> None:
        """Each layer's gradients are reduce-scattered in its backward."""

    def after_pipeline(self, microbatches: int, tied) -> None:
        """Under a pipeline: the pieces hold the sum of the micro-batches' gradients."""
        pieces_after_pipeline(self, microbatches, tied)

    def gather_parameters(self) -> None:
        """The pieces are the parameters: the optimizer updated them in place."""
        for shard in self.shards:
            shard.grad = None

    def whole(self, param: nn.Parameter) -> torch.Tensor:
        """This rank's whole local (tensor-parallel) value of a sharded parameter."""
        i = self._index[id(param)]
        piece = torch.zeros(self.chunks[i], dtype=self.dtype, device=self.device)
        piece[:self.lengths[i]] = self.shards[i].detach()
        # (piece up from the host: offload)
        full = self.dp.all_gather(piece, 0, 1, "state") if self.dp.size > 1 else piece
        return full[:self.numels[i]].view(self.shapes[i]).clone()


class _Spares:
    """Host buffers a pass's collectives are done with, kept for its next one: a layer-sized
    block made afresh is mapped and faulted in page by page (`runtime.host_memory` maps
    every large block on its own), about a quarter of a ZeRO-3 step's page faults."""

    def __init__(self, keep: int):
        self.keep, self.buffers = keep, []

    def take(self, numel: int, dtype: torch.dtype) -> torch.Tensor | None:
        """The first `numel` elements of a spare buffer of `dtype` at least that long."""
        for k, buf in enumerate(self.buffers):
            if buf.dtype == dtype and buf.numel() >= numel:
                return self.buffers.pop(k)[:numel]
        return None

    def give(self, buf: torch.Tensor) -> None:
        """Keep `buf` (nothing reads it any more), the largest `keep` buffers given."""
        if buf.device.type != "cpu":  # (an accelerator's caching allocator reuses them)
            return
        self.buffers.append((buf if buf._base is None else buf._base).view(-1))
        if len(self.buffers) > self.keep:
            self.buffers.pop(min(range(len(self.buffers)),
                                 key=lambda k: self.buffers[k].numel()))

    def clear(self) -> None:
        self.buffers.clear()


class _Saved:
    __slots__ = ("unit", "size", "stride", "offset", "requires_grad")

    def __init__(self, unit, size, stride, offset, requires_grad):
        self.unit, self.size, self.stride, self.offset = unit, size, stride, offset
        self.requires_grad = requires_grad


class _Outer:
    __slots__ = ("packed",)

    def __init__(self, packed):
        self.packed = packed


class _Gather(torch.autograd.Function):
    @staticmethod
    def forward(ctx, zero: ZeroThree, u: int, after, *shards):
        ctx.zero, ctx.u = zero, u
        whole = zero.gather_forward(u, after)
        return zero._views(u, whole)

    @staticmethod
    def backward(ctx, *grads):
        return (None, None, None, *ctx.zero.reduce(ctx.u, grads))


class _GatherLayer(nn.Module):
    """A graph node: one layer's whole parameters, gathered from every rank's pieces."""

    def __init__(self, zero: ZeroThree, unit: int, after: int | None):
        super().__init__()
        self._zero, self.unit, self.after = [zero], unit, after  # a list: no submodule
        # the pieces are this node's parameters: what reads a graph's parameters (torch's
        # zero-bubble weight-gradient pass) finds them
        for j, i in enumerate(zero.units[unit].members):
            self.register_parameter(f"piece{j}", zero.shards[i])

    def extra_repr(self) -> str:
        unit = self._zero[0].units[self.unit]
        return f"layer={unit.layer!r}, params={len(unit.members)}"

    def forward(self):
        zero = self._zero[0]
        shards = [zero.shards[i] for i in zero.units[self.unit].members]
        zero._grad_next = torch.is_grad_enabled()
        views = _Gather.apply(zero, self.unit, self.after, *shards)
        if torch.is_grad_enabled():  # (inside the Function's forward it never is)
            zero.track(self.unit, views[0]._base if views[0]._base is not None else views[0])
        return views


def is_gather(module: nn.Module) -> bool:
    """Whether a graph's submodule is a layer's ZeRO-3 gather."""
    return isinstance(module, _GatherLayer)
class _Scaled:
    """A float8 gather in flight and the scales its members were sent at."""

    def __init__(self, pending, scales: torch.Tensor):
        self.pending, self.scales = pending, scales

    def wait(self) -> torch.Tensor:
        return self.pending.wait()


def _itemsize(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


def _float8_weight(gm: fx.GraphModule, user: fx.Node) -> bool:
    """Whether a parameter that `user` reads (directly, or through mixed precision's cast
    when `user` is that cast) feeds only float8 linears, as their weight."""
    if user.meta.get("autopar_precision") == "compute":
        return bool(user.users) and all(_weight_of_float8(gm, r, user) for r in user.users)
    weight = user.args[1] if len(user.args) > 1 else None
    return isinstance(weight, fx.Node) and weight.op == "get_attr" and \
        _weight_of_float8(gm, user, weight)


def _weight_of_float8(gm: fx.GraphModule, reader: fx.Node, weight: fx.Node) -> bool:
    return reader.op == "call_module" and \
        isinstance(gm.get_submodule(reader.target), Float8Linear) and \
        len(reader.args) > 1 and reader.args[1] is weight and reader.args[0] is not weight


def _casts_to(node: fx.Node, dtype: torch.dtype) -> bool:
    """Whether `node` is mixed precision's cast of a parameter to `dtype`
    (autopar.passes.precision), which a gather in that dtype makes redundant."""
    return node.op == "call_function" and \
        node.target is torch.ops.aten._to_copy.default and \
        node.meta.get("autopar_precision") == "compute" and node.kwargs.get("dtype") == dtype


def _layer_uses(graph: fx.Graph, reads: dict[fx.Node, int]) -> tuple[dict, dict, set]:
    """The layers owning sharded parameters, in graph order, each with its parameters and
    all their users; the first node of each that reads one; and the layers whose
    parameters another layer reads too. A parameter belongs to the first layer that reads
    it: a tied weight (an embedding's, read again by the classifier) is one unit's member,
    gathered once a forward and its two uses' gradients summed before one reduce-scatter."""
    owner: dict[int, str] = {}
    uses: dict[str, dict[int, list[fx.Node]]] = {}
    first: dict[str, fx.Node] = {}
    spans: set[str] = set()
    for node in graph.nodes:
        for arg in node.all_input_nodes:
            if arg in reads:
                layer = owner.setdefault(reads[arg], _layer(node))
                uses.setdefault(layer, {}).setdefault(reads[arg], []).append(node)
                first.setdefault(layer, node)
                if _layer(node) != layer:
                    spans.add(layer)
    return uses, first, spans


def kept_after_forward(order: list[int], held: list[bool], sizes: list[int]) -> list[int]:
    """The units of a graph (`order`, with whether each is `held` and its gathered `sizes`)
    whose forward gather a training step keeps for the backward: the last, and before it
    those whose sizes together fit in the biggest unit not held (beside the last, at most
    the two gather buffers a backward holds at once: one gathered again, one prefetched).
    As FSDP2 keeps its root and torchtitan its last block after the forward: a
    transformer's final norm and last block are gathered once a step, not twice."""
    if not order:
        return []
    room = max((n for n, h in zip(sizes, held) if not h), default=0)
    kept, total = [order[-1]], 0
    for u, h, n in zip(reversed(order[:-1]), reversed(held[:-1]), reversed(sizes[:-1])):
        if h:  # (its buffer lives to its last reader's backward anyway)
            continue
        total += n
        if total > room:
            break
        kept.append(u)
    return kept


def _layer(node: fx.Node) -> str:
    meta = node.meta.get("autopar")
    return getattr(meta, "layer", None) or "<graph>"


def _copy_layer_meta(new: fx.Node, like: fx.Node) -> None:
    if "autopar" in like.meta:
        new.meta["autopar"] = like.meta["autopar"]


def send_piece(zero: ZeroThree, unit: _Unit) -> torch.Tensor | None:
    """Unit `unit`'s all-gather input without a copy: its members' shards made views of one
    flat piece (zeros where they pad) at its first gather, which every later gather sends as
    it is; the optimizer updates the views in place. None (the pieces copied into a send
    buffer, as before) under offload, a gather in another dtype than the pieces', a shard
    another unit's flat piece holds, or a shard replaced since (a checkpoint's load)."""
    if zero.offload or zero.gather_dtype != zero.dtype:
        return None
    shards = [zero.shards[i] for i in unit.members]
    if unit.flat is not None:
        return unit.flat if [s.data_ptr() for s in shards] == unit.flat_at else None
    if any(i in zero.homed for i in unit.members):
        return None
    flat = _send_buffer(shards, unit.chunks, zero.dtype, zero.device)
    off = 0
    for shard, i, chunk in zip(shards, unit.members, unit.chunks):
        shard.data = flat[off:off + zero.lengths[i]]
        off += chunk
    zero.homed.update(unit.members)
    unit.flat, unit.flat_at = flat, [s.data_ptr() for s in shards]
    return flat


def _send_buffer(shards: list, chunks: list[int], dtype: torch.dtype,
                 device) -> torch.Tensor:
    """A unit's all-gather input: each piece in its chunk, zeros where it pads (written
    once, not zeroed whole first: `write_padded` over one row)."""
    send = torch.empty(sum(chunks), dtype=dtype, device=device)
    off = 0
    for shard, chunk in zip(shards, chunks):
        write_padded(send[off:off + chunk].view(1, chunk), shard.detach(), zero_padding=True)
        off += chunk
    return send


def _reduce_buffer(grads, chunks: list[int], ranks: int, dtype: torch.dtype,
                   device) -> torch.Tensor:
    """A unit's reduce-scatter input, [ranks, sum(chunks)]: each gradient padded into its
    columns (zeros for a missing one); not zeroed whole, only each member's padding."""
    buf = torch.empty(ranks, sum(chunks), dtype=dtype, device=device)
    col = 0
    for g, chunk in zip(grads, chunks):
        dst = buf[:, col:col + chunk]
        if g is None:
            dst.zero_()
        else:
            write_padded(dst, g, zero_padding=True)
        col += chunk
    return buf
