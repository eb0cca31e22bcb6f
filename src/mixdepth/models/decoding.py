"""Generation for the families that decode (MoD, MoDE through MoD, MoDA): the one sampling loop, its sampler
and the ragged per-layer KV cache."""

from __future__ import annotations

import torch


class KVCache:
    """One layer's KV cache with a length per sequence (a routed layer holds a different count per sequence).

    Rows ``[0, len[b])`` of sequence b are the keys/values of the tokens this layer processed, in position
    order, RoPE already applied at their true positions.
    """

    def __init__(self, batch: int, n_kv_heads: int, max_len: int, head_dim: int, device, dtype):
        self.k = torch.zeros(batch, n_kv_heads, max_len, head_dim, device=device, dtype=dtype)
        self.v = torch.zeros_like(self.k)
        self.len = torch.zeros(batch, dtype=torch.long, device=device)  # [B]

    def write_prefix(self, k: torch.Tensor, v: torch.Tensor, n: torch.Tensor) -> None:
        """k, v: [B, Hk, L, hd] of which the first n[b] rows are real (prefill); n: [B]."""
        L = k.shape[2]
        self.k[:, :, :L], self.v[:, :, :L] = k, v
        self.len = n.to(torch.long).clone()

    def append(self, k: torch.Tensor, v: torch.Tensor, take: torch.Tensor | None) -> None:
        """k, v: [B, Hk, 1, hd]; take: [B] bool (None = all), the sequences whose token this layer processes."""
        b = torch.arange(k.shape[0], device=k.device) if take is None else take.nonzero().squeeze(1)  # [b']
        slot = self.len[b]  # [b'] next free row per sequence
        # cast: under autocast k/v arrive in bf16 while the cache keeps the parameter dtype
        self.k[b, :, slot], self.v[b, :, slot] = k[b, :, 0].to(self.k.dtype), v[b, :, 0].to(self.v.dtype)
        self.len = self.len + (1 if take is None else take.long())

    def visible(self) -> torch.Tensor:
        """[B, 1, Lc] key mask over the filled prefix (Lc = longest length)."""
        Lc = int(self.len.max())
        return (torch.arange(Lc, device=self.len.device)[None] < self.len[:, None])[:, None]


def sample(logits: torch.Tensor, temperature: float, top_k: int | None, generator=None) -> torch.Tensor:
    """Next tokens for generation: logits [B, V] -> ids [B, 1]; temperature <= 0 is greedy, top_k filters."""
    if temperature <= 0:
        return logits.argmax(-1, keepdim=True)
    logits = logits.float() / temperature
    if top_k is not None:
        kth = logits.topk(min(top_k, logits.shape[-1]), dim=-1).values[:, -1:]  # [B, 1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    return torch.multinomial(logits.softmax(-1), 1, generator=generator)


class Decoder:
    """Mixin giving an LM the one ``generate`` loop. The family supplies three methods:

    - ``new_cache(batch, max_len)``: an empty cache for ``batch`` sequences of up to ``max_len`` positions;
    - ``prefill(idx, cache)``: the forward of a prompt idx [B, T0] (the mode generation runs in, e.g. MoD's
      causal routing) that fills the cache -> logits [B, T0, V];
    - ``decode_step(tok, pos, cache)``: one token per sequence, tok [B, 1] at position ``pos`` -> logits [B, V].

    Decoding prompt + tokens one by one must give the logits of that forward over the whole sequence.
    """

    @torch.no_grad()
    def generate(
        self,
        idx: torch.Tensor,
        max_new_tokens: int,
        temperature: float = 1.0,
        top_k: int | None = None,
        generator: torch.Generator | None = None,
    ) -> torch.Tensor:
        """Sample continuations. idx [B, T0] -> [B, T0 + max_new_tokens].

        temperature <= 0 is greedy; top_k keeps the k most likely tokens before sampling. The last sampled token
        is never fed back, so the positions used are 0 .. T0 + max_new_tokens - 2, all below seq_len (RoPE).
        """
        B, T0 = idx.shape
        if max_new_tokens < 0:
            raise ValueError(f"max_new_tokens must be >= 0, got {max_new_tokens}")
        if max(T0, T0 + max_new_tokens - 1) > self.cfg.seq_len:
            raise ValueError(f"prompt {T0} + {max_new_tokens} new tokens exceeds seq_len {self.cfg.seq_len} (RoPE)")
        cache = self.new_cache(B, T0 + max_new_tokens)
        logits = self.prefill(idx, cache)[:, -1]  # [B, V]
        out = [idx]
        for i in range(max_new_tokens):
            nxt = sample(logits, temperature, top_k, generator)  # [B, 1]
            out.append(nxt)
            if i + 1 < max_new_tokens:
                logits = self.decode_step(nxt, T0 + i, cache)
        return torch.cat(out, dim=1)
