"""Sweep utilisation: the training FLOPs one sweep command trained over what its GPUs could have done in its
wall-clock, from the command's start to its report (wall x GPUs x per-GPU peak), and where the time went. The
FLOPs are each finished run's share trained in this command and, of a run stopped unfinished, those up to its
newest checkpoint (a later command resumes from there): every step of a sweep's runs counts once over its commands.

The parts share the command's device time: start-up (interpreter, imports, plan, corpus, store) and analysis (fits,
figures; up to the report) hold every device; each run's set-up, compilation and first steps (its fit time beyond its
steady-state steps), steady-state steps and evaluation hold its slot, and so does a run stopped unfinished by a time
limit, an interrupt or a failure (its slot's time until then), the steps of a resumed run that an earlier command
counted but whose checkpoint was lost since (trained again, counted once), the time between runs (queue, worker start,
hand-over) and slots left idle. Slots that share a GPU (``sweep.workers_per_gpu``) each count as that share of it.
"""

from __future__ import annotations

import datetime as dt
import os
import time
from dataclasses import dataclass, field

CUT = {  # why a run ended unfinished -> its part
    "time limit": "runs stopped at the time limit",
    "interrupted": "runs interrupted unfinished",
    "failed": "failed attempts",
}
AGAIN = "steps trained again"  # steps an earlier command counted, kept by a checkpoint that was lost since
PARTS = ("start-up", "run set-up", "compilation and first steps", "training steps", "evaluation", *CUT.values(),
         AGAIN, "idle or between runs", "analysis")  # fmt: skip
STOPPED = {  # why a command ended before its report -> how its usage says so
    "interrupted": "interrupted before its report",  # Ctrl-C, SIGTERM, a fault
    "time limit": "stopped at its time limit, before its report",  # --time-limit: runs left queued
}
SHARED = {"mps": "runs sharing a GPU under MPS", "time-sliced": "runs sharing a GPU time-sliced"}


def process_start() -> float:
    """When this process started (seconds since the epoch): from /proc on Linux, else now."""
    try:
        with open("/proc/self/stat") as f:
            ticks = int(f.read().rsplit(")", 1)[1].split()[19])  # field 22, starttime, after the command name
        with open("/proc/stat") as f:
            boot = next(int(line.split()[1]) for line in f if line.startswith("btime "))
        return boot + ticks / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError, StopIteration):
        return time.time()


@dataclass
class Usage:
    """Collects one sweep command's runs and phases; ``row`` is its ``sweep_usage`` row.

    Attributes:
        sweep_id: the sweep.
        slots: runs trained at once.
        gpus: distinct GPUs the slots train on (0 on CPU: no utilisation, the parts still say where time went).
        sharing: how slots that share a GPU ran: "mps" (at once), "time-sliced", or "unshared" (none share one).
        started: when the command started (``process_start``).
        commit, command: the command's provenance (``sweeps.provenance``), stored with its row.
    """

    sweep_id: str
    slots: int
    gpus: int
    sharing: str = "unshared"
    started: float = field(default_factory=process_start)
    commit: str | None = None
    command: str | None = None
    training: float | None = None  # when the first run was handed out
    trained: float | None = None  # when the last run ended
    flops: float = 0.0  # of the finished runs (their share trained in this command)
    kept: float = 0.0  # of the runs stopped unfinished, up to their newest checkpoint: resumed, not trained again
    peak: float | None = None
    runs: int = 0
    stopped: int = 0  # runs ended unfinished (a time limit, an interrupt, a failure): the command used its device
    per_run: dict[str, float] = field(default_factory=lambda: dict.fromkeys(PARTS[1 : 6 + len(CUT)], 0.0))
    mfu_flops: float = 0.0  # sum of MFU x FLOPs over the runs, for their FLOP-weighted mean MFU

    def add(self, metrics, tokens: int, train_flops: float, steps: int, resumed: int = 0, counted: int = 0) -> None:
        """One finished run of ``steps`` steps: its ``RunMetrics``, tokens and training FLOPs. It trained here from
        step ``resumed`` (a run resumed from a checkpoint trained the steps before in earlier commands), and earlier
        commands counted its FLOPs up to step ``counted``: steps between the two it trained again (a checkpoint they
        counted was lost since), which take their time here and count no FLOPs."""
        share, again = 1 - resumed / steps, max(0, counted - resumed) / steps
        wall = metrics.wall_s * share
        steady = min(wall, tokens * share / metrics.tokens_per_s)  # its steps at the steady-state rate
        repeat = steady * again / share if share else 0.0  # resumed at its last step: none trained here
        self.per_run["run set-up"] += metrics.setup_s or 0.0
        self.per_run["compilation and first steps"] += wall - steady
        self.per_run["training steps"] += steady - repeat
        self.per_run[AGAIN] += repeat
        self.per_run["evaluation"] += metrics.eval_s or 0.0
        self.flops += train_flops * (share - again)
        self.runs += 1
        self.peak = self.peak or metrics.peak_flops
        if metrics.mfu is not None:
            self.mfu_flops += metrics.mfu * train_flops * (share - again)

    def cut(self, seconds: float, why: str = "time limit", kept: float = 0.0) -> None:
        """A run ended unfinished after ``seconds`` in its slot, by ``why`` (a key of ``CUT``), its checkpoints
        keeping ``kept`` training FLOPs of them (the run resumes there; 0: its time is lost)."""
        self.per_run[CUT[why]] += seconds
        self.kept += kept
        self.stopped += 1

    def row(self, now: float | None = None, stopped: str | None = None) -> dict:
        """The ``sweep_usage`` row up to ``now`` (default: this moment); parts in device-seconds, summing to
        wall x devices; ``stopped``: why the command ended before its report (``STOPPED``), None when it did not."""
        now = time.time() if now is None else now
        training = self.training if self.training is not None else now
        trained = self.trained if self.trained is not None else now
        wall, devices = now - self.started, max(self.gpus, 1)
        per_slot = devices / self.slots  # device-seconds per slot-second
        between = self.slots * (trained - training) - sum(self.per_run.values())
        parts = {
            "start-up": (training - self.started) * devices,
            **{k: v * per_slot for k, v in self.per_run.items()},
            "idle or between runs": max(0.0, between) * per_slot,
            "analysis": (now - trained) * devices,
        }
        known = self.gpus > 0 and self.peak is not None
        return {
            "sweep_id": self.sweep_id,
            "started_at": dt.datetime.fromtimestamp(self.started, dt.UTC).replace(tzinfo=None),
            "wall_s": wall,
            "gpus": self.gpus,
            "peak_flops": self.peak if known else None,
            "train_flops": self.flops + self.kept,
            "runs": self.runs,
            "utilisation": (self.flops + self.kept) / (wall * devices * self.peak) if known else None,
            "parts": {
                **parts,
                "runs_mfu": self.mfu_flops / self.flops if known and self.flops else None,
                "sharing": self.sharing,
                "interrupted": stopped is not None,  # before its report, by ``stopped``
                "stopped": stopped,
            },
            "commit": self.commit,
            "command": self.command,
        }


def lines(row: dict) -> list[str]:
    """What a sweep prints at its end (and the report and ``sweeps status`` say): utilisation and its parts."""
    parts, wall = row["parts"], row["wall_s"]
    device_s = wall * max(row["gpus"], 1)
    if row["utilisation"] is None:
        head = f"sweep wall-clock {wall:.0f} s (no GPU peak known: utilisation not measured)"
    else:
        head = (
            f"sweep utilisation {row['utilisation']:.1%}: {row['train_flops']:.3g} training FLOPs over {wall:.0f} s"
            f" x {row['gpus']} GPU x {row['peak_flops']:.4g} FLOP/s peak"
        )
        if parts.get("sharing") in SHARED:
            head += f" ({SHARED[parts['sharing']]})"
    shares = []
    for k in PARTS:
        if k not in parts or (k in (*CUT.values(), AGAIN) and not parts[k]):  # stored before it existed; none such
            continue
        share = f"{k} {parts[k] / device_s:.1%}"
        if k == "training steps" and parts.get("runs_mfu") is not None:
            share += f" (the runs' MFU {parts['runs_mfu']:.1%}, FLOP-weighted)"
        shares.append(share)
    stopped = f" ({STOPPED.get(parts.get('stopped'), STOPPED['interrupted'])})" if parts.get("interrupted") else ""
    return [head + stopped, "  where the time went: " + ", ".join(shares)]
