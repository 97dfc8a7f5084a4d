"""An independent plain-PyTorch DLRM (nn.EmbeddingBag tables, nn.Linear MLPs, autograd of the plain
interaction formula, torch.optim.AdamW for the dense part and a hand-written row-wise Adagrad / SGD
for the tables), written without bigtrain's model, reference or sparse optimizer: only the initial
values (bigtrain.models.dlrm.init_value, the spec every layout starts from) and the data (the
sampler) are shared. Used by tests/test_dlrm_own_reference.py."""

from __future__ import annotations

import torch
from torch import nn
import torch.nn.functional as F

from bigtrain.core.tables import parse_sizes
from bigtrain.models.dlrm import init_value
from bigtrain.recsys.data import sampler_for


def _mlp(prefix: str, sizes: list[int], last_relu: bool, seed: int) -> nn.Sequential:
    layers = []
    for i, (a, b) in enumerate(zip(sizes[:-1], sizes[1:])):
        lin = nn.Linear(a, b)
        with torch.no_grad():  # bigtrain's Sequential puts a ReLU after every Linear: index 2 i
            lin.weight.copy_(init_value(f"{prefix}.{2 * i}.weight", (b, a), seed))
            lin.bias.copy_(init_value(f"{prefix}.{2 * i}.bias", (b,), seed))
        layers.append(lin)
        if last_relu or i < len(sizes) - 2:
            layers.append(nn.ReLU())
    return nn.Sequential(*layers)


class PlainDLRM:
    """Global-batch steps on one process (micro-batches of train.micro_batch accumulated); the
    config's dense optimizer must be AdamW at a constant lr without clipping (the tests set schedule = constant, warmup 0, grad_clip 0)."""

    def __init__(self, cfg):
        m, e, o, seed = cfg.model, cfg.embedding, cfg.optim, cfg.train.seed
        assert o.name == "adamw" and o.schedule == "constant" and o.warmup_steps == 0 and o.grad_clip == 0
        self.cfg, self.rows, self.dim = cfg, parse_sizes(e.tables), e.dim
        self.bottom = _mlp("bottom", [m.dlrm_dense_features, *parse_sizes(m.dlrm_bottom_mlp), e.dim], True, seed)
        self.tables = []
        for t, r in enumerate(self.rows):
            bag = nn.EmbeddingBag(r, e.dim, mode="sum")
            with torch.no_grad():
                bag.weight.copy_(init_value(f"embeddings.tables.{t}.weight", (r, e.dim), seed))
            self.tables.append(bag)
        f = len(self.rows) + 1
        self.top = _mlp("top", [e.dim + f * (f - 1) // 2, *parse_sizes(m.dlrm_top_mlp), 1], False, seed)
        dense = list(self.bottom.parameters()) + list(self.top.parameters())
        decay = [p for p in dense if p.dim() >= 2]
        no_decay = [p for p in dense if p.dim() < 2]
        self.adam = torch.optim.AdamW([{"params": decay, "weight_decay": o.weight_decay},
                                       {"params": no_decay, "weight_decay": 0.0}],
                                      lr=o.lr, betas=(o.beta1, o.beta2), eps=o.eps)
        self.acc = [torch.zeros(r, dtype=torch.float64) for r in self.rows]
        self.sampler = sampler_for(cfg, self.rows)
        self.step = 0

    def logits(self, dense, ids):
        b = self.bottom(dense)
        pooled = [bag(ids[:, t]) for t, bag in enumerate(self.tables)]
        x = torch.stack([b, *pooled], dim=1)  # [B, F, D]
        gram = x @ x.transpose(1, 2)
        i, j = torch.tril_indices(x.shape[1], x.shape[1], offset=-1)
        return self.top(torch.cat([b, gram[:, i, j]], dim=1)).squeeze(1)

    def train_step(self) -> float:
        g, e = self.cfg.train.global_batch, self.cfg.embedding
        dense, ids, labels = self.sampler.batch(self.step, 0, g)
        for bag in self.tables:
            bag.weight.grad = None
        self.adam.zero_grad(set_to_none=True)
        # Gradient accumulation as a plain loop does it: autograd sums each micro-batch's gradients
        # into .grad (the tables' dense [rows, dim] ones included), one step after the last.
        micro, loss = min(self.cfg.train.micro_batch, g), 0.0
        for first in range(0, g, micro):
            part = slice(first, first + micro)
            piece = F.binary_cross_entropy_with_logits(self.logits(dense[part], ids[part]), labels[part],
                                                       reduction="sum") / g
            piece.backward()
            loss += float(piece.detach())
        self.adam.step()
        with torch.no_grad():
            for t, bag in enumerate(self.tables):
                grad = bag.weight.grad  # dense [rows, dim]: zero on untouched rows
                touched = ids[:, t].reshape(-1).unique()
                gr = grad[touched]
                if e.optimizer == "sgd":
                    bag.weight[touched] -= e.lr * gr
                else:  # row-wise Adagrad, FBGEMM's exact one, in fp64 for the accumulator
                    self.acc[t][touched] += gr.double().pow(2).mean(1)
                    bag.weight[touched] -= (e.lr * gr.double() / (self.acc[t][touched].sqrt() + e.eps)
                                            .unsqueeze(1)).float()
        self.step += 1
        return loss

    def weights(self) -> dict[str, torch.Tensor]:
        out = {f"embeddings.tables.{t}.weight": bag.weight.detach().clone() for t, bag in enumerate(self.tables)}
        for prefix, mod in (("bottom", self.bottom), ("top", self.top)):
            for name, p in mod.named_parameters():
                out[f"{prefix}.{name}"] = p.detach().clone()
        return out
