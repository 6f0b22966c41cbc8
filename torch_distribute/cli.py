"""The ``torch-distribute`` command: inspect this machine's devices, start local worker processes
of a training script, and convert checkpoints.

    torch-distribute devices    # what MirroredStrategy() would use on this machine
    torch-distribute version
    torch-distribute launch --nproc 2 train.py --epochs 3   # local workers, see `launch -h`
    torch-distribute checkpoint convert ckpt-3 model.pt     # a sharded checkpoint as one file
    torch-distribute lighthouse --min-workers 2   # the quorum server of a fault-tolerant job
"""

from __future__ import annotations

import argparse
import sys

import torch


def _devices(_: argparse.Namespace) -> int:
    from torch_distribute.devices import local_devices

    devices = local_devices(logical_cpus=True)
    print(f"torch {torch.__version__}; intra-op threads: {torch.get_num_threads()}")
    print("MirroredStrategy() would use: " + ", ".join(d.name for d in devices))
    if not torch.cuda.is_available():
        print("No GPU visible: use MirroredStrategy(['cpu:0', 'cpu:1', ...]) for CPU replicas "
              "(or split the CPU with td.config.set_logical_device_configuration).")
    return 0


def _version(_: argparse.Namespace) -> int:
    from torch_distribute import __version__

    print(f"torch-distribute {__version__} (torch {torch.__version__})")
    return 0


def _launch(args: argparse.Namespace) -> int:
    from torch_distribute.cluster.launcher import main as launch_main

    return launch_main(args.launch_args)


def _lighthouse(args: argparse.Namespace) -> int:
    from torch_distribute.cluster.lighthouse import main as lighthouse_main

    return lighthouse_main(args.lighthouse_args)


def _convert(args: argparse.Namespace) -> int:
    from torch_distribute.checkpoint.sharded_io import convert_to_file
    from torch_distribute.errors import CheckpointError

    try:
        convert_to_file(args.source, args.target)
    except CheckpointError as error:
        print(f"torch-distribute checkpoint convert: {error}", file=sys.stderr)
        return 2
    print(f"wrote {args.target}")
    return 0


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv and argv[0] == "launch":  # everything after `launch` belongs to the launcher
        return _launch(argparse.Namespace(launch_args=argv[1:]))
    if argv and argv[0] == "lighthouse":  # so is everything after `lighthouse`
        return _lighthouse(argparse.Namespace(lighthouse_args=argv[1:]))
    from torch_distribute import __version__

    parser = argparse.ArgumentParser(
        prog="torch-distribute",
        description="torch-distribute: the tf.distribute programming model for PyTorch. Inspect "
        "this machine's devices, start local worker processes of a training script, convert "
        "checkpoints, and keep torch imported for quick launches. `torch-distribute COMMAND -h` "
        "describes each command.",
    )
    parser.add_argument("--version", action="version", version=f"torch-distribute {__version__}")
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    commands.add_parser(
        "devices", help="list the devices a strategy would use",
        description="Print the torch version, the intra-op thread count and the devices "
        "MirroredStrategy() would use on this machine (every visible GPU, else the CPU).",
    ).set_defaults(run=_devices)
    commands.add_parser(
        "version", help="print versions",
        description="Print the versions of torch-distribute and of the torch it runs on.",
    ).set_defaults(run=_version)
    checkpoint = commands.add_parser(
        "checkpoint", help="work with checkpoints",
        description="Work with checkpoints written by td.Checkpoint, CheckpointManager or "
        "BackupAndRestore.",
    )
    checkpoint_commands = checkpoint.add_subparsers(dest="checkpoint_command", required=True)
    convert = checkpoint_commands.add_parser(
        "convert", help="write a sharded checkpoint directory (FullyShardedStrategy) as one plain file",
        description="Join the shards of a checkpoint directory written under FullyShardedStrategy "
        "into one plain torch.save file, which loads under any strategy or none.",
    )
    convert.add_argument("source", help="the sharded checkpoint directory, e.g. ckpts/ckpt-3")
    convert.add_argument("target", help="the file to write; loads under any strategy or none")
    convert.set_defaults(run=_convert)
    launch = commands.add_parser(
        "launch", help="start local worker processes of a training script (`launch -h` for its options)",
        add_help=False,
    )
    launch.add_argument("launch_args", nargs=argparse.REMAINDER)
    launch.set_defaults(run=_launch)
    lighthouse = commands.add_parser(
        "lighthouse", help="run the quorum server of a fault-tolerant job (`lighthouse -h` for its options)",
        add_help=False,
    )
    lighthouse.add_argument("lighthouse_args", nargs=argparse.REMAINDER)
    lighthouse.set_defaults(run=_lighthouse)
    args = parser.parse_args(argv)
    return args.run(args)


if __name__ == "__main__":
    sys.exit(main())
