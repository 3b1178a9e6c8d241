"""GShard MoE transformer (Alpa's MoE suite): the GPT with every other FFN a mixture of experts.

Layout (parameter names in brackets), otherwise exactly the GPT of ``meshplan.zoo.gpt``:
  tokens (b, s) -> wte [wte.weight] + wpe [wpe.weight]
  blocks.{i} for even i: the GPT block (ln_1, attn.{q,k,v,out}_proj, ln_2, mlp.fc_in/fc_out)
  blocks.{i} for odd i:  ln_1, attn, ln_2, then moe.{wg, w_in, b_in, w_out, b_out} — a top-2
                         MoELayer with expert FFN width ``expert_ffn * hidden``
  ln_f, logits = x @ wte.weight.T (tied LM head); loss: plain token cross-entropy (no auxiliary
  load-balancing loss, so the loss is easy to verify against a reference)
Each sequence is one routing group (G = batch, T = seq): capacity is counted per sequence, so a
batch split never moves a group across devices and drops exactly the tokens one device drops.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, fields

import torch.nn.functional as F
from torch import Tensor, nn

from meshplan.zoo import gpt
from meshplan.zoo.moe_layer import MoELayer, moe_layer_params

_FLOAT_FIELDS = frozenset({"capacity"})


@dataclass(frozen=True)
class MoEConfig:
    """Sizes of an MoE transformer. ``capacity`` is GShard's capacity factor (a float > 0); every
    other field is an int >= 1 and ``hidden`` must be divisible by ``num_heads``.

    Raises TypeError for a field of the wrong type, ValueError for a value out of range.
    """

    hidden: int
    num_layers: int
    num_heads: int
    num_experts: int
    seq_len: int
    vocab_size: int
    capacity: float = 2.0
    expert_ffn: int = 8

    def __post_init__(self) -> None:
        for f in fields(self):
            value = getattr(self, f.name)
            if f.name in _FLOAT_FIELDS:
                if isinstance(value, bool) or not isinstance(value, (int, float)):
                    raise TypeError(f"MoEConfig.{f.name} must be a number, got {value!r}")
                if not (math.isfinite(value) and value > 0):
                    raise ValueError(f"MoEConfig.{f.name} must be a finite number > 0, got {value}")
                continue
            if not isinstance(value, int) or isinstance(value, bool):
                raise TypeError(f"MoEConfig.{f.name} must be an int, got {value!r}")
            if value < 1:
                raise ValueError(f"MoEConfig.{f.name} must be >= 1, got {value}")
        if self.hidden % self.num_heads != 0:
            raise ValueError(
                f"MoEConfig.hidden={self.hidden} is not divisible by num_heads={self.num_heads}; "
                f"choose num_heads among the divisors of hidden"
            )

    @property
    def dense(self) -> gpt.GPTConfig:
        """The GPT of the same sizes (its blocks are the MoE model's even blocks)."""
        return gpt.GPTConfig(self.hidden, self.num_layers, self.num_heads, self.seq_len, self.vocab_size)

    @staticmethod
    def is_moe_layer(index: int) -> bool:
        """True for blocks 1, 3, 5, ... (counting from 0): every other block is an MoE block."""
        return index % 2 == 1


class MoEBlock(nn.Module):
    """A pre-LayerNorm block whose FFN is an MoE layer, over (batch, seq, hidden)."""

    def __init__(self, config: MoEConfig) -> None:
        super().__init__()
        h = config.hidden
        self.ln_1 = nn.LayerNorm(h)
        self.attn = gpt.Attention(h, config.num_heads)
        self.ln_2 = nn.LayerNorm(h)
        self.moe = MoELayer(h, config.expert_ffn * h, config.num_experts, config.capacity)

    def forward(self, x: Tensor) -> Tensor:
        """``x`` and the result are (batch, seq, hidden); each sequence is one routing group."""
        x = x + self.attn(self.ln_1(x))
        return x + self.moe(self.ln_2(x))


class MoETransformer(nn.Module):
    """Decoder-only MoE transformer mapping tokens (batch, seq) int64 to logits (batch, seq, vocab).

    Raises TypeError if ``config`` is not an MoEConfig.
    """

    def __init__(self, config: MoEConfig) -> None:
        super().__init__()
        if not isinstance(config, MoEConfig):
            raise TypeError(f"MoETransformer expects an MoEConfig, got {type(config).__name__}")
        self.config = config
        self.wte = nn.Embedding(config.vocab_size, config.hidden)
        self.wpe = nn.Embedding(config.seq_len, config.hidden)
        self.blocks = nn.ModuleList(
            MoEBlock(config) if config.is_moe_layer(i) else gpt.Block(config.hidden, config.num_heads)
            for i in range(config.num_layers)
        )
        self.ln_f = nn.LayerNorm(config.hidden)
        gpt.init_weights(self)  # MoE layers drew their own N(0, 0.02) at construction

    def forward(self, tokens: Tensor) -> Tensor:
        """Return logits (batch, seq, vocab) for int64 ``tokens`` (batch, seq).

        Raises ValueError if ``tokens`` is not 2-D or seq exceeds ``config.seq_len``.
        """
        if tokens.dim() != 2:
            raise ValueError(f"MoETransformer expects tokens of shape (batch, seq), got {tuple(tokens.shape)}")
        seq = tokens.shape[1]
        if seq > self.config.seq_len:
            raise ValueError(f"sequence length {seq} exceeds MoEConfig.seq_len={self.config.seq_len}")
        x = self.wte(tokens) + self.wpe.weight[:seq]
        for block in self.blocks:
            x = block(x)
        return F.linear(self.ln_f(x), self.wte.weight)


def num_params(config: MoEConfig) -> int:
    """Scalar parameters of ``MoETransformer(config)``, counting the tied embedding once.

    Dense block 12h^2 + 13h (as the GPT); MoE block 4h^2 + 8h (attention, LayerNorms) plus the MoE
    layer h*E + E*(2*h*H + H + h) with H = expert_ffn * h.
    """
    h = config.hidden
    num_moe = sum(config.is_moe_layer(i) for i in range(config.num_layers))
    dense = (config.num_layers - num_moe) * (12 * h * h + 13 * h)
    moe = num_moe * (4 * h * h + 8 * h + moe_layer_params(h, config.expert_ffn * h, config.num_experts))
    return (config.vocab_size + config.seq_len) * h + dense + moe + 2 * h
