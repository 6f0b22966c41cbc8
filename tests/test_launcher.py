"""The local launcher (``torch-distribute launch``): environment, output, supervision, CLI.

Workers are tiny Python scripts written to ``tmp_path`` (no torch.distributed): they print
their environment, sleep, or exit with a code. Every test is bounded in time and checks
that no worker process outlives the launcher. The launcher's default start (fresh
interpreters) runs them; the tests taking ``start_method`` run again with the workers forked
by Python's forkserver, whose start (torch's import) their time limits allow for.
"""

from __future__ import annotations

import io
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from torch_distribute.cluster import launcher as L
from torch_distribute.cluster.forkserver_tasks import ForkserverTasks
from torch_distribute.cluster.supervisor import ProcessSupervisor
from torch_distribute.errors import InvalidArgumentError

pytestmark = pytest.mark.skipif(not hasattr(os, "killpg"), reason="POSIX process groups")

REPO = Path(__file__).resolve().parents[1]

# Waits until a file exists (workers use it to wait for each other, bounded in time), and
# writes one whole (a reader never sees it half-written).
WAIT_FOR = textwrap.dedent(
    """
    import os, sys, time
    def wait_for(path, limit=20.0):
        end = time.monotonic() + limit
        while not os.path.exists(path):
            if time.monotonic() > end:
                sys.exit(99)
            time.sleep(0.02)
    def publish(path, text):
        with open(path + ".tmp", "w") as f:
            f.write(text)
        os.replace(path + ".tmp", path)
    """
)


def _script(tmp_path: Path, body: str, name: str = "worker.py") -> str:
    path = tmp_path / name
    path.write_text(WAIT_FOR + textwrap.dedent(body))
    return str(path)


def _alive(pid: int) -> bool:
    """True while ``pid`` runs (a zombie left for an init that does not reap counts as gone)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            state = f.read().rsplit(")", 1)[1].split()[0]
        return state not in ("Z", "X")
    except FileNotFoundError:
        return False
    except OSError:  # no /proc
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return False
        return True


def _gone(pid: int, within: float = 3.0) -> bool:
    end = time.monotonic() + within
    while _alive(pid):
        if time.monotonic() > end:
            return False
        time.sleep(0.02)
    return True


def _kill_quietly(*pids: int) -> None:
    for pid in pids:
        try:
            os.kill(pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass


#: How much longer a launch may take to start its workers (the forkserver's import of torch,
#: on a loaded 2-core machine).
STARTUP_S = {"fresh": 0.0, "forkserver": 20.0}
BOTH_START_METHODS = pytest.mark.parametrize("start_method", ["fresh", "forkserver"])


@pytest.fixture(autouse=True)
def _fresh_unless_named(monkeypatch):
    """The default start method (the suite's conftest sets ``forkserver`` for other tests)."""
    monkeypatch.delenv("TD_START_METHOD", raising=False)


def _run(argv, nproc, **kwargs):
    out, err = io.StringIO(), io.StringIO()
    kwargs.setdefault("timeout", 40)
    start = time.monotonic()
    code = L.launch(argv, nproc, stdout=out, stderr=err, **kwargs)
    return code, out.getvalue(), err.getvalue(), time.monotonic() - start


ENV_DUMP = """
    import json
    keys = ["RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK",
            "MASTER_ADDR", "MASTER_PORT", "TD_RESTART_COUNT", "TD_MAX_RESTARTS",
            "PYTHONUNBUFFERED", "TF_CONFIG", "EXTRA"]
    out = sys.argv[1]
    tag = os.environ.get("RANK") or json.loads(os.environ["TF_CONFIG"])["task"]["index"]
    with open(os.path.join(out, f"env_{tag}.json"), "w") as f:
        json.dump({k: os.environ.get(k) for k in keys}, f)
"""


# ----------------------------------------------------------------------------- environment


@pytest.mark.timeout(60)
@pytest.mark.parametrize("nproc", [2, 3])
def test_torchrun_env_per_rank(tmp_path, monkeypatch, nproc):
    monkeypatch.setenv("TF_CONFIG", '{"cluster": {"worker": ["x:1"]}}')  # must not leak
    script = _script(tmp_path, ENV_DUMP)
    code, _, err, _ = _run([script, str(tmp_path)], nproc, extra_env={"EXTRA": "yes"})
    assert code == 0, err
    envs = [json.loads((tmp_path / f"env_{r}.json").read_text()) for r in range(nproc)]
    ports = {e["MASTER_PORT"] for e in envs}
    assert len(ports) == 1 and 0 < int(ports.pop()) < 65536
    for rank, env in enumerate(envs):
        assert env["RANK"] == str(rank)
        assert env["LOCAL_RANK"] == str(rank)
        assert env["WORLD_SIZE"] == env["LOCAL_WORLD_SIZE"] == str(nproc)
        assert env["GROUP_RANK"] == "0"
        assert env["MASTER_ADDR"] == "127.0.0.1"
        assert env["TD_RESTART_COUNT"] == "0" and env["TD_MAX_RESTARTS"] == "0"
        assert env["PYTHONUNBUFFERED"] == "1"
        assert env["TF_CONFIG"] is None
        assert env["EXTRA"] == "yes"


@pytest.mark.timeout(60)
def test_tf_config_env(tmp_path, monkeypatch):
    monkeypatch.setenv("RANK", "7")  # inherited torchrun variables must not leak
    monkeypatch.setenv("MASTER_PORT", "1")
    script = _script(tmp_path, ENV_DUMP)
    code, _, err, _ = _run([script, str(tmp_path)], 3, env_mode="tf_config")
    assert code == 0, err
    configs = []
    for index in range(3):
        env = json.loads((tmp_path / f"env_{index}.json").read_text())
        assert env["RANK"] is None and env["MASTER_PORT"] is None
        assert env["TD_RESTART_COUNT"] == "0"
        configs.append(json.loads(env["TF_CONFIG"]))
    workers = configs[0]["cluster"]["worker"]
    assert len(workers) == 3 and len(set(workers)) == 3
    for address in workers:
        host, port = address.rsplit(":", 1)
        assert host == "127.0.0.1" and 0 < int(port) < 65536
    for index, config in enumerate(configs):
        assert config == {"cluster": {"worker": workers}, "task": {"type": "worker", "index": index}}


def test_multi_node_environment():
    envs = L.worker_environments(2, nnodes=3, node_rank=1, master="node0:29500",
                                 restart_count=2, max_restarts=4)
    assert [e["RANK"] for e in envs] == ["2", "3"]
    assert [e["LOCAL_RANK"] for e in envs] == ["0", "1"]
    assert {e["WORLD_SIZE"] for e in envs} == {"6"}
    assert {e["GROUP_RANK"] for e in envs} == {"1"}
    assert {(e["MASTER_ADDR"], e["MASTER_PORT"]) for e in envs} == {("node0", "29500")}
    assert {(e["TD_RESTART_COUNT"], e["TD_MAX_RESTARTS"]) for e in envs} == {("2", "4")}
    assert L.parse_master("[::1]:1234") == ("::1", 1234)
    # A fresh rendezvous port for every attempt when no master is given.
    ports = {L.worker_environments(1)[0]["MASTER_PORT"] for _ in range(5)}
    assert len(ports) > 1


# ----------------------------------------------------------------------------- output


@pytest.mark.timeout(60)
@BOTH_START_METHODS
def test_output_prefixed_per_rank(tmp_path, start_method):
    script = _script(
        tmp_path,
        """
        rank = os.environ["RANK"]
        print(f"hello from {rank}")
        print(f"second line {rank}")
        print(f"problem {rank}", file=sys.stderr)
        sys.stdout.flush()
        sys.stdout.buffer.write(b"garbage \\xff\\xfe end\\n")
        sys.stdout.buffer.write(f"no newline {rank}".encode())
        """,
    )
    code, out, err, _ = _run([script], 2, start_method=start_method)
    assert code == 0, err
    out_lines = out.splitlines()
    for rank in (0, 1):
        mine = [line for line in out_lines if line.startswith(f"[rank {rank}] ")]
        assert mine[:2] == [f"[rank {rank}] hello from {rank}", f"[rank {rank}] second line {rank}"]
        assert mine[2].startswith(f"[rank {rank}] garbage ") and "\ufffd" in mine[2]
        assert mine[3] == f"[rank {rank}] no newline {rank}"
        assert f"[rank {rank}] problem {rank}" in err.splitlines()
    assert len(out_lines) == 8 and all(re.match(r"\[rank [01]\] ", line) for line in out_lines)
    assert out.endswith("\n")


@pytest.mark.timeout(60)
def test_large_output_does_not_deadlock(tmp_path):
    script = _script(
        tmp_path,
        """
        line = "x" * 1000
        for i in range(3000):
            print(i, line)
            print(i, line, file=sys.stderr)
        """,
    )
    code, out, err, _ = _run([script], 2)  # a deadlock would end in the 40 s timeout
    assert code == 0, err[-2000:]
    assert len(out.splitlines()) == 6000
    assert len([x for x in err.splitlines() if x.startswith("[rank ")]) == 6000


# ----------------------------------------------------------------------------- failures


@pytest.mark.timeout(60)
@BOTH_START_METHODS
def test_failure_stops_other_workers_and_grandchildren(tmp_path, start_method):
    script = _script(
        tmp_path,
        """
        import subprocess
        out = sys.argv[1]
        rank = os.environ["RANK"]
        publish(os.path.join(out, f"pid_{rank}"), str(os.getpid()))
        if rank == "0":
            child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
            publish(os.path.join(out, "grandchild"), str(child.pid))
            time.sleep(60)
        else:
            wait_for(os.path.join(out, "grandchild"))
            sys.exit(3)
        """,
    )
    try:
        code, _, err, elapsed = _run([script, str(tmp_path)], 2, start_method=start_method)
        sleeper = int((tmp_path / "pid_0").read_text())
        failed = int((tmp_path / "pid_1").read_text())
        grandchild = int((tmp_path / "grandchild").read_text())
        assert code == 3, err
        assert elapsed < 15 + STARTUP_S[start_method]
        assert f"worker rank 1 (pid {failed}) failed with exit code 3" in err.splitlines()[-1]
        assert _gone(sleeper), "the sleeping worker outlived the launcher"
        assert _gone(grandchild), "a worker's child outlived the launcher"
    finally:
        for name in ("pid_0", "pid_1", "grandchild"):
            if (tmp_path / name).exists():
                _kill_quietly(int((tmp_path / name).read_text()))


@pytest.mark.timeout(60)
def test_worker_ignoring_sigterm_is_killed_after_grace_period(tmp_path):
    script = _script(
        tmp_path,
        """
        import signal
        out = sys.argv[1]
        if os.environ["RANK"] == "0":
            signal.signal(signal.SIGTERM, signal.SIG_IGN)
            with open(os.path.join(out, "pid_0"), "w") as f:
                f.write(str(os.getpid()))
            time.sleep(60)
        wait_for(os.path.join(out, "pid_0"))
        time.sleep(0.2)
        sys.exit(1)
        """,
    )
    try:
        code, _, err, elapsed = _run([script, str(tmp_path)], 2, grace_period=0.5)
        assert code == 1, err
        assert "worker rank 1" in err and "failed with exit code 1" in err
        assert elapsed < 8
        assert _gone(int((tmp_path / "pid_0").read_text()))
    finally:
        if (tmp_path / "pid_0").exists():
            _kill_quietly(int((tmp_path / "pid_0").read_text()))


@pytest.mark.timeout(60)
@BOTH_START_METHODS
def test_worker_killed_by_signal_is_named(tmp_path, start_method):
    script = _script(
        tmp_path,
        """
        import signal
        if os.environ["RANK"] == "1":
            with open(os.path.join(sys.argv[1], "pid_1"), "w") as f:
                f.write(str(os.getpid()))
            os.kill(os.getpid(), signal.SIGKILL)
        time.sleep(60)
        """,
    )
    code, _, err, elapsed = _run([script, str(tmp_path)], 2, start_method=start_method)
    pid = int((tmp_path / "pid_1").read_text())
    assert code == 128 + signal.SIGKILL
    assert f"worker rank 1 (pid {pid}) was killed by signal SIGKILL" in err.splitlines()[-1]
    assert elapsed < 15 + STARTUP_S[start_method]


@pytest.mark.timeout(60)
@BOTH_START_METHODS
def test_restart_then_success(tmp_path, start_method):
    script = _script(
        tmp_path,
        """
        out = sys.argv[1]
        attempt = os.environ["TD_RESTART_COUNT"]
        rank = os.environ["RANK"]
        with open(os.path.join(out, f"port_{attempt}_{rank}"), "w") as f:
            f.write(os.environ["MASTER_PORT"])
        if attempt == "0" and rank == "1":
            wait_for(os.path.join(out, "port_0_0"))  # else rank 0 may be stopped before it writes
            sys.exit(5)
        print(f"done attempt {attempt}")
        """,
    )
    code, out, err, _ = _run([script, str(tmp_path)], 2, max_restarts=1, start_method=start_method)
    assert code == 0, err
    assert re.search(
        r"restarting all workers \(attempt 1/1\) after worker rank 1 \(pid \d+\) "
        r"failed with exit code 5", err)
    assert "[rank 0] done attempt 1" in out and "[rank 1] done attempt 1" in out
    assert "[rank 1] done attempt 0" not in out
    # Every attempt rendezvouses on a new port.
    assert (tmp_path / "port_0_0").read_text() != (tmp_path / "port_1_0").read_text()


@pytest.mark.timeout(60)
def test_restarts_exhausted(tmp_path):
    script = _script(
        tmp_path,
        """
        attempt = os.environ["TD_RESTART_COUNT"]
        assert os.environ["TD_MAX_RESTARTS"] == "2"
        if os.environ["RANK"] == "0":
            open(os.path.join(sys.argv[1], f"attempt_{attempt}"), "w").close()
            sys.exit(2)
        time.sleep(60)
        """,
    )
    code, _, err, elapsed = _run([script, str(tmp_path)], 2, max_restarts=2)
    assert code == 2
    assert "(attempt 1/2)" in err and "(attempt 2/2)" in err and "(attempt 3/" not in err
    assert re.search(r"worker rank 0 \(pid \d+\) failed with exit code 2$", err.strip())
    assert sorted(p.name for p in tmp_path.glob("attempt_*")) == [
        "attempt_0", "attempt_1", "attempt_2"]
    assert elapsed < 15


@pytest.mark.timeout(60)
def test_timeout_stops_everything(tmp_path):
    script = _script(
        tmp_path,
        """
        with open(os.path.join(sys.argv[1], "pid_" + os.environ["RANK"]), "w") as f:
            f.write(str(os.getpid()))
        time.sleep(60)
        """,
    )
    code, _, err, elapsed = _run([script, str(tmp_path)], 2, timeout=1.5)
    assert code == L.EXIT_TIMEOUT and "timed out after 1.5 s" in err
    assert elapsed < 8
    for path in tmp_path.glob("pid_*"):
        assert _gone(int(path.read_text()))


# ----------------------------------------------------------------------------- arguments


@pytest.mark.timeout(60)
@pytest.mark.parametrize(
    "args, message",
    [
        (["--nproc", "0", "{script}"], "--nproc must be >= 1"),
        (["--nnodes", "2", "--node-rank", "2", "--master", "h:1", "{script}"],
         "--node-rank must be in 0..1"),
        (["--nnodes", "2", "--node-rank", "1", "{script}"], "--master HOST:PORT is required"),
        (["--master", "nohost", "{script}"], "--master must be HOST:PORT"),
        (["--master", "h:99999", "{script}"], "port must be in 1..65535"),
        (["--max-restarts", "-1", "{script}"], "--max-restarts must be >= 0"),
        (["--env", "tf_config", "--nnodes", "2", "--master", "h:1", "{script}"],
         "--env tf_config works on one node only"),
        (["--env", "slurm", "{script}"], "invalid choice"),
        (["--nproc", "2", "missing_script.py"], "script not found"),
        (["--nproc", "2"], "required"),
    ],
)
def test_argument_errors(tmp_path, capsys, args, message):
    script = _script(tmp_path, "")
    code = L.main([a.replace("{script}", script) for a in args])
    assert code == 2
    assert message in capsys.readouterr().err


def test_api_argument_errors(tmp_path):
    script = _script(tmp_path, "")
    with pytest.raises(InvalidArgumentError, match="no script"):
        L.launch([], 2)
    with pytest.raises(InvalidArgumentError, match="-m needs a module"):
        L.launch(["-m"], 2)
    with pytest.raises(InvalidArgumentError, match="must be a list"):
        L.launch(script, 2)
    with pytest.raises(InvalidArgumentError, match="--grace-period"):
        L.launch([script], 2, grace_period=-1)


# ----------------------------------------------------------------------------- CLI


CLI_SCRIPT = """
    print("rank", os.environ["RANK"], "of", os.environ["WORLD_SIZE"], "args", sys.argv[1:])
"""


def _check_cli_output(proc: subprocess.CompletedProcess) -> None:
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    for rank in (0, 1):
        assert f"[rank {rank}] rank {rank} of 2 args ['--nproc', '7', '--flag']" in lines


@pytest.mark.timeout(60)
def test_python_m_entry_point(tmp_path):
    script = _script(tmp_path, CLI_SCRIPT)
    proc = subprocess.run(
        [sys.executable, "-m", "torch_distribute.launch", "--nproc", "2", script,
         "--nproc", "7", "--flag"],
        capture_output=True, text=True, timeout=50, cwd=REPO,
    )
    _check_cli_output(proc)


@pytest.mark.timeout(60)
def test_console_script(tmp_path):
    exe = Path(sys.executable).parent / "torch-distribute"
    if not exe.exists():
        found = shutil.which("torch-distribute")
        if found is None:
            pytest.skip("the torch-distribute console script is not installed")
        exe = Path(found)
    script = _script(tmp_path, CLI_SCRIPT)
    proc = subprocess.run(
        [str(exe), "launch", "--nproc", "2", script, "--nproc", "7", "--flag"],
        capture_output=True, text=True, timeout=50, cwd=tmp_path,
    )
    _check_cli_output(proc)


@pytest.mark.timeout(60)
@BOTH_START_METHODS
def test_module_mode(tmp_path, start_method):
    package = tmp_path / "mypkg"
    package.mkdir()
    (package / "__init__.py").write_text("")
    (package / "train.py").write_text(
        "import os, sys\nprint('module', __name__, os.environ['RANK'], sys.argv[1:])\n"
    )
    code, out, err, _ = _run(["-m", "mypkg.train", "--lr", "0.1"], 2,
                             extra_env={"PYTHONPATH": str(tmp_path)}, start_method=start_method)
    assert code == 0, err
    for rank in (0, 1):
        assert f"[rank {rank}] module __main__ {rank} ['--lr', '0.1']" in out.splitlines()
    assert L.main(["--nproc", "1", "--timeout", "20", "-m", "mypkg.nothing_here"]) != 0


@pytest.mark.timeout(60)
@pytest.mark.parametrize("sig, expected", [(signal.SIGTERM, 143), (signal.SIGINT, 130)])
@BOTH_START_METHODS
def test_launcher_signal_stops_workers(tmp_path, sig, expected, start_method):
    script = _script(
        tmp_path,
        """
        import subprocess
        out = sys.argv[1]
        rank = os.environ["RANK"]
        child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
        publish(os.path.join(out, f"pid_{rank}"), f"{os.getpid()} {child.pid}")
        print("ready", flush=True)
        time.sleep(60)
        """,
    )
    launcher = subprocess.Popen(
        [sys.executable, "-m", "torch_distribute.launch", "--nproc", "2", "--grace-period", "3",
         "--start-method", start_method, script, str(tmp_path)],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=REPO,
        start_new_session=True,
    )
    pids: list[int] = []
    try:
        end = time.monotonic() + 30 + STARTUP_S[start_method]
        while not all((tmp_path / f"pid_{r}").exists() for r in (0, 1)):
            assert time.monotonic() < end and launcher.poll() is None, launcher.stderr.read()
            time.sleep(0.05)
        pids = [int(p) for r in (0, 1) for p in (tmp_path / f"pid_{r}").read_text().split()]
        start = time.monotonic()
        launcher.send_signal(sig)
        out, err = launcher.communicate(timeout=30)
        assert launcher.returncode == expected, err
        assert time.monotonic() - start < 8
        assert f"received {signal.Signals(sig).name}; stopping all workers" in err
        for pid in pids:
            assert _gone(pid), f"pid {pid} outlived the launcher"
    finally:
        if launcher.poll() is None:
            os.killpg(launcher.pid, signal.SIGKILL)
            launcher.wait()
        _kill_quietly(*pids)


# ----------------------------------------------------------------------------- start methods

PROCESS_VIEW = """
    import atexit, json
    out = sys.argv[1]

    def at_exit():  # what an atexit handler sees of the way the program ended
        with open(os.path.join(out, f"ended_{os.environ['RANK']}"), "w") as f:
            f.write(type(getattr(sys, "last_value", None)).__name__)

    atexit.register(at_exit)
    main = sys.modules["__main__"]
    view = {
        "argv": sys.argv, "name": __name__, "file": __file__, "path": sys.path,
        "cwd": os.getcwd(), "stdout_buffer": type(sys.stdout.buffer).__name__, "flags": repr(sys.flags), "spec": repr(__spec__),
        "stdin": os.readlink("/proc/self/fd/0"), "own_session": os.getsid(0) == os.getpid(),
        "env": sorted(os.environ), "globals": sorted(k for k in vars(main) if k not in ("wait_for", "publish", "at_exit")),
        "torch_imported": "torch" in sys.modules,
    }
    with open(os.path.join(out, f"view_{os.environ['RANK']}.json"), "w") as f:
        json.dump(view, f)
    if os.environ["RANK"] == "1":
        wait_for(os.path.join(out, "view_0.json"))
        raise ValueError("raised by the script")
"""


@pytest.mark.timeout(120)
def test_a_forked_worker_sees_what_a_fresh_interpreter_shows(tmp_path):
    """The same script under both start methods: the same argv, __main__, sys.path, working
    directory, environment, stdin, session and exit status, a traceback without the
    forkserver's frames and the exception left for atexit handlers (``sys.last_value``); only
    whether torch is already imported differs."""
    views, errors = {}, {}
    for start_method in ("fresh", "forkserver"):
        out = tmp_path / start_method
        out.mkdir()
        script = _script(out, PROCESS_VIEW)
        code, _, err, _ = _run([script, str(out)], 2, start_method=start_method)
        assert code == 1 and "not from the forkserver" not in err, err
        views[start_method] = [json.loads((out / f"view_{rank}.json").read_text()) for rank in (0, 1)]
        errors[start_method] = [line for line in err.splitlines() if line.startswith("[rank 1]")]
        assert (out / "ended_1").read_text() == "ValueError"
    for fresh, forked in zip(views["fresh"], views["forkserver"], strict=True):
        assert (fresh.pop("torch_imported"), forked.pop("torch_imported")) == (False, True)
        assert json.dumps(forked).replace("forkserver", "fresh") == json.dumps(fresh)
    assert [line.replace("forkserver", "fresh") for line in errors["forkserver"]] == errors["fresh"]
    assert errors["fresh"][0] == "[rank 1] Traceback (most recent call last):"
    assert errors["fresh"][-1] == "[rank 1] ValueError: raised by the script"


@pytest.mark.timeout(90)
def test_forked_workers_end_with_a_killed_launcher(tmp_path):
    """A launcher killed outright (SIGKILL: no chance to stop its workers) takes the workers
    it forked with it: its forkserver ends with it, and they with their parent."""
    script = _script(
        tmp_path,
        """
        out = sys.argv[1]
        rank = os.environ["RANK"]
        publish(os.path.join(out, f"pid_{rank}"), str(os.getpid()))
        time.sleep(60)
        """,
    )
    launcher = subprocess.Popen(
        [sys.executable, "-m", "torch_distribute.launch", "--nproc", "2", "--start-method",
         "forkserver", script, str(tmp_path)],
        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, cwd=REPO,
        start_new_session=True,
    )
    pids: list[int] = []
    try:
        end = time.monotonic() + 60
        while not all((tmp_path / f"pid_{r}").exists() for r in (0, 1)):
            assert time.monotonic() < end and launcher.poll() is None, launcher.stderr.read()
            time.sleep(0.05)
        pids = [int((tmp_path / f"pid_{r}").read_text()) for r in (0, 1)]
        launcher.kill()
        launcher.wait(timeout=10)
        for pid in pids:
            assert _gone(pid, within=10), f"worker {pid} outlived its launcher"
        assert "not from the forkserver" not in launcher.stderr.read()
    finally:
        if launcher.poll() is None:
            os.killpg(launcher.pid, signal.SIGKILL)
            launcher.wait()
        _kill_quietly(*pids)


def test_what_keeps_a_task_from_being_forked_is_named():
    """Another interpreter, an interpreter option, a start-up variable that differs from the
    forkserver's (this process's one, started now unless it runs): such a task starts fresh."""
    tasks = ForkserverTasks()
    started = tasks.start_server({**os.environ, "OMP_NUM_THREADS": "1"})
    python = [sys.executable, "-u"]
    only = f"only `{sys.executable} -u script|-m module|-c code` is forked"
    assert tasks.why_not(["/other/python", "-u", "x.py"], started) == only
    assert tasks.why_not([*python, "-X", "dev", "x.py"], started) == only
    assert tasks.why_not([*python, "-m"], started) == only
    assert tasks.why_not([*python, "-m", "pkg.train"], {**started, "PATH": "/elsewhere", "RANK": "1"}) is None
    threads = str(int(started.get("OMP_NUM_THREADS", "1")) + 1)
    assert tasks.why_not([*python, "x.py"], {**started, "OMP_NUM_THREADS": threads}) == (
        "its OMP_NUM_THREADS differs from the forkserver's")


def test_an_unknown_start_method_is_refused_and_preloaded_is_forkserver():
    with pytest.raises(InvalidArgumentError, match="start_method must be one of fresh, forkserver, got 'spawn'"):
        L.launch(["x.py"], 1, start_method="spawn")
    with pytest.warns(FutureWarning, match="start_method 'preloaded' is now 'forkserver'"):
        supervisor = ProcessSupervisor(stdout=io.StringIO(), stderr=io.StringIO(), start_method="preloaded")
    assert supervisor.forkserver is not None
