"""The process supervisor shared by ``torch-distribute launch`` and the PS local cluster.

``ProcessSupervisor`` starts local tasks (each in its own process group, so a task's
children are stopped with it), copies every line of their stdout/stderr to the caller's
streams with a per-task prefix (``[rank 1] ``, ``[worker:0] ``), watches them, and stops
them: SIGTERM to each process group, SIGKILL to what is left after the grace period. It
runs one of two policies:

- ``run_gang``: all tasks are one job (``torch-distribute launch``). When one fails the
  others are stopped and all start again, up to ``max_restarts`` times; the result is 0,
  the failed task's exit code (128 + signal number when killed), 124 on timeout, or
  128 + signal number when the supervisor itself is interrupted.
- ``run_until_exit``: one task leads (the chief of a parameter-server job) and its exit
  code ends the job; tasks marked ``restartable`` are started again alone when they fail.
- ``run_replacing``: a fault-tolerant job (``torch-distribute launch --min-workers``): a
  worker that is lost (killed by a signal, or left after SIGTERM) is started again alone
  while the others go on; any other failure ends the job.

With ``start_method="forkserver"`` (or ``TD_START_METHOD=forkserver``) a Python task
(``sys.executable -u`` with a script, ``-m`` or ``-c``) is forked by the standard library's
forkserver, which imported torch once (``forkserver_tasks.py``): its start and every restart
skip torch's import, about 4 s of CPU each. Any other command, a task whose start-up
environment differs from the server's, and the default ``start_method="fresh"`` start a new
process. ``"preloaded"``, the name of an earlier fork server, is taken as ``"forkserver"``
with a ``FutureWarning``.

>>> import io, sys
>>> out = io.StringIO()
>>> supervisor = ProcessSupervisor(stdout=out, stderr=out)
>>> task = TaskSpec("hello", "[hello] ", [sys.executable, "-c", "print('hi')"], {})
>>> supervisor.run_until_exit([task]), out.getvalue()
(0, '[hello] hi\\n')

Why not torch's elastic agent (``torchrun``, ``elastic_launch``,
``torch.distributed.elastic.multiprocessing.start_processes``): the agent restarts one
homogeneous role whose environment it computes itself (ranks, its own TCPStore, the
``TORCHELASTIC_*`` variables), so it can neither give each task its own ``TF_CONFIG`` nor
run the heterogeneous chief/worker/ps tasks of the PS local cluster and restart one worker
while the others go on; it reports failures as ``ChildFailedError`` rather than the exit
codes above. Its output prefixing redirects to log files and tails them onto the
``sys.stdout``/``sys.stderr`` of the moment, with no way to hand it the caller's streams.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import tempfile
import threading
import time
import warnings
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from types import FrameType
from typing import IO, TypeAlias

from torch_distribute.cluster.forkserver_tasks import ForkedTask, ForkserverTasks
from torch_distribute.collectives import failure_record
from torch_distribute.errors import InvalidArgumentError

__all__ = [
    "EXIT_TIMEOUT",
    "START_METHODS",
    "START_METHOD_ENV",
    "ProcessSupervisor",
    "SupervisedProcess",
    "TaskSpec",
    "describe_status",
    "exit_code_for",
    "forward_lines",
]

# What signal.signal returns and takes: a function, SIG_DFL/SIG_IGN, or None (not set from Python).
_SignalHandler: TypeAlias = Callable[[int, FrameType | None], object] | int | signal.Handlers | None

#: The exit code when the ``timeout`` passes (as ``timeout(1)`` uses).
EXIT_TIMEOUT = 124
#: How tasks start: each a new process, or forked by a forkserver that imported torch once.
START_METHODS = ("fresh", "forkserver")
#: The environment variable that picks the start method when none is given.
START_METHOD_ENV = "TD_START_METHOD"
POLL_S = 0.05
KILL_WAIT_S = 5.0
READER_JOIN_S = 2.0


@dataclass(frozen=True)
class TaskSpec:
    """One process to start: its name in messages, output prefix, command and environment.

    ``env`` is the complete environment of the process. A ``restartable`` task is started
    again alone when it fails under ``run_until_exit``.
    """

    name: str
    prefix: str
    command: Sequence[str]
    env: Mapping[str, str]
    restartable: bool = False


@dataclass
class SupervisedProcess:
    """A started task: its process (a ``Popen`` or a ``ForkedTask``) and the threads
    forwarding its output."""

    spec: TaskSpec
    proc: subprocess.Popen[bytes] | ForkedTask
    readers: list[threading.Thread] = field(default_factory=list)

    @property
    def pid(self) -> int:
        return self.proc.pid

    def poll(self) -> int | None:
        return self.proc.poll()

    def signal_group(self, sig: int) -> None:
        """Send ``sig`` to the task's process group (itself and any grandchildren)."""
        if hasattr(os, "killpg"):
            try:
                os.killpg(self.pid, sig)
            except ProcessLookupError:
                # Not yet its own group (a forked task makes one first thing): itself.
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.kill(self.pid, sig)
            except PermissionError:
                pass
            return
        if self.proc.poll() is None:  # pragma: no cover - no process groups (Windows)
            try:
                self.proc.kill() if sig == getattr(signal, "SIGKILL", None) else self.proc.terminate()
            except OSError:
                pass

    def group_alive(self) -> bool:
        """True while the task or anything left in its process group runs."""
        if self.proc.poll() is None:
            return True
        if not hasattr(os, "killpg"):  # pragma: no cover
            return False
        try:
            os.killpg(self.pid, 0)
        except ProcessLookupError:
            return False
        except PermissionError:
            return True
        return True


def forward_lines(pipe: IO[bytes], prefix: str, stream: IO[str], lock: threading.Lock) -> None:
    """Copy ``pipe`` to ``stream`` line by line, each line prefixed; never blocks the child.

    Undecodable bytes become U+FFFD and a last line without a newline gets one, so lines of
    different tasks never run together.
    """
    try:
        while True:
            line = pipe.readline(1 << 20)
            if not line:
                break
            text = line.decode("utf-8", errors="replace")
            if not text.endswith("\n"):
                text += "\n"
            with lock:
                try:
                    stream.write(prefix + text)
                    stream.flush()
                except (OSError, ValueError):
                    pass  # our own output went away (closed pipe): keep draining the child
    except (OSError, ValueError):
        pass
    finally:
        try:
            pipe.close()
        except OSError:
            pass


def describe_status(code: int) -> str:
    """A task's exit status in words: ``"failed with exit code 3"``, ``"was killed by ..."``."""
    if code < 0:
        try:
            name = signal.Signals(-code).name
        except ValueError:
            name = f"signal {-code}"
        return f"was killed by signal {name}"
    return f"failed with exit code {code}"


def exit_code_for(code: int) -> int:
    """A task's status as an exit code: itself, or 128 + signal number.

    >>> exit_code_for(3), exit_code_for(-9)
    (3, 137)
    """
    return 128 - code if code < 0 else code


class ProcessSupervisor:
    """Starts, watches and stops local tasks; see the module docstring.

    Args:
        stdout, stderr: where the tasks' prefixed output lines go.
        grace_period: seconds between SIGTERM and SIGKILL when stopping.
        log_prefix: put before the supervisor's own messages.
        log_stream: where those messages go (default ``stderr``).
        start_method: ``"fresh"`` (every task a new process) or ``"forkserver"`` (Python
            tasks forked by a forkserver that imported torch once); None reads
            ``TD_START_METHOD`` (default fresh).
    """

    def __init__(
        self,
        *,
        stdout: IO[str],
        stderr: IO[str],
        grace_period: float = 10.0,
        log_prefix: str = "",
        log_stream: IO[str] | None = None,
        start_method: str | None = None,
    ) -> None:
        if start_method is None:
            start_method = os.environ.get(START_METHOD_ENV) or "fresh"
        if start_method == "preloaded":
            warnings.warn("start_method 'preloaded' is now 'forkserver' (the standard library's "
                          "forkserver, which imports torch once); use that name", FutureWarning, stacklevel=2)
            start_method = "forkserver"
        if start_method not in START_METHODS:
            raise InvalidArgumentError(
                f"start_method must be one of {', '.join(START_METHODS)}, got {start_method!r}")
        self.stdout = stdout
        self.stderr = stderr
        self.grace_period = grace_period
        self.log_prefix = log_prefix
        self.log_stream = stderr if log_stream is None else log_stream
        self.lock = threading.Lock()
        self.processes: list[SupervisedProcess] = []
        self.received: list[int] = []  # signals received by the supervisor, in order
        self.error_dir: str | None = None  # the tasks' failure records (start_all)
        self.seen_failed: list[SupervisedProcess] = []  # found failed in the last poll (_watch)
        self.forkserver = ForkserverTasks() if start_method == "forkserver" else None
        self._told_why_not_forked = False

    def log(self, message: str) -> None:
        """Write one message of the supervisor's own (never fails)."""
        with self.lock:
            try:
                self.log_stream.write(f"{self.log_prefix}{message}\n")
                self.log_stream.flush()
            except (OSError, ValueError):
                pass

    # -- start and stop -----------------------------------------------------------------

    def start(self, spec: TaskSpec) -> SupervisedProcess:
        """Start ``spec`` in a new process group with its output forwarded (not recorded)."""
        forked = self._fork(spec)
        if forked is not None:
            proc: subprocess.Popen[bytes] | ForkedTask = forked[0]
            pipes = forked[1]
        else:
            popen = subprocess.Popen(
                list(spec.command),
                env=dict(spec.env),
                stdin=subprocess.DEVNULL,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                start_new_session=True,
            )
            assert popen.stdout is not None and popen.stderr is not None
            proc, pipes = popen, (popen.stdout, popen.stderr)
        process = SupervisedProcess(spec=spec, proc=proc)
        for pipe, stream, kind in ((pipes[0], self.stdout, "out"), (pipes[1], self.stderr, "err")):
            thread = threading.Thread(  # one per pipe: lines never interleave mid-line
                target=forward_lines,
                args=(pipe, spec.prefix, stream, self.lock),
                name=f"td-supervise-{spec.name}-{kind}",
                daemon=True,
            )
            thread.start()
            process.readers.append(thread)
        return process

    def _fork(self, spec: TaskSpec) -> tuple[ForkedTask, tuple[IO[bytes], IO[bytes]]] | None:
        """``spec`` forked by the forkserver with its output pipes, or None when it must
        start fresh (another command or start-up environment, or the server failed)."""
        if self.forkserver is None:
            return None
        why_not = self.forkserver.why_not(spec.command, spec.env)
        if why_not is not None:
            if not self._told_why_not_forked:
                self._told_why_not_forked = True
                self.log(f"starting {spec.name} in a fresh interpreter, not from the forkserver: {why_not}")
            return None
        out_read, out_write = os.pipe()
        err_read, err_write = os.pipe()
        try:
            proc = self.forkserver.start(spec.command, spec.env, stdout=out_write, stderr=err_write)
        except (OSError, ValueError, subprocess.SubprocessError) as error:
            for fd in (out_read, err_read):
                os.close(fd)
            self.log(f"starting fresh interpreters: the forkserver failed ({error})")
            self.forkserver = None
            return None
        finally:
            os.close(out_write)
            os.close(err_write)
        return proc, (os.fdopen(out_read, "rb"), os.fdopen(err_read, "rb"))

    def start_all(self, specs: Sequence[TaskSpec]) -> None:
        """Start every task; they become the supervised set (``processes``).

        Each gets a file of its own in ``TORCHELASTIC_ERROR_FILE`` where it records how it
        failed (``collectives/failure_record.py``), read by ``first_failure``.
        """
        self._remove_error_files()
        self.error_dir = tempfile.mkdtemp(prefix="td-failures-")
        self.processes = []
        for index, spec in enumerate(specs):
            path = os.path.join(self.error_dir, f"task{index}.json")
            env = {**spec.env, failure_record.ERROR_FILE_ENV: path}
            self.processes.append(self.start(TaskSpec(spec.name, spec.prefix, spec.command, env, spec.restartable)))

    def _remove_error_files(self) -> None:
        if self.error_dir:
            shutil.rmtree(self.error_dir, ignore_errors=True)
            self.error_dir = None

    def first_failure(self, seen: Sequence[SupervisedProcess]) -> tuple[SupervisedProcess, int, str]:
        """After a failure (``seen``: the tasks found failed, in that order) and ``stop_all``:
        the task that failed first, the job's exit code, and the error it recorded (or "").

        Not simply the first exit seen: a worker that raises may still be ending when
        another, which lost it as a partner, has already exited.
        """
        candidates = [*seen, *(p for p in self.processes if p not in seen)]
        records = {id(p): failure_record.read(p.spec.env[failure_record.ERROR_FILE_ENV])
                   for p in candidates if failure_record.ERROR_FILE_ENV in p.spec.env}
        entries = [(id(p), records.get(id(p)), p in seen) for p in candidates
                   if p.poll() not in (None, 0)]
        chosen_id = failure_record.first_failure(entries) if entries else id(seen[0])
        chosen = next(p for p in candidates if id(p) == chosen_id)
        record = records.get(id(chosen))
        code = chosen.poll() or 0
        if chosen not in seen and record is not None:
            code = 1  # stopped by us while it ended after its uncaught exception
        error = record.message.splitlines()[0] if record is not None and record.message else ""
        return chosen, code, error if len(error) <= 300 else error[:297] + "..."

    def stop_all(self) -> None:
        """SIGTERM every task's group, wait up to the grace period, SIGKILL what is left."""
        if not self.processes:
            return
        signals_seen = len(self.received)
        for process in self.processes:
            process.signal_group(signal.SIGTERM)
            if hasattr(signal, "SIGCONT"):
                # A stopped (SIGSTOP) task handles SIGTERM only once continued, as kill(1) does.
                process.signal_group(signal.SIGCONT)
        end = time.monotonic() + self.grace_period
        while any(p.group_alive() for p in self.processes):
            if time.monotonic() >= end or len(self.received) > signals_seen:
                break  # grace over, or interrupted again: kill now
            time.sleep(POLL_S)
        kill = getattr(signal, "SIGKILL", signal.SIGTERM)
        end = time.monotonic() + KILL_WAIT_S
        while True:
            alive = [p for p in self.processes if p.group_alive()]
            if not alive or time.monotonic() >= end:
                break
            for process in alive:
                process.signal_group(kill)
            time.sleep(POLL_S)
        for process in self.processes:
            try:
                process.proc.wait(timeout=KILL_WAIT_S)
            except subprocess.TimeoutExpired:  # pragma: no cover - unkillable (D state)
                self.log(f"{process.spec.name} (pid {process.pid}) did not exit")
        self._join_readers()

    def _join_readers(self) -> None:
        end = time.monotonic() + READER_JOIN_S
        for process in self.processes:
            for thread in process.readers:
                # A pipe stays open only if a grandchild escaped its process group; the
                # reader threads are daemons, so do not wait for it forever.
                thread.join(timeout=max(0.0, end - time.monotonic()))

    def kill_all(self) -> None:
        """Last resort (an exception in the caller): SIGKILL every task group still alive."""
        for process in self.processes:
            if process.group_alive():
                process.signal_group(getattr(signal, "SIGKILL", signal.SIGTERM))
        for process in self.processes:
            try:
                process.proc.wait(timeout=KILL_WAIT_S)
            except subprocess.TimeoutExpired:  # pragma: no cover
                pass

    # -- signals ------------------------------------------------------------------------

    def on_signal(self, signum: int, _frame: object) -> None:
        """Signal handler: remember the signal; the policy loop stops the tasks."""
        self.received.append(signum)

    @contextlib.contextmanager
    def handling_signals(self) -> Iterator[None]:
        """Route SIGINT, SIGTERM (and SIGHUP unless ignored) to ``on_signal`` meanwhile.

        Only in the main thread (elsewhere Python cannot install handlers); the previous
        handlers are put back on exit.
        """
        handled = [signal.SIGINT, signal.SIGTERM]
        if hasattr(signal, "SIGHUP") and signal.getsignal(signal.SIGHUP) is not signal.SIG_IGN:
            handled.append(signal.SIGHUP)
        previous: dict[signal.Signals, _SignalHandler] = {}
        if threading.current_thread() is threading.main_thread():
            for sig in handled:
                previous[sig] = signal.signal(sig, self.on_signal)
        try:
            yield
        finally:
            for restored, handler in previous.items():
                signal.signal(restored, handler)

    def _interrupted(self) -> int:
        signum = self.received[0]
        self.log(f"received {signal.Signals(signum).name}; stopping all workers")
        self.stop_all()
        return 128 + signum

    # -- policies -----------------------------------------------------------------------

    def _watch(self, deadline: float | None) -> tuple[str, SupervisedProcess | None, int]:
        """Wait until all tasks succeed, one fails, a signal arrives or time runs out."""
        while True:
            if self.received:
                return "signal", None, 0
            if deadline is not None and time.monotonic() >= deadline:
                return "timeout", None, 0
            codes = [p.poll() for p in self.processes]
            failed = [p for p, c in zip(self.processes, codes, strict=True) if c is not None and c != 0]
            if failed:
                self.seen_failed = failed  # which came first is decided by first_failure
                return "failed", failed[0], failed[0].poll() or 0
            if all(c == 0 for c in codes):
                return "ok", None, 0
            time.sleep(POLL_S)

    def run_gang(
        self,
        make_tasks: Callable[[int], Sequence[TaskSpec]],
        *,
        max_restarts: int = 0,
        timeout: float | None = None,
    ) -> int:
        """Run ``make_tasks(attempt)`` as one job, restarting all of it after a failure.

        ``attempt`` counts from 0; a new attempt gets new tasks (fresh ports, say). Returns
        0, the failed task's exit code once restarts are exhausted, ``EXIT_TIMEOUT`` when
        ``timeout`` seconds pass, or 128 + signal number when interrupted.
        """
        try:
            return self._run_gang(make_tasks, max_restarts, timeout)
        finally:
            self._remove_error_files()

    def _run_gang(self, make_tasks: Callable[[int], Sequence[TaskSpec]], max_restarts: int,
                  timeout: float | None) -> int:
        deadline = None if timeout is None else time.monotonic() + timeout
        attempt = 0
        while True:
            if self.received:
                return self._interrupted()
            self.start_all(make_tasks(attempt))
            outcome, process, code = self._watch(deadline)
            if outcome == "ok":
                self.stop_all()  # reap stray grandchildren, join readers
                return 0
            if outcome == "signal":
                return self._interrupted()
            if outcome == "timeout":
                self.log(f"timed out after {timeout:g} s; stopping all workers")
                self.stop_all()
                return EXIT_TIMEOUT
            assert process is not None
            self.stop_all()
            exited_first = self.seen_failed[0]
            process, code, error = self.first_failure(self.seen_failed)
            what = f"{process.spec.name} (pid {process.pid}) {describe_status(code)}"
            if error:
                what += f" ({error})"
            if process is not exited_first:
                what += f"; it failed first ({exited_first.spec.name} exited before it, failing after it)"
            if self.received:
                return self._interrupted()
            if attempt < max_restarts:
                attempt += 1
                self.log(f"restarting all workers (attempt {attempt}/{max_restarts}) after {what}")
                continue
            if max_restarts:
                self.log(f"no restarts left ({max_restarts} used)")
            self.log(what)
            return exit_code_for(code)

    def run_replacing(
        self,
        make_task: Callable[[int, int], TaskSpec],
        count: int,
        *,
        lost: Callable[[int], bool],
        joined: Callable[[TaskSpec], bool],
        max_replacements: int | None = None,
        timeout: float | None = None,
    ) -> int:
        """Run ``count`` tasks as one fault-tolerant job: a lost task is replaced alone.

        ``make_task(index, generation)`` gives task ``index`` (generation 0 first, then one
        more per replacement). A task whose exit status is ``lost`` (killed by a signal,
        or left after a preemption) is started again in its place while the others go on,
        up to ``max_replacements`` in all (None: no limit); any other failure stops the job
        with its exit code, as ``run_gang`` does without restarts. Once a task has finished
        (exit 0) none is replaced, and the job ends
        with 0 when every task still running has not ``joined`` (a replacement too late
        for the end: it is stopped). Returns as ``run_gang``.
        """
        try:
            return self._run_replacing(make_task, count, lost, joined, max_replacements, timeout)
        finally:
            self._remove_error_files()

    def _start_recorded(self, spec: TaskSpec, name: str) -> SupervisedProcess:
        """Start ``spec`` with a failure-record file of its own (``first_failure`` reads it)."""
        assert self.error_dir is not None
        env = {**spec.env, failure_record.ERROR_FILE_ENV: os.path.join(self.error_dir, f"{name}.json")}
        return self.start(TaskSpec(spec.name, spec.prefix, spec.command, env, spec.restartable))

    def _run_replacing(self, make_task: Callable[[int, int], TaskSpec], count: int, lost: Callable[[int], bool],
                       joined: Callable[[TaskSpec], bool], max_replacements: int | None,
                       timeout: float | None) -> int:
        deadline = None if timeout is None else time.monotonic() + timeout
        self.error_dir = tempfile.mkdtemp(prefix="td-failures-")
        generations = [0] * count
        self.processes = [self._start_recorded(make_task(index, 0), f"task{index}-0") for index in range(count)]
        replaced = 0
        finishing = False
        while True:
            if self.received:
                return self._interrupted()
            if deadline is not None and time.monotonic() >= deadline:
                self.log(f"timed out after {timeout:g} s; stopping all workers")
                self.stop_all()
                return EXIT_TIMEOUT
            tasks = self.processes
            codes = [task.poll() for task in tasks]
            finishing = finishing or any(code == 0 for code in codes)
            for index, (task, code) in enumerate(zip(tasks, codes, strict=True)):
                if code is None or code == 0 or (finishing and lost(code)):
                    continue
                if lost(code) and (max_replacements is None or replaced < max_replacements):
                    replaced += 1
                    generations[index] += 1
                    self.log(f"{task.spec.name} (pid {task.pid}) {describe_status(code)}; starting a replacement "
                             f"({replaced}{'' if max_replacements is None else f'/{max_replacements}'}), the "
                             "others go on")
                    self.processes[index] = self._start_recorded(
                        make_task(index, generations[index]), f"task{index}-{generations[index]}")
                    continue
                self.seen_failed = [task]
                self.stop_all()
                failed, code, error = self.first_failure([task])
                if lost(code):
                    self.log(f"no replacements left ({replaced} used)")
                self.log(f"{failed.spec.name} (pid {failed.pid}) {describe_status(code)}" + (f" ({error})" if error else ""))
                return exit_code_for(code)
            if finishing:
                running = [task for task, code in zip(tasks, codes, strict=True) if code is None]
                if not any(joined(task.spec) for task in running):
                    if running:
                        self.log(f"the job finished; stopping {len(running)} replacement(s) that had not joined it")
                    self.stop_all()
                    return 0
            time.sleep(POLL_S)

    def run_until_exit(
        self, specs: Sequence[TaskSpec], *, leader: int = 0, timeout: float | None = None
    ) -> int:
        """Run ``specs`` until ``specs[leader]`` exits; return its exit code.

        Tasks marked ``restartable`` that fail meanwhile are started again alone. When
        ``timeout`` seconds pass, returns ``EXIT_TIMEOUT``. Every task is stopped on return,
        also on an exception (``KeyboardInterrupt`` included).
        """
        deadline = None if timeout is None else time.monotonic() + timeout
        self.processes = []
        try:
            for spec in specs:
                self.processes.append(self.start(spec))
            lead = self.processes[leader]
            while lead.poll() is None:
                if deadline is not None and time.monotonic() > deadline:
                    return EXIT_TIMEOUT
                for k, process in enumerate(self.processes):
                    if process.spec.restartable and process.poll() not in (None, 0):
                        self.log(f"{process.spec.name} exited ({process.proc.returncode}); "
                                 "restarting it")
                        self.processes[k] = self.start(process.spec)
                time.sleep(POLL_S)
            return lead.proc.wait()  # it has exited
        finally:
            self.stop_all()
