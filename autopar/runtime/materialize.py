"""Initial values of a model built on the meta device, one module at a time, equal to what
one device gets from the same construction under the same seed.

A single-device construction draws random numbers all through the constructor: each
torch.nn module's `reset_parameters()`, draws a module makes in its own `__init__`
(transformers' Conv1D), then the model's initialization (`init_weights()` of the zoo
models; transformers' `post_init`, which runs `_init_weights` over the modules children
first for every submodel, then ties). Most of those values are overwritten, but every draw
moves the random stream the later ones start from.

So the construction is run again on meta under a dispatch mode that records every aten op
(factories forced onto meta: nothing is allocated): the model's own constructor,
`type(model)(model.config)`, when it rebuilds the same tensors; otherwise (a plain module
tree) `reset_parameters()` of every module children first, then `init_weights()` of the
model and of each transformers submodel, which is what their constructors call. The
recording is then replayed on the CPU with a generator of its own, seeded as the single
device was, so every random op draws the same numbers in the same order. Tensors are
followed by storage, so views and `.data` aliases write where the model's tensors live.
A storage is allocated when an op first makes or writes it, freed when its next use
overwrites it whole (a value `reset_parameters` gave that the model's init replaces), and
a module is handed out as soon as its last tensor is final: the replay holds one module's
tensors plus those written out of order (a tied embedding a later init rewrites).

Exact for the zoo models, plain torch.nn modules (with torch.nn.init's functions, the
truncated normal, orthogonal_, sparse_ and dirac_ included) and transformers models built
with `from_config` (checked: Llama tied and untied, Qwen2, BERT, T5, GPT-2, ViT). Refused,
with an error naming the tensor: a value set outside every recorded initialization (a
plain module tree with `nn.Parameter(torch.ones(n))` no init writes again) or read before
anything writes it. Not exact: a transformers model whose `_init_weights` calls
orthogonal_, sparse_ or dirac_ (transformers holds those functions itself, so the
recording does not see them, and torch skips them on meta); a model cast after
construction (`.to(torch.bfloat16)`), whose values are drawn in the cast dtype instead of
drawn in fp32 and rounded.
"""

from __future__ import annotations

import copy
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch
from torch import nn
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten, tree_map

from autopar.errors import WeightsError

aten = torch.ops.aten
META = torch.device("meta")
# Ops that replace every element of their first argument without reading it.
_OVERWRITE = {aten.normal_, aten.uniform_, aten.fill_, aten.zero_, aten.copy_,
              aten.bernoulli_, aten.exponential_, aten.geometric_, aten.log_normal_,
              aten.cauchy_, aten.random_}
# torch.nn.init functions recorded as one step each and run whole in the replay: the
# truncated normal redraws until its values fall in range (how many numbers it draws
# depends on values meta tensors do not have); orthogonal_, sparse_ and dirac_ do nothing
# on meta. Patched in torch.nn.init while recording (callers that hold the functions
# themselves, as transformers' initialization does for orthogonal_, sparse_ and dirac_,
# are not seen: such models are not reproduced exactly).
_WHOLE = {name: getattr(torch.nn.init, name) for name in
          ("_no_grad_trunc_normal_", "orthogonal_", "sparse_", "dirac_")
          if hasattr(torch.nn.init, name)}
_WHOLE_FUNCS = set(_WHOLE.values())


def _key(t: torch.Tensor) -> int:
    """The identity of a tensor's storage: shared by its views and `.data` aliases."""
    return StorageWeakRef(t.untyped_storage()).cdata


def _tensors(value) -> list[torch.Tensor]:
    return [x for x in tree_flatten(value)[0] if isinstance(x, torch.Tensor)]


def _own_tensors(module: nn.Module) -> list[tuple[str, torch.Tensor]]:
    return [(n, t) for n, t in list(module._parameters.items()) + list(module._buffers.items())
            if t is not None]


@contextmanager
def _whole_steps(ops: list):
    """Record calls of the `_WHOLE` functions as single steps of `ops`."""
    def recorder(func):
        def record(tensor, *args, **kwargs):
            ops.append((func, (tensor, *args), dict(kwargs), tensor))
            return tensor
        return record

    for name, func in _WHOLE.items():
        setattr(torch.nn.init, name, recorder(func))
    try:
        yield
    finally:
        for name, func in _WHOLE.items():
            setattr(torch.nn.init, name, func)


def _draws(func) -> bool:
    """Whether a recorded aten op takes a random generator."""
    return any(a.name == "generator" for a in func._schema.arguments)


class _Recorder(TorchDispatchMode):
    """Every aten op run under it, with its arguments and outputs (kept alive, so storage
    identities stay unique); factory ops made on meta when `force_meta`."""

    def __init__(self, force_meta: bool):
        super().__init__()
        self.force_meta = force_meta
        self.ops: list[tuple] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = dict(kwargs or {})
        if self.force_meta and any(a.name == "device" for a in func._schema.arguments):
            kwargs["device"] = META
        out = func(*args, **kwargs)
        self.ops.append((func, args, kwargs, out))
        return out


@dataclass
class _Plan:
    """A recorded construction: its ops, per op the storages it uses, per storage the ops
    that use it, and the model's tensors by storage."""

    ops: list[tuple]
    touched: list[list[int]] = field(default_factory=list)
    uses: dict[int, list[int]] = field(default_factory=dict)
    made: set[int] = field(default_factory=set)  # storages an op of the recording made
    owners: dict[int, list[tuple[str, str, torch.Tensor]]] = field(default_factory=dict)


# ---------------------------------------------------------------------- recording
def _record(model: nn.Module) -> _Plan:
    """The model's construction on meta, recorded: its own constructor when that rebuilds
    the same tensors, else the initialization its modules' constructors run."""
    config = getattr(model, "config", None)
    if config is not None:
        try:
            ops, rebuilt = _record_constructor(model, config)
        except Exception:  # a constructor that needs real values: the generic path
            rebuilt = None
        if rebuilt is not None and _same_tensors(model, rebuilt):
            return _analyse(rebuilt, ops)
    return _analyse(model, _record_inits(model))


def _record_constructor(model: nn.Module, config) -> tuple[list, nn.Module]:
    dtype = next((t.dtype for _, t in model.state_dict(keep_vars=True).items()
                  if t.is_floating_point()), torch.get_default_dtype())
    recorder, default = _Recorder(force_meta=True), torch.get_default_dtype()
    torch.set_default_dtype(dtype)  # transformers' from_config builds in config.dtype
    try:
        with torch.random.fork_rng(devices=[]), recorder, _whole_steps(recorder.ops):
            rebuilt = type(model)(copy.deepcopy(config))
    finally:
        torch.set_default_dtype(default)
    return recorder.ops, rebuilt


def _same_tensors(model: nn.Module, rebuilt: nn.Module) -> bool:
    def geometry(m):
        return {k: (tuple(t.shape), t.dtype) for k, t in
                list(m.named_parameters(remove_duplicate=False)) +
                list(m.named_buffers(remove_duplicate=False))}
    return geometry(model) == geometry(rebuilt) and all(
        t.device == META for t in rebuilt.state_dict(keep_vars=True).values())


def _record_inits(model: nn.Module) -> list:
    flags = {id(m): m.__dict__.get("_is_hf_initialized", _MISSING) for m in model.modules()}
    recorder = _Recorder(force_meta=False)
    untied = _untie_late(model)
    try:
        with torch.random.fork_rng(devices=[]), torch.no_grad(), recorder, \
                _whole_steps(recorder.ops):
            _construct(model, top=True, seen=set())
    except Exception as e:  # an init that needs real values (.item(), data-dependent code)
        raise WeightsError(f"the initialization of {type(model).__name__} could not run on "
                           f"the meta device ({type(e).__name__}: {e}); build the model on a "
                           "real device or pass weights.") from e
    finally:
        for module, attr, param in untied:
            module._parameters[attr] = param
        for m in model.modules():  # transformers marks modules it initialized
            if flags.get(id(m), _MISSING) is _MISSING:
                m.__dict__.pop("_is_hf_initialized", None)
            else:
                m._is_hf_initialized = flags[id(m)]
    return recorder.ops


_MISSING = object()


def _untie_late(model: nn.Module) -> list[tuple[nn.Module, str, nn.Parameter]]:
    """Give each weight transformers ties only after initializing (its
    `all_tied_weights_keys` targets, e.g. lm_head.weight) a meta tensor of its own while
    recording, as its constructor and init drew into one before `tie_weights` dropped it.
    Returns (module, name, tied parameter) to put back."""
    keys = getattr(model, "all_tied_weights_keys", None)
    out = []
    for target, source in (keys.items() if isinstance(keys, dict) else ()):
        try:
            t, s = model.get_parameter(target), model.get_parameter(source)
        except AttributeError:
            continue
        if t is s:
            path, _, attr = target.rpartition(".")
            module = model.get_submodule(path)
            out.append((module, attr, t))
            module._parameters[attr] = nn.Parameter(torch.empty_like(t, device=META),
                                                    requires_grad=t.requires_grad)
    return out


def _construct(module: nn.Module, top: bool, seen: set) -> None:
    """The initialization a constructor runs, children first: a module's
    `reset_parameters()`, then `init_weights()` for the model itself and for every
    transformers submodel (whose constructor ends with `post_init`, which calls it)."""
    if id(module) in seen:
        return
    seen.add(id(module))
    for child in module.children():
        _construct(child, top=False, seen=seen)
    reset = getattr(module, "reset_parameters", None)
    if callable(reset) and _own_tensors(module):
        reset()
    init = getattr(module, "init_weights", None)
    if callable(init) and (top or (hasattr(module, "post_init") and
                                   hasattr(module, "_init_weights"))):
        init()


def _analyse(model: nn.Module, ops: list) -> _Plan:
    """Uses per storage; the model's tensors by storage (a tied tensor under its first
    owner); a tensor whose value the recording does not determine is refused."""
    plan = _Plan(ops)
    for i, (_, args, kwargs, out) in enumerate(ops):
        inputs = {_key(t) for t in _tensors((args, kwargs))}
        fresh = {_key(t) for t in _tensors(out)} - inputs - plan.uses.keys()
        plan.made |= fresh
        keys = list(dict.fromkeys(_key(t) for t in _tensors((args, kwargs, out))))
        plan.touched.append(keys)
        for k in keys:
            plan.uses.setdefault(k, []).append(i)
    seen: set[int] = set()
    for mod_name, module in model.named_modules():
        for name, t in _own_tensors(module):
            if id(t) in seen:
                continue
            seen.add(id(t))
            plan.owners.setdefault(_key(t), []).append((mod_name, name, t))
    for k, owned in plan.owners.items():
        mod_name, name, _ = owned[0]
        where = f"{mod_name}.{name}" if mod_name else name
        uses = plan.uses.get(k)
        if not uses:
            raise WeightsError(f"{where} is written by neither its module's reset_parameters "
                               "nor the model's init_weights, so its value on the meta device "
                               "is unknown; build that module on a real device or pass "
                               "weights.")
        if k not in plan.made and not _overwrites(plan, uses[0], k):
            raise WeightsError(f"{where} is read by the model's initialization before "
                               "anything writes it, so its value on the meta device is "
                               "unknown; build that module on a real device or pass weights.")
    return plan


def _overwrites(plan: _Plan, i: int, k: int) -> bool:
    """Whether op i replaces all of storage k without reading it."""
    func, args, kwargs, _ = plan.ops[i]
    if (func not in _WHOLE_FUNCS and func.overloadpacket not in _OVERWRITE) or not args or \
            not isinstance(args[0], torch.Tensor) or _key(args[0]) != k:
        return False
    t = args[0]
    whole = t.is_contiguous() and t.storage_offset() == 0 and \
        t.numel() * t.element_size() == t.untyped_storage().nbytes()
    return whole and all(_key(x) != k for x in _tensors((args[1:], kwargs)))


# ---------------------------------------------------------------------- replay
def iter_initial_values(model: nn.Module, seed: int | None = None) \
        -> Iterator[tuple[str, dict[str, torch.Tensor]]]:
    """(module name, {its own parameter and buffer names: full initial value on the CPU})
    for each module of a meta-device model, in the order their values become final; a
    tied tensor comes with its first owner only. `seed`: as `torch.manual_seed(seed)`
    before the single-device construction; None: from the current CPU random state, which
    is then advanced as the construction would have advanced it."""
    plan = _record(model)  # eager: an unrecoverable tensor is refused before any yield
    generator = torch.Generator()
    if seed is None:
        generator.set_state(torch.random.get_rng_state())
    else:
        generator.manual_seed(seed)
    return _replay(plan, generator, advance_global=seed is None)


def _replay(plan: _Plan, generator: torch.Generator, advance_global: bool) \
        -> Iterator[tuple[str, dict[str, torch.Tensor]]]:
    pending: dict[str, int] = {}
    for owned in plan.owners.values():
        for mod_name, _, _ in owned:
            pending[mod_name] = pending.get(mod_name, 0) + 1
    storages: dict[int, torch.UntypedStorage] = {}  # recorded storage -> replayed one
    final: dict[str, dict[str, torch.Tensor]] = {}
    position = dict.fromkeys(plan.uses, 0)

    def real(x):
        if not isinstance(x, torch.Tensor):
            return torch.device("cpu") if x == META else x
        k = _key(x)
        if k not in storages:
            if x.device != META:
                return x  # a constant made outside the recording
            storages[k] = torch.UntypedStorage(x.untyped_storage().nbytes())
        return _view(storages[k], x)

    with torch.no_grad():
        for i, (func, args, kwargs, out) in enumerate(plan.ops):
            args2, kwargs2 = tree_map(real, args), tree_map(real, kwargs)
            if func not in _WHOLE_FUNCS and _draws(func):
                kwargs2["generator"] = generator
                result = func(*args2, **kwargs2)
            elif func in _WHOLE_FUNCS or \
                    torch.Tag.nondeterministic_seeded in getattr(func, "tags", ()):
                # randn.default takes no generator; sparse_ draws a randperm without it
                result = _with_global(generator, func, args2, kwargs2)
            else:
                result = func(*args2, **kwargs2)
            for m, r in zip(_tensors(out), _tensors(result)):
                if _key(m) not in storages:
                    storages[_key(m)] = _like(m, r).untyped_storage()
            for k in plan.touched[i]:
                position[k] += 1
                uses = plan.uses[k]
                later = uses[position[k]] if position[k] < len(uses) else None
                if later is None:
                    for mod_name, name, t in plan.owners.get(k, ()):
                        final.setdefault(mod_name, {})[name] = _view(storages[k], t)
                        pending[mod_name] -= 1
                if later is None or _overwrites(plan, later, k):
                    storages.pop(k, None)
            for mod_name in [n for n in final if pending[n] == 0]:
                yield mod_name, final.pop(mod_name)
    if advance_global:
        torch.random.set_rng_state(generator.get_state())


def _with_global(generator: torch.Generator, func, args, kwargs):
    """Run a random op that takes no generator on the global CPU stream set to
    `generator`'s state, then carry the state back."""
    saved = torch.random.get_rng_state()
    torch.random.set_rng_state(generator.get_state())
    try:
        return func(*args, **kwargs)
    finally:
        generator.set_state(torch.random.get_rng_state())
        torch.random.set_rng_state(saved)


def _view(storage: torch.UntypedStorage, like: torch.Tensor) -> torch.Tensor:
    """A CPU tensor on `storage` with the dtype, size, stride and offset of `like`."""
    return torch.empty(0, dtype=like.dtype).set_(storage, like.storage_offset(), like.size(),
                                                 like.stride())


def _like(recorded: torch.Tensor, result: torch.Tensor) -> torch.Tensor:
    """A fresh result laid out as the recording's (later views address it that way)."""
    if result.size() == recorded.size() and result.stride() == recorded.stride() and \
            result.storage_offset() == recorded.storage_offset() and \
            result.untyped_storage().nbytes() >= recorded.untyped_storage().nbytes():
        return result
    out = torch.empty(0, dtype=recorded.dtype).set_(
        torch.UntypedStorage(recorded.untyped_storage().nbytes()), recorded.storage_offset(),
        recorded.size(), recorded.stride())
    return out.copy_(result)


# ---------------------------------------------------------------------- placing
def materialize_module(module: nn.Module, values: dict[str, torch.Tensor],
                       device: torch.device | str = "cpu") -> None:
    """Give `module`'s own meta parameters and buffers named in `values` real storage on
    `device` holding those values (its submodules untouched)."""
    for name, value in values.items():
        if name in module._parameters:
            old = module._parameters[name]
            module._parameters[name] = nn.Parameter(value.to(device),
                                                    requires_grad=old.requires_grad)
        elif name in module._buffers:
            module._buffers[name] = value.to(device)
        else:
            raise WeightsError(f"{type(module).__name__} has no parameter or buffer {name}; "
                               "pass the values iter_initial_values gave for this module.")


def materialize(model: nn.Module, device: torch.device | str = "cpu",
                seed: int | None = None) -> nn.Module:
    """Materialize a whole meta-device model in place on `device`, module by module, with
    the values one device gets from the same construction and seed; tied tensors stay
    tied. For single-device use and tests: a rank that holds slices consumes
    `iter_initial_values` itself and discards each module's full values."""
    owners: dict[int, list[tuple[nn.Module, str]]] = {}
    for module in model.modules():
        for name, t in _own_tensors(module):
            owners.setdefault(id(t), []).append((module, name))
    firsts = {(id(ms[0][0]), ms[0][1]): ms for ms in owners.values()}
    modules = dict(model.named_modules())
    for mod_name, values in iter_initial_values(model, seed):
        module = modules[mod_name]
        materialize_module(module, values, device)
        for name in values:
            store = module._parameters if name in module._parameters else module._buffers
            for other, other_name in firsts[(id(module), name)][1:]:
                target = other._parameters if other_name in other._parameters \
                    else other._buffers
                target[other_name] = store[name]
    return model
