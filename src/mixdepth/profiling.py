"""Where a training step's wall-clock goes: GPU kernels, GPU idle, the host waiting on the GPU (torch.profiler).

``kernel_time(events)``: the time covered by at least one GPU kernel and the idle gaps between kernels.
``StepWindowProfile``: a Lightning callback profiling a window of ``train.fit``'s steps (``python -m mixdepth.bench
mfu --profile N``), so that what the trainer adds to the step's kernels is measured where users run it.
"""

from __future__ import annotations

import time

import lightning as L
import torch
from torch.autograd import DeviceType
from torch.profiler import ProfilerActivity, profile, record_function

GAP_US = 200  # GPU idle between two kernels counted as a gap (shorter ones are launch spacing)
WAITS = ("cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaEventSynchronize")  # the host blocking on the GPU
_END = "StepWindowProfile.end"


def kernel_time(events) -> tuple[float, list[float]]:
    """(µs covered by at least one GPU kernel or copy, idle gaps longer than ``GAP_US`` between them in µs) of
    profiler events. The GPU-side ranges of annotations (a compiled region's call, Lightning's optimizer step around
    forward and backward) are not work: they would cover the gaps inside them."""
    gpu = [e for e in events if e.device_type == DeviceType.CUDA and not e.is_user_annotation]
    spans = sorted((e.time_range.start, e.time_range.end) for e in gpu)
    busy, gaps = 0.0, []
    end = spans[0][0] if spans else 0.0
    for a, b in spans:
        if a - end > GAP_US:
            gaps.append(a - end)
        busy += max(0, b - max(a, end))
        end = max(end, b)
    return busy, gaps


class StepWindowProfile(L.Callback):
    """Profiles training steps ``start .. start + n - 1`` (1-based), synchronising the device only at the window's
    two ends, and prints per step: wall-clock, GPU kernel time, GPU idle gaps, the host's waits on the GPU (each
    one lets the GPU run dry until the host launches again), and the ``rows`` heaviest kernels."""

    def __init__(self, start: int, n: int, label: str = "", rows: int = 20) -> None:
        self.start, self.n, self.label, self.rows = start, n, label, rows
        self.prof: profile | None = None
        self.t0 = 0.0

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx: int) -> None:
        if trainer.global_step + 1 == self.start:
            cuda = torch.cuda.is_available()
            if cuda:
                torch.cuda.synchronize()
            self.prof = profile(activities=[ProfilerActivity.CPU] + [ProfilerActivity.CUDA] * cuda)
            self.prof.__enter__()
            self.t0 = time.perf_counter()

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx: int) -> None:
        if self.prof is None or trainer.global_step != self.start + self.n - 1:
            return
        cuda = torch.cuda.is_available()
        with record_function(_END):  # waits from here on are the window's own (and the profiler's at its exit)
            if cuda:
                torch.cuda.synchronize()
        wall_ms = (time.perf_counter() - self.t0) * 1e3 / self.n
        self.prof.__exit__(None, None, None)
        prof, self.prof, per = self.prof, None, 1e3 * self.n  # per: µs over the window -> ms per step
        head = f"--- profile{self.label}: train.fit steps {self.start}-{self.start + self.n - 1}, synchronised at the"
        head += f" window's ends: {wall_ms:.2f} ms per step"
        if not cuda:
            print(head + " (no GPU: the heaviest host operations)")
            print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=self.rows))
            return
        events = prof.events()
        end = min(e.time_range.start for e in events if e.name == _END)
        waits = [e for e in events if e.name in WAITS and e.time_range.start < end]
        busy, gaps = kernel_time(events)
        print(
            f"{head}, GPU kernels {busy / per:.2f} ms, GPU idle gaps > {GAP_US} µs {len(gaps) / self.n:.1f} per step"
            f" ({sum(gaps) / per:.2f} ms), host waits on the GPU {len(waits) / self.n:.1f} per step"
            f" ({sum(e.time_range.elapsed_us() for e in waits) / per:.2f} ms)"
        )
        table = prof.key_averages().table(sort_by="self_cuda_time_total", row_limit=self.rows, max_name_column_width=60)
        print(table)
