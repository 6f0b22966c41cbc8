"""Two hosts, really: a 2-worker job across two network namespaces, then one host cut off.

The closest these machines come to many machines. Each job gets two network namespaces,
``tdhostA-<pid>-<tag>`` and ``tdhostB-<pid>-<tag>``, joined by one veth pair (``tdA`` in
A, ``tdB`` in B), and ``python -m torch_distribute.launch --nnodes 2 --node-rank R --master
198.18.0.1:29500`` runs in each: node 0 (worker 0, the chief, which hosts the rendezvous
store) in A and node 1 (worker 1) in B. A namespace has only its own loopback and its veth
end, so every byte between the workers crosses the veth: no loopback short cut.

Two jobs run at once (they mostly wait), each in its own pair of namespaces: both first
train the ``mw_helpers`` model (checked bitwise equal across the workers and equal to one
process), then go on with tiny steps until one host is cut off: B (worker 1) in one job, A
(worker 0, the chief and the store) in the other. The survivor must raise
``td.WorkerUnavailableError`` naming the cut worker within ``timeout_seconds + 10 s``, the
cut host's worker must fail the same way, and both launchers must end the job (non-zero).

Addresses: 198.18.0.1/24 (A) and 198.18.0.2/24 (B), from 198.18.0.0/15, the range RFC 2544
reserves for benchmarking network devices: never routed on the internet and unlikely to be
used on the machine, although nothing could collide inside fresh namespaces anyway.
127.0.0.0/8 on a veth is dropped as martian unless ``route_localnet`` is set (and then
loopback special cases in Gloo and c10d would blur what is tested); 169.254.0.0/16 is
link-local, which some resolvers and tools treat specially.

Left to itself Gloo would not find the veth: it resolves the hostname (here ``vm`` ->
127.0.0.1, as on many machines), so each worker would advertise the namespace's own
loopback and the full-mesh connect would fail. The worker group points Gloo at the
interface that routes to the chief (``collectives/network.py``), and the launchers here get
no ``GLOO_SOCKET_IFNAME``: the test covers that choice.

The cut: ``ip link set dev <veth> down`` in the cut host. The other end loses its carrier
and whatever it sends is dropped silently, with no RST (a dead switch port or cable); its
sockets, routes and addresses stay, so only timeouts tell it that the peer is gone (once
ARP for the peer fails, its own kernel answers new connections with EHOSTUNREACH, as on a
real LAN). ``tc netem``, ``matchall``/``gact`` and nftables/iptables are not available on
this kernel or machine, so there is no finer "drop everything" switch.

Skipped, with the reason, where namespaces cannot be made (not Linux, not root, no ``ip``,
``ip netns add`` or a veth refused): probed once, at import. Names carry the test process's
pid; leftovers of an earlier crashed run (whose pid is gone) are removed first, and every
namespace and process is removed at the end, however it ends. When a launcher outlives its
deadline, its workers get SIGUSR1 first: they print every thread's stack into the report.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import secrets
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import mw_helpers as H  # noqa: E402
import proc_helpers as P  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
JOB = str(Path(__file__).resolve().parent / "multiworker" / "two_hosts_job.py")
PID = os.getpid()
NAMESPACE_RE = re.compile(r"^td(?:hostA|hostB|probe)-(\d+)(?:-\w+)?$")
# host: (veth end, address, node rank). The same in every pair of namespaces.
HOSTS = {"A": ("tdA", "198.18.0.1", 0), "B": ("tdB", "198.18.0.2", 1)}
MASTER = f"{HOSTS['A'][1]}:29500"
TIMEOUT_S = 10  # CommunicationOptions(timeout_seconds=...) of the jobs
SLACK_S = 10  # the goal: the error within TIMEOUT_S + SLACK_S of the cut
# Each launcher gone within TIMEOUT_S + EXIT_SLACK_S of the cut: the worker's exit after the
# error and the launcher's own teardown (it imports torch) take several seconds each, more
# on a loaded machine (measured: 12-28 s after the cut). A hang is what this catches.
EXIT_SLACK_S = 30
START_LIMIT_S = 100  # start-up and the equivalence epochs, on a loaded 2-core machine
EPOCHS = 2
RESULT_PREFIX, TRAIN_PREFIX, STEP_PREFIX = "THRESULT ", "THTRAIN ", "THSTEP "


# -- namespaces -----------------------------------------------------------------------------
def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    return subprocess.run(["ip", *args], capture_output=True, text=True, timeout=20, check=check)


def _delete_namespace(name: str) -> None:
    """Kill whatever still runs in namespace ``name``, then delete it (and so its veth end,
    which takes the peer end with it). Quiet when it does not exist."""
    listed = _ip("netns", "pids", name, check=False)
    for pid in listed.stdout.split():
        with contextlib.suppress(ProcessLookupError, ValueError):
            os.kill(int(pid), signal.SIGKILL)
    _ip("netns", "delete", name, check=False)


def _remove_leftovers() -> None:
    """Namespaces of this test's naming whose test process is gone (a crashed run)."""
    listed = _ip("netns", "list", check=False).stdout
    for line in listed.splitlines():
        name = (line.split() or [""])[0]
        match = NAMESPACE_RE.match(name)
        if not match:
            continue
        pid = int(match.group(1))
        if pid != PID:
            try:
                os.kill(pid, 0)
                continue  # its test process still runs: not ours to remove
            except ProcessLookupError:
                pass
            except PermissionError:
                continue
        _delete_namespace(name)


def _namespaces_unavailable() -> str | None:
    """Why this machine cannot run the test (None: it can). Probed once, at import."""
    if not sys.platform.startswith("linux"):
        return "network namespaces are Linux only"
    if not hasattr(os, "geteuid") or os.geteuid() != 0:
        return "making network namespaces needs root (ip netns add)"
    if shutil.which("ip") is None:
        return "the `ip` command (iproute2) is not installed"
    probe = f"tdprobe-{PID}"
    try:
        _remove_leftovers()
        made = _ip("netns", "add", probe, check=False)
        if made.returncode != 0:
            return f"`ip netns add` failed: {made.stderr.strip() or made.returncode}"
        veth = _ip("-n", probe, "link", "add", "tdp0", "type", "veth", "peer", "name", "tdp1",
                   check=False)
        if veth.returncode != 0:
            return f"cannot make a veth pair: {veth.stderr.strip() or veth.returncode}"
    except (OSError, subprocess.SubprocessError) as error:
        return f"cannot make network namespaces: {error}"
    finally:
        with contextlib.suppress(OSError, subprocess.SubprocessError):
            _delete_namespace(probe)
    return None


UNAVAILABLE = _namespaces_unavailable()
pytestmark = pytest.mark.skipif(UNAVAILABLE is not None, reason=f"two hosts: {UNAVAILABLE}")


@contextlib.contextmanager
def two_hosts(tag: str) -> Iterator[dict[str, str]]:
    """Namespaces ``tdhostA-<pid>-<tag>`` and ``tdhostB-<pid>-<tag>`` joined by a veth pair,
    addresses set, links (and lo) up; yields ``{host: namespace}``; deletes both at the end."""
    names = {host: f"tdhost{host}-{PID}-{tag}" for host in HOSTS}
    for name in names.values():
        _delete_namespace(name)
    if_a, if_b = HOSTS["A"][0], HOSTS["B"][0]
    try:
        _ip("netns", "add", names["A"])
        _ip("netns", "add", names["B"])
        # Made inside A with its peer straight in B: no name ever appears in the root namespace.
        _ip("-n", names["A"], "link", "add", if_a, "type", "veth", "peer", "name", if_b,
            "netns", names["B"])
        for host, (ifname, addr, _) in HOSTS.items():
            _ip("-n", names[host], "addr", "add", f"{addr}/24", "dev", ifname)
            _ip("-n", names[host], "link", "set", "dev", "lo", "up")
            _ip("-n", names[host], "link", "set", "dev", ifname, "up")
        yield names
    finally:
        for name in names.values():
            _delete_namespace(name)


# -- the launchers ----------------------------------------------------------------------------
class Job:
    """One launcher per host (``ip netns exec``), output to files; all killed by ``kill``."""

    def __init__(self, log_dir: Path, namespaces: dict[str, str], job_args: list[str],
                 launcher_timeout: float):
        self.namespaces = namespaces
        self.procs: dict[str, subprocess.Popen] = {}
        self.logs: dict[str, Path] = {}
        self.exited_at: dict[str, float] = {}
        self.cut_at: float | None = None
        # A job across hosts needs a secret: one owner-only file, shared by both hosts.
        secret_file = log_dir / "job-secret"
        secret_file.write_text(secrets.token_hex(32))
        secret_file.chmod(0o600)
        for host, (_, _, node_rank) in HOSTS.items():
            command = ["ip", "netns", "exec", namespaces[host], sys.executable, "-u",
                       "-m", "torch_distribute.launch", "--nnodes", "2", "--node-rank", str(node_rank),
                       "--master", MASTER, "--grace-period", "2", "--timeout", str(launcher_timeout),
                       JOB, "--timeout", str(TIMEOUT_S), "--epochs", str(EPOCHS), *job_args]
            log = log_dir / f"launcher-{host}.log"
            with open(log, "w") as out:
                # `ip netns exec` execs the launcher: the Popen is the launcher itself.
                self.procs[host] = subprocess.Popen(
                    command, env=P.clean_env(TD_JOB_SECRET_FILE=str(secret_file)), cwd=REPO,
                    stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT,
                    start_new_session=True)
            self.logs[host] = log

    def text(self, host: str) -> str:
        return self.logs[host].read_text(errors="replace")

    def lines(self, prefix: str) -> dict[int, dict]:
        """The last ``prefix`` JSON line of each rank, over both logs (complete lines only)."""
        out: dict[int, dict] = {}
        for host in HOSTS:
            text = self.text(host)
            text = text[: text.rfind("\n") + 1]
            with contextlib.suppress(json.JSONDecodeError, KeyError):
                out.update(P.parse_results(text, prefix))
        return out

    def cut(self, host: str) -> None:
        """Take ``host``'s veth end down (see the module docstring); note the time (just
        before: the times measured from it are upper bounds)."""
        cut_at = time.time()
        _ip("-n", self.namespaces[host], "link", "set", "dev", HOSTS[host][0], "down")
        self.cut_at = cut_at

    def poll(self) -> bool:
        """Record when each launcher exits; True once both have."""
        for host, proc in self.procs.items():
            if host not in self.exited_at and proc.poll() is not None:
                self.exited_at[host] = time.time()
        return len(self.exited_at) == len(self.procs)

    def codes(self) -> dict[str, int | None]:
        return {host: proc.poll() for host, proc in self.procs.items()}

    def dump_stacks(self) -> None:
        """SIGUSR1 every worker still alive (faulthandler prints all its threads' stacks)."""
        for proc in self.procs.values():
            if proc.poll() is not None:
                continue
            for pid in P.descendants(proc.pid):
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.kill(pid, signal.SIGUSR1)

    def report(self, tail: int = 6000) -> str:
        return "\n".join(f"--- launcher on host {host} (exit {self.procs[host].poll()}):\n"
                         f"{self.text(host)[-tail:]}" for host in HOSTS)

    def kill(self) -> None:
        for proc in self.procs.values():
            P.kill_tree(proc)


def _steps_done(job: Job) -> int:
    steps = job.lines(STEP_PREFIX)
    return min((steps.get(rank, {}).get("step", -1) for rank in (0, 1)), default=-1)


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict[str, dict]:
    """Both scenarios at once (they mostly wait), each in its own pair of namespaces.

    Every job trains the equivalence epochs, then goes on with tiny steps; once both of its
    workers made 3 of those, host ``B`` (scenario ``"B"``) or ``A`` (``"A"``) is cut off.
    Returns ``{scenario: outcome}``; times are seconds after that scenario's cut.
    """
    _remove_leftovers()
    jobs: dict[str, Job] = {}
    outcomes: dict[str, dict] = {}
    with contextlib.ExitStack() as stack:
        for cut_host in ("B", "A"):
            namespaces = stack.enter_context(two_hosts(f"cut{cut_host}"))
            log_dir = tmp_path_factory.mktemp(f"two_hosts_cut{cut_host}")
            job = Job(log_dir, namespaces, ["--endless", "--dump-after", "12"], launcher_timeout=150)
            stack.callback(job.kill)
            jobs[cut_host] = job
        start_deadline = time.time() + START_LIMIT_S
        start_errors: dict[str, str] = {}
        # Cut each job's host once its workers train; then wait for the launchers to end.
        while True:
            for cut_host, job in jobs.items():
                if job.cut_at is None and cut_host not in start_errors:
                    if _steps_done(job) >= 3:
                        job.cut(cut_host)
                    elif any(code is not None for code in job.codes().values()):
                        start_errors[cut_host] = "a launcher exited before the cut"
                    elif time.time() > start_deadline:
                        start_errors[cut_host] = f"not training after {START_LIMIT_S} s"
            pending = [h for h, j in jobs.items() if h not in start_errors and
                       (j.cut_at is None or (not j.poll() and time.time() < j.cut_at + TIMEOUT_S + EXIT_SLACK_S))]
            if not pending:
                break
            time.sleep(0.1)
        for cut_host, job in jobs.items():  # the outcome, before anything else can change it
            cut_at = job.cut_at or float("nan")
            outcomes[cut_host] = {
                "start_error": start_errors.get(cut_host),
                "all_exited": job.poll(),
                "codes": job.codes(),
                "exit_after": {h: round(t - cut_at, 2) for h, t in job.exited_at.items()},
            }
        for job in jobs.values():
            job.dump_stacks()  # whoever is still there: where it hangs (into the report)
        if any(not outcome["all_exited"] for outcome in outcomes.values()):
            time.sleep(1.5)
        for cut_host, job in jobs.items():
            results = job.lines(RESULT_PREFIX)
            cut_at = job.cut_at or float("nan")
            outcomes[cut_host].update(
                train=job.lines(TRAIN_PREFIX),
                results=results,
                error_after={r: round(p["raised_at"] - cut_at, 2)
                             for r, p in results.items() if "raised_at" in p},
                report=job.report(),
            )
    return outcomes


# -- 1. it trains -------------------------------------------------------------------------------
@pytest.mark.timeout(240)
def test_two_hosts_train_like_one_process(runs):
    """Both jobs, before their cut: bitwise-equal workers, equal to one process within 1e-5."""
    reference = H.train_reference(EPOCHS)
    for name, outcome in runs.items():
        train = outcome["train"]
        assert sorted(train) == [0, 1], f"job {name}: {outcome['start_error']}\n{outcome['report']}"
        chief, other = train[0], train[1]
        assert chief["num_replicas"] == 2, chief
        assert (chief["gloo_ifname"], other["gloo_ifname"]) == ("tdA", "tdB")
        assert chief["init"] == reference["init"]  # the chief's initial values won
        assert other["init"] == chief["init"]
        assert other["params"] == chief["params"], f"job {name}: the workers differ"  # bitwise
        torch.testing.assert_close(torch.tensor(chief["params"]), torch.tensor(reference["params"]),
                                   rtol=0, atol=1e-5)
        assert chief["losses"] == pytest.approx(reference["losses"], abs=1e-5)
        assert chief["params"] != chief["init"]  # it did train


# -- 2. one host cut off --------------------------------------------------------------------------
NAMES = {0: re.compile(r"worker(\(s\))?\s+0\b"), 1: re.compile(r"worker(\(s\))?\s+1\b")}


def _names(message: str, rank: int) -> bool:
    """Does the error name worker ``rank`` as the missing one (not as the one reporting)?"""
    who = message.split(" of 2: ", 1)[-1]  # past "... failed on worker R of 2: "
    return NAMES[rank].search(who) is not None


def check_cut(outcome: dict, cut_host: str) -> None:
    report = outcome["report"]
    assert outcome["start_error"] is None, f"{outcome['start_error']}:\n{report}"
    cut_rank = HOSTS[cut_host][2]
    summary = {k: outcome[k] for k in ("codes", "exit_after", "error_after")}
    results = outcome["results"]
    # The survivor first, then the cut host's worker, which cannot reach anybody either.
    for rank in (1 - cut_rank, cut_rank):
        other = 1 - rank
        assert rank in results, f"worker {rank} reported nothing {summary}:\n{report}"
        assert results[rank].get("error") == "WorkerUnavailableError", f"{summary}\n{report}"
        assert _names(results[rank]["message"], other), results[rank]["message"]
        assert outcome["error_after"][rank] <= TIMEOUT_S + SLACK_S, summary
    # Both launchers end the job: a non-zero exit, not their own timeout, and no hang.
    assert outcome["all_exited"], \
        f"a launcher still ran {TIMEOUT_S + EXIT_SLACK_S} s after the cut {summary}:\n{report}"
    for host, code in outcome["codes"].items():
        assert code not in (0, 124, None), f"launcher on {host}: exit {code} {summary}\n{report}"


@pytest.mark.timeout(240)
def test_cut_worker_host_chief_names_worker_1(runs):
    """Host B (worker 1) cut off: worker 0 on A names worker 1; both launchers end."""
    check_cut(runs["B"], "B")


@pytest.mark.timeout(240)
def test_cut_chief_host_worker_names_worker_0(runs):
    """Host A (worker 0, the chief and the store) cut off: worker 1 on B names worker 0."""
    check_cut(runs["A"], "A")


@pytest.mark.timeout(240)
def test_cut_workers_exit_with_their_error_not_a_signal(runs):
    """After the error each worker exits like any script dying of an exception (status 1),
    not killed by a signal while it tears down (134: SIGABRT)."""
    for name, outcome in runs.items():
        assert outcome["start_error"] is None, f"job {name}: {outcome['start_error']}"
        assert outcome["codes"] == {"A": 1, "B": 1}, f"job {name}: {outcome['codes']}\n{outcome['report']}"
