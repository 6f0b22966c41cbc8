"""Cluster resolvers: TF_CONFIG parsing and validation, torchrun, SLURM, resolution order.

Every resolver reads from an ``environ`` dict here, so no test touches ``os.environ``.
"""

from __future__ import annotations

import json

import pytest

from torch_distribute.cluster import (
    ClusterResolver,
    ClusterSpec,
    SimpleClusterResolver,
    SlurmClusterResolver,
    TFConfigClusterResolver,
    TorchrunClusterResolver,
    expand_hostlist,
    expand_tasks_per_node,
    resolve_cluster,
    validate_cluster_spec,
)
from torch_distribute.errors import ClusterConfigError, DistributeError


def tf_config_env(cluster=None, task=None, **extra) -> dict[str, str]:
    config: dict[str, object] = dict(extra)
    if cluster is not None:
        config["cluster"] = cluster
    if task is not None:
        config["task"] = task
    return {"TF_CONFIG": json.dumps(config)}


def tf_resolver(cluster=None, task=None, **extra) -> TFConfigClusterResolver:
    return TFConfigClusterResolver(environ=tf_config_env(cluster, task, **extra))


THREE = {"chief": ["c:2222"], "worker": ["w0:2222", "w1:2222"]}
TORCHRUN = {
    "RANK": "1",
    "WORLD_SIZE": "4",
    "LOCAL_RANK": "1",
    "LOCAL_WORLD_SIZE": "2",
    "MASTER_ADDR": "node0",
    "MASTER_PORT": "29500",
}
SLURM = {
    "SLURM_PROCID": "3",
    "SLURM_STEP_NUM_TASKS": "4",
    "SLURM_STEP_NODELIST": "t02n[13,41]",
    "SLURM_STEP_TASKS_PER_NODE": "2(x2)",
}


# -- ClusterSpec --------------------------------------------------------------------------


def test_cluster_spec_dense_and_sparse_forms():
    spec = ClusterSpec(THREE)
    assert spec.jobs == ["chief", "worker"]
    assert spec.num_tasks("worker") == 2
    assert spec.task_address("worker", 1) == "w1:2222"
    assert spec.task_indices("worker") == [0, 1]
    assert spec.as_dict() == THREE
    assert spec == ClusterSpec(spec) == THREE
    assert "w1:2222" in repr(spec)

    sparse = ClusterSpec({"worker": {"1": "w1:2222", 3: "w3:2222"}})
    assert sparse.num_tasks("worker") == 2
    assert sparse.task_indices("worker") == [1, 3]
    assert sparse.task_address("worker", 3) == "w3:2222"
    assert sparse.as_dict() == {"worker": {1: "w1:2222", 3: "w3:2222"}}
    assert sparse.job_tasks("worker") == [None, "w1:2222", None, "w3:2222"]
    # A sparse job that happens to be dense is the same cluster as the list form.
    assert ClusterSpec({"worker": {"0": "a:1", "1": "b:1"}}) == {"worker": ["a:1", "b:1"]}


def test_cluster_spec_empty_and_bad_input():
    assert not ClusterSpec({})
    assert not ClusterSpec(None)
    assert ClusterSpec({"worker": ["a:1"]})
    with pytest.raises(ClusterConfigError, match="job 'worker' must be a list"):
        ClusterSpec({"worker": "a:1"})
    with pytest.raises(ClusterConfigError, match="task index 'x'"):
        ClusterSpec({"worker": {"x": "a:1"}})
    with pytest.raises(ClusterConfigError, match="no job 'ps'"):
        ClusterSpec(THREE).num_tasks("ps")
    with pytest.raises(ClusterConfigError, match="has no task 5"):
        ClusterSpec(THREE).task_address("worker", 5)


# -- TF_CONFIG ----------------------------------------------------------------------------


def test_tf_config_parsing():
    r = tf_resolver(THREE, {"type": "worker", "index": 1}, rpc_layer="grpc")
    assert r.cluster_spec() == ClusterSpec(THREE)
    assert (r.task_type, r.task_id, r.rpc_layer, r.environment) == ("worker", 1, "grpc", "")
    assert r.master() == "grpc://w1:2222"
    r.validate()


def test_tf_config_sparse_form_and_string_index():
    r = tf_resolver({"worker": {"1": "w1:2222"}}, {"type": "worker", "index": "1"})
    assert r.cluster_spec().as_dict() == {"worker": {1: "w1:2222"}}
    assert r.task_id == 1
    r.validate()
    with pytest.raises(ClusterConfigError, match="not a task of job 'worker'"):
        tf_resolver({"worker": {"1": "w1:2222"}}, {"type": "worker", "index": 0}).validate()


def test_tf_config_missing_is_local_single_worker():
    for env in ({}, {"TF_CONFIG": ""}, tf_config_env(task={"type": "worker", "index": 0})):
        r = TFConfigClusterResolver(environ=env)
        assert not r.cluster_spec()
        assert (r.num_workers, r.worker_index, r.is_chief) == (1, 0, True)


def test_tf_config_is_reread_and_overridden():
    env = tf_config_env(THREE, {"type": "worker", "index": 0})
    r = TFConfigClusterResolver(environ=env)
    assert r.task_id == 0
    env.update(tf_config_env(THREE, {"type": "chief", "index": 0}))
    assert (r.task_type, r.is_chief) == ("chief", True)
    r2 = TFConfigClusterResolver(task_type="worker", task_id=1, environ=env)
    assert (r2.task_type, r2.task_id, r2.worker_index) == ("worker", 1, 2)
    r2.task_id = 0
    assert r2.worker_index == 1


def test_tf_config_malformed_json():
    r = TFConfigClusterResolver(environ={"TF_CONFIG": '{"cluster": {"worker": ["a:1"]'})
    with pytest.raises(ClusterConfigError, match="TF_CONFIG is not valid JSON"):
        r.cluster_spec()
    with pytest.raises(ClusterConfigError, match="must be a JSON object"):
        TFConfigClusterResolver(environ={"TF_CONFIG": "[1, 2]"}).cluster_spec()
    with pytest.raises(ClusterConfigError, match="task.index must be an integer"):
        _ = tf_resolver(THREE, {"type": "worker", "index": "one"}).task_id


# -- validation ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("cluster", "task", "message"),
    [
        ({"worker": ["a:1"], "trainer": ["b:1"]}, {"type": "worker", "index": 0}, "unknown job 'trainer'"),
        ({"master": ["a:1"]}, {"type": "master", "index": 0}, "unknown job 'master'.*'chief'"),
        ({"chief": ["a:1", "b:1"]}, {"type": "chief", "index": 0}, "job 'chief' has 2 tasks.*at most one"),
        ({"worker": ["a:1"], "evaluator": ["e:1", "f:1"]}, {"type": "worker", "index": 0}, "at most one 'evaluator'"),
        ({"worker": ["a:1", "b:1"]}, {"type": "worker", "index": 2}, "task.index 2 is past the end of job 'worker', which has 2 tasks"),
        ({"worker": ["a:1"]}, {"type": "worker", "index": -1}, "task.index -1 is negative"),
        ({"worker": ["a:1"]}, {"type": "chief", "index": 0}, "task.type 'chief' is not a job of the cluster"),
        ({"worker": ["a:1"]}, {"type": "trainer", "index": 0}, "task.type 'trainer' is not a valid task type"),
        ({"worker": ["a:1"]}, None, "set `task` in TF_CONFIG"),
        ({"worker": ["a:1"]}, {"index": 0}, "task.type is missing"),
        ({"worker": ["a:1"]}, {"type": "worker"}, "task.index is missing"),
        ({"chief": ["a:1"], "worker": ["a:1"]}, {"type": "chief", "index": 0}, "address 'a:1' is used by two tasks, chief 0 and worker 0"),
    ],
)  # fmt: skip
def test_validation_errors(cluster, task, message):
    r = tf_resolver(cluster, task)
    with pytest.raises(ClusterConfigError, match=message):
        r.validate()
    # The properties the strategy reads validate lazily too.
    with pytest.raises(ClusterConfigError, match=message):
        _ = r.num_workers


def test_validation_error_is_value_error_and_distribute_error():
    with pytest.raises(ValueError):
        validate_cluster_spec({"worker": ["a:1"]}, "worker", 1)
    with pytest.raises(DistributeError):
        validate_cluster_spec({"worker": ["a:1"]}, "worker", 1)
    with pytest.raises(ClusterConfigError, match="task.index must be an integer"):
        validate_cluster_spec({"worker": ["a:1"]}, "worker", "0")


def test_evaluator_may_be_missing_from_cluster():
    validate_cluster_spec({"worker": ["a:1"]}, "evaluator", 0)
    r = tf_resolver({"worker": ["a:1"]}, {"type": "evaluator", "index": 0})
    assert (r.num_workers, r.worker_index, r.is_chief) == (1, 0, True)


# -- chief rules, id_in_cluster, rendezvous -----------------------------------------------


@pytest.mark.parametrize(
    ("task_type", "task_id", "worker_index", "is_chief"),
    [("chief", 0, 0, True), ("worker", 0, 1, False), ("worker", 1, 2, False)],
)
def test_with_chief_job(task_type, task_id, worker_index, is_chief):
    r = tf_resolver(THREE, {"type": task_type, "index": task_id})
    assert (r.num_workers, r.worker_index, r.is_chief) == (3, worker_index, is_chief)
    assert r.rendezvous_address() == ("c", 2222)


@pytest.mark.parametrize(("task_id", "is_chief"), [(0, True), (1, False), (2, False)])
def test_without_chief_job_worker_0_is_chief(task_id, is_chief):
    cluster = {"worker": ["w0:1000", "w1:1000", "w2:1000"]}
    r = tf_resolver(cluster, {"type": "worker", "index": task_id})
    assert (r.num_workers, r.worker_index, r.is_chief) == (3, task_id, is_chief)
    assert r.rendezvous_address() == ("w0", 1000)


def test_evaluator_and_ps_tasks():
    cluster = {**THREE, "evaluator": ["e:2222"], "ps": ["p:2222"]}
    evaluator = tf_resolver(cluster, {"type": "evaluator", "index": 0})
    assert (evaluator.num_workers, evaluator.worker_index, evaluator.is_chief) == (1, 0, True)
    assert evaluator.rendezvous_address() == ("e", 2222)
    ps = tf_resolver(cluster, {"type": "ps", "index": 0})
    assert ps.is_chief is False
    with pytest.raises(ClusterConfigError, match="'ps' is not a training worker"):
        _ = ps.num_workers
    # A ps does not change the training workers' view.
    worker = tf_resolver(cluster, {"type": "worker", "index": 1})
    assert (worker.num_workers, worker.worker_index) == (3, 2)


def test_rendezvous_address_forms():
    r = SimpleClusterResolver({"worker": ["[::1]:2222", "[::1]:2223"]}, "worker", 1)
    assert r.rendezvous_address() == ("::1", 2222)
    bad = SimpleClusterResolver({"worker": ["w0", "w1:1"]}, "worker", 1)
    with pytest.raises(ClusterConfigError, match="'w0' is not of the form 'host:port'"):
        bad.rendezvous_address()
    assert SimpleClusterResolver({}).rendezvous_address() == ("127.0.0.1", 0)


def test_simple_resolver_and_base_defaults():
    r = SimpleClusterResolver(
        {"worker": ["a:1", "b:1"]}, "worker", 1, num_accelerators={"GPU": 2}, rpc_layer="grpc",
        environ={"LOCAL_RANK": "3"},
    )  # fmt: skip
    assert r.num_accelerators() == {"GPU": 2}
    assert (r.rpc_layer, r.environment, r.local_rank) == ("grpc", "", 3)
    assert r.master() == "grpc://b:1"
    assert isinstance(r, ClusterResolver)
    assert SimpleClusterResolver({}, environ={}).local_rank == 0
    accelerators = SimpleClusterResolver({}).num_accelerators()
    assert accelerators == {} or set(accelerators) == {"GPU"}
    with pytest.raises(TypeError):
        ClusterResolver()  # type: ignore[abstract]


# -- torchrun -----------------------------------------------------------------------------


def test_torchrun_environment():
    r = TorchrunClusterResolver(environ=TORCHRUN)
    assert r.cluster_spec() == {"worker": ["node0:29500", "rank1", "rank2", "rank3"]}
    assert (r.task_type, r.task_id) == ("worker", 1)
    assert (r.num_workers, r.worker_index, r.is_chief) == (4, 1, False)
    assert (r.local_rank, r.local_world_size, r.world_size) == (1, 2, 4)
    assert r.rendezvous_address() == ("node0", 29500)
    rank0 = TorchrunClusterResolver(environ={**TORCHRUN, "RANK": "0", "LOCAL_RANK": "0"})
    assert rank0.is_chief and rank0.worker_index == 0


@pytest.mark.parametrize("name", ["RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"])
def test_torchrun_missing_variable(name):
    env = {k: v for k, v in TORCHRUN.items() if k != name}
    with pytest.raises(ClusterConfigError, match=f"seen: .*{name} is missing"):
        TorchrunClusterResolver(environ=env)


@pytest.mark.parametrize(
    ("name", "value", "message"),
    [
        ("RANK", "x", "RANK='x' is not an integer"),
        ("RANK", "4", "RANK=4 must be below WORLD_SIZE=4"),
        ("WORLD_SIZE", "0", "WORLD_SIZE='0' is below 1"),
        ("LOCAL_RANK", "2", "LOCAL_RANK=2 must be below LOCAL_WORLD_SIZE=2"),
        ("LOCAL_WORLD_SIZE", "two", "LOCAL_WORLD_SIZE='two' is not an integer"),
        ("MASTER_PORT", "70000", "MASTER_PORT='70000' is above 65535"),
    ],
)
def test_torchrun_invalid_variable(name, value, message):
    with pytest.raises(ClusterConfigError, match=message):
        TorchrunClusterResolver(environ={**TORCHRUN, name: value})


def test_torchrun_optional_local_variables_and_presence():
    env = {k: TORCHRUN[k] for k in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")}
    r = TorchrunClusterResolver(environ=env)
    assert (r.local_rank, r.local_world_size) == (0, 1)
    assert TorchrunClusterResolver.is_present(env)
    # RANK or WORLD_SIZE alone is torchrun's (incomplete: the constructor says what is missing);
    # an address alone describes no cluster.
    assert TorchrunClusterResolver.is_present({"RANK": "1"})
    assert not TorchrunClusterResolver.is_present({"MASTER_ADDR": "h", "MASTER_PORT": "1"})
    single = TorchrunClusterResolver(environ={"RANK": "0", "WORLD_SIZE": "1"})
    assert (single.num_workers, single.is_chief, single.cluster_spec()) == (1, True, ClusterSpec({}))


# -- SLURM --------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("hostlist", "hosts"),
    [
        ("t02n[13,41-43]", ["t02n13", "t02n41", "t02n42", "t02n43"]),
        ("a[1-2],b3,c[07-09]", ["a1", "a2", "b3", "c07", "c08", "c09"]),
        ("node[098-101]", ["node098", "node099", "node100", "node101"]),
        ("n[9-10]", ["n9", "n10"]),
        ("gpu-node7", ["gpu-node7"]),
        ("n[1,3-4],m5,o[3-4,6,7-9]", ["n1", "n3", "n4", "m5", "o3", "o4", "o6", "o7", "o8", "o9"]),
        ("r[1-2]n[01-02]", ["r1n01", "r1n02", "r2n01", "r2n02"]),
        ("node[1-2]-ib", ["node1-ib", "node2-ib"]),
    ],
)
def test_expand_hostlist(hostlist, hosts):
    assert expand_hostlist(hostlist) == hosts


@pytest.mark.parametrize("hostlist", ["", "a[1-2", "a]", "a[]", "a,,b", "a[3-1]", "a[x]"])
def test_expand_hostlist_errors(hostlist):
    with pytest.raises(ClusterConfigError, match="invalid SLURM node list"):
        expand_hostlist(hostlist)


def test_expand_tasks_per_node():
    assert expand_tasks_per_node("2(x3),1") == [2, 2, 2, 1]
    assert expand_tasks_per_node("4") == [4]
    assert expand_tasks_per_node("3(x2),2,1") == [3, 3, 2, 1]
    with pytest.raises(ClusterConfigError, match="bad item '2x3'"):
        expand_tasks_per_node("2x3")


def test_slurm_two_nodes_two_tasks_each():
    env = dict(SLURM)
    r = SlurmClusterResolver(environ=env, gpus_per_node=4)
    assert r.cluster_spec() == {
        "worker": ["t02n13:8888", "t02n13:8889", "t02n41:8888", "t02n41:8889"]
    }
    assert (r.task_type, r.task_id, r.get_task_info()) == ("worker", 3, ("worker", 3))
    assert (r.num_workers, r.worker_index, r.is_chief, r.local_rank) == (4, 3, False, 1)
    assert r.rendezvous_address() == ("t02n13", 8888)
    assert r.num_accelerators() == {"GPU": 2}
    assert r.master() == "grpc://t02n41:8889"
    assert env["CUDA_VISIBLE_DEVICES"] == "2,3"  # second task on its node: GPUs 2 and 3
    # Built again (CUDA_VISIBLE_DEVICES already narrowed): same allocation.
    SlurmClusterResolver(environ=env, gpus_per_node=4)
    assert env["CUDA_VISIBLE_DEVICES"] == "2,3"


def test_slurm_gpus_follow_visible_devices_and_jobs():
    env = {**SLURM, "SLURM_PROCID": "2", "CUDA_VISIBLE_DEVICES": "4,5,6,7"}
    r = SlurmClusterResolver(jobs={"chief": 1, "worker": 3}, port_base=9000, environ=env)
    assert r.cluster_spec() == {
        "chief": ["t02n13:9000"],
        "worker": ["t02n13:9001", "t02n41:9000", "t02n41:9001"],
    }
    assert (r.task_type, r.task_id, r.worker_index, r.local_rank) == ("worker", 1, 2, 0)
    assert r.rendezvous_address() == ("t02n13", 9000)
    assert env["CUDA_VISIBLE_DEVICES"] == "4,5"


def test_slurm_fallback_variables_and_uneven_nodes():
    env = {
        "SLURM_PROCID": "2",
        "SLURM_NTASKS": "3",
        "SLURM_JOB_NODELIST": "a[1-2]",
        "SLURM_TASKS_PER_NODE": "2,1",
    }
    r = SlurmClusterResolver(environ=env, gpus_per_node=0)
    assert r.cluster_spec() == {"worker": ["a1:8888", "a1:8889", "a2:8888"]}
    assert (r.task_id, r.local_rank, r.num_accelerators()) == (2, 0, {})
    assert "CUDA_VISIBLE_DEVICES" not in env


def test_slurm_errors():
    with pytest.raises(ClusterConfigError, match="SLURM_PROCID is not set"):
        SlurmClusterResolver(environ={"SLURM_STEP_NODELIST": "a1"}, gpus_per_node=0)
    with pytest.raises(ClusterConfigError, match="SLURM_STEP_NODELIST"):
        SlurmClusterResolver(environ={"SLURM_PROCID": "0"}, gpus_per_node=0)
    with pytest.raises(ClusterConfigError, match="ask for 5 tasks"):
        SlurmClusterResolver(jobs={"worker": 5}, environ=SLURM, gpus_per_node=0)
    with pytest.raises(ClusterConfigError, match="gives 1 nodes but the node list"):
        SlurmClusterResolver(environ={**SLURM, "SLURM_STEP_TASKS_PER_NODE": "4"}, gpus_per_node=0)
    with pytest.raises(ClusterConfigError, match="only 2 GPUs"):
        SlurmClusterResolver(environ=dict(SLURM), gpus_per_node=2, gpus_per_task=2)
    with pytest.raises(ClusterConfigError, match="SLURM_PROCID=4 is not below"):
        SlurmClusterResolver(environ={**SLURM, "SLURM_PROCID": "4"}, gpus_per_node=0)


def test_slurm_presence():
    assert SlurmClusterResolver.is_present(SLURM)
    assert SlurmClusterResolver.is_present({"SLURM_PROCID": "0", "SLURM_JOB_NODELIST": "a1", "SLURM_STEP_ID": "0"})
    # A batch script (no srun step) is not a step: see test_launcher_environments.py.
    assert not SlurmClusterResolver.is_present({"SLURM_PROCID": "0", "SLURM_JOB_NODELIST": "a1"})
    assert not SlurmClusterResolver.is_present({"SLURM_PROCID": "0"})
    assert not SlurmClusterResolver.is_present({"SLURM_JOB_NODELIST": "a1"})


# -- resolution order ---------------------------------------------------------------------


def test_resolution_order():
    tf_env = tf_config_env(THREE, {"type": "chief", "index": 0})
    slurm = {**SLURM, "CUDA_VISIBLE_DEVICES": ""}
    assert isinstance(resolve_cluster({**tf_env, **TORCHRUN, **slurm}), TFConfigClusterResolver)
    # srun torchrun ...: the agent's ranks describe the workers, SLURM's the agents.
    under_agent = {**TORCHRUN, **slurm, "TORCHELASTIC_RUN_ID": "job"}
    assert isinstance(resolve_cluster(under_agent), TorchrunClusterResolver)
    assert isinstance(resolve_cluster(slurm), SlurmClusterResolver)
    # A TF_CONFIG without a cluster does not count; torchrun wins.
    no_cluster = tf_config_env(task={"type": "worker", "index": 0})
    assert isinstance(resolve_cluster({**no_cluster, **TORCHRUN}), TorchrunClusterResolver)
    local = resolve_cluster({})
    assert isinstance(local, SimpleClusterResolver)
    assert not local.cluster_spec()
    assert (local.num_workers, local.worker_index, local.is_chief) == (1, 0, True)


def test_resolution_never_skips_a_broken_tf_config():
    with pytest.raises(ClusterConfigError, match="TF_CONFIG is not valid JSON"):
        resolve_cluster({"TF_CONFIG": "{not json", **TORCHRUN})
