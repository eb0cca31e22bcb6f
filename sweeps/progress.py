"""The sweep's progress bar: training FLOPs of the runs finished over those of the whole sweep, with the elapsed
time and an ETA (tqdm), and the lines a sweep prints, written above it.

The bar is drawn only when stdout is a terminal; elsewhere (a log file, a pipe) the lines are all there is. Its
total is what this process has trained plus what is left, running here or queued (``Drain`` sets it as runs start
and end): it grows when the sweep adds sizes to bracket an optimum, and shrinks when another host takes a queued
run or a run is left out.
"""

from __future__ import annotations

import sys
import threading

from tqdm import tqdm

REFRESH_S = 1.0  # the elapsed time moves while a run trains in this process, which updates nothing


class Progress:
    def __init__(self, shown: bool | None = None):
        """``shown``: draw the bar (default: whether stdout is a terminal)."""
        self.shown = sys.stdout.isatty() if shown is None else shown
        self.runs, self.flops = 0, 0.0  # runs finished here, and their training FLOPs
        self.planned = 0  # runs finished here and left
        self._bar = tqdm(
            desc="sweep",
            total=0,
            unit="FLOP",
            unit_scale=True,
            smoothing=0,  # the ETA from the mean rate so far: run sizes differ too much for a recent one
            dynamic_ncols=True,
            file=sys.stdout,
            disable=not self.shown,
            bar_format="{desc} {percentage:3.0f}%|{bar}| {n_fmt}/{total_fmt} training FLOPs"
            " [{elapsed}<{remaining}{postfix}]",
        )
        self._stop = threading.Event()
        if self.shown:
            threading.Thread(target=self._tick, daemon=True).start()

    def line(self, text: str) -> None:
        """Print ``text`` (above the bar, when it is shown)."""
        if self.shown:
            self._bar.write(text, file=sys.stdout)
        else:
            print(text, flush=True)

    def left(self, flops: float, runs: int) -> None:
        """What is left of the sweep: ``runs`` runs of ``flops`` training FLOPs in all (running or queued)."""
        self._bar.total, self.planned = self.flops + flops, self.runs + runs
        self._count()
        self._bar.refresh()

    def finished(self, flops: float) -> None:
        """A run of ``flops`` training FLOPs finished here."""
        self.runs, self.flops = self.runs + 1, self.flops + flops
        self._count()
        self._bar.update(flops)

    def _count(self) -> None:
        self._bar.set_postfix_str(f"{self.runs} of {self.planned} runs", refresh=False)

    def close(self) -> None:
        self._stop.set()
        self._bar.close()

    def __enter__(self) -> Progress:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _tick(self) -> None:
        while not self._stop.wait(REFRESH_S):
            self._bar.refresh()
