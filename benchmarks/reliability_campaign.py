"""Fault-injection campaign against the multi-worker strategy and the checkpoint files.

    python benchmarks/reliability_campaign.py [--trials N] [--only SUBSTRING] [--seed S]
                                              [--parallel P] [--flips F] [--keep-logs]

Prints one table: for each scenario, the trials, the passes (the expected outcome happened)
and the worst and median time-to-error, then one line per failed trial saying what happened
instead, and the stacks of anything that hung. Every multi-worker job has 2 workers on this
host (CPU, Gloo, ``td.CommunicationOptions(timeout_seconds=10)``, one replica each,
``MultiWorkerMirroredStrategy``, a TF_CONFIG each). Random choices (the step, epoch or
point of a fault, how much of a file is written, which byte is flipped) come from one
seeded generator; the seed is printed.

1. ``death/<KILL|STOP>/<chief|worker1>/<phase>``: a worker dies (SIGKILL) or stops answering
   (SIGSTOP) at start-up, between steps, inside ``backward()``, inside a checkpoint save, or
   at the ragged last batch of an epoch (``benchmarks/reliability_worker.py``). The victim
   **signals itself** (``os.kill(os.getpid(), sig)``) at the exact place, after printing the
   wall-clock time; the time-to-error is the survivor's ``time.time()`` at its error minus
   that. Pass: the survivor raises ``td.WorkerUnavailableError`` whose message names the
   victim, within ``timeout + --slack`` seconds of the fault; for a mid-save fault also: a
   fresh process (a restarted job) finds with ``td.latest_checkpoint`` either nothing or a
   checkpoint that passes the full checksum and loads, and a ``CheckpointManager`` built
   there removes every leftover temporary file.
2. ``mismatch/<mode>``: ``tests/multiworker/mismatch_job.py`` as is (the programs part ways at
   step 3, a constant of that script), under ``MultiWorkerMirroredStrategy`` and, for the
   modes FSDP2's own collectives could pair wrongly, under ``FullyShardedStrategy``. Pass:
   ``td.ReplicaMismatchError`` on every worker (for ``early_end``: on the worker still
   waiting; the other finishes normally) within
   ``--mismatch-limit`` seconds (default half the timeout) of the call, exit status 17
   (never a Gloo abort, never a success on both). ``none`` is the control: both finish
   with equal parameters.
3. ``corrupt/...``: in this process: a checkpoint file from ``td.Checkpoint(...).save`` is
   damaged (truncated, a byte flipped in each region of the archive, a block zeroed, garbage
   appended, replaced by another file) and restored into fresh objects; a sharded checkpoint
   (written in one process by ``write_sharded``) likewise; the ``checkpoint`` index is
   pointed outside the directory. Pass: ``CheckpointError`` naming the file, the objects
   untouched; and the fallback: ``td.latest_checkpoint`` returns the older intact checkpoint
   with a warning, or, for damage its cheap check does not see (it verifies the end
   record and the zip directory, not the checksum: documented), it returns the damaged one
   and ``CheckpointManager.restore_or_initialize`` falls back to the older one with a
   warning. The notes column counts how often ``latest_checkpoint`` itself fell back.
   Time-to-error: the time ``restore`` took to raise.
4. ``config/...`` (run last): a malformed TF_CONFIG or torchrun variables, then
   ``MultiWorkerMirroredStrategy(...)``. Pass: ``td.ClusterConfigError`` whose message names
   the field, raised within a second of the constructor call.

Jobs that mostly wait run ``--parallel`` pairs at a time (default 6) while this process runs
the corruption trials. A process that hangs past its deadline gets ``SIGUSR1`` (every worker
registers ``faulthandler`` on it: the Python stacks land in its log) and ``gdb`` (native
stacks), and is then killed with its whole tree. Logs are kept under a temporary directory
(printed) when ``--keep-logs`` is given or a trial failed.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import random
import re
import shutil
import signal
import statistics
import struct
import subprocess
import sys
import tempfile
import threading
import time
import traceback
import warnings
import zipfile
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tests"))

import proc_helpers as P  # noqa: E402
import torch  # noqa: E402

import torch_distribute as td  # noqa: E402
from torch_distribute.checkpoint.sharded_io import write_sharded  # noqa: E402
from torch_distribute.cluster.launcher import free_ports  # noqa: E402

WORKER = str(REPO / "benchmarks" / "reliability_worker.py")
MISMATCH_JOB = str(REPO / "tests" / "multiworker" / "mismatch_job.py")
RESULT = "RWRESULT "
FAULT = "RWFAULT "
MW_RESULT = "MWRESULT "
TIMEOUT_S = 10.0
PHASES = ["startup", "between", "backward", "save", "ragged"]
MISMATCH_MODES = ["extra_reduce", "shape", "dtype", "gather", "skip_step", "double_step", "extra_forward",
                  "early_end", "none"]
# Also run under FullyShardedStrategy (--sharded): FSDP2's own collectives run inside forward and backward.
SHARDED_MISMATCH_MODES = ["extra_reduce", "skip_step", "double_step", "extra_forward", "skip_scaled_step", "none"]

_print_lock = threading.Lock()
_port_lock = threading.Lock()
_gdb_lock = threading.Lock()


def progress(text: str) -> None:
    with _print_lock:
        print(text, file=sys.stderr, flush=True)


@dataclass
class Trial:
    scenario: str
    index: int
    params: dict
    passed: bool = False
    tte: float | None = None  # seconds from the fault to the error
    detail: str = ""  # what happened (for a failure: instead of the expected outcome)
    note: str = ""  # counted in the table's notes column
    hung: list[str] = field(default_factory=list)  # stack dumps of processes that hung


# -- process helpers -----------------------------------------------------------------------------
def parse_lines(text: str, prefix: str) -> list[dict]:
    out = []
    for line in text.splitlines():
        if line.startswith(prefix):
            with contextlib.suppress(ValueError):
                out.append(json.loads(line[len(prefix):]))
    return out


def proc_state(proc: subprocess.Popen) -> str:
    """``exited N`` / ``killed by SIGx`` / ``stopped`` / ``running`` (from /proc)."""
    code = proc.poll()
    if code is not None:
        return f"killed by {signal.Signals(-code).name}" if code < 0 else f"exited {code}"
    try:
        with open(f"/proc/{proc.pid}/stat") as f:
            state = f.read().rsplit(")", 1)[1].split()[0]
    except OSError:
        return "gone"
    return {"T": "stopped", "t": "stopped (traced)", "Z": "zombie"}.get(state, "running")


def dump_stacks(procs: P.Processes, proc: subprocess.Popen, label: str) -> str:
    """Python stacks (faulthandler on SIGUSR1, into the log) and native ones (gdb) of ``proc``."""
    before = len(procs.output(proc))
    with contextlib.suppress(ProcessLookupError):
        os.kill(proc.pid, signal.SIGUSR1)
    time.sleep(1.5)
    python = procs.output(proc)[before:].strip() or "(no faulthandler output: the process may be stopped)"
    native = ""
    if shutil.which("gdb"):
        try:
            with _gdb_lock:  # one at a time: reading libtorch's symbols takes a while on a loaded machine
                run = subprocess.run(["gdb", "-nx", "-p", str(proc.pid), "-batch", "-ex", "set pagination off",
                                      "-ex", "thread apply all bt 15"], capture_output=True, text=True, timeout=150)
            lines = [ln if len(ln) <= 220 else ln[:220] + " ..." for ln in run.stdout.splitlines()
                     if ln.startswith(("#", "Thread"))]
            native = "\n".join(lines[:80]) or f"(no frames; gdb said: {short(run.stdout[-500:] + run.stderr[-500:])})"
        except (subprocess.TimeoutExpired, OSError) as exc:
            native = f"(gdb failed: {exc})"
    return f"--- {label} (pid {proc.pid}) Python stacks:\n{python[-6000:]}\n--- native (gdb):\n{native}"


def tf_config(ports: list[int], rank: int) -> str:
    return json.dumps({"cluster": {"worker": [f"127.0.0.1:{p}" for p in ports]},
                       "task": {"type": "worker", "index": rank}})


def get_ports() -> list[int]:
    with _port_lock:
        return free_ports(2)


def fmt_time(seconds: float | None) -> str:
    if seconds is None:
        return "-"
    return f"{seconds:.2f} s" if seconds >= 0.1 else f"{seconds * 1000:.1f} ms"


def raised_from(tb: str) -> str:
    """`` (from <file>:<line> <code>)``: the deepest torch_distribute frame of a traceback."""
    frames = re.findall(r'File "([^"]+)", line (\d+), in (\S+)\n\s+(.+)', tb)
    ours = [f for f in frames if "/torch_distribute/" in f[0]]
    if not ours:
        return ""
    path, line, function, code = ours[-1]
    return f" (raised through {path.split('/torch_distribute/', 1)[1]}:{line} in {function}: {code.strip()})"


def short(text: str, limit: int = 400) -> str:
    text = " ".join(str(text).split())
    return text if len(text) <= limit else text[:limit] + " ..."


# -- 1. worker death -------------------------------------------------------------------------------
def death_params(rng: random.Random, phase: str) -> dict:
    if phase == "startup":
        return {"variant": rng.choice(["before", "store", "process_group", "new_group"])}
    if phase in ("between", "backward"):
        return {"at": rng.randint(1, 6)}
    if phase == "save":
        return {"at": rng.randint(2, 5), "variant": rng.choice(["manager", "checkpoint"]),
                "fraction": round(rng.uniform(0.1, 0.9), 2)}
    return {"at": rng.randint(0, 1), "variant": rng.choice(["before_run", "after_run"])}


def run_death(trial: Trial, sig: str, victim: int, phase: str, root: Path, opts: argparse.Namespace) -> Trial:
    logdir = root / f"{trial.scenario.replace('/', '_')}-{trial.index}"
    logdir.mkdir(parents=True)
    ckpt_dir = logdir / "ckpts"
    argv = [WORKER, "death", "--timeout", str(TIMEOUT_S), "--phase", phase, "--victim", str(victim),
            "--signal", sig, "--ckpt-dir", str(ckpt_dir)]
    for key, value in trial.params.items():
        argv += [f"--{key}", str(value)]
    ports = get_ports()
    survivor_rank = 1 - victim
    with P.processes(logdir) as procs:
        pair = [procs.spawn(argv, P.clean_env(TF_CONFIG=tf_config(ports, r), MW_RANK=str(r)), f"w{r}")
                for r in range(2)]
        code = procs.wait(pair[survivor_rank], opts.deadline)
        if code is None:
            trial.hung.append(dump_stacks(procs, pair[survivor_rank], f"{trial.scenario} #{trial.index} survivor"))
        victim_state = proc_state(pair[victim])
        texts = [procs.output(p) for p in pair]
    faults = parse_lines(texts[victim], FAULT)
    results = parse_lines(texts[survivor_rank], RESULT)
    fault = faults[0] if faults else None
    result = results[0] if results else None
    where = f"fault: {fault['what']}" if fault else "the victim never reached its fault"
    if code is None:
        trial.detail = f"survivor still running after {opts.deadline:.0f} s (hung; stacks below); {where}; victim {victim_state}"
        return trial
    if result is None:
        trial.detail = f"survivor exited {code} without a result; {where}; output tail: {short(texts[survivor_rank][-1500:])}"
        return trial
    tte = result["t_error"] - fault["t"] if fault else None
    trial.tte = tte
    got = result.get("error")
    message = result.get("message", "")
    problems = []
    if fault is None:
        problems.append("the victim never faulted (survivor: "
                        f"{got or 'finished'}; victim output: {short(texts[victim][-800:], 300)})")
    if got != "WorkerUnavailableError":
        problems.append(f"survivor got {got or 'no error (finished training)'}: {short(message)}"
                        + raised_from(result.get("traceback", "")))
    elif not re.search(rf"worker(\(s\))?\s+{victim}\b", message):
        problems.append(f"the message does not name worker {victim}: {short(message)}")
    if tte is not None and not (-0.5 <= tte <= TIMEOUT_S + opts.slack):
        problems.append(f"time-to-error {tte:.2f} s (limit {TIMEOUT_S + opts.slack:.0f} s)")
    described = re.search(rf"worker(?:\(s\))?\s+{victim}\b(?:\s*\([^)]*\))?\s*([a-z]+(?: [a-z]+)?)", message)
    if got == "WorkerUnavailableError" and described:
        trial.note = f"'{described.group(1)}'"
    if sig == "STOP" and fault is not None and victim_state != "stopped":
        trial.note += f" victim {victim_state} (expected stopped)"
    if phase == "save":
        problems += check_after_save(trial, logdir, ckpt_dir, victim)
    survivor_where = result.get("where", {})
    trial.detail = (f"{where}; survivor: {got} after {fmt_time(tte)} at {survivor_where.get('phase')} "
                    f"step {survivor_where.get('step')}: {short(message, 300)}")
    if problems:
        trial.detail = "; ".join(problems) + f" [{where}; victim {victim_state}]"
    else:
        trial.passed = True
    return trial


def check_after_save(trial: Trial, logdir: Path, ckpt_dir: Path, victim: int) -> list[str]:
    """A restarted job's view of the directory (every worker of the job is gone)."""
    if not ckpt_dir.is_dir():
        return ["no checkpoint directory at all"]
    with P.processes(logdir) as procs:
        proc = procs.spawn([WORKER, "check-dir", str(ckpt_dir)], P.clean_env(), "check")
        code = procs.wait(proc, 120)
        if code is None:
            trial.hung.append(dump_stacks(procs, proc, f"{trial.scenario} #{trial.index} check-dir"))
        text = procs.output(proc)
    found = parse_lines(text, RESULT)
    if not found:
        return [f"check-dir gave no result (exit {code}): {short(text[-1500:])}"]
    report = found[0]
    problems = []
    if "latest_error" in report:
        problems.append(f"td.latest_checkpoint raised {report['latest_error']}")
    if report.get("latest") is not None and not report.get("latest_intact"):
        problems.append(f"td.latest_checkpoint returned {report['latest']}, which is damaged: "
                        f"{short(report.get('latest_load_error', ''))}")
    if "manager_error" in report:
        problems.append(f"CheckpointManager(...) raised {report['manager_error']}")
    if report.get("temporaries_after"):
        problems.append(f"temporaries left after CheckpointManager(...): {report['temporaries_after']}")
    trial.note += (f"; latest={report.get('latest')} temporaries before={len(report.get('temporaries_before', []))} "
                  f"after={len(report.get('temporaries_after', []))}")
    if victim == 0 and not report.get("temporaries_before"):
        trial.note += " (no partial file was left: the kill did not land inside the write?)"
    return problems


# -- 2. mismatched programs ------------------------------------------------------------------------
def run_mismatch(trial: Trial, mode: str, root: Path, opts: argparse.Namespace, sharded: bool = False) -> Trial:
    logdir = root / f"mismatch_{mode}{'_sharded' if sharded else ''}-{trial.index}"
    logdir.mkdir(parents=True)
    ports = get_ports()
    extra = ["--sharded"] if sharded else []
    with P.processes(logdir) as procs:
        pair = [procs.spawn([WORKER, "run", MISMATCH_JOB, "--mode", mode, "--timeout", str(TIMEOUT_S), *extra],
                            P.clean_env(TF_CONFIG=tf_config(ports, r), MW_RANK=str(r)), f"w{r}")
                for r in range(2)]
        deadline = time.monotonic() + opts.deadline
        codes = []
        for rank, proc in enumerate(pair):
            code = procs.wait(proc, deadline - time.monotonic())
            if code is None:
                trial.hung.append(dump_stacks(procs, proc, f"{trial.scenario} #{trial.index} worker {rank}"))
            codes.append(code)
        texts = [procs.output(p) for p in pair]
    reports = [next((r for r in parse_lines(t, MW_RESULT)), None) for t in texts]
    problems = []
    limit = opts.mismatch_limit
    expect_error = [0, 1] if mode not in ("early_end", "none") else ([0] if mode == "early_end" else [])
    times = []
    for rank in range(2):
        code, report, text = codes[rank], reports[rank], texts[rank]
        if code is None:
            problems.append(f"worker {rank} hung (still running after {opts.deadline:.0f} s)")
            continue
        if code < 0 or "terminate called" in text or "Aborted" in text:
            problems.append(f"worker {rank} aborted (exit {code}): {short(text[-800:])}")
            continue
        if report is None:
            problems.append(f"worker {rank} exited {code} without a result: {short(text[-800:])}")
            continue
        if rank in expect_error:
            if report.get("error") != "ReplicaMismatchError" or code != 17:
                problems.append(f"worker {rank} got {report.get('error') or 'no error'} (exit {code}): "
                                f"{short(report.get('message', ''))}")
            else:
                times.append(report["blocked_s"])
                if report["blocked_s"] > limit:
                    problems.append(f"worker {rank} raised after {report['blocked_s']:.2f} s (limit {limit:.1f} s)")
        elif code != 0 or report.get("error"):
            problems.append(f"worker {rank} should finish, got {report.get('error')} (exit {code}): "
                            f"{short(report.get('message', ''))}")
    if mode == "none" and not problems and reports[0]["params"] != reports[1]["params"]:
        problems.append("both finished with different parameters")
    trial.tte = max(times) if times else None
    if problems:
        trial.detail = "; ".join(problems)
    else:
        trial.passed = True
        trial.detail = " | ".join(short(r.get("message", ""), 200) for r in reports if r and r.get("message"))
    return trial


# -- 3. corrupted files ----------------------------------------------------------------------------
def make_objects(seed: int):
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(4, 16), torch.nn.ReLU(), torch.nn.Linear(16, 3))
    optimizer = torch.optim.Adam(model.parameters(), lr=0.01)
    model(torch.randn(5, 4)).square().sum().backward()
    optimizer.step()
    optimizer.zero_grad()
    marker = torch.arange(seed * 100, seed * 100 + 64, dtype=torch.float32)
    return model, optimizer, marker


def tensors_of(model, optimizer, marker) -> list[torch.Tensor]:
    out = [p.detach().clone() for p in model.parameters()]
    for state in optimizer.state.values():
        out += [v.detach().clone() for v in state.values() if isinstance(v, torch.Tensor)]
    return out + [marker.clone()]


def same(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
    return len(a) == len(b) and all(x.shape == y.shape and torch.equal(x, y) for x, y in zip(a, b, strict=True))


class Corruption:
    """A directory with ``ckpt-1`` (values A: the intact fallback) and ``ckpt-2`` (values B,
    the one damaged), both from ``Checkpoint.save``; each trial writes a damaged ``ckpt-2``."""

    def __init__(self, root: Path, sharded: bool = False):
        self.dir = root / ("sharded" if sharded else "plain")
        self.dir.mkdir(parents=True)
        self.sharded = sharded
        self.values = {}
        for seed in (1, 2):
            model, optimizer, marker = make_objects(seed)
            ckpt = td.Checkpoint(model=model, optimizer=optimizer, marker=marker)
            if sharded:
                payload = {"format": td.checkpoint.FORMAT, "version": 1, "save_counter": seed,
                           "objects": ckpt.state_dict()["objects"]}
                write_sharded(str(self.dir / f"ckpt-{seed}"), payload, is_writer=True, barrier=lambda what: None)
                ckpt.save_counter = seed
            else:
                ckpt.save_counter = seed - 1
                ckpt.save(str(self.dir / "ckpt"))
            self.values[seed] = tensors_of(model, optimizer, marker)
        if sharded:
            names = {"latest": "ckpt-2", "all": ["ckpt-1", "ckpt-2"]}
            (self.dir / "checkpoint").write_text(json.dumps(names))
        self.path = self.dir / "ckpt-2"
        self.index = (self.dir / "checkpoint").read_bytes()
        if sharded:
            self.pristine = {n: (self.path / n).read_bytes() for n in os.listdir(self.path)}
        else:
            self.pristine = self.path.read_bytes()

    def reset(self) -> None:
        (self.dir / "checkpoint").write_bytes(self.index)
        if self.sharded:
            if self.path.is_dir():
                shutil.rmtree(self.path)
            self.path.mkdir()
            for name, data in self.pristine.items():
                (self.path / name).write_bytes(data)
        else:
            if self.path.is_dir():
                shutil.rmtree(self.path)
            self.path.write_bytes(self.pristine)

    def trial(self, trial: Trial, damage) -> Trial:
        """Apply ``damage()`` to a fresh ``ckpt-2``; restore; then the fallbacks."""
        self.reset()
        damage()
        path = str(self.path)
        model, optimizer, marker = make_objects(7)
        untouched = tensors_of(model, optimizer, marker)
        problems = []
        started = time.perf_counter()
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                td.Checkpoint(model=model, optimizer=optimizer, marker=marker).restore(path)
            trial.tte = time.perf_counter() - started
            now = tensors_of(model, optimizer, marker)
            if same(now, self.values[2]):
                problems.append("restore succeeded (the values are the intact ones: the damage went unnoticed)")
            else:
                problems.append("RESTORE SUCCEEDED WITH CHANGED VALUES")
        except td.CheckpointError as error:
            trial.tte = time.perf_counter() - started
            message = str(error)
            if path not in message and os.path.basename(path) not in message:
                problems.append(f"{type(error).__name__} does not name the file: {short(message)}")
            if not same(tensors_of(model, optimizer, marker), untouched):
                problems.append(f"{type(error).__name__} raised, but the objects were partly restored")
            trial.detail = f"{type(error).__name__}: {short(message, 250)}"
        except Exception as error:  # noqa: BLE001
            trial.tte = time.perf_counter() - started
            problems.append(f"raw {type(error).__name__} (not a CheckpointError): {short(str(error))}")
        problems += self.fallback(trial)
        if problems:
            trial.detail = "; ".join(problems) + (f" [{trial.detail}]" if trial.detail else "")
        else:
            trial.passed = True
        return trial

    def fallback(self, trial: Trial) -> list[str]:
        older = str(self.dir / "ckpt-1")
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            try:
                latest = td.latest_checkpoint(self.dir)
            except Exception as error:  # noqa: BLE001
                return [f"td.latest_checkpoint raised {type(error).__name__}: {short(str(error))}"]
        warned = any("ckpt-2" in str(w.message) for w in caught)
        if latest == older:
            trial.note = "latest_checkpoint fell back"
            return [] if warned else ["td.latest_checkpoint fell back to ckpt-1 without a warning naming ckpt-2"]
        if latest != str(self.path):
            return [f"td.latest_checkpoint returned {latest!r}"]
        trial.note = "latest_checkpoint returned the damaged file; restore_or_initialize fell back"
        model, optimizer, marker = make_objects(8)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            try:
                manager = td.CheckpointManager(td.Checkpoint(model=model, optimizer=optimizer, marker=marker), self.dir)
                restored = manager.restore_or_initialize()
            except Exception as error:  # noqa: BLE001
                trial.note = "latest_checkpoint returned the damaged file"
                return [f"td.latest_checkpoint returned the damaged ckpt-2 and restore_or_initialize raised "
                        f"{type(error).__name__}: {short(str(error))}"]
        if restored != older or not same(tensors_of(model, optimizer, marker), self.values[1]):
            trial.note = "latest_checkpoint returned the damaged file"
            return [f"td.latest_checkpoint returned the damaged ckpt-2 and restore_or_initialize restored {restored!r}"]
        if not any("ckpt-2" in str(w.message) for w in caught):
            return ["restore_or_initialize fell back without a warning naming ckpt-2"]
        return []


def zip_regions(data: bytes) -> dict[str, list[tuple[int, int]]]:
    """Byte ranges of ``data`` (a checkpoint file) by what they hold."""
    regions: dict[str, list[tuple[int, int]]] = {}

    def add(name: str, start: int, end: int) -> None:
        if end > start:
            regions.setdefault(name, []).append((start, end))

    eocd = data.rfind(b"PK\x05\x06")
    cd_size, cd_offset = struct.unpack("<II", data[eocd + 12:eocd + 20])
    covered = []
    with zipfile.ZipFile(io.BytesIO(data)) as archive:
        for info in archive.infolist():
            start = info.header_offset
            name_len, extra_len = struct.unpack("<HH", data[start + 26:start + 30])
            body = start + 30 + name_len + extra_len
            add("local headers", start, body)
            kind = ("pickle (data.pkl)" if info.filename.endswith("data.pkl")
                    else "tensor data" if "/data/" in info.filename else "other records")
            add(kind, body, body + info.compress_size)
            covered.append((start, body + info.compress_size))
    add("zip directory", cd_offset, cd_offset + cd_size)
    add("end record", eocd, eocd + 22)
    add("checksum record", eocd + 22, len(data))
    covered += [(cd_offset, len(data))]
    gaps, position = [], 0  # data descriptors and anything else between the records
    for start, end in sorted(covered):
        if start > position:
            gaps.append((position, start))
        position = max(position, end)
    for start, end in gaps:
        add("other records", start, end)
    return regions


def pick(rng: random.Random, ranges: list[tuple[int, int]]) -> int:
    total = sum(e - s for s, e in ranges)
    k = rng.randrange(total)
    for start, end in ranges:
        if k < end - start:
            return start + k
        k -= end - start
    raise AssertionError


def corruption_trials(root: Path, rng: random.Random, opts: argparse.Namespace, only) -> list[Trial]:
    trials: list[Trial] = []
    plain = Corruption(root)
    data = plain.pristine
    size = len(data)
    path = plain.path

    def run(scenario: str, damage, **params) -> None:
        if not only(scenario):
            return
        trial = Trial(scenario, sum(t.scenario == scenario for t in trials), params)
        try:
            plain.trial(trial, damage)
        except Exception as error:  # noqa: BLE001 - a bug of the campaign or an unexpected raise
            trial.detail = f"campaign error: {type(error).__name__}: {error}\n{traceback.format_exc()[-1500:]}"
        trials.append(trial)

    def write(blob: bytes):
        return lambda: path.write_bytes(blob)

    # truncations
    offsets = sorted({1, 3, 4, 30, 100, size // 4, size // 2, 3 * size // 4, size - 200, size - 110,
                      size - 88, size - 87, size - 22, size - 1})
    for offset in offsets:
        run("corrupt/truncate", write(data[:offset]), offset=offset)
    # byte flips, spread over the regions of the archive
    regions = zip_regions(data)
    names = sorted(regions)
    for k in range(opts.flips):
        region = names[k % len(names)]
        position = pick(rng, regions[region])
        flipped = bytearray(data)
        flipped[position] ^= rng.randrange(1, 256)
        run(f"corrupt/flip: {region}", write(bytes(flipped)), position=position)
    # zeroed blocks (that change something)
    for _ in range(12):
        for _attempt in range(100):
            length = rng.choice([16, 64, 512, 4096])
            start = rng.randrange(0, max(1, size - 1))
            end = min(size, start + length)
            if any(data[start:end]):
                break
        run("corrupt/zero block", write(data[:start] + bytes(end - start) + data[end:]), start=start, length=end - start)
    # appended garbage
    for extra in [b"\0", b"x" * 7, bytes(rng.randrange(256) for _ in range(100)), data]:
        run("corrupt/append garbage", write(data + extra), appended=len(extra))
    # replaced by another file
    other_zip = io.BytesIO()
    with zipfile.ZipFile(other_zip, "w") as z:
        z.writestr("notes.txt", "not a checkpoint")
    other_torch = io.BytesIO()
    torch.save({"weights": torch.ones(3)}, other_torch)
    for what, blob in [("empty file", b""), ("text file", b"model weights go here\n"),
                       ("another zip", other_zip.getvalue()), ("another torch.save archive", other_torch.getvalue())]:
        run("corrupt/replace", write(blob), replaced_by=what)
    # the index pointing outside the directory
    for what in ["../outside", "absolute"]:
        scenario = "corrupt/index outside"
        if not only(scenario):
            continue
        trial = Trial(scenario, sum(t.scenario == scenario for t in trials), {"target": what})
        trials.append(index_trial(trial, plain, root, what))
    # a sharded checkpoint
    if only("corrupt/sharded"):
        trials += sharded_trials(root, rng, opts)
    return trials


def index_trial(trial: Trial, plain: Corruption, root: Path, what: str) -> Trial:
    plain.reset()
    elsewhere = root / "outside"
    elsewhere.mkdir(exist_ok=True)
    model, optimizer, marker = make_objects(9)
    outside_values = tensors_of(model, optimizer, marker)
    td.Checkpoint(model=model, optimizer=optimizer, marker=marker).write(elsewhere / "ckpt-9")
    if what == "../outside":
        shutil.copytree(elsewhere, plain.dir.parent / "outside_sibling", dirs_exist_ok=True)
        name = "../outside_sibling/ckpt-9"
    else:
        name = str(elsewhere / "ckpt-9")
    index_path = plain.dir / "checkpoint"
    index_path.write_text(json.dumps({"latest": name, "all": ["ckpt-1", name]}))
    problems = []
    started = time.perf_counter()
    try:
        latest = td.latest_checkpoint(plain.dir)
        trial.tte = time.perf_counter() - started
        problems.append(f"td.latest_checkpoint returned {latest!r}")
    except td.CheckpointError as error:
        trial.tte = time.perf_counter() - started
        if "checkpoint" not in str(error) or str(index_path) not in str(error):
            problems.append(f"the error does not name the index file: {short(str(error))}")
        trial.detail = f"{type(error).__name__}: {short(str(error), 250)}"
    except Exception as error:  # noqa: BLE001
        problems.append(f"raw {type(error).__name__}: {short(str(error))}")
    fresh = make_objects(8)
    try:
        restored = td.CheckpointManager(td.Checkpoint(model=fresh[0], optimizer=fresh[1], marker=fresh[2]),
                                        plain.dir).restore_or_initialize()
        if same(tensors_of(*fresh), outside_values):
            problems.append(f"CheckpointManager.restore_or_initialize RESTORED THE FILE OUTSIDE ({restored!r})")
        else:
            trial.note = f"CheckpointManager restored {os.path.basename(str(restored))}"
    except td.CheckpointError as error:
        trial.note = f"CheckpointManager: {type(error).__name__}"
    except Exception as error:  # noqa: BLE001
        problems.append(f"CheckpointManager raised raw {type(error).__name__}: {short(str(error))}")
    plain.reset()
    if problems:
        trial.detail = "; ".join(problems) + (f" [{trial.detail}]" if trial.detail else "")
    else:
        trial.passed = True
    return trial


def sharded_trials(root: Path, rng: random.Random, opts: argparse.Namespace) -> list[Trial]:
    sharded = Corruption(root, sharded=True)
    trials: list[Trial] = []
    members = sorted(sharded.pristine)

    def run(scenario: str, damage, **params) -> None:
        trial = Trial(scenario, sum(t.scenario == scenario for t in trials), params)
        try:
            sharded.trial(trial, damage)
        except Exception as error:  # noqa: BLE001
            trial.detail = f"campaign error: {type(error).__name__}: {error}\n{traceback.format_exc()[-1500:]}"
        trials.append(trial)

    def set_member(name: str, blob: bytes):
        return lambda: (sharded.path / name).write_bytes(blob)

    for name in members:
        data = sharded.pristine[name]
        for _ in range(max(2, opts.flips // 25)):
            position = rng.randrange(len(data))
            flipped = bytearray(data)
            flipped[position] ^= rng.randrange(1, 256)
            run(f"corrupt/sharded flip: {name}", set_member(name, bytes(flipped)), position=position)
        for offset in (0, len(data) // 2, len(data) - 1):
            run(f"corrupt/sharded truncate: {name}", set_member(name, data[:offset]), offset=offset)
        run("corrupt/sharded missing member", lambda name=name: (sharded.path / name).unlink(), member=name)
    return trials


# -- 4. malformed configuration --------------------------------------------------------------------
def config_variants() -> list[tuple[str, dict[str, str], list[str]]]:
    """``(name, environment, words one of which the message must hold)``."""
    p1, p2 = free_ports(2)

    def tf(cluster, task) -> dict[str, str]:
        config = {}
        if cluster is not None:
            config["cluster"] = cluster
        if task is not None:
            config["task"] = task
        return {"TF_CONFIG": json.dumps(config)}

    workers = [f"127.0.0.1:{p1}", f"127.0.0.1:{p2}"]
    task0 = {"type": "worker", "index": 0}
    torchrun = {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(p1), "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "1"}
    return [
        ("TF_CONFIG port 70000", tf({"worker": ["127.0.0.1:70000", workers[1]]}, task0), ["port", "70000"]),
        ("TF_CONFIG port 0", tf({"worker": ["127.0.0.1:0", workers[1]]}, task0), ["port"]),
        ("TF_CONFIG non-integer port", tf({"worker": ["127.0.0.1:http", workers[1]]}, task0), ["port"]),
        ("TF_CONFIG empty host", tf({"worker": [f":{p1}", workers[1]]}, task0), ["host"]),
        # Without a cluster, worker 0 is TensorFlow's single local worker; any other task is broken.
        ("TF_CONFIG missing cluster", tf(None, {"type": "worker", "index": 1}), ["cluster"]),
        ("TF_CONFIG missing task", tf({"worker": workers}, None), ["task"]),
        ("TF_CONFIG index out of range", tf({"worker": workers}, {"type": "worker", "index": 2}), ["index"]),
        ("TF_CONFIG unknown task type", tf({"worker": workers}, {"type": "gardener", "index": 0}),
         ["type", "gardener"]),
        ("TF_CONFIG invalid JSON", {"TF_CONFIG": '{"cluster": {"worker": ["127.0.0.1:1"]'}, ["json"]),
        ("TF_CONFIG duplicate addresses", tf({"worker": [workers[0], workers[0]]}, task0),
         ["duplicate", "twice", "more than once", "same address", "two tasks"]),
        ("torchrun WORLD_SIZE=0", {**torchrun, "RANK": "0", "WORLD_SIZE": "0"}, ["world_size"]),
        ("torchrun RANK>=WORLD_SIZE", {**torchrun, "RANK": "2", "WORLD_SIZE": "2"}, ["rank"]),
        ("torchrun MASTER_PORT=abc", {**torchrun, "RANK": "0", "WORLD_SIZE": "2", "MASTER_PORT": "abc"},
         ["master_port"]),
    ]


def run_config(trial: Trial, env: dict[str, str], words: list[str], root: Path, opts: argparse.Namespace) -> Trial:
    logdir = root / f"config-{re.sub(r'[^A-Za-z0-9]+', '_', trial.scenario)}"
    logdir.mkdir(parents=True)
    with P.processes(logdir) as procs:
        proc = procs.spawn([WORKER, "config", "--timeout", str(TIMEOUT_S)], P.clean_env(**env), "config")
        code = procs.wait(proc, opts.config_deadline)
        if code is None:
            trial.hung.append(dump_stacks(procs, proc, f"{trial.scenario}"))
        text = procs.output(proc)
    found = parse_lines(text, RESULT)
    if code is None:
        trial.detail = f"hung: still constructing after {opts.config_deadline:.0f} s (stacks below)"
        return trial
    if not found:
        trial.detail = f"exited {code} without a result: {short(text[-1500:])}"
        return trial
    report = found[0]
    trial.tte = report["seconds"]
    message = report.get("message", "")
    problems = []
    if report.get("error") is None:
        problems.append(f"the strategy was built ({report.get('num_workers')} workers) in {report['seconds']:.2f} s")
    elif not report.get("is_cluster_config_error"):
        kind = "a td.DistributeError" if report.get("is_distribute_error") else "raw"
        problems.append(f"{kind} {report['error']} after {report['seconds']:.2f} s: {short(message)}")
    else:
        if not any(word in message.lower() for word in words):
            problems.append(f"ClusterConfigError does not name the field ({'/'.join(words)}): {short(message)}")
        if report["seconds"] > 1.0:
            problems.append(f"raised after {report['seconds']:.2f} s (limit 1 s)")
    if problems:
        trial.detail = "; ".join(problems)
    else:
        trial.passed = True
        trial.detail = short(message, 250)
    return trial


# -- the campaign ----------------------------------------------------------------------------------
def print_table(trials: list[Trial]) -> None:
    order: list[str] = []
    for t in trials:
        if t.scenario not in order:
            order.append(t.scenario)
    width = max([len(s) for s in order] + [8])
    print(f"{'scenario':<{width}}  trials  passes  worst tte   median tte  notes")
    for scenario in order:
        group = [t for t in trials if t.scenario == scenario]
        times = [t.tte for t in group if t.tte is not None]
        notes: dict[str, int] = {}
        for t in group:
            if t.note:
                key = re.sub(r"latest=\S+ ", "", t.note) if scenario.startswith("death") else t.note
                notes[key] = notes.get(key, 0) + 1
        note = "; ".join(f"{k} x{v}" if v > 1 else k for k, v in notes.items())
        passes = sum(t.passed for t in group)
        mark = "" if passes == len(group) else "  <--"
        print(f"{scenario:<{width}}  {len(group):>6}  {passes:>6}  {fmt_time(max(times) if times else None):>10}  "
              f"{fmt_time(statistics.median(times) if times else None):>10}  {short(note, 200)}{mark}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--trials", type=int, default=3, help="trials per death scenario (default 3)")
    parser.add_argument("--mismatch-trials", type=int, default=1, help="trials per mismatch mode (default 1)")
    parser.add_argument("--flips", type=int, default=200, help="random byte flips of a checkpoint file (default 200)")
    parser.add_argument("--only", default=None, help="only the scenarios whose name contains SUBSTRING")
    parser.add_argument("--seed", type=int, default=None, help="seed of every random choice (default: from the clock)")
    parser.add_argument("--parallel", type=int, default=6, help="worker pairs running at once (default 6)")
    parser.add_argument("--slack", type=float, default=5.0, help="seconds over the timeout a death may take to be reported")
    parser.add_argument("--mismatch-limit", type=float, default=TIMEOUT_S / 2,
                        help="seconds within which a mismatch must be reported (default half the timeout)")
    parser.add_argument("--deadline", type=float, default=90.0, help="seconds a job may take before it counts as hung")
    parser.add_argument("--config-deadline", type=float, default=40.0)
    parser.add_argument("--keep-logs", action="store_true")
    opts = parser.parse_args()
    seed = opts.seed if opts.seed is not None else int(time.time()) % 100000
    rng = random.Random(seed)
    torch.set_num_threads(1)
    began = time.monotonic()
    root = Path(tempfile.mkdtemp(prefix=f"reliability-{seed}-"))
    print(f"reliability campaign: seed {seed}, {opts.trials} trial(s) per death scenario, "
          f"{opts.mismatch_trials} per mismatch mode, {opts.flips} byte flips; timeout_seconds={TIMEOUT_S:g}; "
          f"logs in {root}", flush=True)

    def only(name: str) -> bool:
        return opts.only is None or opts.only in name

    # Jobs of worker pairs; their random parameters are drawn here, in a fixed order.
    jobs = []
    for sharded, modes in ((False, MISMATCH_MODES), (True, SHARDED_MISMATCH_MODES)):
        for mode in modes:
            scenario = (f"mismatch/{mode}" + (" (FullyShardedStrategy)" if sharded else "")
                        + (" (control: same program)" if mode == "none" else ""))
            if only(scenario):
                for i in range(opts.mismatch_trials):
                    jobs.append((Trial(scenario, i, {}),
                                 lambda t, m=mode, f=sharded: run_mismatch(t, m, root, opts, sharded=f)))
    death_jobs = []
    for phase in PHASES:
        for sig in ("KILL", "STOP"):
            for victim in (0, 1):
                scenario = f"death/{sig}/{'chief' if victim == 0 else 'worker1'}/{phase}"
                for i in range(opts.trials):
                    params = death_params(rng, phase)
                    if only(scenario):
                        death_jobs.append((Trial(scenario, i, params),
                                           lambda t, s=sig, v=victim, ph=phase: run_death(t, s, v, ph, root, opts)))
    random.Random(seed).shuffle(death_jobs)  # mix the long (SIGSTOP) waits with the short ones
    jobs += death_jobs

    done: list[Trial] = []

    def execute(job) -> Trial:
        trial, fn = job
        try:
            fn(trial)
        except Exception as error:  # noqa: BLE001 - a bug of the campaign: reported, not fatal
            trial.detail = f"campaign error: {type(error).__name__}: {error}\n{traceback.format_exc()[-2000:]}"
        done.append(trial)
        progress(f"[{time.monotonic() - began:6.0f} s] {len(done)}/{len(jobs)} {trial.scenario} #{trial.index}: "
                 f"{'pass' if trial.passed else 'FAIL'} {fmt_time(trial.tte)}"
                 + ("" if trial.passed else f" - {short(trial.detail, 200)}"))
        return trial

    with ThreadPoolExecutor(max_workers=max(1, opts.parallel)) as pool:
        futures = [pool.submit(execute, job) for job in jobs]
        corruption_started = time.monotonic()
        corrupt = corruption_trials(root / "corrupt", rng, opts, only) if only("corrupt") or opts.only is None else []
        progress(f"[{time.monotonic() - began:6.0f} s] corruption: {len(corrupt)} trials in "
                 f"{time.monotonic() - corruption_started:.1f} s, {sum(t.passed for t in corrupt)} passed")
        pair_trials = [f.result() for f in futures]

    configs = []
    variants = [(f"config/{name}", env, words) for name, env, words in config_variants() if only(f"config/{name}")]
    if variants:
        with ThreadPoolExecutor(max_workers=4) as pool:
            futures = [pool.submit(run_config, Trial(name, 0, {}), env, words, root, opts)
                       for name, env, words in variants]
            configs = [f.result() for f in futures]

    trials = pair_trials + corrupt + configs
    names = sorted(dict.fromkeys(t.scenario for t in trials), key=lambda name: (_group(name), name))
    ordered = [t for name in names for t in sorted(trials, key=lambda t: t.index) if t.scenario == name]
    print()
    print_table(ordered)
    failed = [t for t in ordered if not t.passed]
    print()
    print(f"{len(ordered) - len(failed)}/{len(ordered)} trials passed; seed {seed}; "
          f"{time.monotonic() - began:.0f} s")
    for t in failed:
        params = ", ".join(f"{k}={v}" for k, v in t.params.items())
        print(f"FAIL {t.scenario} #{t.index}" + (f" ({params})" if params else "") + f": {t.detail}")
    for t in ordered:
        for dump in t.hung:
            print(f"\nHUNG {t.scenario} #{t.index}:\n{dump}")
    if failed or opts.keep_logs:
        print(f"\nlogs kept in {root}")
    else:
        shutil.rmtree(root, ignore_errors=True)
    return 1 if failed else 0


def _group(scenario: str) -> tuple[int, int]:
    kind = scenario.split("/")[0]
    rank = {"death": 0, "mismatch": 1, "corrupt": 2, "config": 3}.get(kind, 4)
    phase = next((i for i, p in enumerate(PHASES) if scenario.endswith("/" + p)), 0)
    if kind == "mismatch":
        phase = next((i for i, m in enumerate(MISMATCH_MODES) if scenario.startswith(f"mismatch/{m}")), 0)
    return rank, phase


if __name__ == "__main__":
    sys.exit(main())
