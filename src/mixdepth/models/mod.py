"""Mixture-of-Depths (paper 003, Sec. 3): routed blocks alternate with full blocks.

A routed block scores every token with a linear fp32 router, keeps the top k = max(1, round(c·T)) per
sequence (positions sorted), runs attention (causal among the kept tokens, RoPE at their ORIGINAL
positions) and the MLP on them only, and writes x + g(r)·f back, where f is the block's update WITHOUT the
residual (Eq. 1 with g = identity; g = sigmoid optional). Unselected tokens pass unchanged and give no K/V.

Top-k over the whole sequence is not causal, so two causal rules are trained alongside (Sec. 3.5): (a) an aux
BCE on the router logit (routed when r > 0) and (b) a small MLP predictor on stop-grad(x) (routed when its
logit > 0). ``causal`` picks the rule used for causal evaluation and generation; both are always trained and
both are reported. Post-norm is supported with f = block(x) - x (so g = 1 reproduces the post-norm block).
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial
from typing import Any, NamedTuple

import torch
from torch import nn

from kernels.route_gather_scatter import route_gather, route_scatter_add
from mixdepth.models.blocks import Block, Rotary
from mixdepth.models.decoding import Decoder, KVCache
from mixdepth.models.dense import DenseConfig, DenseLM, ModelConfigError
from mixdepth.models.routing import (
    CausalPredictor,
    Router,
    bce,
    capacity_k,
    compact,
    confusion,
    gaussian_scores,
    membership,
    topk_indices,
)

MODES = ("topk", "causal")


@dataclass(frozen=True)
class MoDConfig(DenseConfig):
    arch: str = "mod"
    capacity: float = 0.125  # c: share of each sequence a routed block processes, k = max(1, round(c·T))
    route_every: int = 2  # layer l is routed when l % route_every == route_offset % route_every
    route_offset: int = 1  # 1: layers 1, 3, ... routed, the first block always full
    gate: str = "identity"  # g in x + g(r)·f: identity (paper Eq. 1) | sigmoid
    routing: str = "learned"  # learned | random (Gaussian scores, same capacity: the paper's control)
    causal: str = "predictor"  # rule at causal eval/generation: aux (router logit > 0) | predictor (MLP logit > 0)
    aux_weight: float = 0.01  # weight of the router's BCE (the predictor's BCE has weight 1: stop-grad input)
    predictor_hidden: int = 0  # 0: max(1, d_model // 4)

    def __post_init__(self):
        super().__post_init__()
        if self.predictor_hidden == 0:
            object.__setattr__(self, "predictor_hidden", max(1, self.d_model // 4))
        if not 0 < self.capacity <= 1:
            raise ModelConfigError(f"model.capacity must be in (0, 1], got {self.capacity}")
        if self.route_every < 1 or self.route_offset < 0:
            raise ModelConfigError(
                f"model.route_every must be >= 1 and model.route_offset >= 0, got {self.route_every}"
                f" and {self.route_offset}"
            )
        for key, allowed in (("gate", ("identity", "sigmoid")), ("routing", ("learned", "random"))):
            if getattr(self, key) not in allowed:
                raise ModelConfigError(f"model.{key} must be one of {allowed}, got {getattr(self, key)!r}")
        if self.causal not in ("aux", "predictor"):
            raise ModelConfigError(f"model.causal must be 'aux' or 'predictor', got {self.causal!r}")
        if self.aux_weight < 0 or self.predictor_hidden < 0:
            raise ModelConfigError("model.aux_weight and model.predictor_hidden must be >= 0")

    def is_routed(self, layer: int) -> bool:
        # offset taken modulo route_every, so model.route_every=1 routes every layer without touching the offset
        return layer % self.route_every == self.route_offset % self.route_every

    @property
    def n_routed(self) -> int:
        return sum(self.is_routed(i) for i in range(self.n_layers))

    def same_as_dense(self) -> str | None:
        if self.n_routed == 0:
            return f"no routed layer (route_every={self.route_every}, route_offset={self.route_offset})"
        return None

    @property
    def k(self) -> int:
        """Tokens per sequence a routed block processes at seq_len."""
        return capacity_k(self.seq_len, self.capacity)

    # ---- parameters -------------------------------------------------------------------------------
    def router_params(self) -> int:
        """Router (d) + predictor MLP with biases (d·h + h + h + 1) of one routed block."""
        h = self.predictor_hidden
        return self.d_model + self.d_model * h + 2 * h + 1

    def n_params(self) -> dict[str, int]:
        """total / nonembed as for dense plus routers and predictors; ``active`` = parameters touched per token
        on average: a routed block's weights count at the routed share k/T, its router and predictor fully."""
        base = super().n_params()
        extra = self.n_routed * self.router_params()
        total = base["total"] + extra
        skipped = self.n_routed * (1 - self.k / self.seq_len) * self.block_params()
        return {"total": total, "nonembed": base["nonembed"] + extra, "active": round(total - skipped)}

    # ---- FLOPs (DESIGN section 5) -----------------------------------------------------------------
    def routed_flops_per_token(self) -> float:
        """One routed layer per token: k tokens through attention (mean causal context (k+1)/2 among the
        selected) and MLP, divided by T; router 2·d and predictor 2·(d·h + h) on every token."""
        T, k, h = self.seq_len, self.k, self.predictor_hidden
        block = (self.attn_flops(k, (k + 1) / 2) + self.mlp_flops(k)) / T
        return block + 2 * self.d_model + 2 * (self.d_model * h + h)

    def flops_per_token(self) -> float:
        """Exact training-forward FLOPs per token at seq_len (router and predictor run at every routed layer)."""
        full = self.attn_flops(1, (self.seq_len + 1) / 2) + self.mlp_flops(1)
        n_full = self.n_layers - self.n_routed
        return n_full * full + self.n_routed * self.routed_flops_per_token() + self.head_flops()


class RouteInfo(NamedTuple):
    logits: torch.Tensor  # [B, T] fp32 router logits r
    pred: torch.Tensor  # [B, T] fp32 predictor logits
    target: torch.Tensor | None  # [B, T] bool top-k membership (top-k mode)
    taken: torch.Tensor  # [B, T] bool tokens this layer processed
    mlp: Any = None  # what the block's MLP returned beside its output (MoDE: the MoE's statistics), else None


class RoutedBlock(nn.Module):
    """A Block run on a routed subset of tokens; router and causal predictor on the block input."""

    def __init__(self, c: MoDConfig):
        super().__init__()
        self.block = Block(c)
        self.router = Router(c.d_model)
        self.predictor = CausalPredictor(c.d_model, c.predictor_hidden)
        self.capacity, self.gate, self.routing, self.causal = c.capacity, c.gate, c.routing, c.causal

    def weight(self, r: torch.Tensor) -> torch.Tensor:
        """g(r): the factor on the block update (fp32)."""
        return r if self.gate == "identity" else torch.sigmoid(r)

    def decide(self, r: torch.Tensor, p: torch.Tensor) -> torch.Tensor:
        """The causal rule: a decision from the token alone. r, p: [...] fp32 logits -> [...] bool."""
        if self.routing == "random":  # Gaussian score above its (1 - c) quantile: Bernoulli(c), content-blind
            z = torch.special.ndtri(torch.tensor(1.0 - self.capacity, dtype=torch.float64)).item()
            return gaussian_scores(r.shape, r.device) > z
        return (r if self.causal == "aux" else p) > 0

    def forward(
        self, x: torch.Tensor, rope: Rotary, mode: str = "topk", cache: KVCache | None = None
    ) -> tuple[torch.Tensor, RouteInfo]:
        """x: [B, T, D] -> (y [B, T, D], RouteInfo). ``cache`` (causal prefill) receives the processed K/V."""
        B, T, _ = x.shape
        r, p = self.router(x), self.predictor(x)  # [B, T] fp32 each
        if mode == "topk":
            sel = r if self.routing == "learned" else gaussian_scores((B, T), x.device)
            idx = topk_indices(sel, capacity_k(T, self.capacity))  # [B, k] ascending
            valid, target = None, membership(idx, T)
            taken = target
        else:
            taken = self.decide(r, p)  # [B, T]
            idx, valid = compact(taken)  # [B, m] taken positions first (ascending), then padding
            target = None
        xs = route_gather(x, idx, distinct=True)  # [B, k, D]; top-k and compact never repeat a position
        attn = partial(self._attend, rope=rope, pos=idx, cache=cache, valid=valid)
        f, stats = self.block.delta_with(xs, attn)  # [B, k, D] update without the residual
        f = f.to(x.dtype)
        w = self.weight(r.gather(1, idx))  # [B, k] fp32
        if valid is not None:
            w = torch.where(valid, w, 0.0)  # padding entries write x + 0
        return route_scatter_add(x, idx, f, w, distinct=True), RouteInfo(r, p, target, taken, stats)

    def _attend(self, u, *, rope, pos, cache, valid):
        """Attention over the gathered tokens at their original positions; fills ``cache`` when given."""
        if cache is None:
            return self.block.attn(u, rope, pos)
        a, k, v = self.block.attn.forward_kv(u, rope, pos)
        n = torch.full((u.shape[0],), u.shape[1], device=u.device) if valid is None else valid.sum(1)
        cache.write_prefix(k, v, n)  # rows past n[b] are padding, masked by the cache length
        return a

    def decode(self, x: torch.Tensor, rope: Rotary, pos: torch.Tensor, cache: KVCache) -> torch.Tensor:
        """One new token per sequence, routed by the causal rule. x: [B, 1, D]; pos: [B, 1] -> [B, 1, D]."""
        r, p = self.router(x)[:, 0], self.predictor(x)[:, 0]  # [B]
        take = self.decide(r, p)  # [B]; only these append K/V to this layer's cache
        f, _ = self.block.delta_with(x, lambda u: self.block.attn.decode(u, rope, pos, cache, take))
        y = x + self.weight(r)[:, None, None] * f.to(x.dtype)
        return torch.where(take[:, None, None], y.to(x.dtype), x)


def _full_attn(u: torch.Tensor, attn, rope: Rotary, cache: KVCache | None) -> torch.Tensor:
    """A full layer's attention over every token; fills ``cache`` when given (causal prefill)."""
    if cache is None:
        return attn(u, rope)
    a, k, v = attn.forward_kv(u, rope, None)
    cache.write_prefix(k, v, torch.full((u.shape[0],), u.shape[1], device=u.device))
    return a


def _decode_attn(u: torch.Tensor, attn, rope: Rotary, pos: torch.Tensor, cache: KVCache) -> torch.Tensor:
    return attn.decode(u, rope, pos, cache)


class MoDLM(Decoder, DenseLM):
    """MoD decoder. ``route_mode`` ('topk' | 'causal', or forward's ``mode``) picks top-k or causal routing.

    Generation (``Decoder.generate``) runs causal routing."""

    REGIONS = ("route_layer", "head_loss")  # compile(scope="block"): one graph for full blocks, one for routed ones

    def __init__(self, cfg: MoDConfig):
        super().__init__(cfg)
        self.route_mode = "topk"

    def make_block(self, layer: int) -> nn.Module:
        return RoutedBlock(self.cfg) if self.cfg.is_routed(layer) else super().make_block(layer)

    def trunk(self, idx: torch.Tensor, mode: str, cache: list[KVCache] | None = None):
        """idx [B, T] -> (final hidden [B, T, D], RouteInfo per routed layer, the statistics MLPs returned beside
        their outputs (MoDE's MoE layers) in layer order); ``cache`` (one KVCache per layer) is prefilled."""
        if mode not in MODES:
            raise ValueError(f"route mode must be one of {MODES}, got {mode!r}")
        x = self.embed_tokens(idx)  # [B, T, D]
        infos, stats = [], []
        for i, blk in enumerate(self.blocks):
            x, info, st = self.route_layer(blk, x, mode, None if cache is None else cache[i])
            if info is not None:
                infos.append(info)
            if st is not None:
                stats.append(st)
        return x, infos, stats

    def route_layer(self, blk: nn.Module, x: torch.Tensor, mode: str, cache: KVCache | None = None):
        """One block of the trunk: x [B, T, D] -> (x, its RouteInfo (None for a full block), its MLP's statistics
        or None); ``cache`` (causal prefill) receives the block's K/V."""
        if isinstance(blk, RoutedBlock):
            x, info = blk(x, self.rope, mode, cache)
            return x, info, info.mlp
        x, st = blk.forward_with(x, partial(_full_attn, attn=blk.attn, rope=self.rope, cache=cache))
        return x, None, st

    def forward(
        self, idx: torch.Tensor, targets: torch.Tensor | None = None, *, mode: str | None = None, terms: bool = False
    ):
        """idx [B, T] -> logits [B, T, V]; with targets [B, T], the training objective (``with_aux_losses``), or with
        ``terms`` the pair (objective, LM loss) of this one pass (``loss_terms``: a keyword of the forward, so that
        compile's scope 'model' compiles it)."""
        mode = mode or self.route_mode
        x, infos, stats = self.trunk(idx, mode)
        if targets is None:
            return self.head_loss(x)  # [B, T, V]
        lm = self.head_loss(x, targets)
        loss = self.with_aux_losses(lm, infos, stats, mode)
        return (loss, lm) if terms else loss

    def loss_terms(self, idx: torch.Tensor, targets: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(training objective, LM loss) of the one forward ``loss`` runs: the second without the aux losses."""
        return self(idx, targets, terms=True)

    def with_aux_losses(self, loss: torch.Tensor, infos: list[RouteInfo], stats: list, mode: str) -> torch.Tensor:
        """LM loss + aux_weight·router BCE + predictor BCE (top-k mode, layer means; random routing skips the
        router BCE, whose targets are noise there); causal mode has no top-k targets: the LM loss alone."""
        infos = [i for i in infos if i.target is not None]
        if infos:
            if self.cfg.routing == "learned":
                loss = loss + self.cfg.aux_weight * sum(bce(i.logits, i.target) for i in infos) / len(infos)
            loss = loss + sum(bce(i.pred, i.target) for i in infos) / len(infos)
        return loss

    # ---- held-out statistics ----------------------------------------------------------------------
    def _lm(self, idx, targets, mode):
        x, infos, stats = self.trunk(idx, mode)
        return self.head_loss(x, targets), infos, stats

    @torch.no_grad()
    def eval_sums(self, idx: torch.Tensor, targets: torch.Tensor) -> dict[str, torch.Tensor]:
        """Additive sums: LM loss under top-k and (with a MoD router) causal routing; per causal rule (aux,
        mlp) the confusion of its decision vs top-k membership on the top-k pass; routed token-layer slots
        under both routings."""
        return self._sums(idx, targets)[0]

    def _sums(self, idx: torch.Tensor, targets: torch.Tensor) -> tuple[dict[str, torch.Tensor], list]:
        """eval_sums' dict and the MLP statistics of its top-k pass (MoDE sums those too)."""
        n = targets.numel()
        loss, infos, stats = self._lm(idx, targets, "topk")
        out = {"loss_sum": loss * n, "tokens": torch.tensor(n)}
        if infos:  # with no MoD router (integrated MoDE) causal routing would repeat the same pass
            loss_c, cinfos, _ = self._lm(idx, targets, "causal")
            out["loss_causal_sum"] = loss_c * n
            out["route_slots"] = torch.tensor(n * len(infos))
            out["topk_routed"] = sum(i.taken.sum() for i in infos)
            out["causal_routed"] = sum(i.taken.sum() for i in cinfos)
            for rule, field in (("aux", "logits"), ("mlp", "pred")):
                cm = [confusion(getattr(i, field) > 0, i.target) for i in infos]
                for key in ("tp", "fp", "fn", "tn"):
                    out[f"{rule}_{key}"] = sum(c[key] for c in cm)
        return out, stats

    def eval_summary(self, sums: dict[str, float]) -> dict[str, float]:
        """val_loss, val_loss_causal; predictor_accuracy / precision / recall of the configured causal rule
        (also per rule: aux_*, mlp_*), realised_capacity (causal routing) and topk_capacity (k/T)."""
        out = {"val_loss": sums["loss_sum"] / sums["tokens"]}
        if "loss_causal_sum" in sums:
            out["val_loss_causal"] = sums["loss_causal_sum"] / sums["tokens"]
        slots = sums.get("route_slots", 0)
        if not slots:  # no routed layer at this depth: nothing to report (no NaN into the JSON column)
            return out
        for rule in ("aux", "mlp"):
            tp, fp, fn, tn = (sums[f"{rule}_{k}"] for k in ("tp", "fp", "fn", "tn"))
            out[f"{rule}_accuracy"] = (tp + tn) / slots
            if tp + fp:
                out[f"{rule}_precision"] = tp / (tp + fp)
            if tp + fn:
                out[f"{rule}_recall"] = tp / (tp + fn)
        chosen = "aux" if self.cfg.causal == "aux" else "mlp"
        for name in ("accuracy", "precision", "recall"):
            if f"{chosen}_{name}" in out:
                out["predictor_accuracy" if name == "accuracy" else name] = out[f"{chosen}_{name}"]
        out["realised_capacity"] = sums["causal_routed"] / slots
        out["topk_capacity"] = sums["topk_routed"] / slots
        return out

    # ---- generation (Decoder) ----------------------------------------------------------------------
    def new_cache(self, batch: int, max_len: int) -> list[KVCache]:
        """One KVCache per layer: full layers hold every token, routed layers the tokens they process."""
        c, w = self.cfg, self.embed.weight
        return [KVCache(batch, c.n_kv_heads, max_len, c.head_dim, w.device, w.dtype) for _ in self.blocks]

    def prefill(self, idx: torch.Tensor, cache: list[KVCache]) -> torch.Tensor:
        """Causal-mode forward of a prompt idx [B, T0] filling ``cache`` -> logits [B, T0, V]."""
        return self.head_loss(self.trunk(idx, "causal", cache)[0])

    def decode_step(self, tok: torch.Tensor, pos: int, cache: list[KVCache]) -> torch.Tensor:
        """tok [B, 1] at position ``pos`` -> logits [B, V]; full layers cache every token, routed layers
        only the tokens their causal rule routes."""
        x = self.embed_tokens(tok)  # [B, 1, D]
        p = torch.full_like(tok, pos)  # [B, 1]
        for blk, c in zip(self.blocks, cache, strict=True):
            if isinstance(blk, RoutedBlock):
                x = blk.decode(x, self.rope, p, c)
            else:
                x, _ = blk.forward_with(x, partial(_decode_attn, attn=blk.attn, rope=self.rope, pos=p, cache=c))
        return self.head_loss(x)[:, 0]
