"""Worker processes of ``benchmarks/reliability_campaign.py`` (fault injection).

    python benchmarks/reliability_worker.py death --timeout S --phase P --victim R --signal KILL|STOP
                                                  --at K [--variant V] [--fraction F] [--ckpt-dir D]
    python benchmarks/reliability_worker.py check-dir DIR
    python benchmarks/reliability_worker.py config --timeout S
    python benchmarks/reliability_worker.py run SCRIPT [ARGS...]

``death``: one of the two workers of a ``MultiWorkerMirroredStrategy`` job (TF_CONFIG and
``MW_RANK`` in the environment, one CPU replica each). Worker ``--victim`` faults at the
place ``--phase`` names by **signalling itself** (``os.kill(os.getpid(), SIGKILL|SIGSTOP)``),
which is exact: the fault lands where the code says, not wherever a signal from outside
happens to find the process. Just before, it prints one ``RWFAULT {json}`` line with the
wall-clock time (``time.time()``: both workers and the campaign share one host clock) and
where it is. Phases:

- ``startup`` (``--variant``): ``before`` the strategy is built; or during its rendezvous
  (``torch.distributed`` monkeypatched): right after the victim's ``TCPStore`` exists
  (``store``: the chief's server is listening, a worker's client is connected), before
  ``init_process_group`` (``process_group``: both joined the store), before ``new_group``
  (``new_group``: the default group is up);
- ``between``: before step ``--at`` (between two steps);
- ``backward``: inside step ``--at``, in the middle of ``backward()`` (a gradient hook on the
  first layer's weight, which runs after the last layer's gradients exist);
- ``save``: every step ends with a checkpoint save of ``--ckpt-dir`` (``--variant manager``:
  ``CheckpointManager.save``; ``checkpoint``: ``Checkpoint.save``); at step ``--at`` the save
  faults: the chief (``torch.save`` monkeypatched: it writes ``--fraction`` of the archive,
  then faults) or a non-chief (it faults inside the save while the chief writes, whose
  ``torch.save`` is slowed down);
- ``ragged``: training on ``experimental_distribute_dataset`` (49 rows, global batches of 8:
  the last batch of an epoch has 1 row, fewer than replicas); in epoch ``--at`` the victim
  faults on the last batch, before running it (``--variant before_run``) or after running it,
  when the epoch-end agreement is next (``after_run``).

The other worker (the survivor) must raise ``td.WorkerUnavailableError``; it prints one
``RWRESULT {json}`` line (error type, message, ``time.time()`` of the error, where it was)
and leaves with ``os._exit`` (no teardown against a dead peer).

``check-dir``: after a mid-save fault (every worker of the job gone), report what a restarted
job sees in the directory: ``td.latest_checkpoint``, whether that file is complete (full
checksum and load), and the temporary files before and after a ``CheckpointManager`` is built.

``config``: build a ``MultiWorkerMirroredStrategy`` from the environment (a malformed
TF_CONFIG or torchrun variables) and report the exception, its type and how long it took.

``run``: run another worker script (``tests/multiworker/mismatch_job.py``) as ``__main__``
with the same ``SIGUSR1`` stack dump as the others.

Every mode registers ``faulthandler`` on ``SIGUSR1``: the campaign sends it to a process that
hangs, and the Python stacks of every thread land in the process's log.
"""

from __future__ import annotations

import faulthandler
import signal
import sys

faulthandler.register(signal.SIGUSR1, all_threads=True)

import argparse  # noqa: E402
import io  # noqa: E402
import json  # noqa: E402
import os  # noqa: E402
import runpy  # noqa: E402
import threading  # noqa: E402
import time  # noqa: E402
import traceback  # noqa: E402

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(REPO, "tests"))

RESULT = "RWRESULT "
FAULT = "RWFAULT "


def emit(prefix: str, payload: dict) -> None:
    sys.stdout.write(prefix + json.dumps(payload) + "\n")
    sys.stdout.flush()


# -- death ---------------------------------------------------------------------------------------
def death(args: argparse.Namespace) -> None:
    import mw_helpers as H
    import torch
    import torch.nn.functional as F

    import torch_distribute as td

    torch.set_num_threads(1)
    rank = int(os.environ["MW_RANK"])
    victim = rank == args.victim
    signum = signal.SIGKILL if args.signal == "KILL" else signal.SIGSTOP
    where = {"phase": "start-up", "step": None, "epoch": None}
    result: dict = {"rank": rank, "error": None}
    fired = threading.Event()  # one fault per process

    def fault(what: str) -> None:
        if fired.is_set():
            return
        fired.set()
        emit(FAULT, {"rank": rank, "t": time.time(), "what": what, "signal": args.signal, **where})
        sys.stderr.flush()
        os.kill(os.getpid(), signum)
        if signum == signal.SIGSTOP:  # continued (the campaign never does): stay out of the way
            time.sleep(3600)

    restore_rendezvous = None
    if victim and args.phase == "startup" and args.variant != "before":
        restore_rendezvous = install_startup_fault(args, where, fault)
    started = time.monotonic()
    try:
        options = td.CommunicationOptions(timeout_seconds=args.timeout)
        if victim and args.phase == "startup" and args.variant == "before":
            fault("before the strategy is built")
        strategy = td.MultiWorkerMirroredStrategy(devices=["cpu:0"], communication_options=options)
        if restore_rendezvous is not None:
            restore_rendezvous()
        where["phase"] = "built"
        assert strategy.cluster_resolver.worker_index == rank
        torch.manual_seed(H.worker_seed(rank))
        with strategy.scope():
            model = H.make_model()
            optimizer = torch.optim.Adam(model.parameters(), lr=H.LR)

        def step(xb: torch.Tensor, yb: torch.Tensor, global_batch_size: int) -> torch.Tensor:
            per_example = F.cross_entropy(model(xb), yb, reduction="none")
            loss = td.compute_average_loss(per_example, global_batch_size=global_batch_size)
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
            return loss

        if victim and args.phase == "backward":
            def hook(grad: torch.Tensor) -> torch.Tensor:
                if where["step"] == args.at:
                    fault("inside backward (gradient hook of the first layer)")
                return grad
            model[0].weight.register_hook(hook)

        if args.phase == "save":
            install_save_faults(args, strategy, rank, victim, where, fault)
            ckpt = td.Checkpoint(model=model, optimizer=optimizer)
            manager = td.CheckpointManager(ckpt, args.ckpt_dir, max_to_keep=3) if args.variant == "manager" else None

        if args.phase == "ragged":
            x, y = H.make_data()
            sizes = H.global_batch_sizes()
            dist_ds = strategy.experimental_distribute_dataset(H.make_loader(x, y))
            for epoch in range(args.at + 3):
                where.update(phase="training (ragged epochs)", epoch=epoch, step=0)
                iterator = iter(dist_ds)
                k = 0
                while True:
                    where["step"] = k
                    try:
                        xb, yb = next(iterator)
                    except StopIteration:
                        break
                    last = k == len(sizes) - 1
                    if victim and epoch == args.at and last and args.variant == "before_run":
                        fault(f"holding the ragged last batch ({sizes[k]} row) of epoch {epoch}, before running it")
                    strategy.run(step, args=(xb, yb, sizes[k]))
                    if victim and epoch == args.at and last and args.variant == "after_run":
                        fault(f"after the ragged last step of epoch {epoch}, before the epoch-end agreement")
                    k += 1
        else:
            gen = torch.Generator().manual_seed(11 + rank)
            for k in range(args.at + 40):
                where.update(phase="training", step=k)
                if victim and args.phase == "between" and k == args.at:
                    fault(f"between steps {k - 1} and {k}")
                xb, yb = torch.randn(4, 4, generator=gen), torch.randint(0, 3, (4,), generator=gen)
                strategy.run(step, args=(xb, yb, 8))
                if args.phase == "save":
                    where["phase"] = "saving"
                    path = manager.save() if manager is not None else ckpt.save(os.path.join(args.ckpt_dir, "ckpt"))
                    result["last_saved"] = os.path.basename(path)
                    where["phase"] = "training"
        where["phase"] = "finished"
        result.update(finished=True)
        code = 0
    except td.WorkerUnavailableError as error:
        result.update(error="WorkerUnavailableError", message=str(error))
        code = 17
    except BaseException as error:  # noqa: BLE001 - any other outcome is reported as wrong
        result.update(error=type(error).__name__, message=str(error), traceback=traceback.format_exc()[-3000:])
        code = 18
    result.update(t_error=time.time(), blocked_total_s=time.monotonic() - started, where=dict(where))
    emit(RESULT, result)
    sys.stderr.flush()
    os._exit(code)


def install_startup_fault(args, where, fault):
    """Patch the ``torch.distributed`` call of the rendezvous that ``--variant`` names so
    that it faults there; returns the function that undoes the patch."""
    import torch.distributed as dist

    name, after, what = {
        "store": ("TCPStore", True, "during the rendezvous: right after its TCPStore was created "
                  "(chief: the server; worker 1: its connection), before announcing it joined"),
        "process_group": ("init_process_group", False, "during the rendezvous: every worker joined the "
                          "store, before init_process_group (Gloo's connections)"),
        "new_group": ("new_group", False, "during the rendezvous: default process group up, before "
                      "the gradient group is created"),
    }[args.variant]
    original = getattr(dist, name)

    def wrapper(*a, **kw):
        if not after:
            fault(what)
        out = original(*a, **kw)
        if after:
            fault(what)
        return out

    setattr(dist, name, wrapper)
    return lambda: setattr(dist, name, original)


def install_save_faults(args, strategy, rank, victim, where, fault) -> None:
    """Patch ``torch.save`` (the chief writes the file) and the non-chief's
    ``all_gather_objects`` so that the save at step ``--at`` faults inside."""
    import torch

    original_save = torch.save

    def chief_save(obj, f, *a, **kw):
        if where["step"] != args.at:
            return original_save(obj, f, *a, **kw)
        buffer = io.BytesIO()
        original_save(obj, buffer, *a, **kw)
        data = buffer.getvalue()
        cut = max(1, int(len(data) * args.fraction))
        if victim:
            f.write(data[:cut])
            f.flush()
            fault(f"inside torch.save of the faulty save, {cut} of {len(data)} bytes written")
            return None
        # The chief survives: a slow write, so the non-chief's fault lands while it writes.
        f.write(data[:cut])
        f.flush()
        time.sleep(0.5)
        f.write(data[cut:])
        return None

    if rank == 0:
        torch.save = chief_save
    elif victim:
        extended = strategy.extended
        original_gather = extended.all_gather_objects

        def gather(obj, what, *a, **kw):
            if where["step"] == args.at and "checkpoint write: the outcome" in what:
                fault("inside the save, waiting for the chief's write (which takes 0.5 s)")
            return original_gather(obj, what, *a, **kw)

        extended.all_gather_objects = gather


# -- check-dir -------------------------------------------------------------------------------------
def check_dir(directory: str) -> None:
    import warnings

    import mw_helpers as H
    import torch

    import torch_distribute as td
    from torch_distribute.checkpoint import file_io

    torch.set_num_threads(1)
    out: dict = {"rank": 0, "before": sorted(os.listdir(directory))}
    out["temporaries_before"] = [n for n in out["before"] if ".td-" in n]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            latest = td.latest_checkpoint(directory)
            out["latest"] = None if latest is None else os.path.basename(latest)
        except Exception as error:  # noqa: BLE001
            latest = None
            out["latest_error"] = f"{type(error).__name__}: {error}"
    out["latest_warnings"] = [str(w.message)[:300] for w in caught]
    if latest is not None:
        try:
            file_io.check_file(latest, full=True)
            payload = file_io.load_payload(latest)
            model = H.make_model()
            optimizer = torch.optim.Adam(model.parameters(), lr=H.LR)
            td.Checkpoint(model=model, optimizer=optimizer).read(latest).assert_consumed()
            out["latest_intact"] = True
            out["latest_save_counter"] = payload.get("save_counter")
        except Exception as error:  # noqa: BLE001
            out["latest_intact"] = False
            out["latest_load_error"] = f"{type(error).__name__}: {error}"
    try:
        model = H.make_model()
        td.CheckpointManager(td.Checkpoint(model=model), directory, max_to_keep=3)
    except Exception as error:  # noqa: BLE001
        out["manager_error"] = f"{type(error).__name__}: {error}"
    out["after"] = sorted(os.listdir(directory))
    out["temporaries_after"] = [n for n in out["after"] if ".td-" in n]
    emit(RESULT, out)


# -- config ----------------------------------------------------------------------------------------
def config(args: argparse.Namespace) -> None:
    import torch

    import torch_distribute as td

    torch.set_num_threads(1)
    out: dict = {"rank": 0}
    started = time.monotonic()
    try:
        strategy = td.MultiWorkerMirroredStrategy(
            devices=["cpu:0"], communication_options=td.CommunicationOptions(timeout_seconds=args.timeout))
        out.update(error=None, built=True, num_workers=strategy.cluster_resolver.num_workers)
    except BaseException as error:  # noqa: BLE001
        out.update(error=type(error).__name__, message=str(error),
                   is_cluster_config_error=isinstance(error, td.ClusterConfigError),
                   is_distribute_error=isinstance(error, td.DistributeError),
                   traceback=traceback.format_exc()[-2500:])
    out["seconds"] = time.monotonic() - started
    emit(RESULT, out)
    sys.stderr.flush()
    os._exit(0)


def main() -> None:
    parser = argparse.ArgumentParser()
    sub = parser.add_subparsers(dest="mode", required=True)
    d = sub.add_parser("death")
    d.add_argument("--timeout", type=float, required=True)
    d.add_argument("--phase", choices=["startup", "between", "backward", "save", "ragged"], required=True)
    d.add_argument("--victim", type=int, required=True)
    d.add_argument("--signal", choices=["KILL", "STOP"], required=True)
    d.add_argument("--at", type=int, default=3)
    d.add_argument("--variant", default="")
    d.add_argument("--fraction", type=float, default=0.5)
    d.add_argument("--ckpt-dir", default=None)
    c = sub.add_parser("check-dir")
    c.add_argument("directory")
    g = sub.add_parser("config")
    g.add_argument("--timeout", type=float, default=10)
    r = sub.add_parser("run")
    r.add_argument("script")
    r.add_argument("rest", nargs=argparse.REMAINDER)
    args = parser.parse_args()
    if args.mode == "death":
        death(args)
    elif args.mode == "check-dir":
        check_dir(args.directory)
    elif args.mode == "config":
        config(args)
    else:
        sys.argv = [args.script, *args.rest]
        sys.path[0] = os.path.dirname(os.path.abspath(args.script))
        runpy.run_path(args.script, run_name="__main__")


if __name__ == "__main__":
    main()
