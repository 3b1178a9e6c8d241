"""A GPT-2/GPT-3 style decoder-only transformer, written plainly so its aten graph is easy to plan.

Layout (parameter names in brackets):
  tokens (b, s) int64 -> wte (vocab, h) [wte.weight] + wpe (seq, h) [wpe.weight]
  blocks.{i}: x = x + attn(ln_1(x)); x = x + mlp(ln_2(x))    (pre-LayerNorm)
    attn: separate q_proj, k_proj, v_proj, out_proj, each Linear(h, h) with bias; causal SDPA
    mlp:  fc_in Linear(h, 4h) -> exact GELU -> fc_out Linear(4h, h)
  ln_f, then logits = x @ wte.weight.T (LM head tied to the embedding)
No dropout, so a forward pass is a pure function of parameters and tokens.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from meshplan.zoo.checks import check_positive_ints

# GPT-2/GPT-3 initialise weights with N(0, 0.02); the PyTorch default N(0, 1) embedding would make
# tied-head logits of std ~sqrt(hidden) and a first loss far above log(vocab).
_INIT_STD = 0.02


@dataclass(frozen=True)
class GPTConfig:
    """Sizes of a GPT. ``hidden`` must be divisible by ``num_heads``; every field is an int >= 1.

    Raises TypeError for a non-int field, ValueError for a field < 1 or indivisible heads.
    """

    hidden: int
    num_layers: int
    num_heads: int
    seq_len: int
    vocab_size: int
    # False: attention as Megatron-LM and Alpa ran it in 2021, the (seq, seq) scores and
    # probabilities materialized per head (`Attention`); True: PyTorch's fused SDPA.
    flash: bool = True

    def __post_init__(self) -> None:
        check_positive_ints(self, skip=frozenset({"flash"}))
        if self.hidden % self.num_heads != 0:
            raise ValueError(
                f"GPTConfig.hidden={self.hidden} is not divisible by num_heads={self.num_heads}; "
                f"choose num_heads among the divisors of hidden"
            )

    @property
    def head_dim(self) -> int:
        """Width of one attention head: hidden // num_heads."""
        return self.hidden // self.num_heads


class Attention(nn.Module):
    """Multi-head self-attention over (batch, seq, hidden); causal unless ``causal=False``.

    ``hidden`` must be divisible by ``num_heads`` (checked by the configs that build it).
    With ``seq_len`` the scores are computed explicitly — softmax(q kᵀ / √d, the pairs above
    the diagonal masked to -inf) v, at the product's dtype (half under autocast, as
    Megatron-LM's fused softmax outputs) — instead of by the fused
    `scaled_dot_product_attention`: the same values, with the (seq, seq) scores and
    probabilities of every head kept for backward.
    """

    def __init__(self, hidden: int, num_heads: int, *, causal: bool = True,
                 seq_len: int | None = None) -> None:
        super().__init__()
        h = hidden
        self.num_heads = num_heads
        self.causal = causal
        self.explicit = seq_len is not None
        if self.explicit:
            hidden_pairs = torch.ones(seq_len, seq_len, dtype=torch.bool).triu(1) if causal \
                else torch.zeros(seq_len, seq_len, dtype=torch.bool)
            self.register_buffer("mask", hidden_pairs, persistent=False)
        self.q_proj = nn.Linear(h, h)
        self.k_proj = nn.Linear(h, h)
        self.v_proj = nn.Linear(h, h)
        self.out_proj = nn.Linear(h, h)

    def _split_heads(self, x: Tensor) -> Tensor:
        b, s, h = x.shape
        return x.view(b, s, self.num_heads, h // self.num_heads).transpose(1, 2)

    def forward(self, x: Tensor) -> Tensor:
        """Attend within each sequence; ``x`` and the result are (batch, seq, hidden)."""
        b, s, h = x.shape
        q = self._split_heads(self.q_proj(x))
        k = self._split_heads(self.k_proj(x))
        v = self._split_heads(self.v_proj(x))
        if self.explicit:
            scores = (q @ k.transpose(-2, -1) * (q.shape[-1] ** -0.5)).masked_fill(
                self.mask[:s, :s], float("-inf"))
            y = scores.softmax(-1) @ v
        else:
            y = F.scaled_dot_product_attention(q, k, v, is_causal=self.causal)
        return self.out_proj(y.transpose(1, 2).reshape(b, s, h))


class FeedForward(nn.Module):
    """fc_in (h -> 4h), exact GELU, fc_out (4h -> h) over (batch, seq, hidden)."""

    def __init__(self, hidden: int) -> None:
        super().__init__()
        self.fc_in = nn.Linear(hidden, 4 * hidden)
        self.fc_out = nn.Linear(4 * hidden, hidden)

    def forward(self, x: Tensor) -> Tensor:
        """Apply the two projections with GELU between; shape preserved."""
        return self.fc_out(F.gelu(self.fc_in(x)))


class Block(nn.Module):
    """One pre-LayerNorm transformer block: residual attention, then residual MLP.

    ``causal=False`` gives the bidirectional encoder block used by the ViT.
    """

    def __init__(self, hidden: int, num_heads: int, *, causal: bool = True,
                 seq_len: int | None = None) -> None:
        super().__init__()
        self.ln_1 = nn.LayerNorm(hidden)
        self.attn = Attention(hidden, num_heads, causal=causal, seq_len=seq_len)
        self.ln_2 = nn.LayerNorm(hidden)
        self.mlp = FeedForward(hidden)

    def forward(self, x: Tensor) -> Tensor:
        """``x`` and the result are (batch, seq, hidden)."""
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


def init_weights(root: nn.Module) -> None:
    """Initialise every Linear and Embedding under ``root`` in place as GPT-2 does: N(0, 0.02).

    LayerNorms keep their default (weight 1, bias 0). Linear biases are small random values rather
    than GPT-2's zeros: the key bias gets a zero gradient in exact arithmetic (softmax is
    shift-invariant), and a zero-initialized tensor that only collects rounding noise has no scale
    to compare parallel runs against. Other parameters are left to their owners.
    """
    for module in root.modules():
        if isinstance(module, (nn.Linear, nn.Embedding)):
            nn.init.normal_(module.weight, mean=0.0, std=_INIT_STD)
        if isinstance(module, nn.Linear) and module.bias is not None:
            nn.init.normal_(module.bias, mean=0.0, std=_INIT_STD)


class GPT(nn.Module):
    """Decoder-only transformer mapping tokens (batch, seq) int64 to logits (batch, seq, vocab).

    Raises TypeError if ``config`` is not a GPTConfig.
    """

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        if not isinstance(config, GPTConfig):
            raise TypeError(f"GPT expects a GPTConfig, got {type(config).__name__}")
        self.config = config
        self.wte = nn.Embedding(config.vocab_size, config.hidden)
        self.wpe = nn.Embedding(config.seq_len, config.hidden)
        explicit = None if config.flash else config.seq_len
        self.blocks = nn.ModuleList(Block(config.hidden, config.num_heads, seq_len=explicit)
                                    for _ in range(config.num_layers))
        self.ln_f = nn.LayerNorm(config.hidden)
        init_weights(self)

    def forward(self, tokens: Tensor) -> Tensor:
        """Return logits (batch, seq, vocab) for int64 ``tokens`` (batch, seq).

        Raises ValueError if ``tokens`` is not 2-D or seq exceeds ``config.seq_len``.
        """
        if tokens.dim() != 2:
            raise ValueError(f"GPT expects tokens of shape (batch, seq), got {tuple(tokens.shape)}")
        seq = tokens.shape[1]
        if seq > self.config.seq_len:
            raise ValueError(f"sequence length {seq} exceeds GPTConfig.seq_len={self.config.seq_len}")
        x = self.wte(tokens) + self.wpe.weight[:seq]
        for block in self.blocks:
            x = block(x)
        return F.linear(self.ln_f(x), self.wte.weight)


def gpt_loss(logits: Tensor, target: Tensor) -> Tensor:
    """Mean token cross-entropy of ``logits`` (batch, seq, vocab) against int64 ``target`` (batch, seq)."""
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), target.reshape(-1))


def num_params(config: GPTConfig) -> int:
    """Number of scalar parameters of ``GPT(config)``, counting the tied embedding once.

    Per block: 4 (h*h + h) attention + 8h^2 + 5h MLP + 4h LayerNorm = 12h^2 + 13h.
    """
    h = config.hidden
    embeddings = (config.vocab_size + config.seq_len) * h
    per_block = 12 * h * h + 13 * h
    return embeddings + config.num_layers * per_block + 2 * h


def make_example_batch(
    config: GPTConfig, batch: int, *, device: str, generator: torch.Generator
) -> tuple[tuple[Tensor], Tensor]:
    """Return ``((tokens,), target)``, int64 (batch, seq_len), uniform in [0, vocab_size).

    On device "meta" the tensors have shapes only; elsewhere they are drawn from ``generator``.
    Raises TypeError/ValueError if ``batch`` is not a positive int.
    """
    if not isinstance(batch, int) or isinstance(batch, bool):
        raise TypeError(f"batch must be an int, got {batch!r}")
    if batch < 1:
        raise ValueError(f"batch must be >= 1, got {batch}")
    shape = (batch, config.seq_len)
    tokens = torch.randint(0, config.vocab_size, shape, generator=generator, device=device)
    target = torch.randint(0, config.vocab_size, shape, generator=generator, device=device)
    return (tokens,), target
