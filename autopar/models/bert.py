"""Bert: a BERT encoder with its masked-language-model head.

Word, position and token-type embeddings summed and normalised, post-LayerNorm
encoder blocks with bidirectional attention and a GELU feed-forward, then the
MLM head (dense, GELU, LayerNorm, and a decoder that shares the word embedding).
"""

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn


@dataclass(frozen=True)
class BertConfig:
    vocab_size: int
    n_layer: int
    n_head: int
    hidden: int
    intermediate: int
    max_position: int
    type_vocab_size: int = 2
    dropout: float = 0.0
    norm_eps: float = 1e-12

    def __post_init__(self):
        if self.hidden % self.n_head:
            raise ValueError(
                f"BertConfig: hidden={self.hidden} must be divisible by n_head={self.n_head}."
            )


class SelfAttention(nn.Module):
    def __init__(self, cfg: BertConfig):
        super().__init__()
        self.n_head = cfg.n_head
        self.hidden = cfg.hidden
        self.head_dim = cfg.hidden // cfg.n_head
        self.dropout = cfg.dropout
        self.query = nn.Linear(cfg.hidden, cfg.hidden)
        self.key = nn.Linear(cfg.hidden, cfg.hidden)
        self.value = nn.Linear(cfg.hidden, cfg.hidden)
        self.output = nn.Linear(cfg.hidden, cfg.hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T = x.size(0), x.size(1)
        q = self.query(x).view(B, T, self.n_head, self.head_dim).transpose(1, 2)
        k = self.key(x).view(B, T, self.n_head, self.head_dim).transpose(1, 2)
        v = self.value(x).view(B, T, self.n_head, self.head_dim).transpose(1, 2)
        y = F.scaled_dot_product_attention(
            q, k, v, dropout_p=self.dropout if self.training else 0.0
        )
        return self.output(y.transpose(1, 2).reshape(B, T, self.hidden))


class Block(nn.Module):
    def __init__(self, cfg: BertConfig):
        super().__init__()
        self.attention = SelfAttention(cfg)
        self.attention_dropout = nn.Dropout(cfg.dropout)
        self.attention_norm = nn.LayerNorm(cfg.hidden, eps=cfg.norm_eps)
        self.intermediate = nn.Linear(cfg.hidden, cfg.intermediate)
        self.gelu = nn.GELU()
        self.output = nn.Linear(cfg.intermediate, cfg.hidden)
        self.output_dropout = nn.Dropout(cfg.dropout)
        self.output_norm = nn.LayerNorm(cfg.hidden, eps=cfg.norm_eps)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Post-LN, as in the original BERT: normalise after each residual sum.
        x = self.attention_norm(x + self.attention_dropout(self.attention(x)))
        h = self.output(self.gelu(self.intermediate(x)))
        return self.output_norm(x + self.output_dropout(h))


class Bert(nn.Module):
    """forward(input_ids: long [B, T]) -> MLM logits [B, T, vocab_size].

    Every token gets token type 0: single-segment inputs are what planning needs.
    """

    def __init__(self, cfg: BertConfig):
        super().__init__()
        self.config = cfg
        self.word_embeddings = nn.Embedding(cfg.vocab_size, cfg.hidden)
        self.position_embeddings = nn.Embedding(cfg.max_position, cfg.hidden)
        self.token_type_embeddings = nn.Embedding(cfg.type_vocab_size, cfg.hidden)
        self.embedding_norm = nn.LayerNorm(cfg.hidden, eps=cfg.norm_eps)
        self.embedding_dropout = nn.Dropout(cfg.dropout)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layer))
        self.mlm_dense = nn.Linear(cfg.hidden, cfg.hidden)
        self.mlm_gelu = nn.GELU()
        self.mlm_norm = nn.LayerNorm(cfg.hidden, eps=cfg.norm_eps)
        # The decoder reuses the word embedding as its weight but keeps a bias of its own.
        self.mlm_decoder = nn.Linear(cfg.hidden, cfg.vocab_size)
        self.mlm_decoder.weight = self.word_embeddings.weight
        self.init_weights()

    @torch.no_grad()
    def init_weights(self) -> None:
        """Fill every weight with its initial value; also materializes a model
        that was built on the meta device and moved with ``to_empty``."""
        # to_empty() gives each module a parameter of its own, which breaks the tie.
        self.mlm_decoder.weight = self.word_embeddings.weight
        for module in self.modules():
            if isinstance(module, (nn.Linear, nn.Embedding)):
                nn.init.normal_(module.weight, mean=0.0, std=0.02)
            if isinstance(module, nn.LayerNorm):
                nn.init.ones_(module.weight)
            if isinstance(module, (nn.Linear, nn.LayerNorm)) and module.bias is not None:
                nn.init.zeros_(module.bias)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        pos = torch.arange(input_ids.size(1), device=input_ids.device)
        token_type = torch.zeros_like(input_ids)
        x = (
            self.word_embeddings(input_ids)
            + self.position_embeddings(pos)
            + self.token_type_embeddings(token_type)
        )
        x = self.embedding_dropout(self.embedding_norm(x))
        for block in self.blocks:
            x = block(x)
        x = self.mlm_norm(self.mlm_gelu(self.mlm_dense(x)))
        return self.mlm_decoder(x)
