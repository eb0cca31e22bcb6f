"""Mixture-of-Experts SwiGLU MLP for MoDE (paper 003, Sec. 4.3): routing, aux losses, grouped expert kernel.

The router scores ``E_tot = n_experts + n_noop`` experts per token in fp32; the gates are the FULL softmax
probabilities over all E_tot experts (not renormalised over the picks). Real assignments become
``(token_idx, expert_idx, weight)`` rows of ``kernels.grouped_mlp.grouped_swiglu``; no-op picks are passed as
``expert_idx = -1``: skipped by the kernel (zero FLOPs, zero output, zero weight gradient).

Gradient path of a no-op pick: the no-op logit sits in the softmax normaliser of every real gate, so
``d p_real / d l_noop = -p_real p_noop``: whenever the token has at least one real pick (top_k >= 2, or any
expert-choice pick) the LM loss reaches the no-op logit through that shared normaliser. A token whose every pick
is a no-op has no MLP output for the LM loss to differentiate (as an unrouted token in MoD); its router logits
then learn from the load-balancing and z losses, which include every token's probabilities.

Routing (``routing``):
- ``token_choice``: each token takes its top_k experts of the E_tot (no-ops included).
  Load balancing (Switch): ``lb = E_tot · Σ_e f_e · P_e`` over ALL E_tot experts, f_e = share of the N·top_k
  picks that went to e, P_e = mean router probability of e. Balancing over no-ops too drives the no-op share
  towards n_noop / E_tot, the share the analytic FLOP count plans with.
- ``expert_choice``: per sequence, each REAL expert takes its C = min(N, max(1, round(capacity·N·top_k/E_tot)))
  highest-probability tokens (no-ops pick nothing: they only take softmax mass). Exact load by construction,
  so lb = 0. Not causal (a pick depends on later tokens), like MoD's top-k.
Router z-loss (both): ``z = mean_tokens logsumexp(logits)²``.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

from kernels.grouped_mlp import grouped_swiglu

ROUTINGS = ("token_choice", "expert_choice")


def expert_tokens(n: int, capacity: float, top_k: int, n_total: int) -> int:
    """Expert choice: tokens each real expert takes out of n per sequence (Python round, as everywhere)."""
    return min(n, max(1, round(capacity * n * top_k / n_total)))


class MoEStats(NamedTuple):
    lb: torch.Tensor  # scalar fp32 load-balancing loss (0 for expert choice)
    z: torch.Tensor  # scalar fp32 router z-loss
    load: torch.Tensor  # [E] fp32 real assignments per expert (detached)
    tokens: int  # MoE input tokens N (B·n)
    slots: int  # N·top_k
    skipped: torch.Tensor  # scalar: tokens with no real assignment (no MLP update)


class MoE(nn.Module):
    """x [B, N, D] -> (y [B, N, D], MoEStats of this call: aux losses and loads)."""

    def __init__(
        self,
        d_model: int,
        d_expert: int,
        n_experts: int,
        n_noop: int,
        top_k: int,
        routing: str,
        capacity: float,
        init_std: float,
        out_std: float,
    ):
        super().__init__()
        E, D, Fe = n_experts, d_model, d_expert
        self.n_experts, self.n_total, self.top_k = E, E + n_noop, top_k
        self.routing, self.capacity = routing, capacity
        self.router = nn.Linear(D, self.n_total, bias=False)
        self.w1 = nn.Parameter(torch.randn(E, D, Fe) * init_std)  # gate
        self.w3 = nn.Parameter(torch.randn(E, D, Fe) * init_std)  # up
        self.w2 = nn.Parameter(torch.randn(E, Fe, D) * out_std)  # down (depth-scaled like the dense w2)

    def logits(self, x: torch.Tensor) -> torch.Tensor:
        """x [N, D] -> router logits [N, E_tot] fp32 (autocast off: the logits decide the picks)."""
        with torch.autocast(device_type=x.device.type, enabled=False):
            return F.linear(x.float(), self.router.weight.float())

    def route(self, x: torch.Tensor):
        """x [B, N, D] -> (token_idx [M], expert_idx [M] (-1 = no-op), weight [M] fp32, lb, z)."""
        B, N, _ = x.shape
        E, Et, dev = self.n_experts, self.n_total, x.device
        logits = self.logits(x.reshape(B * N, -1))  # [BN, Et]
        probs = logits.softmax(-1)
        z = torch.logsumexp(logits, -1).pow(2).mean()
        if self.routing == "token_choice":
            w, e = probs.topk(self.top_k, dim=-1)  # [BN, k]
            e, w = e.flatten(), w.flatten()  # [M = BN·k], token-major
            tok = torch.arange(B * N, device=dev).repeat_interleave(self.top_k)
            picks = torch.zeros(Et, device=dev).index_add_(0, e, torch.ones_like(w))  # [Et]
            lb = Et * (picks / e.numel() * probs.mean(0)).sum()
            e = torch.where(e < E, e, -1)  # no-op picks: free rows of the kernel
        else:
            C = expert_tokens(N, self.capacity, self.top_k, Et)
            pe = probs.view(B, N, Et)[:, :, :E].transpose(1, 2)  # [B, E, N] real experts only
            w, idx = pe.topk(C, dim=-1)  # [B, E, C] positions within each sequence
            tok = (idx + torch.arange(B, device=dev)[:, None, None] * N).flatten()
            e = torch.arange(E, device=dev)[None, :, None].expand(B, E, C).flatten()
            w, lb = w.flatten(), logits.new_zeros(())
        return tok, e, w, lb, z

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, MoEStats]:
        B, N, D = x.shape
        tok, e, w, lb, z = self.route(x)
        # the kernel wants one dtype: autocast's (as nn.Linear would use), else the input's
        dev = x.device.type
        dt = torch.get_autocast_dtype(dev) if torch.is_autocast_enabled(dev) else x.dtype
        xs = x.reshape(B * N, D).to(dt)
        out = grouped_swiglu(xs, self.w1.to(dt), self.w3.to(dt), self.w2.to(dt), tok, e, w).to(x.dtype)
        with torch.no_grad():
            real = (e >= 0).float()  # [M]
            load = torch.zeros(self.n_experts, device=x.device).index_add_(0, e.clamp(min=0), real)
            got = torch.zeros(B * N, device=x.device).index_add_(0, tok, real)  # real picks per token
            stats = MoEStats(lb, z, load, B * N, B * N * self.top_k, (got == 0).sum())
        return out.view(B, N, D), stats
