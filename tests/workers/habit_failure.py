"""Worker for the failure-reporting tests: a 2-worker custom loop in which worker
``$FAIL_RANK`` (default 1) fails at step 3, and the other does what a DDP user does with the
error it gets: catch it, print it and ``sys.exit(7)``.

    python habit_failure.py MODE      # under torch-distribute launch, torchrun or TF_CONFIG

MODE ``raise``: the failing worker's step raises ``ValueError`` (a bug in the program); ``raise-slow``:
the same, then that worker takes 4 s to exit (its teardown: DataLoader workers, a CUDA
context), so the other exits first; ``kill``: it is SIGKILLed.
"""

import atexit
import os
import signal
import sys
import time

mode = sys.argv[1]
failing = int(os.environ.get("FAIL_RANK", "1"))
if mode == "raise-slow":
    # Registered before torch_distribute is imported: runs after its exit handler.
    atexit.register(lambda: time.sleep(4) if os.environ.get("RANK") == str(failing) else None)

import torch  # noqa: E402

import torch_distribute as td  # noqa: E402

torch.set_num_threads(1)
strategy = td.MultiWorkerMirroredStrategy(communication_options=td.CommunicationOptions(timeout_seconds=20))
rank = strategy.extended.worker_index
with strategy.scope():
    model = torch.nn.Linear(4, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)


def step(x, i):
    if rank == failing and i == 3:
        if mode == "kill":
            os.kill(os.getpid(), signal.SIGKILL)
        raise ValueError(f"bad batch on worker {rank}")
    loss = td.compute_average_loss(model(x).square().sum(1), global_batch_size=8)
    loss.backward()
    optimizer.step()
    optimizer.zero_grad()
    return loss


try:
    for i in range(6):
        strategy.run(step, args=(torch.ones(4, 4), i))
except td.WorkerUnavailableError as error:
    if rank == failing:
        raise
    print(f"REPORTED {type(error).__name__}: {error}", flush=True)
    sys.exit(7)
print("finished", flush=True)
