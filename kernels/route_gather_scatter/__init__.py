"""Routed gather / scatter-add for Mixture-of-Depths blocks and MoDE experts (see ``op.py``)."""

from kernels.route_gather_scatter.naive import route_gather_naive, route_scatter_add_naive
from kernels.route_gather_scatter.op import route_gather, route_scatter_add

__all__ = ["route_gather", "route_gather_naive", "route_scatter_add", "route_scatter_add_naive"]
