"""The package's structure: the public strategy contract, one interception module, no
private reads across modules, and a strategy built on the contract alone."""

from __future__ import annotations

import ast
import io
import pathlib
import re
import tokenize
from collections.abc import Callable
from typing import Any

import pytest
import torch

import torch_distribute as td
from torch_distribute.devices import LogicalDevice
from torch_distribute.ps.worker import WorkerRuntime
from torch_distribute.replica_context import ReplicaContext
from torch_distribute.strategies import interception
from torch_distribute.strategies.extended import StrategyExtended
from torch_distribute.strategies.parameter_server_worker import ParameterServerWorkerStrategy
from torch_distribute.strategies.single_replica import call_on_this_thread

PACKAGE = pathlib.Path(td.__file__).parent

# (file, attribute) pairs where reading another object's underscore attribute is legitimate:
# the same class reading another instance of itself, or a third-party library without a
# public API for it.
ALLOWED = {
    ("checkpoint/object_graph.py", "_objects"),  # Checkpoint reading a nested Checkpoint
    ("checkpoint/object_graph.py", "_load"),
    ("checkpoint/object_graph.py", "_shard_templates"),
    ("strategies/deferred_init.py", "_schema"),  # OpOverload._schema: which argument an operator writes
    ("checkpoint/object_graph.py", "_metadata"),  # torch's state-dict version metadata
    ("cluster/cluster_spec.py", "_jobs"),  # ClusterSpec comparing with another ClusterSpec
    ("keras/losses.py", "_Loss"),  # torch.nn.modules.loss._Loss, the base of torch's losses
    ("nest.py", "_fields"),  # namedtuple's public protocol
    ("ps/pickling.py", "_fields"),
    ("checkpoint/object_graph.py", "_fields"),
    ("checkpoint/sharded_io.py", "_metadata"),  # torch's state-dict version metadata
    ("checkpoint/sharded_io.py", "_fields"),  # namedtuple's public protocol
    ("eager.py", "_torchdynamo_disable"),  # the mark dynamo reads on disabled functions
    ("collectives/store_threads.py", "_exit"),  # os._exit: leaving before a teardown that would abort
    # A task forked by the forkserver ends as an interpreter does (threading._shutdown,
    # atexit._run_exitfuncs, os._exit), never returning into multiprocessing's bootstrap.
    *(("cluster/forkserver_tasks.py", name) for name in ("_exit", "_shutdown", "_run_exitfuncs")),
    # What ``python -m`` calls: run_module would run the module in a temporary __main__.
    ("cluster/forkserver_tasks.py", "_run_module_as_main"),
    # The forkserver's "alive" pipe, which multiprocessing hands every task: closed in the task.
    *(("cluster/forkserver_tasks.py", name) for name in ("_forkserver", "_forkserver_alive_fd", "_inherited_fds")),
    # Autograd nodes' saved values, torch's documented way to read a graph (``grad_fn._saved_*``).
    *(("strategies/loss_scaling.py", name) for name in (
        "_saved_dim", "_saved_self_sym_sizes", "_saved_self", "_saved_other", "_saved_reduction")),
}
TORCHMETRICS_PRIVATE = {"_defaults", "_update_count", "_reductions", "_computed", "_to_sync"}


def _private_reads(path: pathlib.Path) -> list[tuple[int, str, str]]:
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        name = None
        if isinstance(node, ast.Attribute):
            base = ast.unparse(node.value)
            if base in ("self", "cls", "super()") or base.startswith("torch"):
                continue
            name = node.attr
        elif (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Name)
            and node.func.id in ("getattr", "hasattr", "setattr")
            and len(node.args) > 1
            and isinstance(node.args[1], ast.Constant)
            and isinstance(node.args[1].value, str)
        ):
            base, name = ast.unparse(node.args[0]), node.args[1].value
            if base == "self":
                continue
        if name and name.startswith("_") and not name.startswith("__") and name != "_version":
            found.append((node.lineno, base, name))
    return found


def test_no_module_reads_another_objects_private_attributes():
    offenders = []
    for path in sorted(PACKAGE.rglob("*.py")):
        relative = path.relative_to(PACKAGE).as_posix()
        for line, base, name in _private_reads(path):
            if (relative, name) in ALLOWED:
                continue
            if relative == "metrics/torchmetrics_adapter.py" and name in TORCHMETRICS_PRIVATE:
                continue  # torchmetrics has no public API to merge the states of several copies
            offenders.append(f"{relative}:{line}: {base}.{name}")
    assert offenders == []


def _code_without_strings(text: str) -> str:
    tokens = [token._replace(string='""') if token.type == tokenize.STRING else token
              for token in tokenize.generate_tokens(io.StringIO(text).readline)]
    return tokenize.untokenize(tokens)


def test_only_the_interception_module_touches_torch_classes():
    patching = []
    for path in sorted(PACKAGE.rglob("*.py")):
        text = path.read_text()
        relative = path.relative_to(PACKAGE).as_posix()
        if relative == "strategies/torch_patches.py":  # the table names them, in strings only
            text = _code_without_strings(text)
        for needle in (".__init__ = ", "register_module_parameter_registration_hook",
                       "register_module_buffer_registration_hook", "register_optimizer_step_pre_hook",
                       "types.MethodType("):
            # keras3/keras_seams.py wraps Keras' constructors (never torch's), in its own table.
            keras_seam = relative == "keras3/keras_seams.py" and needle == ".__init__ = "
            if needle in text and relative != "strategies/interception.py" and not keras_seam:
                patching.append((relative, needle))
    assert patching == []


def test_interception_installs_once_and_rebinds_only_what_a_strategy_routes():
    first = td.MirroredStrategy(["cpu:0", "cpu:1"])  # held: the last strategy's collection undoes them
    interception.install()
    wrapped_init = torch.optim.Optimizer.__init__
    interception.install()
    td.MirroredStrategy(["cpu:0", "cpu:1"])
    assert torch.optim.Optimizer.__init__ is wrapped_init and first is not None
    assert not hasattr(torch.optim.Optimizer.__init__.__wrapped__, "__wrapped__")  # wrapped once

    one = td.OneDeviceStrategy("cpu")
    with one.scope():
        plain = torch.optim.SGD(torch.nn.Linear(2, 1).parameters(), lr=0.1)
    assert "step" not in vars(plain) and "zero_grad" not in vars(plain)
    assert td.strategies.owner_of(plain) is one

    mirrored = td.MirroredStrategy(["cpu:0", "cpu:1"])
    with mirrored.scope():
        layer = torch.nn.Linear(2, 1)
        routed = torch.optim.SGD(layer.parameters(), lr=0.1)
        scheduler = torch.optim.lr_scheduler.StepLR(routed, step_size=1, gamma=0.5)
    assert "step" in vars(routed) and "zero_grad" in vars(routed) and "step" in vars(scheduler)
    assert td.strategies.owner_of(routed) is mirrored and td.strategies.owner_of(layer) is mirrored
    assert td.strategies.owner_of(torch.nn.Linear(2, 1)) is None


def test_parameter_server_worker_strategy_is_a_real_strategy_with_the_common_semantics():
    worker = ParameterServerWorkerStrategy(worker_index=1)
    reference = td.OneDeviceStrategy("cpu")
    assert isinstance(worker, td.Strategy) and worker.num_replicas_in_sync == 1
    assert not worker.extended.should_checkpoint

    def step(x: torch.Tensor) -> torch.Tensor:
        ctx = td.get_replica_context()
        return ctx.all_reduce("sum", x * (ctx.replica_id_in_sync_group + 1))

    x = torch.tensor([[1, 2], [3, 5]])
    for strategy in (worker, reference):
        result = strategy.run(step, args=(x,))
        for op, axis in (("sum", None), ("mean", None), ("sum", 0), ("mean", 0), ("mean", 1)):
            got = worker.reduce(op, worker.run(step, args=(x,)), axis=axis)
            want = reference.reduce(op, result, axis=axis)
            assert got.dtype == want.dtype and torch.equal(got, want), (op, axis)
        assert torch.equal(worker.gather(x, axis=0), reference.gather(x, axis=0))


def test_a_scheduled_functions_strategy_reference_becomes_the_worker_strategy():
    runtime = WorkerRuntime(worker_index=3, timeout=1.0)
    strategy = runtime.resolve(("strategy",))
    assert isinstance(strategy, ParameterServerWorkerStrategy)
    assert strategy.extended.task_index == 3
    assert runtime.resolve(("strategy",)) is strategy


@pytest.mark.parametrize("options", [
    {"experimental_place_dataset_on_device": True},  # only with PER_REPLICA (TensorFlow's rule)
    {"experimental_per_replica_buffer_size": -1},
    {"experimental_replication_mode": "PER_REPLICA"},
])
def test_input_options_are_refused_rather_than_ignored(options):
    with pytest.raises(td.InvalidArgumentError):
        td.InputOptions(**options)


def test_integer_mean_is_exact_everywhere():
    strategy = td.MirroredStrategy(["cpu:0", "cpu:1"])
    per_replica = td.PerReplica([torch.tensor([1, 4]), torch.tensor([2, 7])])
    via_reduce = strategy.reduce("mean", per_replica, axis=None)
    via_ops = td.ReductionToOneDevice().batch_reduce("mean", [[torch.tensor([1, 4])], [torch.tensor([2, 7])]],
                                                      torch.device("cpu"))[0]
    assert torch.equal(via_reduce, torch.tensor([1.5, 5.5], dtype=torch.float64))
    assert torch.equal(via_ops, via_reduce)


class _ContractOnlyExtended(StrategyExtended):
    """What docs/architecture.md's guide asks for, and nothing else: one CPU replica."""

    def __init__(self, strategy: td.Strategy):
        super().__init__(strategy, (LogicalDevice("cpu", 0),))
        self._replica_context = ReplicaContext(strategy, 0)
        self.captured: list[torch.Tensor] = []

    def capture_parameter(self, module: Any, name: str, tensor: torch.Tensor, is_buffer: bool) -> None:
        self.captured.append(tensor)
        return None

    def owns(self, obj: Any) -> bool:
        tensors = [*obj.parameters()][:1] if isinstance(obj, torch.nn.Module) else [obj]
        return any(t is c for t in tensors for c in self.captured)

    def call_for_each_replica(self, fn: Callable[..., Any], args: tuple, kwargs: dict) -> Any:
        return call_on_this_thread(self._replica_context, torch.device("cpu"), fn, args, kwargs)


class _ContractOnlyStrategy(td.Strategy):
    def __init__(self) -> None:
        super().__init__(_ContractOnlyExtended(self))


def test_a_strategy_written_against_the_contract_alone_trains_measures_and_checkpoints(tmp_path):
    torch.manual_seed(0)
    strategy = _ContractOnlyStrategy()
    with strategy.scope():
        model = torch.nn.Linear(3, 1)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        mean_loss = td.metrics.Mean()
    reference = torch.nn.Linear(3, 1)
    reference.load_state_dict(model.state_dict())
    reference_optimizer = torch.optim.SGD(reference.parameters(), lr=0.1)
    assert td.strategies.owner_of(model) is strategy and td.strategies.owner_of(optimizer) is strategy

    x, y = torch.randn(8, 3), torch.randn(8, 1)

    def step(batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        features, labels = batch
        loss = td.compute_average_loss(((model(features) - labels) ** 2).squeeze(1), global_batch_size=8)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        mean_loss.update_state(loss)
        return loss

    for batch in strategy.experimental_distribute_dataset([(x, y)] * 3):
        strategy.reduce("sum", strategy.run(step, args=(batch,)), axis=None)
        loss = ((reference(x) - y) ** 2).mean()
        loss.backward()
        reference_optimizer.step()
        reference_optimizer.zero_grad()
    torch.testing.assert_close(model.weight, reference.weight, atol=1e-6, rtol=0)
    assert mean_loss.result() > 0

    path = td.Checkpoint(model=model, optimizer=optimizer).save(str(tmp_path / "ckpt"))
    restored = torch.nn.Linear(3, 1)
    td.Checkpoint(model=restored).restore(path).expect_partial()
    assert torch.equal(restored.weight, model.weight)


def _layer_table() -> list[list[str]]:
    """docs/architecture.md's layer table, top to bottom: each layer's side-by-side names
    (a row's `a → b` is two layers, `a` above `b`)."""
    text = (PACKAGE.parent / "docs" / "architecture.md").read_text(encoding="utf-8")
    section = text.split("## Layers", 1)[1].split("\n## ", 1)[0]
    layers = []
    for line in section.splitlines():
        cells = line.split(" | ")
        if line.startswith("| ") and len(cells) >= 3 and cells[0].strip("| ").isdigit():
            for part in cells[1].split("→"):
                layers.append(re.findall(r"`([a-z_][a-z_0-9]*)`", part))
    return layers


def test_the_layer_table_is_the_enforced_layers_and_every_module_is_listed():
    """The table's layers are lint-imports' layers contract, in order; every top-level
    module or package is in a layer, and every module is in "Every module"."""
    tomllib = pytest.importorskip("tomllib")  # Python 3.11+
    config = tomllib.loads((PACKAGE.parent / "pyproject.toml").read_text(encoding="utf-8"))
    contract = next(c for c in config["tool"]["importlinter"]["contracts"] if c["type"] == "layers")
    enforced = [sorted(name.strip().removeprefix("torch_distribute.") for name in layer.split("|"))
                for layer in contract["layers"]]
    assert [sorted(layer) for layer in _layer_table()] == enforced
    top_level = {p.stem for p in PACKAGE.iterdir()
                 if (p.suffix == ".py" and p.stem != "__init__") or (p / "__init__.py").exists()}
    assert top_level == {name for layer in enforced for name in layer}
    modules = {p.relative_to(PACKAGE).as_posix() for p in PACKAGE.rglob("*.py") if p.name != "__init__.py"}
    text = (PACKAGE.parent / "docs" / "architecture.md").read_text(encoding="utf-8")
    listed = set(re.findall(r"^\| `([a-z0-9_/]+\.py)` \|", text.split("## Every module", 1)[1], re.M))
    assert modules - listed == set(), "add these to docs/architecture.md's 'Every module' table"
    assert listed - modules == set(), "these are listed in docs/architecture.md but no longer exist"
