"""A command's time limit (``--time-limit``: a GPU lent for minutes, a SLURM job's ``--time``): a queued run starts
only when the sweep's finished runs predict that it ends within the limit, the longest of those first, so the
command stops with the rest still queued instead of killing runs half-way, whose time is lost (a fifth of a
9-minute H200 command, 2026-12-05).

A prediction is the run's set-up, training and evaluation seconds, from the finished runs of its sweep:

- a shape trained before (same sweep, arch, width, depth and batch): the seconds per step of its run with the most
  steps (the one whose compilation is spread thinnest; the slowest of those) times the run's steps, plus the
  shape's longest set-up and evaluation;
- another shape: its training FLOPs at the FLOP rate of its arch's run of the most FLOPs at the nearest width at or
  below its own (of every arch when none of its own has finished): wider models run closer to peak, and the nearest
  narrower width is the tightest such bound, where the narrowest would price a d 1024 run at a d 256 one's rate
  (MoD d 1024 at 3e16: 1,415 s predicted, 292 s trained; 2026-12-06). With only wider widths finished, the lowest
  of their rates scaled down with width (the queue's ``cost``: small matmuls run further below peak). Plus the
  longest set-up and evaluation seen;
- nothing finished yet: no prediction; such a run starts first, while the time left is longest.

The finished runs' seconds per step hold their compilation and the runs that shared the device with them;
``MARGIN`` covers a run that trains up to a fifth slower than they did. One that trains with fewer beside it is
over-priced (MoD d 768 alone in 92 s, predicted at 523 s from its shape's run beside three others; 2026-12-06) and
waits for the next command rather than being cut off.

A fifth is not a bound: beside other runs under MPS a run's speed depends on what trains beside it. Replayed on
the 49 and 104 runs of two H100 sweeps, a run took 0.9 x its prediction at the median, over 1.2 x for one in six,
up to 1.8 x; a command of 530 s started MoD d 600 (predicted 424 s) and MoDA d 144 (281 s), both still training
when the device's 600 s ended it (2026-12-07). So the limit is also kept by stopping: a run still training at the
limit is stopped there (its worker process killed; with ``--time-limit`` a sweep of one worker trains in a worker
process too) and queued again, and the command ends as at any time limit. Its time is lost, unless it checkpoints
(``train.ckpt_every``): then the next command resumes it from its last checkpoint. A stopped run that does not is
predicted at least as long as it trained (``STOPPED_S``; it had not ended), so the rerun does not start it into the
same stop. A launch of several ranks (``srun``, ``torchrun``) trains in its own processes and is not stopped.

A run that checkpoints is predicted for the steps left after the checkpoint it resumes from, and may start though it
would not end in time, after every run that would, once its next checkpoint is predicted within the limit: it trains
across commands (a run longer than a whole command, or a sweep's last runs in the commands' empty slots), losing at
each stop only the steps since its newest checkpoint.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

MARGIN = 1.2  # a run starts when now + MARGIN x its predicted seconds is within the limit
STOPPED_S = "stopped_s"  # a queued trial's attribute: the longest a time limit let its run train, unfinished
TIME_LIMIT = 75  # the exit code of a command that stopped at its time limit with runs still queued (EX_TEMPFAIL)


def parse(text: str) -> float:
    """``--time-limit``'s seconds: a positive number of seconds, or of minutes or hours with ``m`` or ``h``
    (``540``, ``9m``, ``1.5h``).

    Raises:
        ConfigError: anything else.
    """
    from mixdepth.config import ConfigError

    scale = {"s": 1, "m": 60, "h": 3600}.get(text[-1:].lower(), 0)
    try:
        value = float(text[:-1] if scale else text) * (scale or 1)
    except ValueError:
        value = math.nan
    if not (math.isfinite(value) and value > 0):
        raise ConfigError(f"--time-limit must be positive seconds, or minutes or hours (540, 9m, 1.5h), got {text!r}")
    return value


def _shape(row: dict) -> tuple:
    return row["sweep_id"], row["arch"], row["d_model"], row["n_layers"], row["batch_size"], row["seq_len"]


def part(row: dict, steps: int) -> dict:
    """The row of ``steps`` of run ``row``'s steps: its training FLOPs in proportion."""
    return {**row, "steps": steps, "train_flops": row["train_flops"] * steps / row["steps"]}


def _fixed(row: dict) -> float:
    """A finished run's seconds outside its steps: set-up before them, evaluation after."""
    return (row.get("setup_s") or 0.0) + (row.get("eval_s") or 0.0)


def predictor(finished: Iterable[dict]) -> Callable[[dict], float | None]:
    """``seconds(row)``: a queued run's predicted seconds (module docstring), from the finished runs' rows with
    their ``RunMetrics`` (``queue.finished``); None when none has finished. Diverged runs are left out (they may
    stop early)."""
    done = [r for r in finished if r.get("status") == "ok" and r["wall_s"] > 0]
    runs: dict[tuple, list[dict]] = {}
    rates: dict[str, list[dict]] = {}
    for r in done:
        runs.setdefault(_shape(r), []).append(r)
        rates.setdefault(r["arch"], []).append(r)
    longest = max(map(_fixed, done), default=0.0)
    every = [r for rs in rates.values() for r in rs]

    def rate(rs: list[dict], d: int) -> float:
        """FLOP/s of the runs ``rs`` (one arch's, or every arch's) for a model of width ``d``."""
        narrower = [r for r in rs if r["d_model"] <= d]
        if not narrower:
            return min(r["train_flops"] / r["wall_s"] * d / r["d_model"] for r in rs)
        width = max(r["d_model"] for r in narrower)
        top = max((r for r in narrower if r["d_model"] == width), key=lambda r: (r["train_flops"], r["wall_s"]))
        return top["train_flops"] / top["wall_s"]

    def seconds(row: dict) -> float | None:
        if not done:
            return None
        if same := runs.get(_shape(row)):
            most = max(same, key=lambda r: (r["steps"], r["wall_s"]))
            return max(map(_fixed, same)) + most["wall_s"] / most["steps"] * row["steps"]
        return longest + row["train_flops"] / rate(rates.get(row["arch"], every), row["d_model"])

    return seconds


def no_checkpoints(attrs: dict) -> tuple[int, int]:
    """``saved`` of runs that keep no checkpoints: (interval 0, no step saved)."""
    return 0, 0


def estimator(
    finished: Iterable[dict], saved: Callable[[dict], tuple[int, int]] = no_checkpoints
) -> Callable[[dict], tuple[float | None, float | None]]:
    """``times(attrs)``: a queued trial's predicted seconds (from its user attributes and the ``finished`` runs,
    ``predictor``) to its end and to its next checkpoint (None when it keeps none), counted from the step it would
    resume from; its end at least as long as a time limit let it train unfinished (``STOPPED_S``). ``saved(attrs)``:
    the run's checkpoint interval in steps (0: none) and the step of the checkpoint it would resume from."""
    seconds = predictor(finished)

    def times(attrs: dict) -> tuple[float | None, float | None]:
        row, (every, done) = attrs["run"]["row"], saved(attrs)
        steps = row["steps"] - done
        end = seconds(part(row, steps) if done else row)
        if (ran := attrs.get(STOPPED_S)) is not None:
            end = max(end or 0.0, ran)
        return end, seconds(part(row, min(every, steps))) if every else None

    return times


@dataclass(frozen=True)
class Deadline:
    """A command's time limit: ``limit`` seconds from ``start`` (``clock`` seconds, the command's start)."""

    start: float
    limit: float
    clock: Callable[[], float] = field(default=time.time, compare=False)

    def left(self) -> float:
        return self.start + self.limit - self.clock()

    def order(
        self, finished: Iterable[dict], saved: Callable[[dict], tuple[int, int]] = no_checkpoints
    ) -> Callable[[dict], float | None]:
        """``key(attrs)`` of a queued trial's user attributes: None when its run, started now, is predicted (from
        ``finished`` and ``saved``, ``estimator``) neither to end in time nor to reach its next checkpoint; else its
        place: the longest of those predicted to end in time first (an unpredicted one before all), so the runs that
        need most of the time left start while they still fit, then those that only checkpoint in time, the shortest
        first."""
        times = estimator(finished, saved)

        def key(attrs: dict) -> float | None:
            left = self.left()
            if left <= 0:
                return None
            end, checkpoint = times(attrs)
            if end is None or MARGIN * end <= left:
                return -math.inf if end is None else -end
            return end if checkpoint is not None and MARGIN * checkpoint <= left else None

        return key

    def held(
        self, queued: list[dict], finished: Iterable[dict], saved: Callable[[dict], tuple[int, int]] = no_checkpoints
    ) -> str:
        """The line of a command that ends with the trials ``queued`` (their user attributes) still queued, none of
        which would end, or reach its next checkpoint, in time (``order``): rerun to resume, or, where even the
        soonest is predicted longer than a whole command of this limit, that rerunning it would start none (and, for
        runs without checkpoints, the ``interval`` that would train them across commands)."""
        finished = list(finished)
        n, times = len(queued), estimator(finished, saved)
        pairs = [times(attrs) for attrs in queued]  # (to its end, to its next checkpoint) of each
        keeps = any(c is not None for _, c in pairs)
        line = (
            f"time limit: {n} run{'s' * (n > 1)} still queued, none predicted to end"
            f"{' or reach its next checkpoint' * keeps} within the {max(0.0, self.left()):.0f} s left of"
            f" {self.limit:g} s"
        )
        soonest = [e if c is None else c for e, c in pairs]  # what a whole command must hold to start each usefully
        if soonest and None not in soonest and MARGIN * min(soonest) > self.limit:
            every = None if keeps else self.interval(queued, finished)
            within = " (each run's next checkpoint then predicted within half a command)" if every else ""
            hint = f", or with train.ckpt_every={every or 'N'}{within} to train such runs across commands"
            return (
                f"{line}; the shortest is predicted at {min(soonest):.0f} s (x {MARGIN:g} margin), more than a whole"
                f" command of {self.limit:g} s: rerun with a longer --time-limit or without one{'' if keeps else hint}"
            )
        return f"{line}; rerun the same command to resume"

    def interval(self, queued: list[dict], finished: Iterable[dict]) -> int | None:
        """The largest round checkpoint interval (1, 2 or 5 x 10^k steps) at which every trial ``queued`` would reach
        its next checkpoint within half of this limit, with ``MARGIN`` (``predictor``'s seconds are affine in a run's
        steps); None where even one step would not."""
        seconds, fits = predictor(finished), math.inf
        for attrs in queued:
            row = attrs["run"]["row"]
            end, first = seconds(row), seconds(part(row, 1))  # its steps; its first step and the fixed seconds
            if end is None or first is None or row["steps"] < 2:
                return None
            per_step = (end - first) / (row["steps"] - 1)
            if per_step > 0:
                fits = min(fits, (self.limit / (2 * MARGIN) - (first - per_step)) / per_step)
        if not 1 <= fits < math.inf:
            return None
        scale = 10 ** math.floor(math.log10(fits))
        return max(m * scale for m in (1, 2, 5) if m * scale <= fits)
