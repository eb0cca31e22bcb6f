"""Bracketed optima: sizes a sweep adds where an (arch, budget)'s isoFLOP vertex falls outside its sampled sizes.

Once every run of an (arch, budget) has finished (the rest of the grid may still train), it gets the analysis's
parabola (``analysis.isoflop.fit_parabola``: val_loss against ln N, N the non-embedding parameters) over its
finished runs. Where the vertex is no minimum inside the sampled N, one size is added beyond an edge: the smaller
side when the vertex lies below the smallest size or (no minimum) the loss falls toward it, else the larger. Optuna
proposes the size: a TPE sampler told every finished run of the (arch, budget) as a completed trial at its ln N asks
ln N from a distribution over that side's candidates only, and the candidate nearest its proposal trains. Then the
parabola is fitted again, until the vertex is inside or ``sweep.max_extra`` sizes were added. With 2 sizes there is
no parabola yet: the side is the end with the lower loss; a single size gives no side, and nothing is added.

Candidates extend the edge's shape (the smallest or largest sampled one): its layer count and heads, d_model in
steps of 2 * n_heads (even head widths, for RoPE) out to half or twice the edge's d_model, each a shape the family
accepts, not the dense model (``same_as_dense``), training at least ``sweep.min_steps`` steps, and not run before
(``sweep.max_steps`` bounds only the plan: a smaller size the losses ask for is added however long it trains).
Where the parabola has a vertex, they reach no further than the first candidate at or beyond it: that size brackets
the vertex if the fit holds; a farther one adds a point where a parabola in ln N holds least and, on the larger side,
needs more memory and trains fewer steps (if the refit moves the vertex further out, the next round goes on from the
new edge).

Deterministic and resumable: the proposal study lives in memory, rebuilt from the database's rows (the record)
each time, its sampler seeded by the sweep, the arch, the budget and how many sizes were added there before; a size
once proposed is a trial of the sweep's study (user attribute ``extra``) and a row once trained, so a rerun after a
kill finds it, trains it if it has no row, and proposes the same next sizes (the same run ids) as an uninterrupted
sweep. Extras train with the sweep's train.seed only.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import duckdb
import optuna
from optuna.distributions import FloatDistribution
from optuna.trial import create_trial

from mixdepth.config import ConfigError, LabConfig, Shape, model_config
from sweeps.plan import Trial, digest, point

SMALLER, LARGER, INSIDE = "smaller", "larger", "inside"
REACH = 2  # candidates reach from the edge's d_model to half of it (smaller) or twice it (larger)


@dataclass(frozen=True)
class Sized:
    """A stored run of one (arch, budget).

    Attributes:
        run_id: its id.
        shape: its ladder shape.
        n: non-embedding parameters.
        tokens: tokens it trained on.
        loss: val_loss of a run that finished ok; None for a diverged one.
    """

    run_id: str
    shape: Shape
    n: int
    tokens: int
    loss: float | None


def stored(con: duckdb.DuckDBPyConnection, sid: str) -> dict[tuple[str, float], list[Sized]]:
    """(arch, budget) -> the sweep's stored runs there, smallest N first."""
    rows = con.execute(
        "SELECT arch, budget, run_id, d_model, n_layers, n_heads, n_kv_heads, params_nonembed, tokens,"
        " CASE WHEN status = 'ok' THEN val_loss END FROM runs WHERE sweep_id = ? ORDER BY params_nonembed, run_id",
        [sid],
    ).fetchall()
    out: dict[tuple[str, float], list[Sized]] = {}
    for arch, budget, rid, d, layers, heads, kv, n, tokens, loss in rows:
        out.setdefault((arch, budget), []).append(Sized(rid, Shape(d, layers, heads, kv), n, tokens, loss))
    return out


def side(runs: list[Sized], budget: float) -> tuple[str | None, str, float | None]:
    """Where the optimum of one (arch, budget) lies against its finished runs: ``(INSIDE | SMALLER | LARGER, why,
    vertex)``, the vertex N where the parabola has a minimum (else None), or ``(None, why, None)`` when fewer than 2
    sizes finished ok."""
    from analysis.isoflop import fit_parabola

    ok = [r for r in runs if r.loss is not None]
    by_n: dict[int, list[float]] = {}
    for r in ok:
        by_n.setdefault(r.n, []).append(r.loss)
    if not by_n:
        return None, "no run finished with a loss to fit", None
    if len(by_n) == 1:
        return None, "one size: no side to add sizes on", None
    mean = {n: sum(v) / len(v) for n, v in by_n.items()}
    lo, hi = min(mean), max(mean)
    toward = SMALLER if mean[lo] < mean[hi] else LARGER  # the end the loss falls toward
    if len(mean) == 2:
        return toward, "2 sizes, too few for a parabola", None
    fit = fit_parabola([r.n for r in ok], [r.loss for r in ok], budget, [r.tokens for r in ok])
    if fit.vertex_inside:
        return INSIDE, f"vertex N={fit.n_opt:,.0f} inside [{lo:,}, {hi:,}]", fit.n_opt
    if fit.curvature <= 0:
        return toward, f"no minimum (curvature {fit.curvature:.3g}), the loss falls toward the {toward} sizes", None
    if fit.n_opt < fit.n_min:
        return SMALLER, f"vertex N={fit.n_opt:,.0f} below the smallest size {lo:,}", fit.n_opt
    return LARGER, f"vertex N={fit.n_opt:,.0f} above the largest size {hi:,}", fit.n_opt


def candidates(lab: LabConfig, sid: str, arch: str, budget: float, edge: Shape, where: str) -> list[Trial]:
    """The runs that may extend ``edge`` (the smallest or largest sampled shape) on side ``where``, nearest first."""
    q = 2 * edge.n_heads
    if where == SMALLER:
        widths = range(edge.d_model - q, max(q, -(-edge.d_model // REACH)) - 1, -q)
    else:
        widths = range(edge.d_model + q, REACH * edge.d_model + 1, q)
    out = []
    for d in widths:
        shape = Shape(d, edge.n_layers, edge.n_heads, edge.n_kv_heads)
        try:
            m = model_config(lab, arch, shape)
        except ConfigError:  # the family refuses this width (heads, grouped KV)
            continue
        if m.same_as_dense():
            continue
        t = point(lab, sid, arch, budget, shape, m, lab.train.seed)
        if t.steps >= lab.sweep.min_steps:
            out.append(t)
    return out


def propose(
    lab: LabConfig,
    sid: str,
    arch: str,
    budget: float,
    runs: list[Sized],
    where: str,
    taken: set[str],
    k: int,
    vertex: float | None = None,
) -> tuple[Trial, float] | None:
    """The next size of one (arch, budget) on side ``where``, and the N Optuna proposed; None when no candidate is
    left.

    Args:
        lab: the sweep's config.
        sid: the sweep id.
        arch, budget: the grid column.
        runs: its stored runs (``stored``).
        where: ``SMALLER`` or ``LARGER`` (``side``).
        taken: run ids that exist already, stored or queued (none is proposed again).
        k: sizes added at this (arch, budget) so far (the sampler's seed depends on it).
        vertex: the parabola's vertex N (``side``), if it has one: no candidate beyond the first at or past it.
    """
    ok = [r for r in runs if r.loss is not None]
    edge = (min if where == SMALLER else max)(ok, key=lambda r: r.n).shape
    cands = [t for t in candidates(lab, sid, arch, budget, edge, where) if t.run_id not in taken]
    if vertex is not None:
        past = [i for i, t in enumerate(cands) if (t.params["nonembed"] - vertex) * (1 if where == LARGER else -1) >= 0]
        cands = cands[: past[0] + 1] if past else cands
    if not cands:
        return None
    logs = [math.log(t.params["nonembed"]) for t in cands]
    told = [math.log(r.n) for r in ok]
    space = FloatDistribution(min(logs + told), max(logs + told))
    sampler = optuna.samplers.TPESampler(n_startup_trials=0, seed=int(digest([sid, arch, budget, k], 8), 16))
    study = optuna.create_study(direction="minimize", sampler=sampler)
    for r, u in zip(ok, told, strict=True):
        study.add_trial(create_trial(params={"log_n": u}, distributions={"log_n": space}, value=r.loss))
    asked = study.ask({"log_n": FloatDistribution(min(logs), max(logs))}).params["log_n"]
    return min(cands, key=lambda t: abs(math.log(t.params["nonembed"]) - asked)), math.exp(asked)


def next_sizes(
    lab: LabConfig,
    sid: str,
    by_key: dict[tuple[str, float], list[Sized]],
    runs: dict[str, dict],
    only: set[tuple[str, float]] | None = None,
) -> tuple[list[tuple[Trial, int, str]], list[str]]:
    """One bracketing round over the sweep: the sizes to add, each with its number at its (arch, budget) and the
    line that says why; and a line for each (arch, budget) whose vertex is still outside but gets no size (its last
    word once a round adds nothing).

    Args:
        by_key: the sweep's stored runs (``stored``).
        runs: run_id -> payload of every run the sweep holds, planned or added (``payload["extra"]``), stored or
            not; an (arch, budget) with one not stored yet (queued, training, or failed and to be retried by a rerun)
            is left as it is.
        only: the (arch, budget)s to look at (a run just finished there); None: every one.
    """
    s = lab.sweep
    grid = {rid for rid, p in runs.items() if "extra" not in p}
    held: dict[tuple[str, float], set[str]] = {}
    for rid, p in runs.items():
        held.setdefault((p["row"]["arch"], p["row"]["budget"]), set()).add(rid)
    taken = set(runs) | {r.run_id for rows in by_key.values() for r in rows}
    new, left = [], []
    for arch in s.archs:
        for budget in s.budgets:
            if only is not None and (arch, budget) not in only:
                continue
            rows = by_key.get((arch, budget), [])
            have = {r.run_id for r in rows}
            where, why, vertex = side(rows, budget)
            if where not in (SMALLER, LARGER) or held.get((arch, budget), set()) - have:
                continue
            label = f"{arch} C={budget:.2e}"
            k = len(have - grid)
            if k >= s.max_extra:
                left.append(f"{label}: {why}; {k} size{'s' * (k != 1)} added (sweep.max_extra={s.max_extra})")
                continue
            got = propose(lab, sid, arch, budget, rows, where, taken, k, vertex)
            if got is None:
                left.append(f"{label}: {why}; no {where} shape left to try (sweep.min_steps, the family's shapes)")
                continue
            trial, asked = got
            line = (
                f"bracket {label}: {why}; Optuna proposes N={asked:,.0f}: adding d_model={trial.shape.d_model}"
                f" layers={trial.shape.n_layers} (N={trial.params['nonembed']:,}), size {k + 1} of at most"
                f" {s.max_extra}"
            )
            new.append((trial, k + 1, line))
    return new, left


def rebuild(lab: LabConfig, sid: str, payload: dict) -> Trial:
    """The ``Trial`` of a size added earlier, from its queued payload (this command's config: same run id)."""
    r = payload["row"]
    shape = Shape(r["d_model"], r["n_layers"], r["n_heads"], r["n_kv_heads"])
    return point(lab, sid, r["arch"], r["budget"], shape, model_config(lab, r["arch"], shape), r["seed"])


def inside(lab: LabConfig, by_key: dict[tuple[str, float], list[Sized]]) -> dict[str, int]:
    """arch -> budgets whose vertex is a minimum inside the sampled sizes."""
    return {
        arch: sum(side(by_key.get((arch, b), []), b)[0] == INSIDE for b in lab.sweep.budgets)
        for arch in lab.sweep.archs
    }
