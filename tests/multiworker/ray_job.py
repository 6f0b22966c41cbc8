"""The tutorial's 2-worker step under Ray Train: ``TorchTrainer(train_loop_per_worker)``.

    python ray_job.py OUT_DIR

A local Ray cluster of 2 CPUs runs a ``TorchTrainer`` with 2 CPU workers. Ray Train sets
``MASTER_*``, ``RANK``, ``WORLD_SIZE`` and calls ``init_process_group`` itself before the
function runs; the function builds ``td.MultiWorkerMirroredStrategy()`` (which adopts that
group) and trains (``launcher_job.train_and_report``). Each worker writes its result to
``OUT_DIR/rank<R>.json``.
"""

from __future__ import annotations

import json
import os
import sys

import ray
from ray.train import RunConfig, ScalingConfig
from ray.train.torch import TorchTrainer

HERE = os.path.dirname(os.path.abspath(__file__))


def train_loop_per_worker(config: dict) -> None:
    sys.path.insert(0, config["here"])
    import launcher_job

    result = launcher_job.train_and_report(timeout=60)
    with open(os.path.join(config["out"], f"rank{result['rank']}.json"), "w") as f:
        json.dump(result, f)


def start_ray(attempts: int = 3) -> None:
    """A local Ray instance. Ray waits a fixed 30 s for its raylet to register, which a loaded
    machine can miss; a failed start is retried."""
    for attempt in range(attempts):
        try:
            ray.init(num_cpus=4,  # logical CPUs: 2 workers and the train controller
                     include_dashboard=False, log_to_driver=True,
                     runtime_env={"env_vars": {"OMP_NUM_THREADS": "1"}})
            return
        except Exception as error:  # noqa: BLE001 - Ray raises a plain Exception here
            if attempt == attempts - 1 or "timed out during startup" not in str(error):
                raise
            ray.shutdown()


def main() -> None:
    out = os.path.abspath(sys.argv[1])
    start_ray()
    trainer = TorchTrainer(
        train_loop_per_worker,
        train_loop_config={"here": HERE, "out": out},
        scaling_config=ScalingConfig(num_workers=2, use_gpu=False),
        run_config=RunConfig(storage_path=os.path.join(out, "ray_results"), name="td"),
    )
    trainer.fit()
    ray.shutdown()


if __name__ == "__main__":
    main()
