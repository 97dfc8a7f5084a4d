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
model.init_std). Optional slots it fills: ``blocks`` lets recomputation (memory.checkpointing) and
activation offload take the decoder blocks one by one; ``tp_plan`` cuts it for parallel.tp > 1;
``check_config`` refuses what that plan does not do. ``bigtrain check --config gpt2.toml`` compares
its layouts with bigtrain's generic reference of a family of one's own (the model in one plain
process). Everything else is left None: pipeline parallelism, the fused loss, ``bigtrain plan``,
export to Hugging Face and generate say "none for this family" before launch.
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


class MLP(nn.Module):
    def __init__(self, dim: int):
        super().__init__()
        self.c_fc = nn.Linear(dim, 4 * dim)
        self.c_proj = nn.Linear(4 * dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.c_proj(F.gelu(self.c_fc(x), approximate="tanh"))


class Block(nn.Module):
    def __init__(self, dim: int, heads: int, eps: float):
        super().__init__()
        self.ln_1 = nn.LayerNorm(dim, eps=eps)
        self.attn = Attention(dim, heads)
        self.ln_2 = nn.LayerNorm(dim, eps=eps)
        self.mlp = MLP(dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


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


def tp_plan(model: GPT2, tp: int, sequence_parallel: bool, ulysses: bool) -> dict:
    """parallel.tp > 1: Megatron's cut of each MLP (c_fc by columns, c_proj by rows, one all-reduce)
    and of the tied vocabulary (the embedding and the head both, so they stay one weight). Attention
    stays whole on every tp rank: its c_attn holds [q | k | v] in one weight, and a plain column cut
    would give the first rank q and half of k."""
    from bigtrain.parallel.tensor.styles import (ColumnParallel, PrepareInput, RowParallel,
                                                 VocabParallelEmbedding, VocabParallelOutput)

    return {"wte": VocabParallelEmbedding(), "lm_head": VocabParallelOutput(),
            "h.*.mlp.c_fc": [PrepareInput(), ColumnParallel()], "h.*.mlp.c_proj": RowParallel()}


def check_config(cfg) -> list[str]:
    """The family's own rules, run by validation before launch (each naming the field and the fix)."""
    p = cfg.parallel
    if p.tp > 1 and p.sequence_parallel:
        return ["parallel.sequence_parallel = true: the gpt2 family's attention needs the whole sequence and its "
                "tp_plan cuts none; set parallel.sequence_parallel = false"]
    if p.tp > 1 and (4 * cfg.model.dim % p.tp or cfg.model.vocab_size % p.tp):
        return [f"parallel.tp = {p.tp} must divide the MLP's 4 x model.dim = {4 * cfg.model.dim} and "
                f"model.vocab_size = {cfg.model.vocab_size}; use parallel.tp = 2"]
    return []


GPT2_FAMILY = register_family(Family(
    name="gpt2",
    summary="a GPT-2 decoder of one's own (examples/own_family/gpt2_family.py)",
    build_meta=build,
    blocks=lambda model: model.h,  # what recomputation and activation offload take, block by block
    tp_plan=tp_plan,
    check_config=check_config,
))
