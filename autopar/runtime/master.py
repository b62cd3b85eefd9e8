"""fp32 master weights for 16-bit parameters, as the planner prices them
(`autopar.cost.precision.precision_of`: bf16 or fp16 weights 2 + gradients 2, fp32 master 4
+ moments 8 bytes a parameter; Micikevicius et al. 2018, §3.1; Rajbhandari et al. 2019,
§3.1, K = 12). The model keeps its 16-bit parameters and gradients, which the graphs, the
gradient reduction and ZeRO's gathers use as they are; the optimizer the user's factory
makes runs on fp32 copies of the parameters it is given (ZeRO's pieces under ZeRO-1/2/3, so
the master is sharded with the moments), and each step writes the updated master back to
the 16-bit parameter. A parameter already fp32 (or wider) is its own master.

The master of a parameter is made from the parameter at its first step (or when a
checkpoint gives it), so weights written before that (a start's slices, a load) are what
it starts from. It is part of the optimizer's state (key "master", shaped like the
parameter), so checkpoints save, reshard and restore it as they do the moments."""

from __future__ import annotations

from collections.abc import MutableMapping

import torch
from torch import nn

MASTER = "master"  # the optimizer state key of a parameter's fp32 master


def is_low(param: torch.Tensor) -> bool:
    """Whether `param` is a floating tensor narrower than fp32 (it gets an fp32 master)."""
    return param.is_floating_point() and param.element_size() < 4


def master_weights(factory):
    """The optimizer factory `factory` (params -> optimizer), holding fp32 masters for the
    16-bit parameters it is given (None stays None)."""
    if factory is None:
        return None

    def make(params):
        params = list(params)
        if not any(is_low(p) for p in params):
            return factory(params)
        return MasterWeights(params, factory)

    return make


class MasterWeights(torch.optim.Optimizer):
    """An optimizer over 16-bit parameters that steps `inner` (the factory's optimizer) on
    their fp32 masters. `param_groups` and `state` are keyed by the 16-bit parameters, as
    the engine, its checkpoints and an LR scheduler see them; the state of a parameter is
    the inner optimizer's state of its master, plus the master itself."""

    def __init__(self, params: list[torch.Tensor], factory):
        self.low = list(params)
        # an fp32 parameter stands for itself; a 16-bit one's master is empty until made
        self.masters = [nn.Parameter(torch.empty(0, device=p.device),
                                     requires_grad=p.requires_grad) if is_low(p) else p
                        for p in self.low]
        self._master_of = {id(p): m for p, m in zip(self.low, self.masters)}
        self.inner = factory(self.masters)
        super().__init__(self.low, dict(self.inner.defaults))
        low_of = {id(m): p for p, m in zip(self.low, self.masters)}
        self.param_groups = [{**g, "params": [low_of[id(m)] for m in g["params"]]}
                             for g in self.inner.param_groups]
        self.state = _State(self)

    def master(self, param: torch.Tensor) -> torch.Tensor:
        """The fp32 master of `param` (made from it now if it has none yet)."""
        m = self._master_of[id(param)]
        if m is not param and m.numel() != param.numel():
            m.data = param.detach().to(torch.float32).clone()
        return m

    def reset(self, param: torch.Tensor) -> None:
        """Forget `param`'s master and state: its next step starts from the parameter."""
        m = self._master_of[id(param)]
        self.inner.state.pop(m, None)
        if m is not param:
            m.data = torch.empty(0, device=param.device)

    def _sync_groups(self) -> None:
        """Hyperparameters set on this optimizer's groups (a scheduler, a load) go inside."""
        for outer, inner in zip(self.param_groups, self.inner.param_groups):
            for k, v in outer.items():
                if k != "params":
                    inner[k] = v

    @torch.no_grad()
    def step(self, closure=None):
        """The inner step on the masters, with the 16-bit gradients in fp32; then each
        stepped parameter takes its master's value (rounded to its dtype)."""
        if closure is not None:
            raise ValueError("MasterWeights.step takes no closure; call the engine's "
                             "train_step.")
        self._sync_groups()
        stepped = []
        for p in self.low:
            m = self.master(p)
            if m is not p:
                m.grad = None if p.grad is None else p.grad.to(torch.float32)
                if p.grad is not None:
                    stepped.append((p, m))
        self.inner.step()
        for p, m in stepped:
            p.copy_(m)
            m.grad = None  # the fp32 gradient lives for the step only
        return None

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.inner.zero_grad(set_to_none=set_to_none)
        for p in self.low:
            if set_to_none:
                p.grad = None
            elif p.grad is not None:
                p.grad.zero_()

    @property
    def whole_norms(self):
        """The norm function of an inner optimizer that takes one (autopar.optim's LAMB and
        LARS); absent when the inner optimizer has none."""
        return self.__dict__.get("_whole_norms") or self.inner.whole_norms

    @whole_norms.setter
    def whole_norms(self, norms) -> None:
        # the inner optimizer asks by masters; the engine's function knows the parameters
        low_of = {id(m): p for p, m in zip(self.low, self.masters)}
        self.__dict__["_whole_norms"] = norms
        self.inner.whole_norms = lambda params, tensors: norms(
            [low_of.get(id(m), m) for m in params], tensors)

    def __getattr__(self, name):
        # what the inner optimizer adds (a step count, ...)
        if name in ("inner", "_master_of"):
            raise AttributeError(name)
        return getattr(self.inner, name)


class _State(MutableMapping):
    """MasterWeights.state: per 16-bit parameter, its master's inner state and the master."""

    def __init__(self, owner: MasterWeights):
        self.owner = owner

    def _pairs(self):
        return ((p, self.owner._master_of[id(p)]) for p in self.owner.low)

    def __getitem__(self, param):
        m = self.owner._master_of.get(id(param)) if isinstance(param, torch.Tensor) else None
        if m is None:
            raise KeyError(param)
        state = dict(self.owner.inner.state.get(m, {}))
        if m is not param and m.numel() == param.numel() and m.numel():
            state[MASTER] = m.detach()
        if not state:
            raise KeyError(param)
        return state

    def __setitem__(self, param, value: dict) -> None:
        value = dict(value)
        master = value.pop(MASTER, None)
        self.owner.reset(param)
        m = self.owner._master_of[id(param)]
        if master is not None and m is not param:
            m.data = master.detach().to(device=param.device, dtype=torch.float32).clone()
        if value:
            self.owner.inner.state[m] = value

    def __delitem__(self, param) -> None:
        if param not in self:
            raise KeyError(param)
        self.owner.reset(param)

    def __contains__(self, param) -> bool:
        try:
            self[param]
        except KeyError:
            return False
        return True

    def __iter__(self):
        return (p for p, _ in self._pairs() if p in self)

    def __len__(self) -> int:
        return sum(1 for _ in self)
