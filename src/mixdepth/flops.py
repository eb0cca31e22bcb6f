"""The FLOP convention, in one place.

Forward FLOPs per token count every matmul as 2·m·n·k: attention projections, attention scores and values
over the mean causal context (T+1)/2, the MLP, routers and predictors, and the LM head; embedding lookups,
norms, RoPE and softmax count 0. Routed blocks count at their capacity, experts at their realised routing,
depth attention over the slots each layer reads. Each family config implements ``flops_per_token()`` and
``n_params()`` under this convention. Training FLOPs = 3 × forward (backward = 2 × forward; ``train_flops``),
so an isoFLOP budget C buys D = C / (3 · flops_per_token) tokens; 6·N·D is stored beside it for comparison only.
"""

from __future__ import annotations


def train_flops(flops_per_token: float, tokens: float) -> float:
    """Training FLOPs (forward and backward) of ``tokens`` tokens at ``flops_per_token`` forward FLOPs."""
    return 3 * flops_per_token * tokens


def tokens_for_budget(flops_per_token: float, budget: float) -> float:
    """Training tokens that a budget of ``budget`` FLOPs buys at ``flops_per_token`` forward FLOPs."""
    return budget / train_flops(flops_per_token, 1)


def steps_for_budget(flops_per_token: float, budget: float, tokens_per_step: int) -> int:
    """Whole optimizer steps nearest to the budget (training FLOPs within half a step of C)."""
    return round(tokens_for_budget(flops_per_token, budget) / tokens_per_step)
