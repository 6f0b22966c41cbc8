"""Start-up: adopting an existing process group, failing fast on workers that disagree, and
reaching the chief's store over a lossy link.

- Two processes that call ``init_process_group`` themselves, then build
  ``MultiWorkerMirroredStrategy()`` (and ``FullyShardedStrategy()``) with no arguments: the
  group is adopted, the parameters equal one process's with the same global batch, and the
  user's group is still there after the strategy closed its own.
- Two workers started with different world sizes fail within seconds, each naming both
  views (and not advising a restart); in-process checks of the view exchange cover a
  duplicate index, different versions and the "waiting for workers" line.
- A worker started alone (its chief never comes) says within 15 s whom it waits for, at
  which address and since when, and again every 15 s, as the chief does.
- A userspace forwarder that drops every connection for longer than half the timeout:
  the store connection still succeeds within the timeout.
"""

from __future__ import annotations

import logging
import os
import sys
import time
from pathlib import Path

import pytest
import torch.distributed as dist

from torch_distribute.collectives import rendezvous_views
from torch_distribute.collectives.store_connect import connect_store
from torch_distribute.errors import ClusterConfigError

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import mw_helpers as H  # noqa: E402
import proc_helpers as P  # noqa: E402
from lossy_proxy import LossyProxy  # noqa: E402

pytestmark = pytest.mark.skipif(not hasattr(os, "killpg"), reason="POSIX process groups")

JOB = str(Path(__file__).resolve().parent / "multiworker" / "launcher_job.py")
sys.path.insert(0, str(Path(JOB).parent))
import launcher_job  # noqa: E402


@pytest.fixture
def processes(tmp_path):
    with P.processes(tmp_path) as procs:
        yield procs


def torchrun_env(rank: int, world: int, port: int, **extra: str) -> dict[str, str]:
    return P.clean_env(RANK=str(rank), WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1",
                       MASTER_PORT=str(port), **extra)


def assert_matches_one_process(reports: dict[int, dict]) -> None:
    reference = H.train_reference(launcher_job.EPOCHS)["params"]
    for rank, report in reports.items():
        assert max(abs(a - b) for a, b in zip(report["params"], reference, strict=True)) <= 1e-6, rank


def test_adopts_the_users_process_group(processes):
    from torch_distribute.cluster.launcher import free_ports

    (port,) = free_ports(1)
    workers = [processes.spawn([JOB, "--init-process-group", "--fsdp-check", "--timeout", "60"],
                               torchrun_env(rank, 2, port), f"adopt{rank}") for rank in range(2)]
    reports = H.results_of_clean_exits(processes, workers, 240)
    assert_matches_one_process(reports)
    for rank, report in reports.items():
        assert (report["adopted"], report["resolver"], report["num_workers"]) == (
            True, "ProcessGroupClusterResolver", 2)
        assert report["fsdp"] == {"num_workers": 2, "worker_index": rank, "sum": 3.0}
        assert report["still_initialized_after_close"] is True


def test_workers_with_different_world_sizes_fail_fast_naming_both_views(processes):
    from torch_distribute.cluster.launcher import free_ports

    (port,) = free_ports(1)
    # Default timeout (300 s): the disagreement must not wait for it.
    workers = [processes.spawn([JOB], torchrun_env(rank, world, port), f"world{world}")
               for rank, world in ((0, 2), (1, 3))]
    started = time.monotonic()
    for proc in workers:
        assert processes.wait(proc, 120) not in (0, None), processes.output(proc)[-2000:]
    elapsed = time.monotonic() - started
    for proc in workers:
        text = processes.output(proc)
        assert "ClusterConfigError" in text and "world size: 2 (worker 0), 3 (worker 1)" in text, text[-3000:]
        assert "worker 0 of 2 (pid" in text and "worker 1 of 3 (pid" in text
        assert "restart" not in text.split("ClusterConfigError", 1)[1].lower()
    assert elapsed < 100  # process start-up (torch's import) on a loaded machine, not the 300 s timeout


# -- the view exchange, in one process -----------------------------------------------------


def exchange(store, rank, world=2, **changes):
    view = {**rendezvous_views.own_view(world, rank, "h:1", "MultiWorkerMirroredStrategy"), **changes}
    ex = rendezvous_views.ViewExchange(store, view, hosts_store=False,
                                       peer_name=lambda r: f"worker {r} at host{r}:2222")
    ex.publish()
    return ex


def test_a_duplicate_index_or_other_versions_are_named():
    store = dist.HashStore()
    first, second = exchange(store, 0), exchange(store, 0, pid=-1)
    for ex in (first, second):
        with pytest.raises(ClusterConfigError, match="index: 2 workers say they are worker 0"):
            ex.poll()
    store = dist.HashStore()
    exchange(store, 0)
    other = exchange(store, 1, torch="2.0.0", strategy="FullyShardedStrategy")
    with pytest.raises(ClusterConfigError) as info:
        other.poll()
    assert "torch version" in str(info.value) and "2.0.0 (worker 1)" in str(info.value)
    assert "strategy: MultiWorkerMirroredStrategy (worker 0), FullyShardedStrategy (worker 1)" in str(info.value)


def test_the_error_names_workers_in_index_order_whatever_order_they_arrived_in():
    store = dist.HashStore()
    late_first = exchange(store, 1, world=3)
    exchange(store, 0, world=2)
    with pytest.raises(ClusterConfigError) as info:
        late_first.poll()
    text = str(info.value)
    assert "world size: 2 (worker 0), 3 (worker 1)" in text
    assert text.index("worker 0 of 2 (pid") < text.index("worker 1 of 3 (pid")


def test_waiting_for_workers_says_who_is_missing(monkeypatch, caplog):
    monkeypatch.setattr(rendezvous_views, "PROGRESS_INTERVAL_S", 0.2)
    store = dist.HashStore()
    alone = exchange(store, 0)
    with caplog.at_level(logging.WARNING, logger="torch_distribute"):
        joined = alone.wait_all(time.monotonic() + 0.7)
    assert joined == {0}
    assert "waiting for workers: 1 of 2 joined (missing: worker 1 at host1:2222)" in caplog.text
    exchange(store, 1)
    assert alone.wait_all(time.monotonic() + 5) == {0, 1}


def test_a_worker_waiting_for_its_chief_says_whom_it_waits_for_where_and_since_when(processes):
    """Worker 1 of 2 started with no chief: within 15 s of its first attempt its stderr names
    the chief's address and since when (the chief's "waiting for workers" line is the other
    side's)."""
    import re

    from torch_distribute.cluster.launcher import free_ports

    (port,) = free_ports(1)  # nobody listens there
    worker = processes.spawn([JOB, "--timeout", "120"], torchrun_env(1, 2, port), "alone")
    pattern = re.compile(rf"worker 1 of 2: waiting for the chief \(worker 0\) at 127\.0\.0\.1:{port} "
                         r"since \d\d:\d\d:\d\d \((\d+) s\): it does not answer yet")
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and worker.poll() is None:
        waited = pattern.search(processes.output(worker))
        if waited:
            break
        time.sleep(0.2)
    assert waited, processes.output(worker)[-3000:]
    assert int(waited.group(1)) <= 15, waited.group(0)


def test_the_waiting_line_comes_again_every_progress_interval(monkeypatch, caplog):
    """Every attempt fails after 0.2 s (a chief that never comes, faster): with the first line
    after 0.5 s and one every 1 s, a 5 s wait says so two to five times (the pauses between attempts grow to 2 s)."""
    from torch_distribute.collectives import store_connect

    def refused(host, port, *args, **kwargs):
        time.sleep(0.2)
        raise RuntimeError(f"connection to ({host}, {port}) refused")

    monkeypatch.setattr(store_connect, "FIRST_REPORT_S", 0.5)
    monkeypatch.setattr(rendezvous_views, "PROGRESS_INTERVAL_S", 1.0)
    monkeypatch.setattr(store_connect.dist, "TCPStore", refused)
    with caplog.at_level(logging.WARNING, logger="torch_distribute"), pytest.raises(RuntimeError):
        connect_store("127.0.0.1", 2222, 2, seconds=5, waiting="worker 1 of 2")
    lines = [r.getMessage() for r in caplog.records if "waiting for the chief" in r.getMessage()]
    assert 2 <= len(lines) <= 5, lines
    assert all(line.startswith("worker 1 of 2: waiting for the chief (worker 0) at 127.0.0.1:2222 since ")
               and "(connection to (127.0.0.1, 2222) refused)" in line for line in lines), lines


# -- a lossy link ------------------------------------------------------------------------------


def test_store_connection_is_retried_within_the_whole_timeout():
    server = dist.TCPStore("127.0.0.1", 0, 2, is_master=True, wait_for_workers=False)
    # Every connection is lost for 6 s (more than half the 10 s timeout one attempt used to
    # get), then 30% of them, the others delayed.
    proxy = LossyProxy(("127.0.0.1", server.port), refuse_for=6.0, drop=0.3, delay=0.3)
    started = time.monotonic()
    try:
        client = connect_store("127.0.0.1", proxy.port, 2, seconds=10)
        client.set("over-the-lossy-link", "yes")
    finally:
        proxy.close()
    assert server.get("over-the-lossy-link") == b"yes"
    assert proxy.dropped >= 2 and time.monotonic() - started < 10.5


def test_two_workers_start_over_a_lossy_link(processes):
    """Worker 1 reaches the chief's store only through the forwarder, which loses every
    connection for 11 s of the 20 s timeout and 30% of them after: the job still starts
    (and trains like one process)."""
    from torch_distribute.cluster.launcher import free_ports

    (port,) = free_ports(1)
    proxy = LossyProxy(("127.0.0.1", port), refuse_for=11.0, drop=0.3, delay=0.3)
    try:
        argv = [JOB, "--timeout", "20"]
        workers = [processes.spawn(argv, torchrun_env(0, 2, port), "chief"),
                   processes.spawn(argv, torchrun_env(1, 2, proxy.port), "behind-the-proxy")]
        reports = H.results_of_clean_exits(processes, workers, 240)
    finally:
        proxy.close()
    assert_matches_one_process(reports)
    assert proxy.dropped >= 2
