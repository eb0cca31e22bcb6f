"""``StepGraph``: a training step's forward, backward and gradient clipping as one CUDA graph (``train.graph_step``).

The first ``warmup`` steps run eagerly (they compile, autotune and allocate); the next one is captured, and every
later step copies its batch into the graph's inputs and replays it: no Python, autograd engine or per-kernel launch
on the host, so a small model's step costs what its kernels cost on the GPU. The gradients stay in the parameters'
``.grad`` (buffers of the graph's pool, written again by each replay); the optimizer steps outside the graph.
"""

from __future__ import annotations

import torch
from torch import nn


class StepGraph:
    """``step(x, y)``: the gradients of the training objective (``model.loss_terms(x, y)``'s first) in the parameters'
    ``.grad``, their norm clipped to ``grad_clip`` (0: not clipped); returns (objective, LM loss), buffers that the
    next step overwrites."""

    def __init__(self, model: nn.Module, grad_clip: float, warmup: int = 3) -> None:
        self.model, self.grad_clip, self.warmup = model, grad_clip, warmup
        self.graph: torch.cuda.CUDAGraph | None = None
        self.eager_steps = 0
        self.x = self.y = torch.empty(0)  # the graph's inputs (from the first step on)
        self.terms = (torch.empty(0), torch.empty(0))  # its outputs: the objective and the LM loss

    def step(self, x: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if self.eager_steps == 0:  # warm-up and capture see the same input tensors: no recompile while capturing
            self.x, self.y = torch.empty_like(x, memory_format=torch.contiguous_format), torch.empty_like(y)
        self.x.copy_(x, non_blocking=True)
        self.y.copy_(y, non_blocking=True)
        if self.eager_steps < self.warmup:
            self.eager_steps += 1
            self.model.zero_grad(set_to_none=True)
            side = torch.cuda.Stream()  # warm-up off the capture's stream, as torch.cuda.graph asks
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                terms = self._forward_backward()
            torch.cuda.current_stream().wait_stream(side)
            return terms
        if self.graph is None:
            self.model.zero_grad(set_to_none=True)  # the captured backward allocates .grad in the graph's pool
            self.graph = torch.cuda.CUDAGraph()
            # under the caller's autocast as the warm-up was (a setting of its own would compile again); its cache
            # of cast weights lives for one step's context, so the capture casts the weights itself
            with torch.cuda.graph(self.graph):
                self.terms = self._forward_backward()
        self.graph.replay()
        return self.terms

    def _forward_backward(self) -> tuple[torch.Tensor, torch.Tensor]:
        loss, lm = self.model.loss_terms(self.x, self.y)
        loss.backward()
        if self.grad_clip > 0:
            torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.grad_clip)
        return loss.detach(), lm.detach()
