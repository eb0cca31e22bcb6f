"""The sweep's training processes: spawned workers with a pipe each, started when a run needs one (or all at once,
``Pool.start``) and replaced by a fresh one (on the same GPU) when a run fails in them. Workers end when the sweep
process dies, whatever kills it."""

from __future__ import annotations

import ctypes
import multiprocessing as mp
import os
import pickle
import queue
import signal
import sys
import threading
import time
from dataclasses import dataclass
from multiprocessing.connection import Connection, wait
from typing import Any

PR_SET_PDEATHSIG = 1  # <linux/prctl.h>


def _die_with(parent: int) -> None:
    """Have the kernel SIGKILL this worker when the sweep process exits (Linux), and exit now if it already has."""
    if sys.platform.startswith("linux"):
        ctypes.CDLL(None).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    if os.getppid() != parent:  # died before prctl: this process is an orphan already
        os._exit(1)


def _read(conn: Connection, jobs: queue.SimpleQueue) -> None:
    """Pass the parent's jobs on to the training thread; at EOF, the parent closed its end or died, exit (the
    portable half of ``_die_with``). Raw bytes: this thread must not import while the main thread does."""
    while True:
        try:
            jobs.put(conn.recv_bytes())
        except (EOFError, OSError):
            os._exit(0)


def _first_line(e: BaseException) -> str:
    text = str(e).strip()
    return f"{type(e).__name__}: {text.splitlines()[0]}" if text else type(e).__name__


def _serve(conn: Connection, gpu: str | None, parent: int) -> None:
    """A worker's main: fit each RunConfig that arrives; send back ("ok", RunResult) or ("error", why)."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the parent's to handle
    _die_with(parent)
    jobs: queue.SimpleQueue = queue.SimpleQueue()
    threading.Thread(target=_read, args=(conn, jobs), daemon=True).start()
    if gpu is not None:
        os.environ["CUDA_VISIBLE_DEVICES"] = gpu  # before torch, let alone CUDA, starts
    while True:
        run = pickle.loads(jobs.get())
        try:
            reply = ("ok", fit_fresh(run))
        except Exception as e:  # e.g. torch.OutOfMemoryError; SystemExit ends the worker, reported as its death
            reply = ("error", _first_line(e))
        except KeyboardInterrupt:  # SIGTERM in training (the trainer raises it), e.g. sent to the whole process group
            signal.signal(signal.SIGTERM, signal.SIG_DFL)  # by timeout or scancel: die of it, without a traceback
            os.kill(os.getpid(), signal.SIGTERM)
        conn.send(reply)


def fit_fresh(run: Any) -> Any:
    """``train.fit`` in a process that lives across runs (a worker, the sweep's own, a launch's other ranks): first
    forget the frames compiled for earlier runs' models. Dynamo keeps 8 compiled variants per function
    (``recompile_limit``) and runs every later shape of it eagerly: a worker's ninth shape of a block would train
    uncompiled. Inductor's on-disk caches still serve shapes seen before."""
    import torch

    from mixdepth.train import fit

    torch._dynamo.reset()
    return fit(run)


@dataclass
class _Slot:
    gpu: str | None
    process: Any = None  # a spawn context Process, started at the first job
    conn: Connection | None = None
    key: Any = None  # the caller's key of the run in flight; None when idle
    since: float = 0.0  # when the run in flight was handed over (time.time())


class Pool:
    """At most ``n`` worker processes, one GPU each when ``gpus`` are given; only this process talks to them.

    Use as a context manager: leaving it normally lets idle workers exit, leaving it by an exception (Ctrl-C)
    kills them at once (SIGKILL: Lightning catches SIGTERM while training).
    """

    def __init__(self, n: int, gpus: list[str]):
        self._ctx = mp.get_context("spawn")  # never fork a process whose torch threads exist
        self._slots = [_Slot(gpus[i] if gpus else None) for i in range(n)]

    def __enter__(self) -> Pool:
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        for s in self._slots:
            self._end(s, kill=exc_type is not None)

    @property
    def free(self) -> int:
        return sum(s.key is None for s in self._slots)

    def start(self) -> Pool:
        """Spawn every slot's worker now, not at its first run: they import torch and the trainer while the caller
        still prepares (opens the queue, plans, enqueues)."""
        for s in self._slots:
            if s.process is None:
                self._spawn(s)
        return self

    def _spawn(self, s: _Slot) -> None:
        ours, theirs = self._ctx.Pipe()
        s.process = self._ctx.Process(target=_serve, args=(theirs, s.gpu, os.getpid()))
        s.process.start()  # from the main thread: PR_SET_PDEATHSIG follows the thread that started the worker
        theirs.close()  # the worker's end: the parent holds none, so the worker sees EOF when the parent dies
        s.conn = ours

    def submit(self, key: Any, run: Any) -> None:
        """Start ``run`` (a RunConfig) on an idle worker; ``wait`` reports its end under ``key``."""
        s = min((s for s in self._slots if s.key is None), key=lambda s: s.process is None)  # a live one first
        if s.process is None:
            self._spawn(s)
        s.key, s.since = key, time.time()
        try:
            s.conn.send_bytes(pickle.dumps(run))
        except OSError:  # it died while idle: wait() finds its sentinel fired and reports this run's attempt failed
            pass

    def wait(self, timeout: float | None = None) -> tuple[Any, Any, str | None] | None:
        """Block until a run ends: ``(key, RunResult, None)``, or ``(key, None, why)`` when its fit raised or its
        worker died (then the worker is replaced by a fresh one, started with its next job); None when
        ``timeout`` seconds passed first."""
        busy = [s for s in self._slots if s.key is not None]
        ready = wait([s.conn for s in busy] + [s.process.sentinel for s in busy], timeout)
        if not ready:
            return None
        s = next(s for s in busy if s.conn in ready or s.process.sentinel in ready)
        key, s.key = s.key, None
        try:
            status, value = s.conn.recv() if s.conn.poll() else ("died", None)  # poll: a message or EOF
        except (EOFError, OSError):  # the pipe closed before a whole reply: it died
            status, value = "died", None
        if status == "ok":
            return key, value, None
        self._end(s, kill=status == "error")  # a dead one is only reaped: its exit code says how it died
        if status == "error":
            why = value
        else:
            code = s.process.exitcode
            why = f"worker died (signal {-code})" if code < 0 else f"worker exited with code {code}"
        s.process = s.conn = None
        return key, None, why

    def stop(self) -> list[tuple[Any, float]]:
        """Kill every worker that trains a run now (SIGKILL, as on leaving by an exception): ``(key, seconds since
        its run was handed over)`` of each; a later ``submit`` starts a fresh worker in its place. One whose reply
        (or death) already waits is left for ``wait`` to report. Which ones train is read before any is killed:
        under MPS a killed worker can fault the kernels of the others on its GPU (an H100 answered them "illegal
        memory access"), and that reply is the stop's doing, not a failed attempt of their runs."""
        now = time.time()
        training = [s for s in self._slots if s.key is not None and not s.conn.poll()]
        stopped = [(s.key, now - s.since) for s in training]
        for s in training:
            s.process.kill()
        for s in training:
            self._end(s, kill=False)  # killed above: reap it
            s.process = s.conn = s.key = None
        return stopped

    @staticmethod
    def _end(s: _Slot, kill: bool) -> None:
        if s.process is None:
            return
        s.conn.close()  # an idle worker exits at this EOF
        if kill:
            s.process.kill()
        s.process.join(10)
        if s.process.exitcode is None:
            s.process.kill()
            s.process.join()


class Inline:
    """The Pool's interface with one slot in this process: ``wait`` runs the submitted fit here, and an exception
    in it propagates (Ctrl-C and faults reach the sweep as they would without a queue)."""

    def __init__(self) -> None:
        self._job: tuple[Any, Any] | None = None

    def __enter__(self) -> Inline:
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        self._job = None

    @property
    def free(self) -> int:
        return int(self._job is None)

    def submit(self, key: Any, run: Any) -> None:
        self._job = (key, run)

    def wait(self, timeout: float | None = None) -> tuple[Any, Any, None]:
        (key, run), self._job = self._job, None
        return key, fit_fresh(run), None


class Ranks(Inline):
    """``Inline`` on global rank 0 of a launch with several ranks (``srun``, ``torchrun``): each run is handed to
    the other ranks (``follow``) through the launch's TCP store before rank 0 trains it, so every rank calls
    ``train.fit`` for the same run in the same order; leaving the block tells them no run is left, and waits (up
    to ``LEAVE_WAIT_S``) until they have read it: the store lives in this process and goes with it."""

    LEAVE_WAIT_S = 60.0

    def __init__(self, store, followers: int) -> None:
        super().__init__()
        self._store, self._k, self._followers = store, 0, followers

    def __exit__(self, exc_type, exc, tb) -> None:
        super().__exit__(exc_type, exc, tb)
        self._store.set(f"run{self._k}", b"")
        deadline = time.monotonic() + self.LEAVE_WAIT_S
        while self._store.add("left", 0) < self._followers and time.monotonic() < deadline:
            time.sleep(0.05)

    def submit(self, key: Any, run: Any) -> None:
        super().submit(key, run)
        self._store.set(f"run{self._k}", pickle.dumps(run))
        self._k += 1


def follow(store) -> int:
    """A rank other than 0 of a ``Ranks`` launch: train each run rank 0 hands over until it says none is left;
    returns how many."""
    k = 0
    while data := store.get(f"run{k}"):
        fit_fresh(pickle.loads(data))
        k += 1
    store.add("left", 1)
    return k
