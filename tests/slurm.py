"""A real, throwaway SLURM cluster for the tests: one slurmctld and two slurmd "nodes" on this host.

Both nodes run on 127.0.0.1 with their own port (``slurmd -N n1``, ``slurmd -N n2``), so ``srun -N 2`` starts
one task on each with distinct ``SLURM_NODEID``; jobs run as the user who starts the cluster (root in CI, any
user elsewhere). Authentication is ``auth/none``: nothing but this host can reach the ports, and munge would be
one more daemon to start and a key to share for no gain. Everything lives in one folder; every daemon and job
process carries that folder's ``SLURM_CONF`` in its environment, which is how ``stop`` finds leftovers.
"""

import contextlib
import getpass
import math
import os
import re
import shutil
import signal
import socket
import subprocess
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

NODES = ("n1", "n2")
CPUS_PER_NODE = 2
# Job states after which a job never runs again unless requeued (squeue's and scontrol's names).
DONE = {"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY", "BOOT_FAIL", "DEADLINE"}
# Debian puts the daemons in /usr/sbin, which a non-root user's PATH often lacks.
PATH = os.pathsep.join([os.environ.get("PATH", os.defpath), "/usr/sbin", "/sbin"])
PROGRAMS = ("slurmctld", "slurmd", "srun", "sbatch", "squeue", "scontrol", "sinfo", "scancel")


def missing() -> str | None:
    """Why no cluster can start here (a SLURM program not on PATH), or None."""
    absent = [p for p in PROGRAMS if shutil.which(p, path=PATH) is None]
    if absent:
        return f"SLURM is not installed (no {', '.join(absent)}; apt-get install slurmctld slurmd slurm-client)"
    return None


def _free_ports(n: int) -> list[int]:
    socks = [socket.socket() for _ in range(n)]
    try:
        for s in socks:
            s.bind(("127.0.0.1", 0))
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


def _conf(root: Path, ports: list[int]) -> str:
    user = getpass.getuser()
    nodes = "\n".join(
        f"NodeName={n} NodeHostname=localhost NodeAddr=127.0.0.1 Port={p} CPUs={CPUS_PER_NODE} State=UNKNOWN"
        for n, p in zip(NODES, ports[1:], strict=True)
    )
    # %n is the node name, so the two slurmd of one host keep apart their spool, pid and log files.
    # config_overrides: the nodes declare CPUs this host may not have; without it slurmd drains them.
    # MinJobAge keeps finished jobs in `scontrol show job` long enough for wait_jobs to read their state.
    return f"""\
ClusterName=mixdepth
SlurmctldHost=localhost
SlurmctldPort={ports[0]}
SlurmUser={user}
SlurmdUser={user}
AuthType=auth/none
CredType=cred/none
StateSaveLocation={root}/state
SlurmdSpoolDir={root}/spool/%n
SlurmctldPidFile={root}/slurmctld.pid
SlurmdPidFile={root}/slurmd-%n.pid
SlurmctldLogFile={root}/log/slurmctld.log
SlurmdLogFile={root}/log/slurmd-%n.log
SlurmdParameters=config_overrides
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
MpiDefault=none
SwitchType=switch/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
MailProg=/bin/true
ReturnToService=2
InactiveLimit=0
KillWait=2
MinJobAge=600
{nodes}
PartitionName=debug Nodes=ALL Default=YES MaxTime=INFINITE State=UP
"""


@dataclass
class SlurmCluster:
    """A running cluster: ``env`` is the environment for its client commands and the jobs they start.

    ``env`` sets ``MASTER_ADDR=127.0.0.1``: the node names n1 and n2 resolve nowhere, and Lightning's
    SLURMEnvironment takes the first node's name as the rendezvous address unless MASTER_ADDR is set.
    """

    root: Path
    env: dict[str, str]
    procs: list[subprocess.Popen]

    def run(
        self, args: Sequence[str], *, cwd: Path | None = None, timeout: float = 120, check: bool = True
    ) -> subprocess.CompletedProcess[str]:
        """Run a client command (``srun``, ``sbatch``, ``squeue``...) against this cluster; CompletedProcess.

        Raises:
            AssertionError: ``check`` and a non-zero exit (the message carries the command's output).
        """
        out = subprocess.run(
            list(args), cwd=cwd or self.root, env=self.env, capture_output=True, text=True, timeout=timeout
        )
        if check and out.returncode:
            raise AssertionError(f"{' '.join(args)} exited {out.returncode}:\n{out.stdout}\n{out.stderr}")
        return out

    def sbatch(self, *args: str, cwd: Path | None = None) -> str:
        """Submit ``sbatch args...`` and return the job id (of the array, for ``--array``)."""
        return self.run(["sbatch", "--parsable", *args], cwd=cwd).stdout.strip().split(";")[0]

    def jobs(self, job_id: str) -> dict[str, dict[str, str]]:
        """``scontrol show job`` of a job or array: ``{"12" or "12_0": {"JobState": ..., "ExitCode": ...}}``."""
        out = self.run(["scontrol", "-o", "show", "job", job_id]).stdout
        jobs = {}
        for line in out.splitlines():
            fields = dict(re.findall(r"(\w+)=(\S*)", line))
            task = fields.get("ArrayTaskId")
            jobs[f"{fields['ArrayJobId']}_{task}" if task else fields["JobId"]] = fields
        return jobs

    def wait_jobs(self, *job_ids: str, timeout: float = 120) -> dict[str, str]:
        """Wait until every listed job (every task of an array) has ended; ``{job: JobState}``.

        A requeued job is pending again and is waited for: SLURM holds it back 120 s, ``start_now`` ends that.

        Raises:
            TimeoutError: some job still pending or running after ``timeout`` s (with the states and the logs).
        """
        deadline = time.monotonic() + timeout
        while True:
            states = {j: f["JobState"] for i in job_ids for j, f in self.jobs(i).items()}
            if all(s in DONE for s in states.values()):
                return states
            if time.monotonic() > deadline:
                raise TimeoutError(f"jobs not done after {timeout} s: {states}\n{self.logs()}")
            time.sleep(0.2)

    def start_now(self, job_id: str, timeout: float = 30) -> None:
        """Once a requeued job is pending again, let it start within a second or two instead of after SLURM's 120 s
        delay. Not in the second of the requeue: the requeue revoked the job's credential, with a resolution of one
        second, and slurmd refuses a launch in that second ("Job credential revoked"): the job ends FAILED.

        Raises:
            TimeoutError: the job is not pending within ``timeout`` s.
        """
        deadline = time.monotonic() + timeout
        while (state := self.jobs(job_id)[job_id]["JobState"]) != "PENDING":
            if time.monotonic() > deadline:
                raise TimeoutError(f"job {job_id} not pending again after {timeout} s: {state}")
            time.sleep(0.1)
        # into the next second, then now: StartTime=now+1 instead would wait for a scheduler pass, up to a minute
        time.sleep(math.floor(time.time()) + 1.05 - time.time())
        self.run(["scontrol", "update", f"JobId={job_id}", "StartTime=now"])

    def logs(self) -> str:
        """The daemons' log tails, for failure messages."""
        return "\n".join(
            f"--- {p.name}\n" + "\n".join(p.read_text(errors="replace").splitlines()[-20:])
            for p in sorted((self.root / "log").glob("*.log"))
        )


def _ours(conf: str) -> list[int]:
    """Pids of processes whose environment names this cluster's slurm.conf: daemons, slurmstepd and jobs."""
    pids = []
    needle = f"\0SLURM_CONF={conf}\0".encode()
    for d in Path("/proc").iterdir():
        if d.name.isdigit() and int(d.name) != os.getpid():
            with contextlib.suppress(OSError):
                if needle in b"\0" + (d / "environ").read_bytes():
                    pids.append(int(d.name))
    return pids


def _stop(cluster: SlurmCluster) -> None:
    """Cancel every job, stop the daemons, then kill whatever still carries this cluster's SLURM_CONF."""
    with contextlib.suppress(subprocess.TimeoutExpired):
        cluster.run(["scancel", "--user", getpass.getuser()], check=False, timeout=10)
        # slurmd waits for its running steps before it obeys SIGTERM: let the cancel land first.
        deadline = time.monotonic() + 10
        while cluster.run(["squeue", "-h"], check=False, timeout=10).stdout.strip() and time.monotonic() < deadline:
            time.sleep(0.1)
    for p in cluster.procs:
        p.terminate()
    for p in cluster.procs:
        try:
            p.wait(timeout=5)
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()
    # slurmstepd detaches from slurmd, and a step's processes may outlive their cancel: kill them by environment.
    conf = cluster.env["SLURM_CONF"]
    deadline = time.monotonic() + 5
    while (pids := _ours(conf)) and time.monotonic() < deadline:
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        time.sleep(0.1)
    if pids:
        raise RuntimeError(f"SLURM processes left after the cluster stopped: {pids}")


@contextlib.contextmanager
def slurm_cluster(root: Path, start_timeout: float = 30) -> Iterator[SlurmCluster]:
    """Start a cluster in ``root`` (an empty folder), wait until both nodes are idle, stop it all on exit.

    Raises:
        RuntimeError: SLURM is not installed, or a node is not idle after ``start_timeout`` s (with the logs).
    """
    if why := missing():
        raise RuntimeError(why)
    root = Path(root)
    for d in ("state", "log", *(f"spool/{n}" for n in NODES)):
        (root / d).mkdir(parents=True, exist_ok=True)
    conf = root / "slurm.conf"
    conf.write_text(_conf(root, _free_ports(1 + len(NODES))))
    env = {**os.environ, "PATH": PATH, "SLURM_CONF": str(conf), "MASTER_ADDR": "127.0.0.1"}
    for k in [k for k in env if k.startswith(("SLURM_", "SBATCH_", "SRUN_")) and k != "SLURM_CONF"]:
        del env[k]  # a test run inside a SLURM job must not leak the outer job's settings into this cluster
    cmds = [["slurmctld", "-D"], *(["slurmd", "-D", "-N", n] for n in NODES)]
    procs = [
        subprocess.Popen(c, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
        for c in cmds
    ]
    cluster = SlurmCluster(root=root, env=env, procs=procs)
    try:
        deadline = time.monotonic() + start_timeout
        while True:
            out = cluster.run(["sinfo", "-h", "-N", "-o", "%N %t"], check=False, timeout=10).stdout.split()
            if dict(zip(out[::2], out[1::2], strict=True)) == dict.fromkeys(NODES, "idle"):
                break
            dead = [" ".join(c) for c, p in zip(cmds, procs, strict=True) if p.poll() is not None]
            if dead or time.monotonic() > deadline:
                raise RuntimeError(f"SLURM nodes not idle ({out}; exited: {dead})\n{cluster.logs()}")
            time.sleep(0.1)
        yield cluster
    finally:
        _stop(cluster)
