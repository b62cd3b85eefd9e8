"""MLP: a plain stack of Linear + GELU blocks and a final Linear.

The smallest model in the zoo; each hidden layer is its own submodule under
``blocks`` so that layers can be grouped by module path like the transformers.
"""

from dataclasses import dataclass

import torch
from torch import nn


@dataclass(frozen=True)
class MLPConfig:
    in_features: int
    hidden: int
    out_features: int
    n_layer: int  # number of Linear + GELU blocks before the output Linear
    dropout: float = 0.0

    def __post_init__(self):
        if self.n_layer < 1:
            raise ValueError(f"MLPConfig: n_layer={self.n_layer} must be at least 1.")


class Block(nn.Module):
    def __init__(self, in_features: int, out_features: int, dropout: float):
        super().__init__()
        self.fc = nn.Linear(in_features, out_features)
        self.gelu = nn.GELU()
        self.dropout = nn.Dropout(dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.dropout(self.gelu(self.fc(x)))


class MLP(nn.Module):
    """forward(x: float [B, in_features]) -> [B, out_features]."""

    def __init__(self, cfg: MLPConfig):
        super().__init__()
        self.config = cfg
        widths = [cfg.in_features] + [cfg.hidden] * cfg.n_layer
        self.blocks = nn.ModuleList(
            Block(widths[i], widths[i + 1], cfg.dropout) for i in range(cfg.n_layer)
        )
        self.head = nn.Linear(cfg.hidden, cfg.out_features)
        self.init_weights()

    @torch.no_grad()
    def init_weights(self) -> None:
        """Fill every weight with its initial value; also materializes a model
        that was built on the meta device and moved with ``to_empty``."""
        for module in self.modules():
            if isinstance(module, nn.Linear):
                nn.init.normal_(module.weight, mean=0.0, std=0.02)
                nn.init.zeros_(module.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return self.head(x)
