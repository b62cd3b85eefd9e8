"""ViT: a Vision Transformer image classifier.

The image is cut into patches by a strided convolution, a learned class token is
prepended, learned position embeddings are added, and pre-LayerNorm encoder
blocks run over the sequence. The classifier reads the class token.
"""

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn


@dataclass(frozen=True)
class ViTConfig:
    image_size: int
    patch_size: int
    n_layer: int
    n_head: int
    hidden: int
    mlp_dim: int
    num_classes: int
    channels: int = 3
    dropout: float = 0.0

    def __post_init__(self):
        if self.image_size % self.patch_size:
            raise ValueError(
                f"ViTConfig: image_size={self.image_size} must be divisible by "
                f"patch_size={self.patch_size}."
            )
        if self.hidden % self.n_head:
            raise ValueError(
                f"ViTConfig: hidden={self.hidden} must be divisible by n_head={self.n_head}."
            )

    @property
    def n_patches(self) -> int:
        return (self.image_size // self.patch_size) ** 2


class SelfAttention(nn.Module):
    def __init__(self, cfg: ViTConfig):
        super().__init__()
        self.n_head = cfg.n_head
        self.hidden = cfg.hidden
        self.head_dim = cfg.hidden // cfg.n_head
        self.dropout = cfg.dropout
        self.qkv = nn.Linear(cfg.hidden, 3 * cfg.hidden)
        self.proj = nn.Linear(cfg.hidden, cfg.hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T = x.size(0), x.size(1)
        q, k, v = self.qkv(x).split(self.hidden, dim=2)
        q = q.view(B, T, self.n_head, self.head_dim).transpose(1, 2)
        k = k.view(B, T, self.n_head, self.head_dim).transpose(1, 2)
        v = v.view(B, T, self.n_head, self.head_dim).transpose(1, 2)
        y = F.scaled_dot_product_attention(
            q, k, v, dropout_p=self.dropout if self.training else 0.0
        )
        return self.proj(y.transpose(1, 2).reshape(B, T, self.hidden))


class FeedForward(nn.Module):
    def __init__(self, cfg: ViTConfig):
        super().__init__()
        self.fc1 = nn.Linear(cfg.hidden, cfg.mlp_dim)
        self.gelu = nn.GELU()
        self.fc2 = nn.Linear(cfg.mlp_dim, cfg.hidden)
        self.dropout = nn.Dropout(cfg.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.dropout(self.fc2(self.gelu(self.fc1(x))))


class Block(nn.Module):
    def __init__(self, cfg: ViTConfig):
        super().__init__()
        self.norm1 = nn.LayerNorm(cfg.hidden, eps=1e-6)
        self.attn = SelfAttention(cfg)
        self.attn_dropout = nn.Dropout(cfg.dropout)
        self.norm2 = nn.LayerNorm(cfg.hidden, eps=1e-6)
        self.mlp = FeedForward(cfg)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn_dropout(self.attn(self.norm1(x)))
        return x + self.mlp(self.norm2(x))


class ViT(nn.Module):
    """forward(images: float [B, channels, image_size, image_size]) -> logits [B, num_classes]."""

    def __init__(self, cfg: ViTConfig):
        super().__init__()
        self.config = cfg
        self.patch_embed = nn.Conv2d(
            cfg.channels, cfg.hidden, kernel_size=cfg.patch_size, stride=cfg.patch_size
        )
        self.cls_token = nn.Parameter(torch.empty(1, 1, cfg.hidden))
        self.pos_embed = nn.Parameter(torch.empty(1, cfg.n_patches + 1, cfg.hidden))
        self.drop = nn.Dropout(cfg.dropout)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layer))
        self.norm = nn.LayerNorm(cfg.hidden, eps=1e-6)
        self.head = nn.Linear(cfg.hidden, cfg.num_classes)
        self.init_weights()

    @torch.no_grad()
    def init_weights(self) -> None:
        """Fill every weight with its initial value; also materializes a model
        that was built on the meta device and moved with ``to_empty``."""
        nn.init.normal_(self.cls_token, mean=0.0, std=0.02)
        nn.init.normal_(self.pos_embed, mean=0.0, std=0.02)
        for module in self.modules():
            if isinstance(module, (nn.Linear, nn.Conv2d)):
                nn.init.normal_(module.weight, mean=0.0, std=0.02)
                nn.init.zeros_(module.bias)
            if isinstance(module, nn.LayerNorm):
                nn.init.ones_(module.weight)
                nn.init.zeros_(module.bias)

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        x = self.patch_embed(images).flatten(2).transpose(1, 2)  # [B, n_patches, hidden]
        cls = self.cls_token.expand(x.size(0), -1, -1)
        x = self.drop(torch.cat((cls, x), dim=1) + self.pos_embed)
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x[:, 0]))
