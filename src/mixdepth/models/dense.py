"""Dense decoder-only transformer: the baseline every routed family is compared against."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from kernels.linear_ce import linear_cross_entropy
from mixdepth.models.blocks import Block, RMSNorm, Rotary
from mixdepth.models.compile_cache import cache_compiled_graphs


class ModelConfigError(ValueError):
    """An inconsistent model shape, reported in one line."""


def default_d_ff(d_model: int) -> int:
    """SwiGLU width: 8/3 · d_model rounded up to a multiple of 16 (keeps parameters near a 4x GELU MLP)."""
    return -(-8 * d_model // 3 // 16) * 16


@dataclass(frozen=True)
class DenseConfig:
    arch: str = "dense"
    d_model: int = 128
    n_layers: int = 4
    n_heads: int = 4
    n_kv_heads: int = 4
    d_ff: int = 0  # 0: default_d_ff(d_model)
    vocab_size: int = 256
    seq_len: int = 128
    qk_norm: bool = False
    norm: str = "pre"  # pre: x + f(N(x)); post: N(x + f(x))
    tie_embeddings: bool = False
    rope_theta: float = 10000.0
    init_std: float = 0.02
    attn_impl: str = "sdpa"  # sdpa (fused kernels) | naive (explicit matmuls: reference, FLOP counting)
    # the residual stream's dtype under autocast: fp32 (the embedding's: autocast leaves adds in the wider dtype) or
    # autocast (its dtype, bf16 under bf16-mixed, as torchtitan and Megatron keep it: half the stream's memory
    # traffic, each residual add rounded to bf16); without autocast both are the parameters' dtype
    residual: str = "fp32"

    def __post_init__(self):
        if self.d_ff == 0:
            object.__setattr__(self, "d_ff", default_d_ff(self.d_model))
        for k in ("d_model", "n_layers", "n_heads", "n_kv_heads", "d_ff", "vocab_size", "seq_len"):
            if getattr(self, k) <= 0:
                raise ModelConfigError(f"model.{k} must be positive, got {getattr(self, k)}")
        if self.d_model % self.n_heads:
            raise ModelConfigError(f"model.d_model={self.d_model} is not divisible by n_heads={self.n_heads}")
        if self.n_heads % self.n_kv_heads:
            raise ModelConfigError(f"model.n_heads={self.n_heads} is not divisible by n_kv_heads={self.n_kv_heads}")
        if (self.d_model // self.n_heads) % 2:
            raise ModelConfigError(f"model head dim {self.d_model // self.n_heads} must be even for RoPE")
        if self.norm not in ("pre", "post"):
            raise ModelConfigError(f"model.norm must be 'pre' or 'post', got {self.norm!r}")
        if self.attn_impl not in ("sdpa", "naive"):
            raise ModelConfigError(f"model.attn_impl must be 'sdpa' or 'naive', got {self.attn_impl!r}")
        if self.residual not in ("fp32", "autocast"):
            raise ModelConfigError(f"model.residual must be 'fp32' or 'autocast', got {self.residual!r}")

    @property
    def head_dim(self) -> int:
        return self.d_model // self.n_heads

    def same_as_dense(self) -> str | None:
        """Why this config computes exactly the dense model (the sweep leaves such grid points out), or None."""
        return None

    # ---- parameters -------------------------------------------------------------------------------
    def block_params(self) -> int:
        d, hd = self.d_model, self.head_dim
        attn = d * self.n_heads * hd * 2 + d * self.n_kv_heads * hd * 2  # wqkv (q, k, v rows), wo
        qk = 2 * hd if self.qk_norm else 0
        return attn + qk + 3 * d * self.d_ff + 2 * d  # + SwiGLU + two norms

    def n_params(self) -> dict[str, int]:
        """total, nonembed (total minus the input embedding) and active (touched per token) parameters."""
        emb = self.vocab_size * self.d_model
        head = 0 if self.tie_embeddings else self.vocab_size * self.d_model
        total = emb + head + self.n_layers * self.block_params() + self.d_model
        return {"total": total, "nonembed": total - emb, "active": total}

    # ---- FLOPs (DESIGN section 5: matmuls at 2mnk, attention over the mean causal context) ----------
    def attn_flops(self, n_tokens: float, context: float) -> float:
        """Forward FLOPs of one attention sublayer for n_tokens queries over a mean context length."""
        d, hd = self.d_model, self.head_dim
        proj = 2 * d * hd * (2 * self.n_heads + 2 * self.n_kv_heads)
        return n_tokens * (proj + 4 * self.n_heads * hd * context)  # + QK^T and AV

    def mlp_flops(self, n_tokens: float) -> float:
        return n_tokens * 2 * 3 * self.d_model * self.d_ff

    def head_flops(self) -> float:
        return 2 * self.d_model * self.vocab_size

    def flops_per_token(self) -> float:
        """Exact forward FLOPs per token at sequence length seq_len (causal mean context (T+1)/2)."""
        ctx = (self.seq_len + 1) / 2
        return self.n_layers * (self.attn_flops(1, ctx) + self.mlp_flops(1)) + self.head_flops()


class DenseLM(nn.Module):
    """Decoder-only LM. forward(idx [B, T]) -> logits [B, T, V]."""

    def __init__(self, cfg: DenseConfig):
        super().__init__()
        self.cfg = cfg
        self.embed = nn.Embedding(cfg.vocab_size, cfg.d_model)
        self.blocks = nn.ModuleList(self.make_block(i) for i in range(cfg.n_layers))
        self.norm = RMSNorm(cfg.d_model)
        self.head = nn.Linear(cfg.d_model, cfg.vocab_size, bias=False)
        if cfg.tie_embeddings:
            self.head.weight = self.embed.weight
        self.rope = Rotary(cfg.head_dim, cfg.seq_len, cfg.rope_theta)
        self.apply(self._init)
        # scale residual-branch outputs by depth (GPT-2 style) so deeper ladders start stable
        for name, p in self.named_parameters():
            if name.endswith(("wo.weight", "w2.weight")):
                nn.init.normal_(p, std=cfg.init_std / (2 * cfg.n_layers) ** 0.5)

    def make_block(self, layer: int) -> nn.Module:
        return Block(self.cfg)

    def _init(self, m: nn.Module) -> None:
        if isinstance(m, (nn.Linear, nn.Embedding)):
            nn.init.normal_(m.weight, std=self.cfg.init_std)

    def forward(self, idx: torch.Tensor, targets: torch.Tensor | None = None) -> torch.Tensor:
        """idx [B, T] -> logits [B, T, V]; with targets [B, T], the mean next-token loss instead.

        The loss is the fused head + cross-entropy (``kernels.linear_ce``): the [B*T, V] logits are made and
        consumed in chunks, never whole (unfused, their fp32 upcast and log-softmax cost a quarter of a
        GPT-2-small step on an H200).
        """
        x = self.embed_tokens(idx)  # [B, T, D]
        for block in self.blocks:
            x = self.layer(block, x)
        return self.head_loss(x, targets)

    def embed_tokens(self, idx: torch.Tensor) -> torch.Tensor:
        """idx [B, T] -> the residual stream's start [B, T, D], in autocast's dtype with ``residual='autocast'``."""
        x = self.embed(idx)
        dev = x.device.type
        if self.cfg.residual == "autocast" and torch.is_autocast_enabled(dev):
            return x.to(torch.get_autocast_dtype(dev))
        return x

    def layer(self, block: nn.Module, x: torch.Tensor) -> torch.Tensor:
        """One block of the trunk: x [B, T, D] -> [B, T, D]."""
        return block(x, self.rope)

    def head_loss(self, x: torch.Tensor, targets: torch.Tensor | None = None) -> torch.Tensor:
        """Final hidden x [B, T, D] -> logits [B, T, V], or with targets [B, T] the mean next-token loss (fp32)."""
        h = self.norm(x)  # [B, T, D]
        if targets is None:
            return self.head(h)  # [B, T, V]
        return linear_cross_entropy(h.flatten(0, 1), self.head.weight, targets.flatten())

    # What compile(scope="block") compiles: functions that take the block as an argument, so that one graph serves
    # every block of a kind (their parameters are graph inputs); the embedding between them runs eagerly.
    REGIONS: tuple[str, ...] = ("layer", "head_loss")

    def compile(self, *args, scope: str = "model", **kwargs) -> None:
        """torch.compile. ``scope`` 'model': the whole forward, one graph (``nn.Module.compile``); 'block': each of
        ``REGIONS`` instead, one graph per kind of block whatever the depth, so compile time does not grow with the
        layers (the residual stream then crosses a graph boundary at every block)."""
        if scope not in ("model", "block"):
            raise ValueError(f"compile scope must be 'model' or 'block', got {scope!r}")
        cache_compiled_graphs()
        if scope == "model":
            return super().compile(*args, **kwargs)
        for name in self.REGIONS:
            setattr(self, name, torch.compile(getattr(self, name), *args, **kwargs))

    def loss(self, idx: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """The training objective: mean next-token cross-entropy (nats) in fp32 (+ aux losses in routed families)."""
        return self(idx, targets)

    def loss_terms(self, idx: torch.Tensor, targets: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(training objective, LM loss) of one forward, fp32 scalars: ``loss`` and the mean next-token cross-entropy
        (nats) in it, which the training curves record beside it; one tensor twice where the objective has no aux
        losses."""
        loss = self.loss(idx, targets)
        return loss, loss

    def eval_sums(self, idx: torch.Tensor, targets: torch.Tensor) -> dict[str, torch.Tensor]:
        """Additive held-out statistics of one batch; summed over batches, then read by ``eval_summary``."""
        return {"loss_sum": self(idx, targets) * targets.numel(), "tokens": torch.tensor(targets.numel())}

    @staticmethod
    def eval_summary(sums: dict[str, float]) -> dict[str, float]:
        """Held-out metrics from summed statistics: ``val_loss`` always; routed families add their own."""
        return {"val_loss": sums["loss_sum"] / sums["tokens"]}
