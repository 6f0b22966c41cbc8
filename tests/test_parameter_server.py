"""ParameterServerStrategy + ClusterCoordinator: real chief/worker/ps processes on loopback."""

from __future__ import annotations

import io
import json
import os
import subprocess
import sys

import pytest
import torch

import torch_distribute as td
from torch_distribute.ps.local_cluster import cluster_config, run_local_cluster

HERE = os.path.dirname(__file__)
JOB = os.path.join(HERE, "workers", "ps_job.py")
sys.path.insert(0, os.path.join(HERE, "workers"))
import ps_job  # noqa: E402  (the job's model classes, for the plain-module checks)


def _run_scenarios(scenarios, directory, restart_workers=False):
    """Run the scenarios in order in one local cluster: ``({scenario: result}, output)``."""
    out = io.StringIO()
    argv = [JOB, "--dir", str(directory)]
    for scenario in scenarios:
        argv += ["--scenario", scenario]
    code = run_local_cluster(argv, 2, 2, restart_workers=restart_workers, timeout=170, stdout=out)
    text = out.getvalue()
    assert code == 0, text[-4000:]
    results = [json.loads(line.split("RESULT ", 1)[1]) for line in text.splitlines() if "RESULT " in line]
    by_scenario = {result.pop("scenario"): result for result in results}
    assert list(by_scenario) == list(scenarios), text[-4000:]
    return by_scenario, text


def _run(scenario, directory, restart_workers=False):
    results, text = _run_scenarios([scenario], directory, restart_workers)
    return results[scenario], text


@pytest.fixture(scope="module")
def count_then_user_error(tmp_path_factory):
    """The two scenarios that stop no process, run one after the other in one cluster."""
    results, _ = _run_scenarios(["count", "user_error"], tmp_path_factory.mktemp("ps_count"))
    return results


@pytest.mark.timeout(200)
def test_schedule_join_counts(count_then_user_error):
    result = count_then_user_error["count"]
    assert result["first"] == 10  # five `total += next(it)` over a per-worker dataset of 2s
    assert result["second"] == 20
    assert result["done"] is True
    # Each function returns its worker's view right after its own update (asynchronous:
    # two workers may both have read 6 and both return 8, yet both increments are applied).
    assert len(result["fetched"]) == 10 and set(result["fetched"]) <= set(range(2, 21, 2))


@pytest.mark.timeout(200)
def test_first_error_raised_once_and_queued_functions_cancelled(count_then_user_error):
    result = count_then_user_error["user_error"]  # after `count` on the same coordinator
    assert result["join_raised"] == "bad input 7"
    assert result["queued"] == [0, 1]
    assert result["later"].count("cancelled") >= 18  # at most the in-flight ones ran
    assert result["bad_fetch_raised"] is True
    assert result["after"] == 5 and result["done"] is True  # the error state was cleared
    assert result["lambda_rejected"] is True


@pytest.mark.timeout(200)
def test_killed_worker_its_steps_rerun_and_it_rejoins(tmp_path):
    result, text = _run("worker_failure", tmp_path, restart_workers=True)
    assert result["killed"] is True
    assert "worker:1 failed" in text and "goes back to the queue" in text
    assert result["phase1_steps"] >= 30  # every scheduled step counted at least once
    assert result["steps"] >= 60 and result["fetched"] == 60
    assert result["rejoined_as"] == "worker:1:2"
    assert result["worker1_after_restart"] >= 1


@pytest.mark.timeout(200)
def test_killed_parameter_server_raises_documented_error(tmp_path):
    result, _ = _run("ps_failure", tmp_path)
    assert result["raised"] == "ParameterServerUnavailableError"
    assert "ps:1" in result["message"] and "checkpoint" in result["message"]
    assert result["raised_again"] is True
    assert result["seconds"] < 60


@pytest.mark.timeout(200)
def test_checkpoint_from_parameter_servers_restores_into_plain_module(tmp_path):
    result, _ = _run("checkpoint", tmp_path)
    assert result["shards"] == [5, 1, 1]  # embedding [13, 4] in 5 shards (3,3,3,2,2 rows)
    reference = torch.load(tmp_path / "reference.pt")
    model = ps_job.Net()
    optimizer = torch.optim.Adam(model.parameters(), lr=0.05)
    status = td.Checkpoint(model=model, optimizer=optimizer).restore(result["path"])
    status.assert_consumed()
    assert list(model.state_dict()) == list(reference["model"])  # a plain module's keys
    for name, value in model.state_dict().items():
        assert torch.equal(value, reference["model"][name]), name
    saved = optimizer.state_dict()
    assert saved["state"].keys() == reference["optimizer"]["state"].keys() == {0, 1, 2}
    for index, state in saved["state"].items():
        for key, value in state.items():
            assert torch.equal(value, reference["optimizer"]["state"][index][key]), (index, key)
    assert saved["state"][0]["exp_avg"].shape == (13, 4)  # shards joined
    # ckpt.restore on the coordinator wrote the saved values back to the servers.
    assert result["changed_before_restore"] is True
    for name, value in result["restored"].items():
        assert torch.equal(torch.tensor(value), reference["model"][name]), name


def _chief(code, cluster, timeout=60):
    env = dict(os.environ, TF_CONFIG=json.dumps({"cluster": cluster, "task": {"type": "chief", "index": 0}}))
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=timeout)


@pytest.mark.timeout(90)
def test_missing_parameter_server_is_named_at_startup():
    code = ("import torch_distribute as td\n"
            "try:\n    td.ParameterServerStrategy(startup_timeout=3)\n"
            "except td.ParameterServerUnavailableError as e:\n    print('ERR', e)\n")
    result = _chief(code, cluster_config(1, 2))
    assert "ERR Parameter servers ['ps:0', 'ps:1'] did not join" in result.stdout, result.stderr[-2000:]


def test_cluster_validation():
    empty = td.cluster_resolver.SimpleClusterResolver({})
    with pytest.raises(td.ClusterConfigError, match="empty cluster"):
        td.ParameterServerStrategy(empty)
    cluster = {"chief": ["a:1"], "worker": ["b:1"], "ps": ["c:1"]}
    with pytest.raises(td.ClusterConfigError, match="run td.distribute_server"):
        td.ParameterServerStrategy(td.cluster_resolver.SimpleClusterResolver(cluster, "worker", 0))
    with pytest.raises(td.ClusterConfigError, match="at least one 'ps'"):
        td.ParameterServerStrategy(td.cluster_resolver.SimpleClusterResolver(
            {"chief": ["a:1"], "worker": ["b:1"]}, "chief", 0))
    with pytest.raises(td.InvalidArgumentError, match="only works with a ParameterServerStrategy"):
        td.coordinator.ClusterCoordinator(td.OneDeviceStrategy("cpu"))
    assert td.distribute_server(empty) is False


def test_remote_value_and_per_worker_values():
    value = td.coordinator.RemoteValue()
    assert value.status.value == "NOT_READY"
    value.cancel()
    with pytest.raises(td.ClosureCancelledError):
        value.fetch()
    assert td.coordinator.PerWorkerValues([1, 2]).values == (1, 2)
    assert td.coordinator.experimental_get_current_worker_index() is None


@pytest.mark.timeout(240)
def test_example_trains_the_cnn_asynchronously(tmp_path):
    example = os.path.join(HERE, "..", "examples", "parameter_server.py")
    result = subprocess.run([sys.executable, example, "--workers", "2", "--ps", "2", "--epochs", "1",
                             "--checkpoint-dir", str(tmp_path)], capture_output=True, text=True, timeout=220)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert "shards per tensor [1, 1, 1, 1, 2, 1, 1, 1]" in result.stdout
    line = next(x for x in result.stdout.splitlines() if "a plain nn.Module restored" in x)
    assert float(line.rsplit(" ", 1)[1]) > 50.0
