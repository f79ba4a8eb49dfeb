"""A Megatron-LM-style GPT in plain torch: the large transformer the planner is meant to fit into a budget.

Written here rather than taken from Megatron so the graph is plain ``torch.nn`` (no tensor-parallel layers,
no fused CUDA kernels) and traces on any device, including meta. The structure follows Megatron's GPT:
learned position embeddings, pre-LayerNorm blocks with one fused QKV Linear, scaled-dot-product attention
with a causal mask, a 4x GELU MLP, a final LayerNorm and an LM head tied to the word embedding by default.
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from karma_fx.zoo._common import Request, ZooError, heads_for, positive_int, tokens


class SelfAttention(nn.Module):
    """Causal self-attention with a fused QKV projection laid out per head ([.., heads, 3, head_dim]) as
    Megatron does, so one GEMM produces q, k and v."""

    def __init__(self, hidden: int, heads: int, dropout: float) -> None:
        super().__init__()
        self.heads = heads
        self.head_dim = hidden // heads
        self.qkv = nn.Linear(hidden, 3 * hidden)
        self.dense = nn.Linear(hidden, hidden)
        self.attn_dropout = dropout

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, h = x.shape
        qkv = self.qkv(x).view(b, s, self.heads, 3, self.head_dim)
        q, k, v = qkv.permute(3, 0, 2, 1, 4).unbind(0)  # each [b, heads, s, head_dim]
        p = self.attn_dropout if self.training else 0.0
        ctx = F.scaled_dot_product_attention(q, k, v, dropout_p=p, is_causal=True)
        return self.dense(ctx.transpose(1, 2).reshape(b, s, h))


class MLP(nn.Module):
    """h -> 4h -> h with tanh-approximated GELU (Megatron's fused bias-GELU computes the same function)."""

    def __init__(self, hidden: int) -> None:
        super().__init__()
        self.fc1 = nn.Linear(hidden, 4 * hidden)
        self.fc2 = nn.Linear(4 * hidden, hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(F.gelu(self.fc1(x), approximate="tanh"))


class TransformerLayer(nn.Module):
    """Pre-LN block: x + drop(attn(ln(x))), then x + drop(mlp(ln(x)))."""

    def __init__(self, hidden: int, heads: int, dropout: float) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(hidden)
        self.attn = SelfAttention(hidden, heads, dropout)
        self.ln2 = nn.LayerNorm(hidden)
        self.mlp = MLP(hidden)
        self.drop = nn.Dropout(dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.drop(self.attn(self.ln1(x)))
        return x + self.drop(self.mlp(self.ln2(x)))


class MegatronGPT(nn.Module):
    """GPT language model. ``forward(input_ids, labels=None)`` returns the mean cross-entropy when labels are
    given (labels are already shifted, as Megatron's data loader provides them) and logits otherwise."""

    def __init__(
        self,
        *,
        vocab: int,
        hidden: int,
        layers: int,
        heads: int,
        max_positions: int,
        dropout: float = 0.1,
        tie_embeddings: bool = True,
    ) -> None:
        super().__init__()
        self.vocab = vocab
        self.max_positions = max_positions
        self.word_emb = nn.Embedding(vocab, hidden)
        self.pos_emb = nn.Embedding(max_positions, hidden)
        self.emb_drop = nn.Dropout(dropout)
        self.layers = nn.ModuleList(TransformerLayer(hidden, heads, dropout) for _ in range(layers))
        self.final_ln = nn.LayerNorm(hidden)
        self.lm_head: nn.Linear | None = None if tie_embeddings else nn.Linear(hidden, vocab, bias=False)
        self._init(layers)

    def _init(self, layers: int) -> None:
        """Megatron's init: N(0, 0.02) everywhere, output projections of each block scaled by 1/sqrt(2L) so
        the residual stream's variance does not grow with depth."""
        std, out_std = 0.02, 0.02 / math.sqrt(2.0 * layers)
        for name, p in self.named_parameters():
            if p.dim() < 2:
                if name.endswith("bias"):
                    nn.init.zeros_(p)
                continue
            is_out = name.endswith("attn.dense.weight") or name.endswith("mlp.fc2.weight")
            nn.init.normal_(p, 0.0, out_std if is_out else std)

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor | None = None) -> torch.Tensor:
        s = input_ids.shape[1]
        pos = torch.arange(s, device=input_ids.device)
        x = self.emb_drop(self.word_emb(input_ids) + self.pos_emb(pos))
        for layer in self.layers:
            x = layer(x)
        x = self.final_ln(x)
        weight = self.word_emb.weight if self.lm_head is None else self.lm_head.weight
        logits = F.linear(x, weight)
        if labels is None:
            return logits
        return F.cross_entropy(logits.float().view(-1, self.vocab), labels.view(-1))


def build_megatron_gpt(req: Request) -> tuple[nn.Module, tuple, dict]:
    """Real: hidden 1600, 48 layers, 25 heads (head dim 64), vocab 50257, 1024 positions, tied LM head
    (about 1.56B parameters, the GPT-2 1.5B shape Megatron-LM trains). Tiny: hidden 64, 2 layers, 4 heads,
    vocab 256.

    Overrides: ``layers``, ``hidden`` (heads then follow head dim 64 real / 16 tiny unless ``heads`` is
    given), ``heads``, ``vocab``, ``dropout`` (default 0.1), ``tie_embeddings`` (default True).
    Position table = max(default, seq) so a longer ``seq`` never indexes past it.
    """
    layers = positive_int("layers", req.opt("layers", 2 if req.tiny else 48))
    hidden = positive_int("hidden", req.opt("hidden", 64 if req.tiny else 1600))
    default_heads = None if "hidden" in req.overrides else (4 if req.tiny else 25)
    heads = heads_for(hidden, req.opt("heads", default_heads), 16 if req.tiny else 64)
    vocab = positive_int("vocab", req.opt("vocab", 256 if req.tiny else 50257))
    dropout = float(req.opt("dropout", 0.1))
    if not 0.0 <= dropout < 1.0:
        raise ZooError(f"dropout must be in [0, 1), got {dropout}")
    assert req.seq is not None
    model = MegatronGPT(
        vocab=vocab,
        hidden=hidden,
        layers=layers,
        heads=heads,
        max_positions=max(64 if req.tiny else 1024, req.seq),
        dropout=dropout,
        tie_embeddings=bool(req.opt("tie_embeddings", True)),
    )
    return model, (tokens(req, vocab), tokens(req, vocab)), {}
