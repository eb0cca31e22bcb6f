"""The SLURM fixture is a real cluster: job arrays, multi-node srun under Lightning's SLURMEnvironment, requeue."""

import json
import sys
import time

SEES_SLURM = """
import json, torch, torch.distributed as dist
from lightning.fabric.plugins.environments import SLURMEnvironment
env = SLURMEnvironment()
dist.init_process_group("gloo", init_method=f"tcp://{env.main_address}:{env.main_port}",
                        rank=env.global_rank(), world_size=env.world_size())
total = torch.tensor(env.global_rank() + 1.0)
dist.all_reduce(total)
dist.destroy_process_group()
print(json.dumps([SLURMEnvironment.detect(), env.global_rank(), env.world_size(), env.node_rank(), total.item()]))
"""


def test_job_array_runs_every_task(slurm, tmp_path):
    job = slurm.sbatch(
        "--array=0-2", "-o", "%A_%a.out", "--wrap", "echo $SLURMD_NODENAME > task-$SLURM_ARRAY_TASK_ID", cwd=tmp_path
    )
    assert slurm.wait_jobs(job) == {f"{job}_{i}": "COMPLETED" for i in range(3)}
    assert {p.name for p in tmp_path.glob("task-*")} == {"task-0", "task-1", "task-2"}


def test_srun_two_nodes_is_one_lightning_world(slurm, tmp_path):
    """One task per node: Lightning detects SLURM, ranks 0 and 1 on nodes 0 and 1 meet through gloo."""
    out = slurm.run(["srun", "-J", "world", "-N", "2", "--ntasks-per-node", "1", sys.executable, "-c", SEES_SLURM])
    seen = sorted(json.loads(line) for line in out.stdout.splitlines())
    assert seen == [[True, 0, 2, 0, 3.0], [True, 1, 2, 1, 3.0]], out.stderr


def test_requeued_batch_job_runs_again(slurm, tmp_path):
    """What Lightning's auto-requeue does on SIGUSR1: `scontrol requeue` puts the job back, it starts over."""
    script = 'echo ${SLURM_RESTART_COUNT:-0} >> runs; [ "$SLURM_RESTART_COUNT" = 1 ] || sleep 60'
    job = slurm.sbatch("-J", "requeue", "--wrap", script, cwd=tmp_path)
    deadline = time.monotonic() + 30
    while not (tmp_path / "runs").exists() and time.monotonic() < deadline:
        time.sleep(0.1)
    slurm.run(["scontrol", "requeue", job])
    slurm.start_now(job)
    states = slurm.wait_jobs(job)  # on a failure: the job's fields, its runs and the daemons' logs, to tell why
    runs = (tmp_path / "runs").read_text().split()
    # a string, not a tuple: pytest cuts a message that is not a string down to 240 characters
    assert states == {job: "COMPLETED"}, f"{states}\nruns {runs}\n{slurm.jobs(job)}\n{slurm.logs()}"
    assert runs == ["0", "1"]
