"""Large-batch optimizers whose per-parameter trust ratio needs the whole parameter's norm.

LAMB (You et al. 2019, "Large Batch Optimization for Deep Learning: Training BERT in 76
minutes", Algorithm 2) and LARS (You, Gitman and Ginsburg 2017, "Large Batch Training of
Convolutional Networks", Algorithm 1) scale each parameter's update by a ratio of norms of
that parameter. When tensor parallelism or ZeRO cuts a parameter into pieces, a rank sees
one piece; the ratio must still use the norms of the whole parameter. Both optimizers
take their norms from `self.whole_norms(params, tensors)`, which returns, for each of
`params` (the optimizer's own parameters, in order), the norm of the whole tensor that
`tensors[i]` is this rank's piece of. Alone it is the local norm; `autopar.parallelize`
installs one that adds the squared norms of every rank's pieces with one all-reduce.

    engine = autopar.parallelize(model, 4, ..., optimizer=functools.partial(
        autopar.optim.LAMB, lr=1e-3, weight_decay=0.01), plan=dict(tensor=dict(size=4)))
"""

from __future__ import annotations

import torch


def local_norms(params, tensors) -> list[torch.Tensor]:
    return [torch.linalg.vector_norm(t.detach()) for t in tensors]


class LAMB(torch.optim.Optimizer):
    """Adam's update made layer-wise: each parameter moves by lr x ||w|| / ||u|| x u, where
    u = m_hat / (sqrt(v_hat) + eps) + weight_decay x w is Adam's direction with decoupled
    weight decay (Algorithm 2; phi is the identity). A parameter whose ||w|| or ||u|| is
    zero takes a trust ratio of 1."""

    def __init__(self, params, lr: float = 1e-3, betas=(0.9, 0.999), eps: float = 1e-6,
                 weight_decay: float = 0.0, bias_correction: bool = True):
        if not lr > 0:
            raise ValueError(f"LAMB needs a positive learning rate, not {lr!r}")
        super().__init__(params, dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay,
                                      bias_correction=bias_correction))
        self.whole_norms = local_norms

    @torch.no_grad()
    def step(self, closure=None):
        loss = closure() if closure is not None else None
        for group in self.param_groups:
            beta1, beta2 = group["betas"]
            params, updates = [], []
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]
                if not state:
                    state["step"] = 0
                    state["exp_avg"] = torch.zeros_like(p)
                    state["exp_avg_sq"] = torch.zeros_like(p)
                state["step"] += 1
                m, v = state["exp_avg"], state["exp_avg_sq"]
                m.mul_(beta1).add_(p.grad, alpha=1 - beta1)
                v.mul_(beta2).addcmul_(p.grad, p.grad, value=1 - beta2)
                m_hat, v_hat = m, v
                if group["bias_correction"]:
                    m_hat = m / (1 - beta1 ** state["step"])
                    v_hat = v / (1 - beta2 ** state["step"])
                update = m_hat / (v_hat.sqrt() + group["eps"])
                if group["weight_decay"]:
                    update = update + group["weight_decay"] * p
                params.append(p)
                updates.append(update)
            if not params:
                continue
            w_norms = self.whole_norms(params, params)
            u_norms = self.whole_norms(params, updates)
            for p, u, w_norm, u_norm in zip(params, updates, w_norms, u_norms):
                trust = float(w_norm / u_norm) if w_norm > 0 and u_norm > 0 else 1.0
                p.add_(u, alpha=-group["lr"] * trust)
        return loss


class LARS(torch.optim.Optimizer):
    """SGD with momentum and a layer-wise learning rate (Algorithm 1): the local rate is
    trust x ||w|| / (||g|| + weight_decay x ||w||), the step v = momentum x v + lr x local
    rate x (g + weight_decay x w), w -= v. A parameter whose ||w|| or ||g|| is zero takes a
    local rate of 1."""

    def __init__(self, params, lr: float = 0.1, momentum: float = 0.9,
                 weight_decay: float = 0.0, trust_coefficient: float = 0.001):
        if not lr > 0:
            raise ValueError(f"LARS needs a positive learning rate, not {lr!r}")
        super().__init__(params, dict(lr=lr, momentum=momentum, weight_decay=weight_decay,
                                      trust_coefficient=trust_coefficient))
        self.whole_norms = local_norms

    @torch.no_grad()
    def step(self, closure=None):
        loss = closure() if closure is not None else None
        for group in self.param_groups:
            params = [p for p in group["params"] if p.grad is not None]
            if not params:
                continue
            w_norms = self.whole_norms(params, params)
            g_norms = self.whole_norms(params, [p.grad for p in params])
            wd = group["weight_decay"]
            for p, w_norm, g_norm in zip(params, w_norms, g_norms):
                local = 1.0
                if w_norm > 0 and g_norm > 0:
                    local = float(group["trust_coefficient"] * w_norm / (g_norm + wd * w_norm))
                state = self.state[p]
                if "momentum_buffer" not in state:
                    state["momentum_buffer"] = torch.zeros_like(p)
                buf = state["momentum_buffer"]
                buf.mul_(group["momentum"]).add_(p.grad + wd * p, alpha=group["lr"] * local)
                p.sub_(buf)
        return loss
