"""Security (docs/security.md): tampered checkpoints run nothing through any load path, and a
process without the job secret is refused at the rendezvous.

A checkpoint directory anyone could write (a shared filesystem, a download) must never run
code in the process that opens it: DCP's ``.metadata`` is a pickle, and its own reader
unpickles whatever it names. Each attack here would create a file if anything in the
tampered file ran; the test asserts the file is never created and the error names the file.
"""

from __future__ import annotations

import json
import logging
import os
import pickle
import sys
import time
from pathlib import Path

import pytest
import torch

import torch_distribute as td
from torch_distribute import cli
from torch_distribute.checkpoint import CheckpointManager, file_io
from torch_distribute.checkpoint.sharded_io import CHECKSUMS_KEY, write_sharded
from torch_distribute.cluster.launch_spec import LaunchSpec
from torch_distribute.cluster.launcher import free_ports
from torch_distribute.collectives import job_secret

sys.path.insert(0, str(Path(__file__).resolve().parent))
import mw_helpers as H  # noqa: E402
import proc_helpers as P  # noqa: E402

pytestmark = pytest.mark.timeout(120)


class _Payload:
    """Unpickling this runs ``os.system("touch <marker>")``."""

    def __init__(self, marker: str):
        self.marker = marker

    def __reduce__(self):
        return os.system, (f"touch {self.marker}",)


class _Net(td.keras.Model):
    def __init__(self):
        super().__init__()
        self.dense = torch.nn.Linear(3, 2)

    def forward(self, x):
        return self.dense(x)


def _sharded(path, model: torch.nn.Module) -> None:
    payload = {"format": td.checkpoint.FORMAT, "version": 1, "save_counter": 1,
               "objects": {"model": model.state_dict()}}
    write_sharded(str(path), payload, is_writer=True, barrier=lambda what: None)


def _rewrite_layout(directory, checksums: str) -> None:
    """Make ``layout.pt`` agree with the files as they are now (``"consistent"``), or drop its
    checksums (``"removed"``, as a checkpoint written before checksums existed)."""
    layout_path = directory / "layout.pt"
    layout = torch.load(layout_path, weights_only=True)
    if checksums == "removed":
        del layout[CHECKSUMS_KEY]
        torch.save(layout, layout_path)
        return
    layout[CHECKSUMS_KEY] = {name: list(file_io.file_fingerprint(str(directory / name)))
                             for name in layout[CHECKSUMS_KEY]}
    file_io.save_file(str(layout_path), layout)


def _load_paths(directory, checkpoint_path):
    """Every public way to load ``checkpoint_path`` (a checkpoint in ``directory``)."""
    def read():
        td.Checkpoint(model=torch.nn.Linear(3, 2)).read(checkpoint_path)

    def restore():
        td.Checkpoint(model=torch.nn.Linear(3, 2)).restore(checkpoint_path)

    def manager():
        CheckpointManager(td.Checkpoint(model=torch.nn.Linear(3, 2)), str(directory)).restore_or_initialize()

    def latest_then_restore():
        found = td.latest_checkpoint(directory)
        td.Checkpoint(model=torch.nn.Linear(3, 2)).restore(found)

    def load_weights():
        _Net().load_weights(str(checkpoint_path))

    def load_model():
        td.keras.models.load_model(checkpoint_path)

    def convert():
        code = cli.main(["checkpoint", "convert", str(checkpoint_path), str(directory / "plain.pt")])
        if code != 0:
            raise td.CheckpointError(f"convert exited {code}")
        raise AssertionError("convert accepted a tampered checkpoint")

    return {"read": read, "restore": restore, "restore_or_initialize": manager,
            "latest_checkpoint+restore": latest_then_restore, "load_weights": load_weights,
            "load_model": load_model, "checkpoint convert": convert}


@pytest.mark.parametrize("checksums", ["consistent", "removed"])
def test_tampered_dcp_metadata_runs_nothing_through_any_load_path(tmp_path, capsys, checksums):
    directory = tmp_path / "ckpts"
    checkpoint = directory / "ckpt-1"
    _sharded(checkpoint, torch.nn.Linear(3, 2))
    marker = tmp_path / "pwned"
    (checkpoint / ".metadata").write_bytes(pickle.dumps(_Payload(str(marker))))
    _rewrite_layout(checkpoint, checksums)
    for name, load in _load_paths(directory, checkpoint).items():
        with pytest.raises(td.CheckpointError) as caught:
            load()
        message = str(caught.value) + capsys.readouterr().err
        assert "ckpt-1/.metadata" in message and ".system, which is not" in message, (name, message)
        assert not marker.exists(), name


def test_tampered_layout_and_plain_file_run_nothing(tmp_path):
    """``layout.pt`` and plain checkpoint files load with ``weights_only``: torch's allowlist."""
    marker = tmp_path / "pwned"
    sharded = tmp_path / "sharded" / "ckpt-1"
    _sharded(sharded, torch.nn.Linear(3, 2))
    layout = torch.load(sharded / "layout.pt", weights_only=True)
    layout["objects"]["extra"] = _Payload(str(marker))
    file_io.save_file(str(sharded / "layout.pt"), layout)  # a valid checksum of its own
    plain = tmp_path / "plain" / "ckpt-1"
    os.makedirs(plain.parent)
    file_io.save_file(str(plain), {"format": td.checkpoint.FORMAT, "version": 1, "save_counter": 1,
                                   "objects": {"model": _Payload(str(marker))}})
    for path, name in ((sharded, "layout.pt"), (plain, "ckpt-1")):
        with pytest.raises(td.CheckpointError, match=f"{name}.*weights_only"):
            td.Checkpoint(model=torch.nn.Linear(3, 2)).restore(td.latest_checkpoint(path.parent))
        with pytest.raises(td.CheckpointError, match=name):
            CheckpointManager(td.Checkpoint(model=torch.nn.Linear(3, 2)), str(path.parent)).restore_or_initialize()
    assert not marker.exists()


def test_untampered_sharded_checkpoint_loads(tmp_path):
    model = torch.nn.Linear(3, 2)
    _sharded(tmp_path / "ckpt-1", model)
    fresh = torch.nn.Linear(3, 2)
    td.Checkpoint(model=fresh).read(tmp_path / "ckpt-1").assert_consumed()
    assert torch.equal(fresh.weight, model.weight)


# -- the rendezvous of MultiWorkerMirrored and FullySharded --------------------------------------
AUTH_JOB = str(Path(__file__).resolve().parent / "multiworker" / "auth_job.py")
SECRET = "a" * 64


@pytest.fixture(scope="module")
def rendezvous_reports(tmp_path_factory) -> dict[tuple[str, str], dict[int, dict]]:
    """``{(strategy, case): {rank: report}}``: 2-worker jobs on loopback where worker 1 has the
    job's secret (``same``) or another one (``wrong``)."""
    cases = [(kind, case) for kind in ("mirrored", "sharded") for case in ("same", "wrong")]
    with P.processes(tmp_path_factory.mktemp("rendezvous")) as procs:
        started = {}
        for kind, case in cases:
            cluster = {"worker": [f"127.0.0.1:{p}" for p in free_ports(2)]}
            started[kind, case] = [
                procs.spawn([AUTH_JOB, *(["--sharded"] if kind == "sharded" else [])],
                            P.clean_env(MW_RANK=str(rank), TD_JOB_SECRET=SECRET if rank == 0 or case == "same"
                                        else "b" * 64, TF_CONFIG=json.dumps(
                                            {"cluster": cluster, "task": {"type": "worker", "index": rank}})),
                            f"{kind}-{case}-{rank}")
                for rank in range(2)]
        deadline = time.monotonic() + 150
        out = {}
        for key, pair in started.items():
            out[key] = {}
            for rank, proc in enumerate(pair):
                code = procs.wait(proc, deadline - time.monotonic())
                text = procs.output(proc)
                out[key][rank] = {**H.parse_results(text).get(rank, {}), "code": code, "text": text[-3000:]}
        return out


@pytest.mark.parametrize("kind", ["mirrored", "sharded"])
def test_workers_with_the_secret_join_and_the_store_listens_on_loopback_only(rendezvous_reports, kind):
    reports = rendezvous_reports[kind, "same"]
    for rank in range(2):
        assert reports[rank].get("sum") == 3.0, reports[rank]["text"]
    loopback = {"0100007F", "00000000000000000000000001000000"}  # 127.0.0.1, ::1 as /proc/net shows them
    assert reports[0]["listening"] and set(reports[0]["listening"]) <= loopback, reports[0]["listening"]


@pytest.mark.parametrize("kind", ["mirrored", "sharded"])
def test_a_worker_with_the_wrong_secret_is_refused_at_rendezvous(rendezvous_reports, kind):
    reports = rendezvous_reports[kind, "wrong"]
    assert reports[1].get("error") == "JobAuthenticationError", reports[1]["text"]
    assert "refused worker 1" in reports[1]["message"], reports[1]["message"]
    assert reports[0].get("error") == "JobAuthenticationError", reports[0]["text"]
    assert "refused worker(s) 1" in reports[0]["message"], reports[0]["message"]
    assert "LOG torch_distribute.security WARNING" in reports[0]["text"] and "claiming worker 1" in reports[0]["text"]
    assert "sum" not in reports[0] and "sum" not in reports[1]


# -- the job secret ------------------------------------------------------------------------------
def test_the_job_secret_comes_from_the_environment_or_an_owner_only_file(tmp_path, caplog):
    assert job_secret.job_secret({"TD_JOB_SECRET": SECRET}) == SECRET.encode()
    path = tmp_path / "secret"
    path.write_text(SECRET + "\n")
    path.chmod(0o644)
    with pytest.raises(td.ClusterConfigError, match="may be read by other users.*chmod 600"):
        job_secret.job_secret({"TD_JOB_SECRET_FILE": str(path)})
    path.chmod(0o600)
    assert job_secret.job_secret({"TD_JOB_SECRET_FILE": str(path)}) == SECRET.encode()
    with pytest.raises(td.ClusterConfigError, match="at least 16"):
        job_secret.job_secret({"TD_JOB_SECRET": "short"})
    # Across hosts a secret is required, unless the user says the network is trusted.
    with pytest.raises(td.ClusterConfigError, match="another host, but has no job secret.*TD_JOB_SECRET_FILE"):
        job_secret.required_secret("10.1.2.3", "The job", {})
    with caplog.at_level(logging.WARNING, logger="torch_distribute.security"):
        assert job_secret.required_secret("10.1.2.3", "The job", {"TD_INSECURE": "1"}) is None
    assert "TD_INSECURE=1" in caplog.text and "without a job secret" in caplog.text


def test_the_launcher_gives_one_node_a_secret_and_refuses_nodes_without_one(tmp_path, monkeypatch):
    script = tmp_path / "train.py"
    script.write_text("pass\n")
    monkeypatch.delenv("TD_JOB_SECRET", raising=False)
    monkeypatch.delenv("TD_JOB_SECRET_FILE", raising=False)
    monkeypatch.delenv("TD_INSECURE", raising=False)
    tasks = LaunchSpec([str(script)], 2).tasks(0)
    secrets_given = {task.env["TD_JOB_SECRET"] for task in tasks}
    assert len(secrets_given) == 1 and len(secrets_given.pop()) == 64
    assert LaunchSpec([str(script)], 2).tasks(0)[0].env["TD_JOB_SECRET"] != tasks[0].env["TD_JOB_SECRET"]
    spec = LaunchSpec([str(script)], 1, nnodes=2, master="10.1.2.3:29500")
    with pytest.raises(td.InvalidArgumentError, match="no job secret"):
        spec.validate()
    monkeypatch.setenv("TD_JOB_SECRET", SECRET)
    spec.validate()
    assert spec.tasks(0)[0].env["TD_JOB_SECRET"] == SECRET  # the user's, on every node


# -- the authenticated channel (ps/secure_channel.py) --------------------------------------------
def test_the_channel_calls_entry_points_only_for_peers_with_the_secret(tmp_path, caplog):
    import socket

    from torch_distribute.ps.secure_channel import ChannelClient, ChannelServer, RemoteCallError

    marker = tmp_path / "pwned"
    server = ChannelServer(("127.0.0.1", 0), SECRET.encode(), {"apply": lambda fn, x: fn(x)}, name="ps:0")
    try:
        client = ChannelClient(server.address, SECRET.encode(), name="worker:0")
        offset = 10
        assert client.call("apply", lambda x: x + offset, 5, timeout=30) == 15  # closures travel
        with caplog.at_level(logging.WARNING, logger="torch_distribute.security"):
            # A function the server did not register is refused, and logged.
            with pytest.raises(RemoteCallError, match="no entry point 'os.system'"):
                client.call("os.system", f"touch {marker}", timeout=30)
            # The wrong secret: refused on both sides, before any request is read.
            with pytest.raises(td.JobAuthenticationError):
                ChannelClient(server.address, b"b" * 64, name="intruder")
            # A process that skips the handshake and sends a pickle: never unpickled.
            raw = socket.create_connection(server.address, timeout=30)
            raw.recv(64)
            raw.sendall(pickle.dumps(_Payload(str(marker))) * 4)
            raw.settimeout(30)
            try:
                assert raw.recv(64) == b""  # dropped
            except ConnectionResetError:
                pass  # dropped, with bytes unread
            raw.close()
            # A message altered on the way: the connection is closed, nothing runs.
            victim = ChannelClient(server.address, SECRET.encode(), name="worker:1")
            victim._session._key = b"x" * 32  # noqa: SLF001 - forge the MAC
            with pytest.raises(ConnectionError):
                victim.call("apply", _Payload(str(marker)), 1, timeout=30)
        assert client.call("apply", abs, -3, timeout=30) == 3  # the job goes on
        assert not marker.exists()
        log = caplog.text
        assert "refused a call" in log and "refused a connection" in log and "MAC is wrong" in log, log
    finally:
        server.close()


# -- a parameter-server job under attack ----------------------------------------------------------
PS_ATTACK_JOB = str(Path(__file__).resolve().parent / "workers" / "ps_attack_job.py")


def _attack(address: tuple[str, int], marker: Path) -> list[str]:
    """What an outsider holding everything but the secret tries on one task's listener."""
    import datetime
    import socket

    import torch.distributed as dist

    from torch_distribute.ps.secure_channel import ChannelClient

    outcomes = []
    try:  # the library's own protocol, with a guessed secret
        ChannelClient(address, b"guessed-secret-0123456789", name="intruder")
        outcomes.append("joined")
    except td.JobAuthenticationError:
        outcomes.append("refused")
    raw = socket.create_connection(address, timeout=30)  # skip the handshake: send a pickle
    raw.recv(64)
    raw.sendall(pickle.dumps(_Payload(str(marker))) * 2)
    raw.settimeout(30)
    try:
        outcomes.append("dropped" if raw.recv(64) == b"" else "answered")
    except ConnectionResetError:
        outcomes.append("dropped")
    raw.close()
    try:  # the membership step of torch.distributed.rpc (what the visitor ran)
        dist.TCPStore(address[0], address[1], is_master=False, timeout=datetime.timedelta(seconds=3))
        outcomes.append("store joined")
    except Exception:  # noqa: BLE001 - any failure is a refusal
        outcomes.append("store refused")
    return outcomes


@pytest.mark.timeout(400)
def test_an_outsider_cannot_join_or_run_code_in_a_parameter_server_job(tmp_path):
    """Both ways of starting a job, at once: the in-process cluster, and one task per process
    with a TF_CONFIG each (``local_cluster``)."""
    marker = tmp_path / "pwned"
    ways = {"in_process": [PS_ATTACK_JOB],
            "tf_config": ["-m", "torch_distribute.ps.local_cluster", "--workers", "1", "--ps", "1",
                          "--timeout", "300", PS_ATTACK_JOB]}
    with P.processes(tmp_path) as procs:
        jobs = {way: procs.spawn([*argv, str(tmp_path / f"done-{way}")], P.clean_env(), way)
                for way, argv in ways.items()}
        deadline = time.monotonic() + 300
        outcomes, texts, codes = {}, {}, {}
        for way, job in jobs.items():
            while "CLUSTER " not in procs.output(job):
                assert job.poll() is None and time.monotonic() < deadline, procs.output(job)
                time.sleep(0.2)
            cluster = json.loads(procs.output(job).split("CLUSTER ", 1)[1].splitlines()[0])
            for kind in ("chief", "worker", "ps"):
                host, port = cluster[kind][0].rsplit(":", 1)
                outcomes[way, kind] = _attack((host, int(port)), marker)
            (tmp_path / f"done-{way}").touch()
        for way, job in jobs.items():
            codes[way] = procs.wait(job, deadline - time.monotonic())
            texts[way] = procs.output(job)
    assert outcomes == {key: ["refused", "dropped", "store refused"] for key in outcomes}, outcomes
    for way, text in texts.items():
        assert codes[way] == 0, (way, text[-3000:])
        result = json.loads(text.split("RESULT ", 1)[1].splitlines()[0])
        assert result["untouched"] and result["last_loss"] < 0.5 and result["steps"] == {"worker:0": 20}, result
        for task in ("chief:0", "[worker:0] worker:0", "[ps:0] ps:0"):  # each task logged its intruders
            assert f"{task} refused a connection" in text, (way, task, text[-3000:])
    assert not marker.exists()
