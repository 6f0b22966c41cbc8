"""The environments launchers give a process, read by ``resolve_cluster`` (issue 27's table).

Every row that used to fall back silently to one worker now either resolves to the cluster
the launcher meant or raises ``ClusterConfigError`` naming the variables seen and what is
missing; a process with no launcher's variables stays one worker and says so at INFO. The
real launchers (mpirun, torchrun, accelerate, Ray Train, SLURM) are started in
``test_real_launchers.py``.
"""

from __future__ import annotations

import logging
import time

import pytest

import torch_distribute as td
from torch_distribute.cluster import (
    KubeflowClusterResolver,
    MPIClusterResolver,
    SimpleClusterResolver,
    SlurmBatchClusterResolver,
    SlurmClusterResolver,
    TorchrunClusterResolver,
    resolve_cluster,
)
from torch_distribute.cluster.launch_spec import build_parser
from torch_distribute.errors import ClusterConfigError

PET = {"PET_NNODES": "2", "PET_NPROC_PER_NODE": "1", "PET_NODE_RANK": "1",
       "PET_MASTER_ADDR": "job-node-0-0.job", "PET_MASTER_PORT": "29500"}
OMPI = {"OMPI_COMM_WORLD_RANK": "1", "OMPI_COMM_WORLD_SIZE": "2", "OMPI_COMM_WORLD_LOCAL_RANK": "1"}
SBATCH = {"SLURM_JOB_ID": "42", "SLURM_PROCID": "0", "SLURM_NTASKS": "2", "SLURM_LOCALID": "0",
          "SLURM_JOB_NODELIST": "node1", "SLURM_TASKS_PER_NODE": "2", "SLURM_JOB_NAME": "train.sh"}
SRUN_STEP = {**SBATCH, "SLURM_STEP_ID": "0", "SLURM_PROCID": "1", "SLURM_STEP_NUM_TASKS": "2",
             "SLURM_STEP_NODELIST": "node1", "SLURM_STEP_TASKS_PER_NODE": "2", "CUDA_VISIBLE_DEVICES": ""}


def raises(env, *patterns):
    """``resolve_cluster(env)`` raises ClusterConfigError whose message has every pattern."""
    with pytest.raises(ClusterConfigError) as info:
        resolve_cluster(env)
    for pattern in patterns:
        assert pattern in str(info.value), str(info.value)
    return str(info.value)


# -- Kubeflow PET_* ------------------------------------------------------------------------


def test_kubeflow_pet_variables_of_a_script_run_directly():
    r = resolve_cluster(PET)
    assert isinstance(r, KubeflowClusterResolver)
    assert (r.num_workers, r.worker_index, r.is_chief) == (2, 1, False)
    assert r.rendezvous_address() == ("job-node-0-0.job", 29500)
    chief = resolve_cluster({**PET, "PET_NODE_RANK": "0"})
    assert chief.is_chief and chief.worker_index == 0
    # No port: torchrun's default.
    no_port = {k: v for k, v in PET.items() if k != "PET_MASTER_PORT"}
    assert resolve_cluster(no_port).rendezvous_address() == ("job-node-0-0.job", 29500)
    # One pod: a single worker that needs no address.
    assert resolve_cluster({"PET_NNODES": "1", "PET_NODE_RANK": "0"}).num_workers == 1


def test_kubeflow_incomplete_or_needing_torchrun():
    raises({"PET_NODE_RANK": "1"}, "PET_NODE_RANK='1'", "PET_NNODES is missing")
    raises({k: v for k, v in PET.items() if k != "PET_MASTER_ADDR"},
           "PET_NNODES=2 but PET_MASTER_ADDR is not set", "PET_NODE_RANK='1'")
    raises({**PET, "PET_NPROC_PER_NODE": "2"}, "PET_NPROC_PER_NODE='2'", "torchrun")
    raises({**PET, "PET_NPROC_PER_NODE": "auto"}, "PET_NPROC_PER_NODE='auto'", "torchrun")
    raises({**PET, "PET_NNODES": "1:4"}, "elastic", "torchrun")
    raises({**PET, "PET_NODE_RANK": "2"}, "PET_NODE_RANK=2 must be below PET_NNODES=2")


def test_kubeflow_pytorchjob_v1_and_its_disagreements():
    v1 = {**PET, "RANK": "1", "WORLD_SIZE": "2", "MASTER_ADDR": "job-master-0", "MASTER_PORT": "23456"}
    r = resolve_cluster(v1)
    assert isinstance(r, TorchrunClusterResolver) and r.worker_index == 1
    raises({**v1, "WORLD_SIZE": "3", "RANK": "1"}, "disagree", "WORLD_SIZE='3'", "PET_NNODES='2'")


def test_our_launcher_takes_pet_variables_as_defaults():
    args = build_parser(PET).parse_args(["train.py"])
    assert (args.nproc, args.nnodes, args.node_rank, args.master) == (1, 2, 1, "job-node-0-0.job:29500")
    explicit = build_parser(PET).parse_args(["--nnodes", "3", "train.py"])
    assert explicit.nnodes == 3
    assert build_parser({}).parse_args(["train.py"]).nnodes == 1


# -- MPI -----------------------------------------------------------------------------------


def test_mpi_ranks_with_an_address():
    r = resolve_cluster({**OMPI, "MASTER_ADDR": "node0", "MASTER_PORT": "29500"})
    assert isinstance(r, MPIClusterResolver) and r.family == "Open MPI"
    assert (r.num_workers, r.worker_index, r.is_chief, r.local_rank) == (2, 1, False, 1)
    assert r.rendezvous_address() == ("node0", 29500)
    pmi = resolve_cluster({"PMI_RANK": "0", "PMI_SIZE": "2", "MASTER_ADDR": "n", "MASTER_PORT": "1"})
    assert isinstance(pmi, MPIClusterResolver) and pmi.is_chief
    assert resolve_cluster({"PMI_RANK": "0", "PMI_SIZE": "1"}).num_workers == 1


def test_mpi_without_an_address_or_incomplete():
    raises(OMPI, "OMPI_COMM_WORLD_RANK='1'", "MASTER_ADDR is not set", "-x MASTER_ADDR")
    raises({"PMI_RANK": "1", "PMI_SIZE": "2"}, "PMI_SIZE='2'", "MASTER_ADDR is not set")
    raises({"OMPI_COMM_WORLD_RANK": "1"}, "OMPI_COMM_WORLD_SIZE is missing")
    raises({**OMPI, "MASTER_ADDR": "n"}, "MASTER_PORT is not set")
    raises({**OMPI, "RANK": "0", "WORLD_SIZE": "2", "MASTER_ADDR": "n", "MASTER_PORT": "1"},
           "disagree", "RANK='0'", "OMPI_COMM_WORLD_RANK='1'")


def test_srun_with_pmi_is_read_as_the_slurm_step():
    r = resolve_cluster({**SRUN_STEP, "PMI_RANK": "1", "PMI_SIZE": "2"})
    assert isinstance(r, SlurmClusterResolver) and r.worker_index == 1


# -- SLURM ---------------------------------------------------------------------------------


def test_sbatch_without_srun_is_one_task(caplog):
    with caplog.at_level(logging.INFO, logger="torch_distribute"):
        r = resolve_cluster(SBATCH)
    assert isinstance(r, SlurmBatchClusterResolver)
    assert (r.num_workers, r.worker_index, r.is_chief) == (1, 0, True)
    assert "SLURM_NTASKS=2" in caplog.text and "srun" in caplog.text
    # Slurm's own batch step id is not an srun step either.
    assert isinstance(resolve_cluster({**SBATCH, "SLURM_STEP_ID": "4294967291"}), SlurmBatchClusterResolver)
    step = resolve_cluster(SRUN_STEP)
    assert isinstance(step, SlurmClusterResolver) and step.num_workers == 2


def test_rank_exported_in_a_batch_script_disagrees_with_the_srun_step():
    exported = {**SRUN_STEP, "RANK": "0", "WORLD_SIZE": "2", "MASTER_ADDR": "node1", "MASTER_PORT": "1"}
    raises(exported, "disagree", "RANK='0'", "SLURM_PROCID='1'")


# -- torchrun's variables, incomplete ------------------------------------------------------


def test_rank_without_world_size_or_address():
    raises({"RANK": "1", "WORLD_SIZE": "2"}, "RANK='1', WORLD_SIZE='2'",
           "MASTER_ADDR, MASTER_PORT are missing")
    raises({"RANK": "1"}, "WORLD_SIZE, MASTER_ADDR, MASTER_PORT are missing")
    raises({"WORLD_SIZE": "2", "MASTER_ADDR": "h", "MASTER_PORT": "1"}, "RANK is missing")
    one = resolve_cluster({"RANK": "0", "WORLD_SIZE": "1"})
    assert (one.num_workers, one.is_chief) == (1, True)


def test_no_launcher_is_one_worker_said_at_info(caplog):
    with caplog.at_level(logging.INFO, logger="torch_distribute"):
        r = resolve_cluster({"MASTER_ADDR": "h", "MASTER_PORT": "1"})
    assert isinstance(r, SimpleClusterResolver) and r.num_workers == 1
    assert "single worker" in caplog.text and "MASTER_ADDR='h'" in caplog.text


@pytest.mark.parametrize("strategy", [td.MultiWorkerMirroredStrategy, td.FullyShardedStrategy])
@pytest.mark.parametrize("env", [
    {"RANK": "1", "WORLD_SIZE": "2"},
    {"PET_NNODES": "2", "PET_NODE_RANK": "1"},
    {"OMPI_COMM_WORLD_RANK": "1", "OMPI_COMM_WORLD_SIZE": "2"},
], ids=["rank-without-address", "kubeflow-without-address", "mpirun-without-address"])
def test_strategies_refuse_an_incomplete_environment_at_once(monkeypatch, strategy, env):
    for name in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "LOCAL_RANK", "TF_CONFIG",
                 "SLURM_JOB_ID", "SLURM_PROCID"):
        monkeypatch.delenv(name, raising=False)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    started = time.monotonic()
    with pytest.raises(ClusterConfigError, match="MASTER_ADDR"):
        strategy()
    assert time.monotonic() - started < 5
