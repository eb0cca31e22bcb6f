"""The isoFLOP plan: every (arch, budget, shape) grid point, and its repeats with other seeds, with its exact FLOPs,
tokens and steps."""

from __future__ import annotations

import hashlib
import json
from dataclasses import asdict, dataclass
from typing import Any

from mixdepth.config import ConfigError, LabConfig, Shape, model_config
from mixdepth.flops import steps_for_budget, train_flops


@dataclass(frozen=True)
class Trial:
    run_id: str
    arch: str
    budget: float
    shape: Shape
    model: Any  # the family config
    params: dict[str, int]
    flops_per_token: float
    tokens: int
    steps: int
    seed: int  # train.seed of the run: the sweep's, or train.seed + k for the k-th repeat (sweep.seeds)

    @property
    def train_flops(self) -> float:
        return train_flops(self.flops_per_token, self.tokens)


def digest(obj: Any, n: int = 12) -> str:
    return hashlib.sha1(json.dumps(obj, sort_keys=True, default=str).encode()).hexdigest()[:n]


# Keys that change how a sweep is shown, scheduled or fitted, never what a run trains to: not part of its identity,
# so changing one resumes the same sweep and reuses every stored run (sweep.max_extra: how many sizes the sweep may
# add to bracket an optimum; raising it resumes the sweep and adds more; train.compile_mode, compile_scope and
# graph_step: the same model compiled for speed, with CUDA graphs, autotuned matmuls, per block or as one graph of
# the step, which can move results only by last bits as another GPU would).
NOT_IDENTITY = {
    "train": (
        "progress",
        "logger",
        "compile_mode",
        "compile_scope",
        "graph_step",
        "devices",
        "num_nodes",
        "strategy",
        "ckpt_every",
        "ckpt_dir",
        "keep_ckpt",
    ),
    "sweep": (
        "name",
        "workers",
        "workers_per_gpu",
        "mps",
        "retries",
        "storage",
        "heartbeat_interval",
        "grace_period",
        "max_extra",
    ),
}


# Keys added after sweeps were stored, at the value that trains what those sweeps trained before the key existed:
# left out of the identity while at it, so an older sweep resumes as the same sweep with the same run ids.
LATER = {"train": {"warmup_steps": 0}}


def identity(lab: LabConfig) -> dict:
    """The config that defines results: the merged sections without the ``NOT_IDENTITY`` keys, nor the ``LATER``
    keys at their former value.

    The resolved ``lab.archs`` are left out: they derive from these sections and conf/model/ YAML, and each
    run id hashes its own family config.
    """
    d = lab.sections()
    for section, keys in NOT_IDENTITY.items():
        for key in keys:
            d[section].pop(key)
    for section, former in LATER.items():
        for key, value in former.items():
            if d[section][key] == value:
                d[section].pop(key)
    return d


def sweep_id(lab: LabConfig, preset: str) -> str:
    """Deterministic id from the preset and what defines results: the same config resumes the same sweep, whatever
    its ``sweep.name`` (a label, kept in the ``sweeps`` table) or its fit and scheduling settings."""
    return f"{preset}-{digest([preset, identity(lab)], 8)}"


def point(lab: LabConfig, sid: str, arch: str, budget: float, shape: Shape, model: Any, seed: int) -> Trial:
    """The run of ``model`` (``arch``'s family config at ``shape``) at ``budget`` with ``train.seed = seed``; its
    run_id hashes the sweep, the point and what defines its training (the sweep's train section with this seed).
    Bracketing extras (sweeps/bracket.py) are made here too, so every run of a sweep is named the same way."""
    ident = identity(lab)
    tokens_per_step = lab.train.batch_size * lab.data.seq_len
    fpt = model.flops_per_token()
    steps = steps_for_budget(fpt, budget, tokens_per_step)
    train = {**ident["train"], "seed": seed}
    rid = digest([sid, arch, budget, asdict(model), ident["data"], train, steps])
    return Trial(rid, arch, budget, shape, model, model.n_params(), fpt, steps * tokens_per_step, steps, seed)


def seeds_at(lab: LabConfig, budget: float) -> range:
    """The train.seed values each grid point at ``budget`` trains with: the sweep's, and ``sweep.seeds - 1`` more
    at the ``sweep.seed_budgets`` (every budget when that is empty)."""
    s, base = lab.sweep, lab.train.seed
    repeated = not s.seed_budgets or budget in s.seed_budgets
    return range(base, base + (s.seeds if repeated else 1))


def plan(lab: LabConfig, sid: str) -> tuple[list[Trial], list[str]]:
    """All grid points that train at least ``sweep.min_steps`` steps and at most ``sweep.max_steps`` (each with its
    seeds), and notes on those left out."""
    s, t = lab.sweep, lab.train
    tokens_per_step = t.batch_size * lab.data.seq_len
    trials, notes = [], []
    for arch in s.archs:
        models, dense_like = [], {}
        for shape in s.ladder:
            m = model_config(lab, arch, shape)
            if why := m.same_as_dense():
                dense_like.setdefault(why, []).append(f"d={shape.d_model} L={shape.n_layers}")
            else:
                models.append((shape, m))
        for why, shapes in dense_like.items():  # one note per reason, not one per shape
            notes.append(f"{arch} {', '.join(shapes)}: {why}, the dense model; left out")
        if not models:
            raise ConfigError(f"no sweep.ladder shape suits {arch}: {notes[-1]}")
        for budget in s.budgets:
            kept = []
            for shape, m in models:
                trial = point(lab, sid, arch, budget, shape, m, t.seed)
                too_few, too_many = trial.steps < s.min_steps, 0 < s.max_steps < trial.steps
                if too_few or too_many:
                    bound = f"< sweep.min_steps={s.min_steps}" if too_few else f"> sweep.max_steps={s.max_steps}"
                    notes.append(
                        f"{arch} C={budget:.2e} d={shape.d_model} L={shape.n_layers}: {trial.steps} steps {bound},"
                        " left out"
                    )
                    continue
                kept.append((shape, m, trial))
            if not kept:
                need = min(train_flops(m.flops_per_token(), s.min_steps * tokens_per_step) for _, m in models)
                if budget < need:
                    raise ConfigError(
                        f"budget {budget:.3g} FLOPs is below the smallest {arch} model's cost"
                        f" ({need:.3g} FLOPs for sweep.min_steps={s.min_steps} steps)"
                    )
                raise ConfigError(
                    f"no sweep.ladder size of {arch} trains between sweep.min_steps={s.min_steps} and"
                    f" sweep.max_steps={s.max_steps} steps at budget {budget:.3g} FLOPs"
                )
            trials += [trial for _, _, trial in kept]
            for seed in seeds_at(lab, budget)[1:]:  # the repeats after the budget's first pass
                trials += [point(lab, sid, arch, budget, shape, m, seed) for shape, m, _ in kept]
    return trials, notes


def table(trials: list[Trial]) -> str:
    """The plan as a fixed-width text table."""
    head = (
        "arch",
        "budget",
        "d_model",
        "layers",
        "heads",
        "params",
        "nonembed",
        "FLOPs/token",
        "tokens",
        "steps",
        "seed",
    )
    rows = [
        (
            t.arch,
            f"{t.budget:.2e}",
            str(t.shape.d_model),
            str(t.shape.n_layers),
            str(t.shape.n_heads),
            f"{t.params['total']:,}",
            f"{t.params['nonembed']:,}",
            f"{t.flops_per_token:.4g}",
            f"{t.tokens:,}",
            str(t.steps),
            str(t.seed),
        )
        for t in trials
    ]
    widths = [max(len(r[i]) for r in [head, *rows]) for i in range(len(head))]
    fmt = "  ".join(f"{{:>{w}}}" for w in widths)
    return "\n".join([fmt.format(*head), fmt.format(*("-" * w for w in widths))] + [fmt.format(*r) for r in rows])
