"""Turn a model into an aten-level fx graph with a symbolic batch dimension.

torch.export (non-strict, training IR) is tried first. When it fails, the model is traced
with torch.fx.symbolic_trace (every module inlined), and that graph is exported through
an fx.Interpreter, so both paths end in the same aten vocabulary and the rest of autopar
sees one kind of graph. Module paths survive the detour through node meta. Linears written
out by hand then become `aten.linear` (`autopar.graph.linear_forms`), and in-place ops on
values nothing else reads run out of place (`autopar.graph.inplace`).
"""

from __future__ import annotations

import contextlib
import os
import traceback

import torch
import torch.fx as fx
import torch.fx.traceback as fx_traceback
from torch import nn
from torch.export import Dim
from torch.fx._lazy_graph_module import _use_lazy_graph_module

from autopar.errors import TraceError
from autopar.graph import trace_cache
from autopar.graph.analysis import analyse
from autopar.graph.inplace import out_of_place
from autopar.graph.ir import BATCH, LOSS_MODULE, ParamInfo, TracedGraph
from autopar.graph.linear_forms import canonical_linears

__all__ = ["BATCH", "TracedGraph", "release_tensors", "trace"]  # BATCH and TracedGraph live in autopar.graph.ir

_WRAPPED = "model"
_TORCH_DIR = os.path.dirname(torch.__file__)
_TRACE_DIR = os.path.dirname(os.path.abspath(__file__))


class _Wrapper(nn.Module):
    """The model under a fixed attribute name, followed by the user's loss when given.

    `forward` takes exactly as many positional tensors as the example (see `_wrap`), since
    both tracers turn positional parameters, not *args, into graph inputs.
    """

    def __init__(self, model: nn.Module, loss_fn):
        super().__init__()
        self.model = model
        self.loss_fn = loss_fn

    def run(self, args):
        if self.loss_fn is None:
            return self.model(*args)
        *inputs, target = args
        return self.loss_fn(self.model(*inputs), target)


def _wrap(model: nn.Module, loss_fn, n_args: int) -> _Wrapper:
    names = ", ".join(f"a{i}" for i in range(n_args))
    namespace: dict = {}
    exec(f"def forward(self, {names}):\n    return self.run(({names},))\n", namespace)  # noqa: S102
    cls = type(f"{_Wrapper.__name__}{n_args}", (_Wrapper,), {"forward": namespace["forward"]})
    return cls(model, loss_fn)


class _InlineTracer(fx.Tracer):
    """symbolic_trace that inlines every module, so parameters become get_attr nodes."""

    def is_leaf_module(self, m: nn.Module, qualname: str) -> bool:
        return False


class _Interpret(nn.Module):
    """Runs an fx graph node by node, letting export see each node's module path."""

    def __init__(self, gm: fx.GraphModule):
        super().__init__()
        self.gm = gm

    def forward(self, *args):
        with fx_traceback.preserve_node_meta():
            return fx.Interpreter(self.gm).run(*args)


def trace(model: nn.Module, example_inputs, *, loss_fn=None, example_target=None,
          train: bool = True) -> TracedGraph:
    """Trace `model` (and `loss_fn(model(*inputs), target)` when given) into an analysed graph.

    Every tensor input must have the batch on dimension 0; the batch becomes the symbol
    `BATCH` in all shapes, so one graph serves any micro-batch or data-parallel shard.
    """
    inputs = tuple(example_inputs) if isinstance(example_inputs, (tuple, list)) else (example_inputs,)
    if not inputs or not all(isinstance(t, torch.Tensor) for t in inputs):
        raise TraceError("example_inputs must be a non-empty tuple of tensors with the batch on "
                         "dimension 0; pass e.g. example_inputs=(x,).")
    with_loss = loss_fn is not None
    if isinstance(loss_fn, type):
        raise TraceError(f"loss_fn is the class {loss_fn.__name__}, not a loss; pass an instance "
                         f"such as {loss_fn.__name__}() or a function (output, target) -> loss.")
    if with_loss:
        if not isinstance(example_target, torch.Tensor):
            raise TraceError("tracing with a loss needs example_target, a tensor with the batch on "
                             "dimension 0.")
        inputs = inputs + (example_target,)
    batch = inputs[0].shape[0] if inputs[0].dim() else 0
    if any(t.dim() == 0 or t.shape[0] != batch for t in inputs):
        raise TraceError("every example input (and target) must have the same batch size on "
                         f"dimension 0; got shapes {[tuple(t.shape) for t in inputs]}.")
    if batch < 2:  # export specialises sizes 0 and 1, which would bake the batch in
        inputs = tuple(t.expand(2, *t.shape[1:]).contiguous() if batch == 1 else t for t in inputs)
        batch = 2
    key = trace_cache.key(model, inputs, loss_fn, train)
    cached = trace_cache.lookup(key, model) if key is not None else None
    if cached is not None:
        model.train(model.training)  # as a trace leaves it: every module as the root
        cached.example_batch = batch  # (the key leaves the batch out: the graph's is symbolic)
        return cached
    wrapper = _wrap(model, loss_fn, len(inputs))
    was_training = model.training
    caching = _caching_configs(model)
    model.train(train)
    for config in caching:  # transformers models: a generation cache is no tensor to shard
        config.use_cache = False
    try:
        gm, tracer, reason = _trace_either(wrapper, inputs)
    finally:
        model.train(was_training)
        for config in caching:
            config.use_cache = True
    canonical_linears(gm)
    out_of_place(gm)
    params = _param_table(gm, model)
    traced = TracedGraph(gm=gm, tracer=tracer, example_batch=batch, params=params,
                         with_loss=with_loss, fallback_reason=reason)
    analyse(traced)
    if key is not None:
        trace_cache.store(key, model, traced)
    return traced


def release_tensors(traced: TracedGraph) -> None:
    """Let go of the model's tensors a traced graph holds (its parameters, buffers and
    constants become meta tensors of the same kind, shape and dtype), once the engine has cut
    its own slices from them: else the graph keeps a whole copy of the weights alive for the
    engine's life, after the user dropped the model. Every parameter and buffer of its module
    tree goes, read or not (a tied weight's second name stays an attribute nothing reads);
    constants export lifted (masks, rotary tables: small, and shared by copies of one trace)
    stay. The graph's modules are its own (export's and the trace cache's), never the
    model's."""
    for module in traced.gm.modules():
        for table in (module._parameters, module._buffers):
            for name, value in table.items():
                if value is not None and value.device.type != "meta":
                    table[name] = trace_cache.stand_in_for(value)


def _caching_configs(model: nn.Module) -> list:
    """Every distinct config of the model's modules that asks for a generation cache: an
    encoder-decoder's stacks hold copies of their own (T5's decoder returns its cache from
    its copy's use_cache, whatever the top config says)."""
    seen, out = set(), []
    for module in model.modules():
        config = getattr(module, "config", None)
        if id(config) not in seen and getattr(config, "use_cache", None) is True:
            seen.add(id(config))
            out.append(config)
    return out


def _trace_either(wrapper: nn.Module, inputs: tuple) -> tuple[fx.GraphModule, str, str | None]:
    try:
        return _via_export(wrapper, inputs), "export", None
    except Exception as export_error:  # noqa: BLE001 - any failure sends us to the fallback
        first = export_error
        export_reason = _describe_failure(export_error)
    try:
        return _via_fx(wrapper, inputs), "fx", f"torch.export failed: {export_reason}"
    except Exception as fx_error:  # noqa: BLE001
        fx_reason = _describe_failure(fx_error)
        second = fx_error
    name = type(wrapper.model).__name__
    # export's error names the op and line best; fx's where export's gives no user line
    cause = first if _user_frame(first) is not None or _user_frame(second) is None else second
    raise TraceError(f"could not trace {name}: torch.export failed at {export_reason} "
                     f"(torch.fx.symbolic_trace failed at {fx_reason}); {_advice(cause)}.")


def _batch_dims(n: int):
    batch = Dim("batch")
    return batch, tuple({0: batch} for _ in range(n))


@contextlib.contextmanager
def _no_stack_traces():
    """Export without a Python stack trace captured and symbolized for every node (a tenth
    to a fifth of a trace's CPU): nothing reads a node's `stack_trace`, and a failed trace
    names the user's line from its exception's traceback (`_user_frame`). The graph modules
    export makes on the way generate their Python code only if they run (most never do)."""
    config = torch.fx.config
    before = config.do_not_emit_stack_traces
    config.do_not_emit_stack_traces = True
    try:
        with _use_lazy_graph_module(True):
            yield
    finally:
        config.do_not_emit_stack_traces = before


def _via_export(wrapper: nn.Module, inputs: tuple) -> fx.GraphModule:
    _, dims = _batch_dims(len(inputs))
    with _no_stack_traces():
        ep = torch.export.export(wrapper, inputs, dynamic_shapes=dims, strict=False)
        gm = ep.module(check_guards=False)
    _finish(gm, inputs, prefix="")
    for node in gm.graph.nodes:
        stack = node.meta.get("nn_module_stack")
        path = list(stack.values())[-1][0] if stack else ""
        node.meta["autopar_module"] = _strip(path, _WRAPPED)
    return gm


def _via_fx(wrapper: nn.Module, inputs: tuple) -> fx.GraphModule:
    graph = _InlineTracer().trace(wrapper)
    inner = fx.GraphModule(wrapper, graph)
    for node in inner.graph.nodes:
        stack = node.meta.get("nn_module_stack")
        path = list(stack.values())[-1][0] if stack else ""
        node.meta["custom"] = {"autopar_module": _strip(path, _WRAPPED)}
    _, dims = _batch_dims(len(inputs))
    with _no_stack_traces():
        ep = torch.export.export(_Interpret(inner), inputs, dynamic_shapes=(dims,),
                                 strict=False)
        gm = ep.module(check_guards=False)
    _finish(gm, inputs, prefix="gm.")
    for node in gm.graph.nodes:
        node.meta["autopar_module"] = (node.meta.get("custom") or {}).get("autopar_module", "")
    return gm


def _strip(path: str, prefix: str) -> str:
    """A module path of the wrapper as a path of the user's model ("" is the model's root)."""
    if path == prefix:
        return ""
    if path.startswith(prefix + "."):
        return path[len(prefix) + 1:]
    return LOSS_MODULE


def _finish(gm: fx.GraphModule, inputs: tuple, prefix: str) -> None:
    """Drop unused attribute reads (the second name of a tied weight) and name the batch
    symbol. The graph has no input guards (`module(check_guards=False)`: they would pin the
    traced batch range, and generating them costs sympy work)."""
    erased = False
    for node in list(gm.graph.nodes):
        if node.op == "get_attr" and not node.users:
            gm.graph.erase_node(node)
            erased = True
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    batch_syms = set()
    for node in placeholders:
        val = node.meta.get("val")
        if isinstance(val, torch.Tensor) and val.dim() and isinstance(val.shape[0], torch.SymInt):
            batch_syms |= val.shape[0].node.expr.free_symbols
    if len(batch_syms) != 1:
        raise TraceError("the batch dimension could not be kept symbolic: the model fixes it "
                         "(e.g. a view with a literal batch size); use x.size(0) or -1 instead.")
    gm.meta["autopar_batch_symbol"] = next(iter(batch_syms))
    gm.meta["autopar_param_prefix"] = prefix
    gm.graph.lint()
    if erased:  # (module() generated the code of the graph as it came)
        gm.recompile()


def _param_table(gm: fx.GraphModule, model: nn.Module) -> dict[str, ParamInfo]:
    prefix = gm.meta["autopar_param_prefix"] + _WRAPPED + "."
    aliases: dict[int, list[str]] = {}
    for name, tensor in list(model.named_parameters(remove_duplicate=False)) + \
            list(model.named_buffers(remove_duplicate=False)):
        aliases.setdefault(id(tensor), []).append(name)
    by_name = {name: names for names in aliases.values() for name in names}
    persistent = set(model.state_dict(keep_vars=True).keys())
    table = {}
    for node in gm.graph.nodes:
        if node.op != "get_attr":
            continue
        value = _getattr(gm, node.target)
        if not isinstance(value, torch.Tensor):
            continue
        name = node.target[len(prefix):] if node.target.startswith(prefix) else node.target
        names = tuple(n for n in by_name.get(name, [name]) if n in persistent) or (name,)
        table[node.target] = ParamInfo(target=node.target, names=names, shape=tuple(value.shape),
                                       dtype=value.dtype,
                                       is_parameter=isinstance(value, nn.Parameter))
    return table


def _getattr(module: nn.Module, target: str):
    obj = module
    for part in target.split("."):
        obj = getattr(obj, part)
    return obj


def _user_frame(error: BaseException):
    """The innermost frame of the traceback in the user's code (not torch's nor autopar's)."""
    for frame in reversed(traceback.extract_tb(error.__traceback__)):
        filename = os.path.abspath(frame.filename)
        if not filename.startswith(_TORCH_DIR) and not filename.startswith(_TRACE_DIR) \
                and "<" not in frame.filename:
            return frame
    return None


def _failing_op(error: BaseException) -> str | None:
    """The aten op that raised, read from the dispatcher's frames of the traceback."""
    tb = error.__traceback__
    while tb is not None:
        for name in ("func", "op"):
            value = tb.tb_frame.f_locals.get(name)
            if isinstance(value, (torch._ops.OpOverload, torch._ops.OpOverloadPacket)):
                return str(value)
        tb = tb.tb_next
    return None


def _describe_failure(error: BaseException) -> str:
    """The failing op, the user's source line where tracing broke, and the tracer's reason,
    in one line."""
    frame = _user_frame(error)
    where = f"{frame.filename}:{frame.lineno} ({frame.line or frame.name})" if frame else \
        "an unknown location"
    op = _failing_op(error)
    reason = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
    return f"{where}{f' in {op}' if op else ''}: {type(error).__name__}: {reason}"


_CAUSES = (  # (words in the error, advice): the first match gives the advice
    (("data-dependent", "control flow", "Boolean value of Tensor", "DataDependent"),
     "remove the data-dependent Python control flow at that line (a branch or loop on tensor "
     "values: torch.where computes both sides), or trace a submodule"),
    (("Constraints violated (batch)", "specializ"),
     "the model or the loss fixes the batch size there: use x.size(0) or -1 instead of a "
     "literal batch, and give every input and the target the batch on dimension 0"),
    (("dtype", "scalar type", "Long", "Float", "Half", "BFloat16"),
     "pass example inputs of the dtype the model expects at that line (integer token ids, "
     "floating features) and a target the loss takes"),
    (("shape", "size", "mat1 and mat2", "dimension", "expand", "out of range", "out of bounds"),
     "pass example inputs of the shape the model expects at that line (the batch on dimension "
     "0, then the model's own sizes) and a target shaped as the loss needs"),
    (("positional argument", "keyword argument", "takes", "missing"),
     "pass as many example inputs as the model's forward takes, in its order"),
)


def _advice(error: BaseException) -> str:
    """What would fix the trace, from the kind of error (not always control flow)."""
    text = f"{type(error).__name__}: {error}"
    for words, advice in _CAUSES:
        if any(w in text for w in words):
            return advice
    return "fix the model at that line, or trace a submodule"
