"""A small GPT-style byte-level language model (pre-norm transformer, tied embeddings).

Deliberately plain (GPT-2 layout, ``scaled_dot_product_attention``): the benchmark compares
optimizers, so the model only has to be a realistic mix of parameter shapes — large matrices
that get quantized state and small biases/norms that keep fp32 state.
"""

from dataclasses import asdict, dataclass

import torch
import torch.nn.functional as F
import torch.utils.checkpoint
from torch import nn

from lowbit_optim.bench.data import VOCAB_SIZE


@dataclass(frozen=True)
class ModelConfig:
    d_model: int
    n_layers: int
    n_heads: int
    context: int
    # Recompute each block's activations during backward instead of keeping them (what
    # large-model training does to fit memory): only the blocks' inputs stay alive.
    activation_checkpointing: bool = False

    def as_dict(self) -> dict:
        return asdict(self)


class Block(nn.Module):
    def __init__(self, config: ModelConfig):
        super().__init__()
        self.n_heads = config.n_heads
        self.norm1 = nn.LayerNorm(config.d_model)
        self.qkv = nn.Linear(config.d_model, 3 * config.d_model)
        self.proj = nn.Linear(config.d_model, config.d_model)
        self.norm2 = nn.LayerNorm(config.d_model)
        self.fc = nn.Linear(config.d_model, 4 * config.d_model)
        self.fc_out = nn.Linear(4 * config.d_model, config.d_model)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, length, width = x.shape
        q, k, v = self.qkv(self.norm1(x)).split(width, dim=-1)
        q, k, v = (t.view(batch, length, self.n_heads, -1).transpose(1, 2) for t in (q, k, v))
        attended = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(attended.transpose(1, 2).reshape(batch, length, width))
        return x + self.fc_out(F.gelu(self.fc(self.norm2(x))))


class ByteGPT(nn.Module):
    def __init__(self, config: ModelConfig):
        super().__init__()
        if config.d_model % config.n_heads:
            raise ValueError(f"d_model={config.d_model} is not divisible by n_heads={config.n_heads}")
        self.config = config
        self.token_embedding = nn.Embedding(VOCAB_SIZE, config.d_model)
        self.position_embedding = nn.Embedding(config.context, config.d_model)
        self.blocks = nn.ModuleList(Block(config) for _ in range(config.n_layers))
        self.norm = nn.LayerNorm(config.d_model)
        self.apply(self._init_weights)
        # GPT-2: scale the residual projections by 1/sqrt(2 * layers) so depth does not
        # inflate the residual stream at initialisation.
        for block in self.blocks:
            for layer in (block.proj, block.fc_out):
                nn.init.normal_(layer.weight, std=0.02 / (2 * config.n_layers) ** 0.5)

    @staticmethod
    def _init_weights(module: nn.Module) -> None:
        if isinstance(module, (nn.Linear, nn.Embedding)):
            nn.init.normal_(module.weight, std=0.02)
        if isinstance(module, nn.Linear) and module.bias is not None:
            nn.init.zeros_(module.bias)

    def forward(self, tokens: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """Mean next-byte cross-entropy (nats)."""
        positions = torch.arange(tokens.shape[1], device=tokens.device)
        x = self.token_embedding(tokens) + self.position_embedding(positions)
        for block in self.blocks:
            if self.config.activation_checkpointing and torch.is_grad_enabled():
                x = torch.utils.checkpoint.checkpoint(block, x, use_reentrant=False)
            else:
                x = block(x)
        # Output head tied to the token embedding (GPT-2).
        logits = self.norm(x) @ self.token_embedding.weight.T
        return F.cross_entropy(logits.flatten(0, 1), targets.flatten())
