"""Capacity top-k routing shared by routed families (MoD; MoDE later): router, selection, aux targets, predictor.

Everything here works per sequence: scores are ``[B, T]``, indices ``[B, k]`` are positions within each
sequence (never flat rows), and targets are scattered row by row, so no batch offset can be forgotten.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


def capacity_k(seq_len: int, capacity: float) -> int:
    """Tokens processed per sequence at a routed layer: k = max(1, round(c·T)), at most T.

    Python's round (half to even) is used everywhere k appears (model and FLOP count), so they agree.
    """
    return max(1, min(seq_len, round(capacity * seq_len)))


def _fp32(x: torch.Tensor):
    """Context that keeps router arithmetic in fp32 even under bf16 autocast (scores decide top-k)."""
    return torch.autocast(device_type=x.device.type, enabled=False)


class Router(nn.Module):
    """Scalar score r_i = w·x_i per token (no bias, as in the paper), computed in fp32.

    A multiply-sum, not a matmul: as a [D] -> 1 matmul its backward dx = dr w^T is a K = 1 outer product,
    which under compile ran as a 115 us bf16 cuBLAS kernel per routed layer (B 32 x 2048, d 1024, H200);
    as elementwise work it fuses into the kernels around it, in fp32.
    """

    def __init__(self, d_model: int):
        super().__init__()
        self.proj = nn.Linear(d_model, 1, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x: [B, T, D] -> logits [B, T] float32."""
        with _fp32(x):
            return (x.float() * self.proj.weight[0].float()).sum(-1)


class CausalPredictor(nn.Module):
    """Small MLP on stop-grad(x) predicting top-k membership (the paper's second causal option).

    It has biases (unlike the transformer): the positive class is rare (c = 12.5%), and a bias carries that prior.
    Its first matmul runs in the ambient precision (bf16 under autocast): forced fp32 it ran on the GPU's fp32
    units (~2 ms of a 38 ms MoD step at d_model 1024 on an H200) for a classifier that never shapes the LM.
    The output layer (hidden -> 1) is a fp32 multiply-sum like the router's (its matmul form cost a K = 1
    cuBLAS kernel in the backward). The router, whose scores decide top-k, stays fp32.
    """

    def __init__(self, d_model: int, hidden: int):
        super().__init__()
        self.fc1 = nn.Linear(d_model, hidden)
        self.fc2 = nn.Linear(hidden, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x: [B, T, D] -> logits [B, T] float32; the input is detached so the predictor never shapes the LM."""
        h = F.silu(self.fc1(x.detach()))  # [B, T, H]
        return (h.float() * self.fc2.weight[0].float()).sum(-1) + self.fc2.bias.float()


def topk_indices(scores: torch.Tensor, k: int) -> torch.Tensor:
    """Top-k positions per sequence, ascending; ties go to the lower position (deterministic).

    A stable descending sort keeps equal scores in index order, unlike ``torch.topk`` whose tie order is
    unspecified. scores: [B, T] -> idx [B, k] int64, sorted ascending.
    """
    order = torch.sort(scores, dim=-1, descending=True, stable=True).indices  # [B, T]
    return order[:, :k].sort(dim=-1).values


def membership(idx: torch.Tensor, seq_len: int) -> torch.Tensor:
    """Per-sequence membership mask: out[b, t] = t in idx[b]. idx: [B, k] -> [B, T] bool.

    scatter along dim 1 indexes each row by its own positions: no flat indices, hence no batch offsets.
    """
    out = torch.zeros(idx.shape[0], seq_len, dtype=torch.bool, device=idx.device)
    return out.scatter_(1, idx, True)


def compact(take: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Turns a ragged decision mask into a padded index list for a gathered block.

    take: [B, T] bool -> (idx [B, m], valid [B, m]) with m = max(1, max_b count_b). Row b lists its taken
    positions ascending, then untaken positions ascending as padding (valid False). Padding sits after every
    real entry, so causal attention in list order never lets a real token see a pad; pads get weight 0.
    """
    B, T = take.shape
    pos = torch.arange(T, device=take.device)
    key = torch.where(take, pos, pos + T)  # taken first, each group in position order
    n = take.sum(1)  # [B]
    m = max(1, int(n.max()))
    idx = key.argsort(dim=-1)[:, :m]  # [B, m]
    valid = torch.arange(m, device=take.device)[None] < n[:, None]  # [B, m]
    return idx, valid


def gaussian_scores(shape: tuple[int, int], device, generator: torch.Generator | None = None) -> torch.Tensor:
    """Random-routing control: i.i.d. N(0, 1) scores [B, T] (same capacity, content-blind selection)."""
    return torch.randn(shape, device=device, generator=generator)


def bce(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """Mean binary cross-entropy of fp32 logits [B, T] against a bool target [B, T]."""
    return F.binary_cross_entropy_with_logits(logits.float(), target.float())


def confusion(pred: torch.Tensor, target: torch.Tensor) -> dict[str, torch.Tensor]:
    """Counts (float64 scalars) of a bool decision vs bool truth: tp, fp, fn, tn."""
    return {
        "tp": (pred & target).sum().double(),
        "fp": (pred & ~target).sum().double(),
        "fn": (~pred & target).sum().double(),
        "tn": (~pred & ~target).sum().double(),
    }
