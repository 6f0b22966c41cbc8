"""Per-step fault tolerance (td.experimental.FaultTolerance, on torchft): a lost worker costs a
step, not the job.

One chaos job runs once for the module: ``torch-distribute launch --nproc 3 --min-workers 2``
of ``tests/workers/ft_mwms.py``. Four workers are lost one after the other, each once all
three are live again, at random steps (the seed is printed; ``TD_FT_TEST_SEED`` replays
one): one SIGKILLs itself between its backward and its optimizer step, one is SIGKILLed from
outside, one is SIGSTOPped past the collective timeout then continued, one gets SIGTERM. The
launcher replaces the killed and the preempted ones alone; the stopped one rejoins by itself.
The tests then check what the issue asks: the job finishes, the other workers never restart
and their committed step never goes back, every worker ends with bitwise-equal parameters and
optimizer state, and a one-process replay of the committed-step log gives the same parameters.

The in-process tests check the pieces: the live split of a global batch and its resumption,
the log's merge, and the errors (no torchft, a lighthouse that says min_workers differently,
too few workers past the quorum timeout, a replacement whose loop cannot resume, policies
that cannot be re-split). Every process started is killed at the end, whatever happens.
"""

from __future__ import annotations

import importlib.util
import io
import json
import os
import random
import re
import signal
import sys
import threading
import time
from pathlib import Path

import pytest
import torch

import torch_distribute as td
from torch_distribute.cluster.launcher import launch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import proc_helpers as P  # noqa: E402
from workers.ft_common import replay  # noqa: E402

HAS_TORCHFT = importlib.util.find_spec("torchft") is not None
pytestmark = [pytest.mark.skipif(not HAS_TORCHFT, reason="torchft is not installed (pip install '.[ft]')"),
              pytest.mark.skipif(not hasattr(os, "killpg"), reason="POSIX process groups")]

WORKER = str(Path(__file__).resolve().parent / "workers" / "ft_mwms.py")
FIT_WORKER = str(Path(__file__).resolve().parent / "workers" / "ft_fit.py")
TIMEOUT = 3.0  # FaultTolerance(timeout=...) in the job: a stopped worker is lost after it


class _Lines(io.TextIOBase):
    """Where the launcher writes every worker's lines; read by the test while the job runs."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.lines: list[str] = []
        self.times: list[float] = []
        self._partial = ""

    def write(self, text: str) -> int:
        with self.lock:
            text = self._partial + text
            *complete, self._partial = text.split("\n")
            now = time.monotonic()
            self.lines.extend(complete)
            self.times.extend([now] * len(complete))
        return len(text)

    def snapshot(self) -> list[str]:
        with self.lock:
            return list(self.lines)


def _fields(line: str, tag: str) -> list[str] | None:
    payload = line.split("] ", 1)[1] if line.startswith("[") and "] " in line else line
    return payload.split()[1:] if payload.startswith(tag + " ") else None


class _Job:
    """The chaos job's launcher (in a thread) and what its workers printed so far."""

    def __init__(self, command: list[str], log_dir: Path, **env: str) -> None:
        self.out = _Lines()
        self.code: int | None = None
        self.log_dir = log_dir
        env = {**P.WORKER_START_ENV, "TD_FT_LOG_DIR": str(log_dir), **env}
        self.out.write("TEST launching\n")
        self._thread = threading.Thread(target=self._run, args=(command, env), daemon=True)
        self._thread.start()

    def _run(self, command: list[str], env: dict[str, str]) -> None:
        self.code = launch(command, nproc=3, min_workers=2, extra_env=env, grace_period=2, timeout=200,
                           stdout=self.out, stderr=self.out)

    def starts(self) -> list[tuple[int, int, int]]:
        """(slot, pid, generation) of every process started, in order."""
        return [(int(f[0]), int(f[1]), int(f[2])) for line in self.out.snapshot()
                if (f := _fields(line, "FTSTART")) is not None]

    def steps(self) -> list[tuple[int, int, int, int]]:
        """(slot, pid, committed step, live workers) after every step, in order."""
        return [(int(f[0]), int(f[1]), int(f[2]), int(f[3])) for line in self.out.snapshot()
                if (f := _fields(line, "FTSTEP")) is not None]

    def pid(self, slot: int) -> int:
        return [pid for s, pid, _ in self.starts() if s == slot][-1]

    def committed(self) -> int:
        steps = self.steps()
        return max((step for *_, step, _ in steps), default=0)

    def wait_for(self, condition, what: str, limit: float = 60.0) -> None:
        deadline = time.monotonic() + limit
        while not condition():
            if self.code is not None or time.monotonic() > deadline:
                tail = "\n".join(self.out.snapshot()[-40:])
                raise AssertionError(f"gave up waiting for {what} (launcher: {self.code}):\n{tail}")
            time.sleep(0.05)

    def all_live(self, slot_pid: dict[int, int] | None = None) -> bool:
        """Whether the last step of every slot's current process ran with all 3 workers."""
        latest: dict[int, tuple[int, int]] = {}
        for slot, pid, _, live in self.steps():
            if pid == (slot_pid or {}).get(slot, self.pid(slot)):
                latest[slot] = (pid, live)
        return len(latest) == 3 and all(live == 3 for _, live in latest.values())

    def finish(self) -> None:
        self._thread.join(timeout=200)
        self.out.write(f"TEST launcher returned {self.code}\n")

    def lose(self, kind: str, slot: int, rng: random.Random) -> dict:
        """Once all 3 are live, a few steps on: ``kind`` (kill, stop, term) to ``slot``'s
        process, then wait until all 3 are live again; what happened, for the asserts."""
        self.wait_for(self.all_live, f"all 3 live before the {kind}")
        target = self.committed() + rng.randint(2, 8)
        if kind == "stop":  # early in an epoch: continued, it finds the job in the same epoch
            target += (20 - target % 20) % 20 + rng.randint(1, 4)
        self.wait_for(lambda: self.committed() >= target, f"step {target}")
        before = {s: self.pid(s) for s in range(3)}
        at = self.committed()
        os.kill(before[slot], {"kill": signal.SIGKILL, "stop": signal.SIGSTOP, "term": signal.SIGTERM}[kind])
        self.out.write(f"TEST sent {kind} to slot {slot} at step {at}\n")
        if kind == "stop":
            # The others go on without it once the collective timeout has passed.
            self.wait_for(lambda: self.committed() >= at + 2, "steps without the stopped worker")
            time.sleep(1.0)
            os.kill(before[slot], signal.SIGCONT)
            self.wait_for(lambda: self.all_live(before), "the stopped worker back in the quorum")
        else:
            self.wait_for(lambda: self.pid(slot) != before[slot] and self.all_live(), f"the {kind}ed one replaced")
        return {"kind": kind, "slot": slot, "before": before, "after": {s: self.pid(s) for s in range(3)}, "at": at}

    def end(self) -> dict:
        """Wait for the launcher, kill whatever is left (by pid), and collect the results."""
        try:
            self.finish()
        finally:
            for pid in {pid for _, pid, _ in self.starts()}:
                for sig in (signal.SIGCONT, signal.SIGKILL):
                    try:
                        os.kill(pid, sig)
                    except (ProcessLookupError, PermissionError):
                        pass
            self.finish()
            with open(self.log_dir / "output.txt", "w") as file:  # every line, with when it came
                start = self.out.times[0] if self.out.times else 0.0
                file.writelines(f"{t - start:8.2f} {line}\n" for t, line in zip(self.out.times, self.out.lines, strict=False))
        results = {}
        for line in self.out.snapshot():
            payload = line.split("] ", 1)[1] if line.startswith("[") and "] " in line else line
            if payload.startswith("FTRESULT "):
                result = json.loads(payload[len("FTRESULT "):])
                results[result["slot"]] = result
        return results


@pytest.fixture(scope="module")
def chaos(tmp_path_factory):
    seed = int(os.environ.get("TD_FT_TEST_SEED", random.randrange(1 << 30)))
    print(f"chaos job seed: TD_FT_TEST_SEED={seed}")
    rng = random.Random(seed)
    killed_self, killed, stopped = rng.sample(range(3), 3)
    preempted = rng.randrange(3)
    checkpoints = tmp_path_factory.mktemp("ft_checkpoints")
    job = _Job([WORKER, "--epochs", "7", "--timeout", str(TIMEOUT), "--checkpoints", str(checkpoints)],
               tmp_path_factory.mktemp("ft_log"), FT_SELF_KILL=f"{killed_self}:{rng.randint(3, 10)}")
    events: list[dict] = []
    try:
        job.wait_for(lambda: len([s for s in job.starts() if s[0] == killed_self]) == 2, "the self-killed one's replacement")
        events.append({"kind": "self-kill", "slot": killed_self})
        for kind, slot in (("kill", killed), ("stop", stopped), ("term", preempted)):
            events.append(job.lose(kind, slot, rng))
    finally:
        results = job.end()
    return {"job": job, "events": events, "results": results, "log_dir": job.log_dir, "seed": seed,
            "checkpoints": checkpoints}


@pytest.fixture(scope="module")
def fit_job(tmp_path_factory):
    seed = int(os.environ.get("TD_FT_TEST_SEED", random.randrange(1 << 30)))
    print(f"fit job seed: TD_FT_TEST_SEED={seed}")
    rng = random.Random(seed)
    job = _Job([FIT_WORKER, "--epochs", "4", "--timeout", str(TIMEOUT)], tmp_path_factory.mktemp("ft_fit_log"))
    try:
        event = job.lose("kill", rng.randrange(3), rng)
    finally:
        results = job.end()
    return {"job": job, "events": [event], "results": results, "log_dir": job.log_dir}


def test_the_job_finishes_and_every_worker_ends_bitwise_equal(chaos):
    job, results = chaos["job"], chaos["results"]
    assert job.code == 0, "\n".join(job.out.snapshot()[-60:])
    assert sorted(results) == [0, 1, 2]
    assert len({r["params"] for r in results.values()}) == 1
    assert len({r["optimizer"] for r in results.values()}) == 1
    assert len({r["committed"] for r in results.values()}) == 1
    assert results[0]["committed"] >= 7 * 20 - 8  # a step lost to each failure at most
    assert {r["schedule"] for r in results.values()} == {results[0]["committed"]}  # dropped steps do not move it


def test_the_others_never_restart_and_their_step_never_goes_back(chaos):
    job = chaos["job"]
    for event in chaos["events"][1:]:
        for slot in range(3):
            if slot != event["slot"]:
                assert event["after"][slot] == event["before"][slot], event
        if event["kind"] == "stop":
            assert event["after"][event["slot"]] == event["before"][event["slot"]]  # it came back itself
        else:
            assert event["after"][event["slot"]] != event["before"][event["slot"]]  # replaced
    seen: dict[int, int] = {}
    for _, pid, step, _ in job.steps():
        assert step >= seen.get(pid, 0), f"worker pid {pid} went back from step {seen[pid]} to {step}"
        seen[pid] = step
    degraded = [live for *_, live in job.steps() if live == 2]
    assert degraded, "some steps ran with the two workers left"


def test_a_one_process_replay_of_the_committed_log_gives_the_same_parameters(chaos):
    _check_replay(chaos, fit=False)


def test_the_collective_saves_hold_the_job_s_state(chaos):
    from workers.ft_common import make_model

    latest = td.latest_checkpoint(str(chaos["checkpoints"]))
    committed = chaos["results"][0]["committed"]
    assert latest is not None and latest.endswith(f"-{committed}")  # the last epoch's save, by the job's step
    model = make_model()
    td.Checkpoint(model=model).read(latest)
    got = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    expected = torch.tensor([v for values in chaos["results"][0]["values"] for v in values])
    assert torch.equal(got, expected)
    assert len([name for name in os.listdir(chaos["checkpoints"]) if name.startswith("ckpt-")]) <= 2 * 2


def test_fit_survives_a_lost_worker_like_a_custom_loop(fit_job):
    job, results = fit_job["job"], fit_job["results"]
    assert job.code == 0, "\n".join(job.out.snapshot()[-60:])
    assert sorted(results) == [0, 1, 2]
    assert len({r["params"] for r in results.values()}) == 1
    assert len({r["optimizer"] for r in results.values()}) == 1
    assert len({r["val_loss"] for r in results.values()}) == 1  # validation over the same workers
    event = fit_job["events"][0]
    assert all(event["after"][s] == event["before"][s] for s in range(3) if s != event["slot"])
    _check_replay(fit_job, fit=True)


def _check_replay(job: dict, fit: bool) -> None:
    records = td.experimental.read_committed_steps(job["log_dir"])
    results = job["results"]
    assert len(records) == results[0]["committed"]
    sizes = {len(r["workers"]) for r in records}
    assert 3 in sizes and sizes <= {2, 3}
    if not fit:  # the stopped worker's absence leaves steps of 2 (under fit, one kill may leave none)
        assert 2 in sizes
    model = replay(records, fit=fit)
    expected = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    got = torch.tensor([v for values in results[0]["values"] for v in values])
    torch.testing.assert_close(got, expected, rtol=1e-6, atol=1e-6)


# -- in-process: the pieces ------------------------------------------------------------------------


def test_fault_tolerance_settings_are_checked(monkeypatch):
    with pytest.raises(td.InvalidArgumentError, match="min_workers=0"):
        td.experimental.FaultTolerance(min_workers=0)
    with pytest.raises(td.InvalidArgumentError, match="timeout"):
        td.experimental.FaultTolerance(min_workers=1, timeout=0)
    monkeypatch.delenv("TD_FT_MIN_WORKERS", raising=False)
    with pytest.raises(td.FaultToleranceError, match="--min-workers N"):
        td.experimental.FaultTolerance().resolved_min_workers(3)
    with pytest.raises(td.FaultToleranceError, match="more than the job's 2 workers"):
        td.experimental.FaultTolerance(min_workers=3).resolved_min_workers(2)
    monkeypatch.setenv("TD_FT_MIN_WORKERS", "2")
    assert td.experimental.FaultTolerance().resolved_min_workers(3) == 2
    with pytest.raises(td.FaultToleranceError, match="give both the same number"):
        td.experimental.FaultTolerance(min_workers=1).resolved_min_workers(3)
    with pytest.raises(td.FaultToleranceError, match="not attached to a strategy"):
        next(td.experimental.FaultTolerance(min_workers=1).epochs(2))


def test_without_torchft_the_mode_says_what_to_install(monkeypatch):
    from torch_distribute.collectives import fault_tolerant_group

    real = importlib.util.find_spec
    monkeypatch.setattr(fault_tolerant_group.importlib.util, "find_spec",
                        lambda name, *a: None if name == "torchft" else real(name, *a))
    with pytest.raises(td.FaultToleranceError, match=r"pip install 'torch-distribute\[ft\]'"):
        fault_tolerant_group.require_torchft()


def test_a_global_batch_is_cut_over_the_steps_workers_and_a_pass_resumes_where_a_peer_is():
    from torch_distribute.strategies.fault_tolerant_input import LiveSplitSource

    rows = torch.arange(120).view(30, 4).float()
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(rows), batch_size=5, shuffle=True,
                                         generator=torch.Generator().manual_seed(0))
    membership = [(3, 0), (3, 2), (2, 1)]  # (workers, rank) of each step
    source = LiveSplitSource(loader, begin_step=lambda: membership[0])
    reads = iter(source)
    first = next(reads)[0]
    assert first.shape[0] == 2  # 5 rows over 3 workers: 2, 2, 1
    membership.pop(0)
    assert next(reads)[0].shape[0] == 1  # rank 2's one row of the second batch
    position = source.position()
    assert (position["passes"], position["batch"], position["new_pass"]) == (1, 2, False)
    # A worker that joins now: its pass restarts from the same random state, at batch 2.
    membership.pop(0)
    expected = next(reads)[0]
    joined = LiveSplitSource(torch.utils.data.DataLoader(torch.utils.data.TensorDataset(rows), batch_size=5,
                                                         shuffle=True, generator=torch.Generator().manual_seed(9)),
                             begin_step=lambda: (2, 1))
    joined.resume_at(position, {**position["rng"], "generators": []})
    assert torch.equal(next(iter(joined))[0], expected)
    # A peer whose next read starts a new pass: the joining one starts it from the same state.
    for _ in reads:  # the rest of the pass
        pass
    iter(source)
    waiting = source.position()
    assert waiting["new_pass"] and waiting["passes"] == 1
    again = LiveSplitSource(torch.utils.data.DataLoader(torch.utils.data.TensorDataset(rows), batch_size=5,
                                                        shuffle=True, generator=torch.Generator().manual_seed(9)),
                            begin_step=lambda: (1, 0))
    again.resume_at(waiting, waiting["rng"])
    membership[:] = [(1, 0)]
    assert torch.equal(next(iter(again))[0], next(iter(source))[0])
    assert source.position()["passes"] == again.position()["passes"] == 2


def test_the_log_merges_workers_and_keeps_the_surviving_history(tmp_path):
    from torch_distribute.strategies.committed_steps import CommittedStepLog

    a, b = CommittedStepLog(tmp_path, 0), CommittedStepLog(tmp_path, 1)
    for log in (a, b):
        log.write(step=1, quorum=1, workers=[0, 1], reads=[("#0", 0, 0)])
    a.write(step=2, quorum=1, workers=[0, 1], reads=[("#0", 0, 1)])  # committed by 0, then 0 was lost
    b.write(step=2, quorum=2, workers=[1], reads=[("#0", 0, 2)])  # 1 went on without it
    assert [r["reads"] for r in td.experimental.read_committed_steps(tmp_path)] == [[["#0", 0, 0]], [["#0", 0, 2]]]
    a.write(step=3, quorum=3, workers=[0, 1], reads=[("#0", 0, 3)])
    b.write(step=3, quorum=3, workers=[0, 1], reads=[("#0", 0, 4)])
    with pytest.raises(td.FaultToleranceError, match="logged different contents for step 3"):
        td.experimental.read_committed_steps(tmp_path)
    other = tmp_path / "gap"
    CommittedStepLog(other, 0).write(step=2, quorum=1, workers=[0], reads=[])
    with pytest.raises(td.FaultToleranceError, match=r"no record of steps \[1\]"):
        td.experimental.read_committed_steps(other)


@pytest.fixture
def lighthouse(monkeypatch):
    """A lighthouse in this process (min_workers 1) that every fault-tolerant strategy made here uses."""
    from torch_distribute.cluster.launcher import free_ports
    from torch_distribute.cluster.lighthouse import start_lighthouse

    address = f"127.0.0.1:{free_ports(1)[0]}"
    server = start_lighthouse(address, 1, join_timeout=0.5, heartbeat_timeout=1.0)
    monkeypatch.setenv("TD_FT_LIGHTHOUSE", f"http://{address}")
    monkeypatch.delenv("TD_FT_MIN_WORKERS", raising=False)
    monkeypatch.setenv("TD_JOB_SECRET", "0123456789abcdef-in-process")
    yield f"http://{address}"
    server.shutdown()


def test_one_worker_trains_step_by_step_and_what_cannot_be_cut_again_is_refused(lighthouse, tmp_path):
    ft = td.experimental.FaultTolerance(min_workers=1, timeout=5, quorum_timeout=10, log_dir=tmp_path)
    strategy = td.MultiWorkerMirroredStrategy(fault_tolerance=ft)
    try:
        with strategy.scope():
            model = torch.nn.Linear(4, 2)
            optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        batches = [torch.ones(6, 4)] * 3

        def step(x):
            td.compute_average_loss(model(x).sum(1), global_batch_size=6).backward()
            optimizer.step()
            optimizer.zero_grad()

        for _ in ft.epochs(2):
            for x in strategy.experimental_distribute_dataset(batches):
                strategy.run(step, args=(x,))
        assert ft.committed_step == 6 and strategy.num_replicas_in_sync == 1
        records = td.experimental.read_committed_steps(tmp_path)
        assert [r["reads"][0] for r in records] == [[f"#{e}", 0, b] for e in range(2) for b in range(3)]
        with pytest.raises(td.FaultToleranceError, match="AutoShardPolicy.FILE"):
            strategy.experimental_distribute_dataset(
                batches, td.InputOptions(auto_shard_policy=td.AutoShardPolicy.FILE))
        with pytest.raises(td.FaultToleranceError, match="read ahead"):
            strategy.experimental_distribute_dataset(batches, td.InputOptions(experimental_per_replica_buffer_size=1))
        with pytest.raises(td.FaultToleranceError, match="distribute_datasets_from_function"):
            strategy.distribute_datasets_from_function(lambda ctx: batches)
        with pytest.raises(td.FaultToleranceError, match="after fault-tolerant training started"):
            with strategy.scope():
                late = torch.nn.Linear(2, 2)
            strategy.run(lambda: late)
    finally:
        strategy.extended.fault_tolerance.close()


def test_too_few_workers_past_the_quorum_timeout_is_named_and_a_process_without_the_secret_gets_no_state(
        lighthouse, caplog):
    from torch_distribute.collectives.fault_tolerant_group import FaultTolerantGroup

    honest_state = {"weights": torch.arange(4.0)}
    received = []

    def group(slot, secret, min_workers=1, quorum_timeout=20.0):
        return FaultTolerantGroup(slot=slot, host="127.0.0.1", lighthouse=lighthouse, min_workers=min_workers,
                                  timeout=3, quorum_timeout=quorum_timeout, secret=secret, verify=True,
                                  state_dict=lambda: honest_state, load_state_dict=received.append)

    lonely = group(5, b"0123456789abcdef", min_workers=2, quorum_timeout=1.0)
    try:
        with pytest.raises(td.NotEnoughWorkersError, match="at least 2 live workers"):
            lonely.begin_step()
    finally:
        lonely.close()
    honest = group(0, b"0123456789abcdef")
    try:
        for _ in range(2):
            honest.begin_step()
            assert honest.should_commit()
        rogue = group(1, b"not-the-job-secret-at-all")  # behind: it would be healed from the honest one
        outcome = {}
        thread = threading.Thread(target=lambda: outcome.update(failed=(rogue.begin_step(), rogue.step_failed)[1]))
        with caplog.at_level("WARNING", logger="torch_distribute.security"):
            thread.start()
            time.sleep(1.5)  # its quorum request reaches the lighthouse first: the next quorum has both
            honest.begin_step()
            thread.join(timeout=30)
        assert outcome == {"failed": True} and honest.step_failed
        assert received == []  # no state reached the process without the secret
        assert "did not prove the job secret" in caplog.text
        rogue.close()
        honest.begin_step()  # once it is gone, the job goes on
        assert honest.should_commit() and honest.committed_step == 3
    finally:
        honest.close()


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_a_compiled_mixed_precision_step_commits_like_an_eager_one(lighthouse):
    """td.function with bfloat16 autocast and a GradScaler (whose state ``track`` sends to a
    worker that joins): the commit decision sits outside the compiled graph."""
    ft = td.experimental.FaultTolerance(min_workers=1, timeout=5, quorum_timeout=10)
    strategy = td.MultiWorkerMirroredStrategy(fault_tolerance=ft)
    try:
        torch.manual_seed(0)
        with strategy.scope():
            model = torch.nn.Linear(4, 2)
            optimizer = torch.optim.Adam(model.parameters(), lr=0.1)
        scaler = ft.track(torch.amp.GradScaler("cpu", init_scale=2.0 ** 8))
        reference = torch.nn.Linear(4, 2)
        reference.load_state_dict(model.state_dict())
        reference_optimizer = torch.optim.Adam(reference.parameters(), lr=0.1)

        def step(x, module=model, opt=optimizer):
            with torch.autocast("cpu", dtype=torch.bfloat16):
                loss = module(x).float().pow(2).sum() / 8
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
            opt.zero_grad()
            return loss

        compiled = td.function(step)
        batches = [torch.full((8, 4), float(k)) for k in range(1, 4)]
        for x in strategy.experimental_distribute_dataset(batches):
            strategy.run(compiled, args=(x,))
        assert ft.committed_step == 3
        eager_scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 8)
        for x in batches:
            with torch.autocast("cpu", dtype=torch.bfloat16):
                loss = reference(x).float().pow(2).sum() / 8
            eager_scaler.scale(loss).backward()
            eager_scaler.step(reference_optimizer)
            eager_scaler.update()
            reference_optimizer.zero_grad()
        for ours, theirs in zip(model.parameters(), reference.parameters(), strict=True):
            torch.testing.assert_close(ours, theirs, rtol=1e-3, atol=1e-3)
        assert scaler.get_scale() == eager_scaler.get_scale()
        with pytest.raises(td.InvalidArgumentError, match="state_dict"):
            ft.track(object())
    finally:
        strategy.extended.fault_tolerance.close()


def test_the_launcher_replaces_a_lost_worker_alone_and_ends_the_job_on_a_bug(tmp_path):
    """``run_replacing`` with tasks that need no torch: a worker killed by a signal (or that
    left with 143) is started again alone; one that fails otherwise ends the job."""
    from torch_distribute.cluster.supervisor import ProcessSupervisor, TaskSpec

    script = ("import os, signal, sys, time; index, generation = int(sys.argv[1]), int(sys.argv[2]); "
              "os.kill(os.getpid(), signal.SIGKILL) if (index, generation) == (1, 0) else None; "
              "sys.exit(143) if (index, generation) == (2, 0) else time.sleep(2); "
              "sys.exit(int(sys.argv[3]))")

    def run(code: int) -> tuple[int, str]:
        out = io.StringIO()
        supervisor = ProcessSupervisor(stdout=out, stderr=out, grace_period=1, start_method="fresh")

        def task(index: int, generation: int) -> TaskSpec:
            return TaskSpec(f"worker rank {index}", f"[rank {index}] ",
                            [sys.executable, "-c", script, str(index), str(generation), str(code)],
                            {**os.environ, "JOINED": str(tmp_path / f"{index}-{generation}")})

        result = supervisor.run_replacing(task, 3, lost=lambda c: c < 0 or c == 143,
                                          joined=lambda spec: True, timeout=60)
        return result, out.getvalue()

    code, text = run(0)
    assert code == 0, text
    assert re.search(r"worker rank 1 \(pid \d+\) was killed by signal SIGKILL; starting a replacement", text), text
    assert re.search(r"worker rank 2 \(pid \d+\) failed with exit code 143; starting a replacement", text), text
    assert "worker rank 0 (pid" not in text  # never replaced
    code, text = run(1)
    assert code == 1 and "failed with exit code 1" in text
