"""What torch.compile's on-disk caches may serve: graphs that hold this project's autocast regions and kernels.

AOTAutograd's cache bypasses a graph holding an autocast context (the routers' fp32 region) or a custom
autograd.Function (every kernel under ``kernels/`` on CUDA), so each process of a sweep traced and partitioned those
graphs again: MoDE's warm compile on the H200 spent 9.1 of its 13.1 s in AOTAutograd (2026-12-02). The autocast
nodes depend only on their arguments, constants of the graph and so of its cache key (pytorch/pytorch#191106,
allowed upstream after torch 2.13). torch keeps autograd.Functions out because what they call need not be in the key
(here: Triton kernels, helpers around them); the key is salted here with the sha256 of the sources that define them,
so an edited kernel misses the cache instead of replaying stale code.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from functools import cache
from pathlib import Path

import torch

import kernels

AUTOCAST_NODES = ("torch.amp.autocast_mode._enter_autocast", "torch.amp.autocast_mode._exit_autocast")
SOURCES = (Path(kernels.__file__).parent, Path(__file__).parent)  # the kernels and the models that call them


@cache
def sources_digest(roots: tuple[Path, ...]) -> str:
    """sha256 (16 hex digits) of every ``*.py`` file under ``roots``: names and contents, in a fixed order."""
    h = hashlib.sha256()
    for root in roots:
        for path in sorted(root.rglob("*.py")):
            h.update(f"{path.relative_to(root.parent)}\0".encode())
            h.update(path.read_bytes())
    return h.hexdigest()[:16]


def cache_compiled_graphs(sources: Sequence[Path] = SOURCES) -> None:
    """Let the on-disk caches serve graphs that enter an autocast region (``AUTOCAST_NODES``) and, where this torch
    can salt its cache key (``torch.compiler.config.cache_key_tag``), graphs holding autograd.Functions defined in
    ``sources``, keyed by their digest. Idempotent; a cache key tag set before is kept in front of the digest."""
    import torch._functorch.config as functorch
    import torch._inductor.config as inductor
    import torch.compiler.config as compiler

    marked = dict(inductor.unsafe_marked_cacheable_functions)
    for name in AUTOCAST_NODES:
        marked.setdefault(name, torch.__version__)
    inductor.unsafe_marked_cacheable_functions = marked
    allow = "autograd_cache_allow_custom_autograd_functions"
    if not (hasattr(compiler, "cache_key_tag") and hasattr(functorch, allow)):
        return
    salt = f"mixdepth-sources-{sources_digest(tuple(Path(s) for s in sources))}"
    kept = [t for t in compiler.cache_key_tag.split("+") if t and not t.startswith("mixdepth-sources-")]
    compiler.cache_key_tag = "+".join([*kept, salt])
    setattr(functorch, allow, True)
