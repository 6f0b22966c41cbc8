"""1 vs 2 replicas, measured: the same seeds and global batch on OneDeviceStrategy and on
MirroredStrategy with two CPU replicas (or two GPUs).

    python -m examples.cyclegan.compare                          # 2 epochs, global batch 16
    python -m examples.cyclegan.compare --epochs 3 --output-dir /tmp/compare -- --image-size 16

Reports the largest parameter difference between the two runs, per-epoch seconds, the final
losses, and writes ``compare_losses.png`` (every training loss per step, one curve per run)
and ``compare.json``. Arguments after ``--`` go to ``examples.cyclegan.train`` for both runs.
In exact arithmetic the runs are identical (same data order, same initial weights, gradients
of the same global-batch mean); in practice they differ by rounding, which the training
dynamics amplify about a thousandfold every five steps (in float64: 1e-16 at step 1, 1e-11
at step 10, 1e-3 near step 20). One device run twice with 1 and 2 intra-op threads diverges
at the same rate, so the curves are compared by shape, not by value.
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile

import torch

from examples.cyclegan import train
from examples.cyclegan.plots import loss_curves_figure, save_figure
from examples.cyclegan.steps import LOSS_KEYS

__all__ = ["compare", "main", "max_parameter_difference"]

SUMMARY_KEYS = ("loss_G/total", "loss_F/total", "loss_X/loss", "loss_Y/loss")


def max_parameter_difference(a: train.TrainResult, b: train.TrainResult) -> dict[str, float]:
    """``{network: max |a - b|}`` over every parameter of each of the four networks.

    >>> # max_parameter_difference(one_replica_result, two_replica_result)["generator_g"]
    """
    out = {}
    for name, model in a.gan.models().items():
        other = b.gan.models()[name]
        out[name] = max(float((p.detach().cpu() - q.detach().cpu()).abs().max())
                        for p, q in zip(model.parameters(), other.parameters(), strict=True))
    return out


def compare(epochs: int, batch_size_per_replica: int, output_dir: str, seed: int,
            two_devices: str, train_args: list[str]) -> dict:
    """Train twice at the same global batch and return the measurements (also as JSON).

    >>> # compare(2, 8, "/tmp/compare", 0, "cpu:0,cpu:1", ["--image-size", "16"])
    """
    global_batch = 2 * batch_size_per_replica
    common = ["--epochs", str(epochs), "--seed", str(seed), "--no-progress", *train_args]
    runs = {
        "1 replica": ["--strategy", "one", "--devices", two_devices.split(",")[0],
                      "--batch-size-per-replica", str(global_batch)],
        "2 replicas": ["--strategy", "mirrored", "--devices", two_devices,
                       "--batch-size-per-replica", str(batch_size_per_replica)],
    }
    results = {}
    for label, flags in runs.items():
        print(f"== {label} (global batch {global_batch}) ==")
        run_dir = os.path.join(output_dir, label.replace(" ", "_"))
        results[label] = train.main([*flags, *common, "--output-dir", run_dir])

    one, two = results["1 replica"], results["2 replicas"]
    differences = max_parameter_difference(one, two)
    gaps = [max(abs(a[k] - b[k]) / max(abs(a[k]), 1e-12) for k in LOSS_KEYS)
            for a, b in zip(one.steps, two.steps, strict=True)]
    diverged = next((i + 1 for i, gap in enumerate(gaps) if gap > 1e-3), None)
    figure = loss_curves_figure({label: r.steps for label, r in results.items()}, LOSS_KEYS,
                                xlabel="step", title=f"CycleGAN, 1 vs 2 replicas, global batch {global_batch}")
    plot = save_figure(figure, os.path.join(output_dir, "compare_losses.png"))
    summary = {
        "global_batch": global_batch,
        "epochs": epochs,
        "torch_threads": torch.get_num_threads(),
        "max_parameter_difference": differences,
        "max_relative_step_loss_difference": max(gaps),
        "first_step_with_relative_loss_difference_above_1e-3": diverged,
        "relative_step_loss_difference_at": {
            step: gaps[step - 1] for step in (1, 2, 5, 10, 20, 50, 100, 200) if step <= len(gaps)},
        "seconds_per_epoch": {label: [e["seconds"] for e in r.epochs] for label, r in results.items()},
        "final_losses": {label: {k: r.epochs[-1][f"train/{k}"] for k in SUMMARY_KEYS}
                         for label, r in results.items()},
        "final_test_mae": {label: {k: v for k, v in r.epochs[-1].items() if k.startswith("test/MAE")}
                           for label, r in results.items()},
        "plot": plot,
    }
    with open(os.path.join(output_dir, "compare.json"), "w") as f:
        json.dump(summary, f, indent=2)
    return summary


def _report(summary: dict) -> None:
    print(f"\n== 1 vs 2 replicas, global batch {summary['global_batch']}, "
          f"{summary['epochs']} epochs, {summary['torch_threads']} torch threads ==")
    diffs = summary["max_parameter_difference"]
    print("largest parameter difference: " + ", ".join(f"{k} {v:.2e}" for k, v in diffs.items()))
    at = ", ".join(f"step {k}: {v:.1e}" for k, v in summary["relative_step_loss_difference_at"].items())
    print(f"largest relative difference of a per-step loss: {at}")
    print("first step where a loss differs by more than 1e-3 (relative): "
          f"{summary['first_step_with_relative_loss_difference_above_1e-3']}")
    for label, seconds in summary["seconds_per_epoch"].items():
        losses = "  ".join(f"{k} {v:.4f}" for k, v in summary["final_losses"][label].items())
        print(f"{label:>10}: seconds/epoch {', '.join(f'{s:.1f}' for s in seconds)}; "
              f"final epoch: {losses}")
    print(f"loss curves: {summary['plot']}")


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(prog="python -m examples.cyclegan.compare",
                                     description=__doc__.splitlines()[0])
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--batch-size-per-replica", type=int, default=8,
                        help="per replica of the 2-replica run; the 1-replica run gets twice it")
    parser.add_argument("--devices", default=None,
                        help="the two devices of the 2-replica run (default: cuda:0,cuda:1 with "
                        "two GPUs, else cpu:0,cpu:1); the 1-replica run uses the first")
    parser.add_argument("--output-dir", default=os.path.join(tempfile.gettempdir(), "td_cyclegan_compare"))
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=None,
                        help="torch intra-op threads of this process (default: torch's, one per "
                        "core); the 2-replica run splits them between its CPU replicas")
    args, train_args = parser.parse_known_args(argv)
    if train_args[:1] == ["--"]:
        train_args = train_args[1:]
    if args.epochs < 1 or args.batch_size_per_replica < 1:
        parser.error("--epochs and --batch-size-per-replica must be positive")
    if args.threads is not None:
        if args.threads < 1:
            parser.error(f"--threads must be positive, got {args.threads}")
        torch.set_num_threads(args.threads)
    devices = args.devices or ("cuda:0,cuda:1" if torch.cuda.device_count() >= 2 else "cpu:0,cpu:1")
    if len(devices.split(",")) != 2:
        parser.error(f"--devices must name exactly two devices, got {devices!r}")
    summary = compare(args.epochs, args.batch_size_per_replica, args.output_dir, args.seed,
                      devices, train_args)
    _report(summary)
    return summary


if __name__ == "__main__":
    main()
