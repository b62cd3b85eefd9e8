"""Dynamic loss scaling for fp16 (Micikevicius et al. 2018, "Mixed Precision Training", §3.2):
the loss is scaled before the backward; a step whose gradients overflow on any rank is
skipped and the scale halved; it doubles after `growth_interval` clean steps."""

from __future__ import annotations

import torch


class LossScaler:
    """The current loss scale and its update rule (starts at 2**16; scales are powers of two,
    so unscaling is exact)."""

    def __init__(self, init_scale: float = 2.0 ** 16, growth_factor: float = 2.0,
                 backoff_factor: float = 0.5, growth_interval: int = 2000):
        if not init_scale > 0 or not growth_factor > 1 or not 0 < backoff_factor < 1 or \
                growth_interval < 1:
            raise ValueError("LossScaler needs init_scale > 0, growth_factor > 1, "
                             "0 < backoff_factor < 1 and growth_interval >= 1.")
        self.scale = float(init_scale)
        self.growth_factor, self.backoff_factor = float(growth_factor), float(backoff_factor)
        self.growth_interval = int(growth_interval)
        self.good_steps = 0  # steps without overflow since the scale last changed
        self.skipped_steps = 0  # steps skipped for an overflow, in all

    def unscale_(self, grads: list[torch.Tensor], sum_over_world) -> bool:
        """Divide `grads` (this rank's, in place) by the scale; True when any rank's holds
        an inf or a nan. `sum_over_world(t)` sums a tensor over every rank in place: one
        all-reduce of a one-element flag, so every rank decides alike."""
        inv = 1.0 / self.scale
        device = grads[0].device if grads else torch.device("cpu")
        bad = torch.zeros(1, dtype=torch.float32, device=device)
        for g in grads:
            g.mul_(inv)
            bad += (~torch.isfinite(g)).any()  # no host sync per gradient
        return bool(sum_over_world(bad)[0] > 0)

    def update(self, overflow: bool) -> None:
        """After a step: halve the scale on overflow, double it after `growth_interval` good
        steps in a row."""
        if overflow:
            self.scale *= self.backoff_factor
            self.good_steps = 0
            self.skipped_steps += 1
            return
        self.good_steps += 1
        if self.good_steps >= self.growth_interval:
            self.scale *= self.growth_factor
            self.good_steps = 0

    def state_dict(self) -> dict:
        """What a checkpoint keeps so a resumed run goes on at the same scale."""
        return {"scale": self.scale, "good_steps": self.good_steps,
                "skipped_steps": self.skipped_steps}

    def load_state_dict(self, state: dict) -> None:
        self.scale = float(state["scale"])
        self.good_steps = int(state["good_steps"])
        self.skipped_steps = int(state["skipped_steps"])
