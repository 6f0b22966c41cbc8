"""Malformed input fails at once with a ``td.DistributeError`` that names the bad field.

Cluster descriptions: every malformed field of ``TF_CONFIG`` (ports, addresses, task type
and index, missing or non-object ``cluster``/``task``, invalid JSON), torchrun's and SLURM's
variables, ``SimpleClusterResolver``'s arguments and the launcher's ``--master`` raise
``ClusterConfigError`` (``InvalidArgumentError`` for the launcher) naming it. Reductions:
``strategy.reduce``/``gather`` and ``ReplicaContext.all_reduce``/``all_gather`` of
non-tensors, or of replicas whose values differ in shape or dtype, raise
``InvalidArgumentError`` naming the replicas, before anything is combined.
"""

from __future__ import annotations

import json
import re

import pytest
import torch

import torch_distribute as td
from torch_distribute.cluster import (
    SimpleClusterResolver,
    SlurmClusterResolver,
    TFConfigClusterResolver,
    TorchrunClusterResolver,
    resolve_cluster,
    split_address,
)
from torch_distribute.cluster.launch_spec import parse_master
from torch_distribute.collectives import ReductionToOneDevice
from torch_distribute.errors import ClusterConfigError, InvalidArgumentError

# -- TF_CONFIG -------------------------------------------------------------------------------

TWO = {"worker": ["w0:2222", "w1:2222"]}
W0 = {"type": "worker", "index": 0}


def _tf_config(config: object) -> dict[str, str]:
    return {"TF_CONFIG": config if isinstance(config, str) else json.dumps(config)}


def _resolve(environ: dict[str, str]) -> td.cluster_resolver.ClusterResolver:
    """What a strategy does: pick the resolver, then read the topology (which validates)."""
    resolver = resolve_cluster(environ)
    _ = (resolver.num_workers, resolver.worker_index, resolver.is_chief, resolver.rendezvous_address())
    return resolver


@pytest.mark.parametrize(
    ("config", "field", "message"),
    [
        ({"cluster": {"worker": ["w0:2222", "w1:70000"]}, "task": W0},
         'TF_CONFIG["cluster"]["worker"][1]', "port 70000, but a port must be in 1..65535"),
        ({"cluster": {"worker": ["w0:2222", "w1:0"]}, "task": W0},
         'TF_CONFIG["cluster"]["worker"][1]', "port 0"),
        ({"cluster": {"worker": ["w0:2222", "w1:http"]}, "task": W0},
         'TF_CONFIG["cluster"]["worker"][1]', "port 'http', which is not an integer"),
        ({"cluster": {"worker": ["w0:2222", "w1"]}, "task": W0},
         'TF_CONFIG["cluster"]["worker"][1]', "not of the form 'host:port'"),
        ({"cluster": {"worker": ["w0:2222", ":2222"]}, "task": W0},
         'TF_CONFIG["cluster"]["worker"][1]', "not of the form 'host:port'"),
        ({"cluster": {"worker": ["w0:2222", ""]}, "task": W0},
         'TF_CONFIG["cluster"]["worker"][1]', "needs a 'host:port' address"),
        ({"cluster": {"worker": ["w0:2222", None]}, "task": W0},
         'TF_CONFIG["cluster"]["worker"][1]', "needs a 'host:port' address"),
        ({"cluster": {"worker": ["w0:2222", "grpc://w1:2222"]}, "task": W0},
         'TF_CONFIG["cluster"]["worker"][1]', "leave out any scheme"),
        ({"cluster": {"worker": ["w0:2222", "w 1:2222"]}, "task": W0},
         'TF_CONFIG["cluster"]["worker"][1]', "not a host name or IP address"),
        ({"cluster": {"worker": ["w0:2222", "[w1]:2222"]}, "task": W0},
         'TF_CONFIG["cluster"]["worker"][1]', "not an IPv6 address"),
        ({"cluster": {"chief": ["c:1"], "worker": ["w0:1", "C:1"]}, "task": W0},
         'TF_CONFIG["cluster"]["worker"][1]', "'C:1' is used by two tasks, chief 0 and worker 1"),
        ({"cluster": {"worker": {"0": "w0:1", "x": "w1:1"}}, "task": W0},
         'TF_CONFIG["cluster"]["worker"]', "task index 'x'"),
        ({"cluster": {"worker": "w0:1"}, "task": W0},
         'TF_CONFIG["cluster"]["worker"]', "must be a list"),
        ({"cluster": ["w0:1", "w1:1"], "task": W0}, 'TF_CONFIG["cluster"]', "must be an object"),
        ({"cluster": "w0:1", "task": W0}, 'TF_CONFIG["cluster"]', "must be an object"),
        ({"cluster": {"trainer": ["a:1"]}, "task": W0}, 'TF_CONFIG["cluster"]', "unknown job 'trainer'"),
        ({"cluster": TWO, "task": {"type": "worker", "index": 2}},
         'TF_CONFIG["task"]["index"]', "task.index 2 is past the end of job 'worker'"),
        ({"cluster": TWO, "task": {"type": "worker", "index": -1}}, 'TF_CONFIG["task"]["index"]', "negative"),
        ({"cluster": TWO, "task": {"type": "worker", "index": "one"}},
         'TF_CONFIG["task"]["index"]', "must be an integer"),
        ({"cluster": TWO, "task": {"type": "worker", "index": 1.0}},
         'TF_CONFIG["task"]["index"]', "must be an integer"),
        ({"cluster": TWO, "task": {"type": "worker"}}, 'TF_CONFIG["task"]["index"]', "task.index is missing"),
        ({"cluster": TWO, "task": {"type": "trainer", "index": 0}},
         'TF_CONFIG["task"]["type"]', "'trainer' is not a valid task type"),
        ({"cluster": TWO, "task": {"type": "chief", "index": 0}},
         'TF_CONFIG["task"]["type"]', "'chief' is not a job of the cluster"),
        ({"cluster": TWO, "task": {"type": 1, "index": 0}}, 'TF_CONFIG["task"]["type"]', "must be a string"),
        ({"cluster": TWO, "task": {"index": 0}}, 'TF_CONFIG["task"]["type"]', "task.type is missing"),
        ({"cluster": TWO, "task": "worker"}, 'TF_CONFIG["task"]', "must be an object"),
        ({"cluster": TWO}, "TF_CONFIG", "set `task` in TF_CONFIG"),
        ({"task": {"type": "worker", "index": 1}}, 'TF_CONFIG["cluster"]', "is missing or empty"),
        ({"cluster": {}, "task": {"type": "ps", "index": 0}}, 'TF_CONFIG["cluster"]', "is missing or empty"),
        ({"cluster": TWO, "task": W0, "rpc_layer": 7}, 'TF_CONFIG["rpc_layer"]', "must be a string"),
        ('{"cluster": {"worker": ["w0:1"]}, "task": ', "TF_CONFIG", "is not valid JSON"),
        ("{'cluster': {}}", "TF_CONFIG", "is not valid JSON"),
        ('{"cluster": {"worker": ["a:1"], "worker": ["b:1"]}, "task": {"type": "worker", "index": 0}}',
         "TF_CONFIG", "the key 'worker' twice"),
        ("[1, 2]", "TF_CONFIG", "must be a JSON object"),
    ],
)  # fmt: skip
def test_malformed_tf_config_names_the_field(config, field, message):
    with pytest.raises(ClusterConfigError, match=re.escape(message)) as info:
        _resolve(_tf_config(config))
    assert field in str(info.value)


def test_malformed_tf_config_stops_the_strategy_before_any_networking():
    bad = TFConfigClusterResolver(environ=_tf_config({"cluster": {"worker": ["127.0.0.1:1", "127.0.0.1:70000"]},
                                                      "task": W0}))
    with pytest.raises(ClusterConfigError, match=re.escape('TF_CONFIG["cluster"]["worker"][1]')):
        td.MultiWorkerMirroredStrategy(cluster_resolver=bad)


def test_valid_tf_config_forms_still_resolve():
    r = _resolve(_tf_config({"cluster": {"chief": ["[::1]:2222"], "worker": {"0": "w0:65535"}},
                             "task": {"type": "worker", "index": "0"}}))
    assert (r.num_workers, r.worker_index, r.rendezvous_address()) == (2, 1, ("::1", 2222))
    # No cluster: the single local worker, which the task may name (worker or chief 0).
    for task in (W0, {"type": "chief", "index": 0}, {}):
        local = TFConfigClusterResolver(environ=_tf_config({"task": task}))
        assert (local.num_workers, local.worker_index) == (1, 0)


# -- the one address check ---------------------------------------------------------------------


@pytest.mark.parametrize(
    ("address", "expected"),
    [("h:1", ("h", 1)), ("10.0.0.1:65535", ("10.0.0.1", 65535)), ("[fe80::1%eth0]:2", ("fe80::1%eth0", 2))],
)
def test_split_address_accepts(address, expected):
    assert split_address(address) == expected


@pytest.mark.parametrize("address", ["h", "h:", ":1", "h:0", "h:65536", "h:-1", "h:1.5", "h: 1", "::1:2",
                                     "[h]:1", "a b:1", "h/x:1", 2222, None])
def test_split_address_refuses(address):
    with pytest.raises(ClusterConfigError, match="the field"):
        split_address(address, what="the field")


# -- the other resolvers and the launcher --------------------------------------------------------

TORCHRUN = {"RANK": "1", "WORLD_SIZE": "2", "MASTER_ADDR": "node0", "MASTER_PORT": "29500"}


@pytest.mark.parametrize(
    ("name", "value", "message"),
    [
        ("MASTER_PORT", "70000", "MASTER_PORT='70000' is above 65535"),
        ("MASTER_PORT", "0", "MASTER_PORT='0' is below 1"),
        ("MASTER_PORT", "port", "MASTER_PORT='port' is not an integer"),
        ("MASTER_ADDR", "node0:29500", "MASTER_ADDR='node0:29500' is not a host name"),
        ("MASTER_ADDR", "tcp://node0", "MASTER_ADDR='tcp://node0' is not a host name"),
        ("MASTER_ADDR", "node 0", "MASTER_ADDR:MASTER_PORT 'node 0:29500'"),
        ("WORLD_SIZE", "0", "WORLD_SIZE='0' is below 1"),
        ("WORLD_SIZE", "two", "WORLD_SIZE='two' is not an integer"),
        ("RANK", "2", "RANK=2 must be below WORLD_SIZE=2"),
        ("RANK", "-1", "RANK='-1' is below 0"),
    ],
)
def test_torchrun_variables(name, value, message):
    with pytest.raises(ClusterConfigError, match=re.escape(message)):
        _resolve({**TORCHRUN, name: value})


def test_torchrun_ipv6_master_addr():
    r = TorchrunClusterResolver(environ={**TORCHRUN, "MASTER_ADDR": "::1"})
    assert r.rendezvous_address() == ("::1", 29500)


SLURM = {"SLURM_PROCID": "1", "SLURM_STEP_NUM_TASKS": "2", "SLURM_STEP_NODELIST": "n[1-2]",
         "SLURM_STEP_TASKS_PER_NODE": "1(x2)"}


@pytest.mark.parametrize(
    ("environ", "kwargs", "message"),
    [
        (SLURM, {"port_base": 0}, "port_base must be at least 1"),
        (SLURM, {"port_base": "8888"}, "port_base must be an integer"),
        ({**SLURM, "SLURM_STEP_TASKS_PER_NODE": "2(x2)", "SLURM_STEP_NUM_TASKS": "4"}, {"port_base": 65535},
         "gives ports up to 65536"),
        (SLURM, {"jobs": {"worker": "2"}}, "jobs['worker'] must be an integer"),
        (SLURM, {"jobs": {"worker": -1, "chief": 3}}, "jobs['worker'] must be at least 0"),
        (SLURM, {"tasks_per_node": 0}, "tasks_per_node must be at least 1"),
        ({**SLURM, "SLURM_STEP_NUM_TASKS": "3"}, {}, "SLURM_STEP_NUM_TASKS='3' but the SLURM step places 2"),
        ({**SLURM, "SLURM_PROCID": "x"}, {}, "SLURM_PROCID='x' is not an integer"),
        ({**SLURM, "SLURM_PROCID": "2"}, {}, "SLURM_PROCID=2 is not below the number of tasks, 2"),
    ],
)
def test_slurm_variables_and_arguments(environ, kwargs, message):
    with pytest.raises(ClusterConfigError, match=re.escape(message)):
        SlurmClusterResolver(environ=dict(environ), gpus_per_node=0, **kwargs)


def test_simple_resolver_arguments_are_named():
    bad_port = SimpleClusterResolver({"worker": ["a:1", "b:99999"]}, "worker", 0)
    with pytest.raises(ClusterConfigError, match=re.escape("cluster_spec[\"worker\"][1] 'b:99999' has port 99999")):
        _ = bad_port.num_workers
    with pytest.raises(ClusterConfigError, match=re.escape("task_id: task.index 2 is past the end")):
        _ = SimpleClusterResolver({"worker": ["a:1", "b:1"]}, "worker", 2).worker_index
    with pytest.raises(ClusterConfigError, match=re.escape("task_type: task.type 'ps' is not a job")):
        SimpleClusterResolver({"worker": ["a:1"]}, "ps", 0).validate()
    with pytest.raises(ClusterConfigError, match=re.escape('cluster_spec["worker"]: cluster job')):
        SimpleClusterResolver({"worker": 5}, "worker", 0)


@pytest.mark.parametrize(("master", "message"), [
    ("node0", "not of the form 'host:port'"),
    ("node0:0", "port must be in 1..65535"),
    ("node0:99999", "port must be in 1..65535"),
    ("node0:x", "not an integer"),
    ("tcp://node0:1", "leave out any scheme"),
])
def test_launcher_master_flag(master, message):
    with pytest.raises(InvalidArgumentError, match=re.escape(message)) as info:
        parse_master(master)
    assert "--master" in str(info.value)
    assert parse_master(" node0:29500 ") == ("node0", 29500)


def test_launcher_nproc_and_master_on_the_command_line(capsys, tmp_path):
    from torch_distribute.cluster.launcher import main

    script = tmp_path / "train.py"
    script.write_text("")
    assert main(["--nproc", "0", str(script)]) == 2
    assert "--nproc must be >= 1" in capsys.readouterr().err
    assert main(["--master", "h:70000", str(script)]) == 2
    assert "port must be in 1..65535" in capsys.readouterr().err


# -- reduce / gather ----------------------------------------------------------------------------


@pytest.fixture(params=["one_device", "mirrored"])
def strategy(request):
    if request.param == "one_device":
        return td.OneDeviceStrategy("cpu")
    return td.MirroredStrategy(["cpu:0", "cpu:1"])


def _per_replica(strategy, values):
    return td.PerReplica(values[: strategy.num_replicas_in_sync])


@pytest.mark.parametrize("bad", ["loss", None, object(), b"bytes", [torch.ones(1), "x"]])
def test_reduce_and_gather_of_non_tensors(strategy, bad):
    for call in (lambda: strategy.reduce("sum", bad, axis=None), lambda: strategy.reduce("mean", bad, axis=0),
                 lambda: strategy.gather(bad, axis=0)):
        with pytest.raises(InvalidArgumentError, match="it combines tensors"):
            call()


def test_per_replica_component_that_is_not_a_tensor():
    strategy = td.MirroredStrategy(["cpu:0", "cpu:1"])
    with pytest.raises(InvalidArgumentError, match=re.escape("PerReplica whose replica 1 is 'x' (type str)")):
        strategy.reduce("sum", td.PerReplica([torch.ones(2), "x"]), axis=None)


def test_python_numbers_keep_working(strategy):
    assert float(strategy.reduce("mean", 2.0, axis=None)) == 2.0
    assert float(strategy.reduce("sum", _per_replica(strategy, [1.0, 2.0]), axis=None)) == (
        3.0 if strategy.num_replicas_in_sync == 2 else 1.0)


def test_mismatched_replicas_are_named_with_shapes_and_dtypes():
    strategy = td.MirroredStrategy(["cpu:0", "cpu:1"])
    shapes = td.PerReplica([torch.ones(2, 3), torch.ones(3, 3)])
    with pytest.raises(InvalidArgumentError,
                       match=re.escape("differ in shape (replica 0: (2, 3) float32, replica 1: (3, 3) float32)")):
        strategy.reduce("sum", shapes, axis=None)
    assert strategy.reduce("sum", shapes, axis=0).shape == (3,)  # along axis 0 they may differ
    assert strategy.gather(shapes, axis=0).shape == (5, 3)
    off_axis = td.PerReplica([torch.ones(2, 3), torch.ones(2, 4)])
    for call in (lambda: strategy.gather(off_axis, axis=0), lambda: strategy.reduce("mean", off_axis, axis=0)):
        with pytest.raises(InvalidArgumentError, match=re.escape(
                "differ in shape outside axis 0 (replica 0: (2, 3) float32, replica 1: (2, 4) float32)")):
            call()
    dtypes = td.PerReplica([torch.ones(2), torch.ones(2, dtype=torch.float64)])
    for call in (lambda: strategy.reduce("sum", dtypes, axis=None), lambda: strategy.gather(dtypes, axis=0)):
        with pytest.raises(InvalidArgumentError, match=re.escape(
                "different dtypes (replica 0: (2,) float32, replica 1: (2,) float64)")):
            call()


def test_nothing_is_combined_before_every_leaf_is_checked():
    strategy = td.MirroredStrategy(["cpu:0", "cpu:1"])
    calls = []
    extended = strategy.extended
    extended.reduce_to = lambda *a, **k: calls.append("reduce_to")
    extended.reduce_across_workers = lambda t: calls.append("across") or t
    extended.gather_across_workers = lambda t, axis: calls.append("gather") or t
    good = td.PerReplica([torch.ones(2), torch.ones(2)])
    bad = td.PerReplica([torch.ones(2), torch.ones(3, 2)])
    for call in (lambda: strategy.reduce("sum", (good, bad), axis=None),
                 lambda: strategy.reduce("sum", (good, bad), axis=0),
                 lambda: strategy.gather((good, bad), axis=0),
                 lambda: strategy.reduce("sum", {"a": good, "b": "text"}, axis=None)):
        with pytest.raises(InvalidArgumentError):
            call()
    assert calls == []


def test_replica_context_all_reduce_and_all_gather():
    strategy = td.MirroredStrategy(["cpu:0", "cpu:1"])

    def replica() -> int:
        return td.get_replica_context().replica_id_in_sync_group

    with pytest.raises(InvalidArgumentError, match=re.escape(
            "ReplicaContext.all_reduce: the replicas' values differ in shape (replica 0: (1,) float32, "
            "replica 1: (2,) float32)")):
        strategy.run(lambda: td.get_replica_context().all_reduce("sum", torch.ones(replica() + 1)))
    with pytest.raises(InvalidArgumentError, match=re.escape(
            "ReplicaContext.all_gather: the replicas' values differ in shape outside axis 0")):
        strategy.run(lambda: td.get_replica_context().all_gather(torch.ones(2, replica() + 1), axis=0))
    with pytest.raises(InvalidArgumentError, match="different dtypes"):
        strategy.run(lambda: td.get_replica_context().all_reduce(
            "sum", torch.ones(2, dtype=(torch.float32, torch.float64)[replica()])))
    for bad in ("x", None):
        with pytest.raises(InvalidArgumentError, match="ReplicaContext.all_reduce got "):
            strategy.run(lambda bad=bad: td.get_replica_context().all_reduce("sum", bad))
        with pytest.raises(InvalidArgumentError, match="ReplicaContext.all_gather got "):
            strategy.run(lambda bad=bad: td.get_replica_context().all_gather(bad, axis=0))
    # After the errors the strategy still works, gradients included.
    x = torch.ones(2, requires_grad=True)
    out = strategy.run(lambda: td.get_replica_context().all_gather(x * (replica() + 1), axis=0))
    assert [v.tolist() for v in strategy.experimental_local_results(out)] == [[1.0, 1.0, 2.0, 2.0]] * 2
    summed = strategy.run(lambda: td.get_replica_context().all_reduce("sum", torch.tensor(1.0)))
    assert [float(v) for v in strategy.experimental_local_results(summed)] == [2.0, 2.0]


def test_cross_device_ops_refuse_mismatched_dtypes():
    ops = ReductionToOneDevice()
    with pytest.raises(InvalidArgumentError, match="different dtypes"):
        ops.reduce("sum", [torch.ones(2), torch.ones(2, dtype=torch.float64)], torch.device("cpu"))
    with pytest.raises(InvalidArgumentError, match="not a tensor"):
        ops.batch_reduce("sum", [[torch.ones(2)], ["x"]], torch.device("cpu"))
