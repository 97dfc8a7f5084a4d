"""A family of your own: a small GPT-2 (learned positions, LayerNorm, GELU, a tied head),
registered as ``model.family = "gpt2"`` and trained by ``bigtrain train`` like a built-in model.

    cd examples/own_family
    bigtrain train --config gpt2.toml                # dp 2 x ZeRO-2 through bigtrain's launcher
    torchrun --nproc-per-node 2 -m bigtrain train --config gpt2.toml

``gpt2.toml`` names this module in ``model.family_module = "gpt2_family"``: bigtrain imports it
before it validates the config, in the launcher and in every rank, and the import registers the
family. The module must be importable from the working directory (or sys.path).

What the family gives (docs/families.md, "A family of your own"): a name, a line for help texts,
and the model on the meta device from the config (bigtrain materializes each rank's part and
initializes it by (seed, name): LayerNorm weights one, biases zero, other weights normal with
model.init_std). ``blocks`` lets recomputation (memory.checkpointing) and activation offload take
the decoder blocks one by one. Everything else is left None: tensor or pipeline parallelism, the
fused loss, ``bigtrain plan``, ``bigtrain check``, export to Hugging Face and generate say "none for
this family" before launch.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from bigtrain.families import Family, register_family


class Attention(nn.Module):
    def __init__(self, dim: int, heads: int):
        super().__init__()
        self.heads = heads
        self.c_attn = nn.Linear(dim, 3 * dim)  # q, k and v in one projection, as GPT-2's
        self.c_proj = nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = (part.view(b, t, self.heads, d // self.heads).transpose(1, 2)
                   for part in self.c_attn(x).split(d, dim=-1))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.c_proj(y.transpose(1, 2).reshape(b, t, d))


class Block(nn.Module):
    def __init__(self, dim: int, heads: int, eps: float):
        super().__init__()
        self.ln_1 = nn.LayerNorm(dim, eps=eps)
        self.attn = Attention(dim, heads)
        self.ln_2 = nn.LayerNorm(dim, eps=eps)
        self.c_fc = nn.Linear(dim, 4 * dim)
        self.c_proj = nn.Linear(4 * dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))
        return x + self.c_proj(F.gelu(self.c_fc(self.ln_2(x)), approximate="tanh"))


class GPT2(nn.Module):
    """tokens (batch, seq) -> logits (batch, seq, vocab): what the Trainer's decoder step calls."""

    def __init__(self, vocab: int, positions: int, dim: int, layers: int, heads: int, eps: float = 1e-5):
        super().__init__()
        self.wte = nn.Embedding(vocab, dim)
        self.wpe = nn.Embedding(positions, dim)
        self.h = nn.ModuleList(Block(dim, heads, eps) for _ in range(layers))
        self.ln_f = nn.LayerNorm(dim, eps=eps)
        self.lm_head = nn.Linear(dim, vocab, bias=False)
        self.lm_head.weight = self.wte.weight  # tied

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        positions = torch.arange(tokens.shape[1], device=tokens.device)
        x = self.wte(tokens) + self.wpe(positions)
        for block in self.h:
            x = block(x)
        return self.lm_head(self.ln_f(x))


def build(cfg, device: str | torch.device = "meta") -> GPT2:
    """The model the [model] fields describe (vocab_size, max_seq_len, dim, n_layers, n_heads, norm_eps)."""
    m = cfg.model
    with torch.device(device):
        return GPT2(m.vocab_size, m.max_seq_len, m.dim, m.n_layers, m.n_heads, m.norm_eps)


GPT2_FAMILY = register_family(Family(
    name="gpt2",
    summary="a GPT-2 decoder of one's own (examples/own_family/gpt2_family.py)",
    build_meta=build,
    blocks=lambda model: model.h,  # what recomputation and activation offload take, block by block
))
