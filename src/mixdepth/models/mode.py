"""Mixture-of-Depths-and-Experts (paper 003, Sec. 4.3): MoD routing combined with an MoE MLP (models/moe.py).

Two variants (``variant``), both on the layers MoD would route (``route_every`` / ``route_offset``); the other
layers are plain dense blocks:

- ``staged``: an MoD RoutedBlock (router, top-k capacity c, causal predictor, x + g(r)·f) whose MLP is the MoE:
  attention over the k routed tokens, then the MoE over the same k tokens. The MoE's aux losses therefore see
  the routed tokens only. No-op experts are not used here (``n_noop`` is ignored: the MoD router is the skip).
- ``integrated``: a full block (attention for every token) whose MLP is an MoE with ``n_noop`` no-op experts in
  its softmax and top-k: a token sent to a no-op gets no MLP update and costs no expert FLOPs. The MoD fields
  (capacity, gate, routing, causal, aux_weight, predictor_hidden) do not apply. ``n_noop=0`` is a plain MoE.

Loss (top-k mode): MoD's LM + router BCE + predictor BCE (staged) + lb_weight·mean_layers(lb) +
z_weight·mean_layers(z), lb and z as defined in models/moe.py.

FLOPs (DESIGN section 5) per MoE-input token: router 2·d·E_tot + a·6·d·F_e with a = planned real expert
assignments per MoE-input token:
- expert choice: a = E·C/n, C = min(n, max(1, round(expert_capacity·n·top_k/E_tot))), n tokens per sequence
  entering the MoE (k staged, T integrated): exact by construction;
- token choice: a = top_k·E/E_tot, the balanced routing the load-balancing loss (over real AND no-op experts)
  drives to. Staged has E_tot = E, so a = top_k exactly. Integrated token choice is data-dependent: this is a
  planning count; ``eval_summary`` reports ``realised_flops_per_token`` from the actual assignments.

Causality: expert choice picks tokens per sequence, so it reads later tokens (as MoD's top-k does). MoD's causal
mode replaces only the MoD router; an expert-choice MoE stays non-causal there (``val_loss_causal`` of an
expert-choice model is not a causal loss; in staged causal mode padding rows of the compacted list also compete
for expert capacity, and a decode step gives every expert its single token). Token choice is causal throughout.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from mixdepth.models.blocks import Block
from mixdepth.models.dense import DenseConfig, DenseLM, ModelConfigError
from mixdepth.models.mod import MoDConfig, MoDLM, RoutedBlock
from mixdepth.models.moe import ROUTINGS, MoE, MoEStats, expert_tokens

VARIANTS = ("staged", "integrated")


@dataclass(frozen=True)
class MoDEConfig(MoDConfig):
    arch: str = "mode"
    variant: str = "staged"  # staged (MoD router, then MoE on the routed tokens) | integrated (no-op experts)
    n_experts: int = 4  # real SwiGLU experts per MoE layer
    n_noop: int = 1  # integrated: no-op experts in the softmax / top-k (staged ignores it)
    top_k: int = 1  # token choice: picks per token; expert choice: enters the capacity C
    expert_routing: str = "token_choice"  # token_choice (top-k, lb + z loss) | expert_choice (capacity, z loss)
    expert_capacity: float = 1.0  # expert choice: C = capacity·n·top_k/E_tot tokens per expert and sequence
    expert_d_ff: int = 0  # 0: max(1, d_ff // top_k): top_k real experts cost one dense SwiGLU
    lb_weight: float = 0.01  # load-balancing loss weight (token choice)
    z_weight: float = 1e-3  # router z-loss weight

    def __post_init__(self):
        super().__post_init__()
        if self.expert_d_ff == 0:
            object.__setattr__(self, "expert_d_ff", max(1, self.d_ff // max(1, self.top_k)))
        if self.variant not in VARIANTS:
            raise ModelConfigError(f"model.variant must be one of {VARIANTS}, got {self.variant!r}")
        if self.expert_routing not in ROUTINGS:
            raise ModelConfigError(f"model.expert_routing must be one of {ROUTINGS}, got {self.expert_routing!r}")
        if self.n_experts < 1 or self.n_noop < 0:
            raise ModelConfigError(f"model.n_experts must be >= 1 and model.n_noop >= 0, got {self.n_experts}")
        if not 1 <= self.top_k <= self.n_total:
            raise ModelConfigError(f"model.top_k must be in [1, {self.n_total}] (n_experts + no-ops), got {self.top_k}")
        if self.expert_capacity <= 0 or self.expert_d_ff < 0:
            raise ModelConfigError("model.expert_capacity must be > 0 and model.expert_d_ff >= 0")
        if self.lb_weight < 0 or self.z_weight < 0:
            raise ModelConfigError("model.lb_weight and model.z_weight must be >= 0")

    @property
    def staged(self) -> bool:
        return self.variant == "staged"

    @property
    def noops(self) -> int:
        """No-op experts actually built (staged: none)."""
        return 0 if self.staged else self.n_noop

    @property
    def n_total(self) -> int:
        return self.n_experts + (0 if self.variant == "staged" else self.n_noop)

    @property
    def moe_in(self) -> int:
        """Tokens per sequence entering a MoE layer: k (staged) or T (integrated)."""
        return self.k if self.staged else self.seq_len

    def expert_assign(self) -> float:
        """Planned real expert assignments per MoE-input token (exact for expert choice, balanced for token
        choice; see the module docstring)."""
        if self.expert_routing == "expert_choice":
            n = self.moe_in
            return self.n_experts * expert_tokens(n, self.expert_capacity, self.top_k, self.n_total) / n
        return self.top_k * self.n_experts / self.n_total

    def planned_assign_per_token(self) -> float:
        """Real expert assignments per sequence token, summed over MoE layers (the FLOP count's plan)."""
        return self.n_routed * self.expert_assign() * self.moe_in / self.seq_len

    # ---- parameters -------------------------------------------------------------------------------
    def expert_params(self) -> int:
        return 3 * self.d_model * self.expert_d_ff

    def moe_params(self) -> int:
        return self.n_experts * self.expert_params() + self.d_model * self.n_total  # experts + router

    def moe_block_params(self) -> int:
        return self.block_params() - 3 * self.d_model * self.d_ff + self.moe_params()

    def n_params(self) -> dict[str, int]:
        """total / nonembed: dense, with each MoE layer's MLP replaced by the MoE (+ MoD router and predictor when
        staged); active = parameters touched per token on average: a MoE layer's non-expert weights at the
        entering share n/T, its experts at a·n/T expert weights (a = expert_assign())."""
        base = DenseConfig.n_params(self)
        per = self.moe_params() - 3 * self.d_model * self.d_ff + (self.router_params() if self.staged else 0)
        total = base["total"] + self.n_routed * per
        share = self.moe_in / self.seq_len
        other = self.moe_block_params() - self.n_experts * self.expert_params()
        touched = share * (other + self.expert_assign() * self.expert_params())
        skipped = self.n_routed * (self.moe_block_params() - touched)
        return {"total": total, "nonembed": base["nonembed"] + self.n_routed * per, "active": round(total - skipped)}

    # ---- FLOPs (DESIGN section 5) -----------------------------------------------------------------
    def moe_flops(self) -> float:
        """Per MoE-input token: router 2·d·E_tot and a planned real assignments at 6·d·F_e each."""
        return 2 * self.d_model * self.n_total + self.expert_assign() * 2 * self.expert_params()

    def flops_per_token(self) -> float:
        """Forward FLOPs per token at seq_len; no-op picks free; token choice planned at balance (docstring)."""
        T = self.seq_len
        full = self.attn_flops(1, (T + 1) / 2) + self.mlp_flops(1)
        if self.staged:
            k, h = self.k, self.predictor_hidden
            routed = (self.attn_flops(k, (k + 1) / 2) + k * self.moe_flops()) / T
            routed += 2 * self.d_model + 2 * (self.d_model * h + h)  # MoD router + predictor on every token
        else:
            routed = self.attn_flops(1, (T + 1) / 2) + self.moe_flops()
        return (self.n_layers - self.n_routed) * full + self.n_routed * routed + self.head_flops()

    def realised_flops_per_token(self, real_per_token: float) -> float:
        """flops_per_token with the planned expert assignments replaced by the realised ones (per token)."""
        return self.flops_per_token() + 2 * self.expert_params() * (real_per_token - self.planned_assign_per_token())


def make_moe(c: MoDEConfig) -> MoE:
    out_std = c.init_std / (2 * c.n_layers) ** 0.5  # the dense w2 depth scaling
    return MoE(
        c.d_model,
        c.expert_d_ff,
        c.n_experts,
        c.noops,
        c.top_k,
        c.expert_routing,
        c.expert_capacity,
        c.init_std,
        out_std,
    )


class StagedBlock(RoutedBlock):
    """An MoD RoutedBlock whose MLP is the MoE: it sees only the k gathered tokens ([B, k, D]); its statistics
    come back in the RouteInfo (``mlp``)."""

    def __init__(self, c: MoDEConfig):
        super().__init__(c)
        self.block.mlp = make_moe(c)  # after the router and predictor: the init order the weights depend on


def moe_block(c: MoDEConfig) -> Block:
    """Integrated MoDE layer: full attention, MoE MLP with no-op experts (forward_with returns its statistics)."""
    blk = Block(c)
    blk.mlp = make_moe(c)
    return blk


class MoDELM(MoDLM):
    """MoDE decoder (variant staged | integrated). forward(idx, targets) adds the MoE aux losses (top-k mode)."""

    def make_block(self, layer: int):
        c = self.cfg
        if not c.is_routed(layer):
            return DenseLM.make_block(self, layer)
        return StagedBlock(c) if c.staged else moe_block(c)

    def aux_loss(self, stats: list[MoEStats]) -> torch.Tensor:
        """lb_weight·mean(lb) + z_weight·mean(z) over the MoE layers of one forward."""
        lb = sum(s.lb for s in stats) / len(stats)
        z = sum(s.z for s in stats) / len(stats)
        return self.cfg.lb_weight * lb + self.cfg.z_weight * z

    def with_aux_losses(self, loss: torch.Tensor, infos: list, stats: list[MoEStats], mode: str) -> torch.Tensor:
        """MoD's objective; in top-k mode, plus the MoE aux losses."""
        loss = super().with_aux_losses(loss, infos, stats, mode)
        if mode != "topk" or not stats:
            return loss
        return loss + self.aux_loss(stats)

    # ---- held-out statistics ----------------------------------------------------------------------
    @torch.no_grad()
    def eval_sums(self, idx: torch.Tensor, targets: torch.Tensor) -> dict[str, torch.Tensor]:
        """MoD's sums plus, over MoE layers of the top-k pass (the trained routing): input tokens, pick slots,
        real assignments, tokens without a real assignment, and the real assignments per expert."""
        out, st = self._sums(idx, targets)
        if st:
            out["moe_tokens"] = torch.tensor(float(sum(s.tokens for s in st)))
            out["moe_slots"] = torch.tensor(float(sum(s.slots for s in st)))
            out["moe_real"] = sum(s.load.sum() for s in st).double()
            out["moe_skipped"] = sum(s.skipped for s in st).double()
            for e in range(self.cfg.n_experts):
                out[f"moe_load_{e}"] = sum(s.load[e] for s in st).double()
        return out

    def eval_summary(self, sums: dict[str, float]) -> dict[str, float]:
        """MoD's metrics plus noop_share (1 - real assignments / pick slots), mlp_skip_share (MoE-input tokens
        with no real expert), expert_load_<e> (share of real assignments), expert_load_max / _min, and
        realised_flops_per_token (flops_per_token at the realised assignments) beside planned_flops_per_token."""
        out = super().eval_summary(sums)
        out["planned_flops_per_token"] = self.cfg.flops_per_token()
        if not sums.get("moe_slots"):
            out["realised_flops_per_token"] = out["planned_flops_per_token"]
            return out
        real = sums["moe_real"]
        out["noop_share"] = 1 - real / sums["moe_slots"]
        out["mlp_skip_share"] = sums["moe_skipped"] / sums["moe_tokens"]
        loads = [sums[f"moe_load_{e}"] / real if real else 0.0 for e in range(self.cfg.n_experts)]
        for e, v in enumerate(loads):
            out[f"expert_load_{e}"] = v
        out["expert_load_max"], out["expert_load_min"] = max(loads), min(loads)
        out["realised_flops_per_token"] = self.cfg.realised_flops_per_token(real / sums["tokens"])
        return out
