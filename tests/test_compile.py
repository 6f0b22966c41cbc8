"""torch.compile and td.function under every strategy: a compiled module, a compiled replica
step and ``@td.function`` on the distributed step give eager's numbers (a ragged last batch
included), the graphs stay few, and replicas on one device share theirs."""

from __future__ import annotations

import threading

import pytest
import torch
from torch import nn
from torch._dynamo.utils import counters

import torch_distribute as td

pytestmark = [pytest.mark.timeout(300), pytest.mark.slow]

GLOBAL_BATCH = 16
STRATEGIES = {
    "one": lambda: td.OneDeviceStrategy("cpu"),
    "mirrored2": lambda: td.MirroredStrategy(["cpu:0", "cpu:1"]),
    "central2": lambda: td.CentralStorageStrategy(["cpu:0", "cpu:1"]),
    "mwms1": lambda: td.MultiWorkerMirroredStrategy(devices=["cpu:0", "cpu:1"]),
}


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    torch._dynamo.reset()
    counters.clear()
    yield
    torch._dynamo.reset()


def make_data(epochs: int = 1, ragged: bool = True) -> list[tuple[torch.Tensor, torch.Tensor]]:
    generator = torch.Generator().manual_seed(1)
    epoch = [(torch.randn(GLOBAL_BATCH, 8, generator=generator), torch.randn(GLOBAL_BATCH, 1, generator=generator))
             for _ in range(4)]
    if ragged:  # 12 rows: 6 a replica of 2, 3 of 4 (never 1 row: BatchNorm refuses to train on one)
        epoch.append((torch.randn(12, 8, generator=generator), torch.randn(12, 1, generator=generator)))
    return epoch * epochs


def build():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.BatchNorm1d(16), nn.ReLU(), nn.Linear(16, 1))
    return model, torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)


def state(model: nn.Module) -> torch.Tensor:
    return torch.cat([t.detach().float().reshape(-1) for t in [*model.parameters(), *model.buffers()]])


def train(strategy, compile_where: str | None, epochs: int = 1, ragged: bool = True):
    """Train on ``make_data``; ``compile_where``: None (eager), "module_in_scope",
    "module_outside", "step" (torch.compile on the replica step) or "function" (td.function
    on the distributed step). Returns the final state, the losses and the function."""
    with strategy.scope():
        model, optimizer = build()
        forward = torch.compile(model) if compile_where == "module_in_scope" else model
    if compile_where == "module_outside":
        forward = torch.compile(model)

    def replica_step(x, y):
        loss = td.compute_average_loss(((forward(x) - y) ** 2).squeeze(1), global_batch_size=GLOBAL_BATCH)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        return loss

    step = torch.compile(replica_step) if compile_where == "step" else replica_step

    def distributed_step(x, y):
        return strategy.reduce("sum", strategy.run(step, args=(x, y)), axis=None)

    if compile_where == "function":
        distributed_step = td.function(distributed_step)
    losses = [float(distributed_step(x, y)) for x, y in strategy.experimental_distribute_dataset(make_data(epochs, ragged))]
    for replica_model in strategy.experimental_local_results(model):
        torch.testing.assert_close(state(replica_model), state(model), rtol=0, atol=0)
    return state(model), losses, distributed_step


@pytest.mark.parametrize("name", list(STRATEGIES))
@pytest.mark.parametrize("compile_where", ["module_in_scope", "module_outside", "function"])
def test_compiled_training_matches_eager(name, compile_where):
    want, want_losses, _ = train(STRATEGIES[name](), None)
    got, losses, _ = train(STRATEGIES[name](), compile_where)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    assert losses == pytest.approx(want_losses, rel=1e-5, abs=1e-6)
    replicas = STRATEGIES[name]().num_replicas_in_sync
    # A few graphs per replica at most (the ragged batch adds some): no recompile storm.
    assert counters["stats"]["unique_graphs"] <= 2 * replicas * 3


def test_a_compiled_replica_step_matches_eager_under_mirrored():
    want, _, _ = train(STRATEGIES["mirrored2"](), None)
    got, _, _ = train(STRATEGIES["mirrored2"](), "step")
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_td_function_compiles_in_the_first_epoch_and_not_again_in_the_next():
    torch._dynamo.reset()  # graphs cached by earlier tests in this process would skew the counts
    strategy = STRATEGIES["mirrored2"]()
    _, _, function = train(strategy, "function", epochs=1)
    after_one_epoch = function.experimental_get_tracing_count()
    assert after_one_epoch >= 1
    torch._dynamo.reset()
    strategy = STRATEGIES["mirrored2"]()
    _, _, function = train(strategy, "function", epochs=3)
    assert function.experimental_get_tracing_count() == after_one_epoch


CPU_REPLICAS = {
    "mirrored": lambda n: td.MirroredStrategy([f"cpu:{k}" for k in range(n)]),
    "mwms": lambda n: td.MultiWorkerMirroredStrategy(devices=[f"cpu:{k}" for k in range(n)]),
}


@pytest.mark.parametrize("name", list(CPU_REPLICAS))
def test_replicas_on_one_device_trace_and_compile_their_graphs_once(name):
    """Replicas on one device (CPU replicas) share the compiled graphs: in a run whose inputs
    differ in kind from the last run's they take turns, replica 0 traces, and the others find
    its graphs in dynamo's cache (every replica computes with a copy of the parameters, and the graphs take the copies
    as inputs). So four replicas trace what two do, the ragged last batch's graph (a dynamic
    batch size) included, and ask inductor for as many compiled graphs."""
    found = {}
    for replicas in (2, 4):
        torch._dynamo.reset()
        counters.clear()
        _, _, function = train(CPU_REPLICAS[name](replicas), "function")
        inductor = counters["inductor"]
        found[replicas] = (function.experimental_get_tracing_count(),
                           inductor["fxgraph_cache_miss"] + inductor["fxgraph_cache_hit"])
    graphs, asked = found[2]
    assert found[4] == found[2] and graphs >= 2 and asked >= graphs, found


class Boom(Exception):
    pass


def test_replicas_take_turns_in_a_compiled_steps_runs_whose_inputs_change_kind():
    """A run whose inputs differ in kind from the last run's runs the replicas one at a time,
    each up to its merge (replica 0 first again after it), for the first 16 kinds; the other
    runs run them together: there replica 0 waits for replicas 1 and 2 at a barrier before its
    merge, which turns would deadlock."""
    strategy = td.MirroredStrategy(["cpu:0", "cpu:1", "cpu:2"])
    order: list[tuple[int, str]] = []
    meet = {"barrier": None}

    @torch.compiler.disable
    def note(tag):
        order.append((int(td.get_replica_context().replica_id_in_sync_group), tag))
        if meet["barrier"] is not None:
            meet["barrier"].wait(timeout=60)

    def replica_step(x):
        note("before")
        total = td.get_replica_context().all_reduce("sum", (x * 2).sum())
        note("after")
        return total + 1

    @td.function
    def step(x):
        return strategy.reduce("sum", strategy.run(replica_step, args=(x,)), axis=None)

    turns = [(k, "before") for k in range(3)] + [(k, "after") for k in range(3)]
    runs = [(6, False), (6, True), (9, False), (9, True), (6, False)]  # kinds 1 and 2, and back
    runs += [(rows, False) for rows in range(10, 24)]  # kinds 3 to 16
    runs += [(24, True), (25, True)]  # more kinds: shapes that vary, together
    for rows, together in runs:
        order.clear()
        meet["barrier"] = threading.Barrier(3) if together else None
        (x,) = strategy.experimental_distribute_dataset([torch.ones(rows, 2)])
        assert float(step(x)) == 3 * (4 * rows + 1)
        assert sorted(order) == sorted(turns)
        if not together:
            assert order == turns, rows


def test_the_replica_threads_meeting_in_a_merge_is_never_traced():
    """A compiled replica step's ``all_reduce`` meets the other replica threads in
    ``ReplicaThreads.merge_call``, and the last to arrive runs the merge function for all of
    them. That bookkeeping (each replica's state, whose turn it is) and those values are shared
    with the other threads, which change them while one thread's frame is traced, so dynamo
    must trace none of it (guards on such state fail as it changes: "Guard failed on the same
    frame it was created", met on torch 2.14 in a long process). They run eagerly, whether the
    replicas take turns or run together, and the sums stay exact."""
    from torch._dynamo.eval_frame import _debug_get_cache_entry_list

    from torch_distribute.collectives.cross_device_ops import CrossDeviceOps
    from torch_distribute.strategies.replica_threads import ReplicaThreads
    from torch_distribute.strategies.replicated import ReplicatedExtended
    from torch_distribute.values import regroup

    torch._dynamo.reset()  # the caches of earlier tests' compiled frames
    strategy = td.MirroredStrategy(["cpu:0", "cpu:1"])

    def replica_step(x):
        return td.get_replica_context().all_reduce("sum", (x * 2).sum()) + 1

    @td.function
    def step(x):
        return strategy.run(replica_step, args=(x,))

    for rows in (4, 4, 6, 6):  # a new kind (turns), the same kind (together), twice
        (x,) = strategy.experimental_distribute_dataset([torch.ones(rows, 2)])
        assert [float(v) for v in strategy.experimental_local_results(step(x))] == [4 * rows + 1] * 2
    merge_side = [getattr(ReplicaThreads.merge_call, "__wrapped__", ReplicaThreads.merge_call),
                  ReplicaThreads._merge, CrossDeviceOps.batch_reduce, CrossDeviceOps.broadcast,
                  ReplicatedExtended.broadcast_locally, regroup]
    compiled = [f.__qualname__ for f in merge_side if _debug_get_cache_entry_list(f.__code__)]
    assert compiled == []


@pytest.mark.parametrize("replica_1", ["raises", "skips the merge"])
def test_a_replica_that_fails_while_replicas_take_turns_is_named_and_hangs_nothing(replica_1):
    strategy = td.MirroredStrategy(["cpu:0", "cpu:1", "cpu:2"])

    @torch.compiler.disable
    def is_replica_1():
        return int(td.get_replica_context().replica_id_in_sync_group) == 1

    def replica_step(x):
        if is_replica_1():
            if replica_1 == "raises":
                raise Boom("replica 1")
            return x.sum()
        return td.get_replica_context().all_reduce("sum", x.sum())

    @td.function
    def step(x):
        return strategy.run(replica_step, args=(x,))

    (x,) = strategy.experimental_distribute_dataset([torch.ones(6, 2)])
    with pytest.raises(Boom if replica_1 == "raises" else td.ReplicaMismatchError):
        step(x)
    assert strategy.experimental_local_results(strategy.run(lambda: 3)) == (3, 3, 3)  # nothing is stuck


def test_gradients_accumulated_eagerly_then_stepped_under_td_function_count_once():
    """The first compiled run gives replica 0 copies of its own (see above): what every replica
    accumulated before, in eager runs without a step, still enters that step, once."""

    def train_two_runs(compile_second: bool) -> torch.Tensor:
        strategy = STRATEGIES["mirrored2"]()
        with strategy.scope():
            model, optimizer = build()

        def accumulate(x, y):
            td.compute_average_loss(((model(x) - y) ** 2).squeeze(1), global_batch_size=GLOBAL_BATCH).backward()

        def accumulate_and_step(x, y):
            accumulate(x, y)
            optimizer.step()
            optimizer.zero_grad()

        def second(x, y):
            return strategy.run(accumulate_and_step, args=(x, y))

        batches = list(strategy.experimental_distribute_dataset(make_data(ragged=False)))
        strategy.run(accumulate, args=batches[0])
        (td.function(second) if compile_second else second)(*batches[1])
        return state(model)

    torch.testing.assert_close(train_two_runs(True), train_two_runs(False), rtol=1e-5, atol=1e-6)


def test_td_function_on_a_function_without_run_compiles_it_whole():
    model, _ = build()
    model.eval()

    @td.function
    def predict(x):
        return torch.relu(model(x)) * 2

    x = torch.randn(4, 8)
    want = torch.relu(model(x)) * 2
    for _ in range(3):
        torch.testing.assert_close(predict(x), want)
    assert predict.experimental_get_tracing_count() == 1 and predict.__name__ == "predict"


def test_td_function_options():
    assert td.function(mode="max-autotune-no-cudagraphs", dynamic=True)(lambda x: x + 1)(torch.ones(2)).tolist() == [2, 2]
    with pytest.raises(td.InvalidArgumentError, match="mode must be one of"):
        td.function(lambda x: x, mode="fastest")
    with pytest.raises(td.InvalidArgumentError, match="fullgraph must be True, False or None"):
        td.function(lambda x: x, fullgraph="yes")
    with pytest.raises(td.InvalidArgumentError, match="decorates a callable"):
        td.function(3)


@pytest.mark.parametrize("mode", ["reduce-overhead", "max-autotune"])
def test_cuda_graph_modes_are_refused_for_replicas_in_threads(mode):
    """Checked before compiling (no GPU needed): torch keeps CUDA graph trees per thread, and on
    an H200 a Mirrored step under mode="reduce-overhead" failed inside inductor's tree manager."""
    two_replicas = (torch.device("cuda", 0), torch.device("cuda", 0))
    with pytest.raises(td.InvalidArgumentError, match=f"mode={mode!r} captures CUDA graphs.*2 replicas in threads"):
        td.function(lambda x: x, mode=mode).compiled(lambda x: x + 1, two_replicas)
    assert callable(td.function(lambda x: x, mode=mode).compiled(lambda x: x + 1, two_replicas[:1]))


def test_td_function_input_signature_marks_none_dimensions_dynamic():
    """TensorFlow's input_signature: every batch size runs the one graph; a tensor that does not
    match the signature is refused."""
    torch._dynamo.reset()
    strategy = td.MirroredStrategy(["cpu:0", "cpu:1"])
    with strategy.scope():
        model = nn.Linear(4, 1)
    signature = [td.TensorSpec((None, 4), torch.float32)]

    @td.function(input_signature=signature)
    def predict(x):
        return torch.relu(model(x)).sum()

    def replica_predict(rows):
        return model(rows).sum()

    @td.function(input_signature=signature)
    def distributed_predict(x):
        return strategy.reduce("sum", strategy.run(replica_predict, args=(x,)), axis=None)

    for rows in (8, 5, 3):
        x = torch.randn(rows, 4)
        torch.testing.assert_close(predict(x), torch.relu(model(x)).sum())
    assert predict.experimental_get_tracing_count() == 1
    batches = [torch.randn(rows, 4) for rows in (8, 6, 4)]
    for x, batch in zip(strategy.experimental_distribute_dataset(batches), batches, strict=True):
        torch.testing.assert_close(distributed_predict(x), model(batch).sum(), rtol=1e-5, atol=1e-5)
    assert distributed_predict.experimental_get_tracing_count() == 1  # one graph for both replicas
    with pytest.raises(td.InvalidArgumentError, match=r"argument 0 does not match its input_signature.*shape \(3, 5\)"):
        predict(torch.randn(3, 5))
    with pytest.raises(td.InvalidArgumentError, match="input_signature must be a list of td.TensorSpec"):
        td.function(lambda x: x, input_signature=[(None, 4)])


def build_gan():
    """A tiny DCGAN: 4 latent channels to a 1x8x8 image and back to one logit; SGD each."""
    torch.manual_seed(0)
    generator = nn.Sequential(nn.ConvTranspose2d(4, 2, 4, 1, 0), nn.BatchNorm2d(2), nn.ReLU(),
                              nn.ConvTranspose2d(2, 1, 4, 2, 1), nn.Tanh())
    discriminator = nn.Sequential(nn.Conv2d(1, 2, 4, 2, 1), nn.LeakyReLU(0.2), nn.Conv2d(2, 1, 4, 1, 0), nn.Flatten())
    optimizers = [torch.optim.SGD(net.parameters(), lr=0.1, momentum=0.9) for net in (generator, discriminator)]
    return generator, discriminator, optimizers


def train_gan(strategy, compiled: bool, steps: int = 3):
    """The DCGAN tutorial's step: the discriminator on real and ``fake.detach()``, its backward
    and step, then the generator's loss through the updated discriminator, its backward and
    step. One graph for the whole forward could not run it: the discriminator's backward frees
    what the generator's needs. Returns both networks' state, the losses, the function and the
    convolution backward kernels of the last step."""
    with strategy.scope():
        generator, discriminator, (optimizer_g, optimizer_d) = build_gan()
    bce = nn.functional.binary_cross_entropy_with_logits

    def average(per_sample):
        return td.compute_average_loss(per_sample.squeeze(1), global_batch_size=GLOBAL_BATCH)

    def replica_step(real, noise):
        fake = generator(noise)
        d_real, d_fake = discriminator(real), discriminator(fake.detach())
        loss_d = average(bce(d_real, torch.ones_like(d_real), reduction="none")
                         + bce(d_fake, torch.zeros_like(d_fake), reduction="none"))
        loss_d.backward()
        optimizer_d.step()
        optimizer_d.zero_grad()
        d_fake = discriminator(fake)
        loss_g = average(bce(d_fake, torch.ones_like(d_fake), reduction="none"))
        loss_g.backward()
        optimizer_g.step()
        optimizer_g.zero_grad()
        return loss_g.detach()

    def distributed_step(real, noise):
        return strategy.reduce("sum", strategy.run(replica_step, args=(real, noise)), axis=None)

    if compiled:
        distributed_step = td.function(distributed_step)
    rng = torch.Generator().manual_seed(1)
    batches = [(torch.rand(GLOBAL_BATCH, 1, 8, 8, generator=rng), torch.randn(GLOBAL_BATCH, 4, 1, 1, generator=rng))
               for _ in range(steps)]
    losses = []
    for k, (real, noise) in enumerate(strategy.experimental_distribute_dataset(batches)):
        with torch.profiler.profile() as profiled:
            losses.append(float(distributed_step(real, noise)))
        if k < steps - 1:
            continue
        conv_backward = sum(event.name == "aten::convolution_backward" for event in profiled.events())
    return torch.cat([state(generator), state(discriminator)]), losses, distributed_step, conv_backward


def test_a_gan_step_compiles_each_network_apart_and_does_eager_backward_work():
    """The scope made two networks, so td.function compiles each network's forward as a graph
    of its own (the losses and optimizer steps as the graphs between): each network call has
    its own backward, and each backward runs those of the calls it reaches, as in eager, no
    more. (Several replicas: tests/test_cyclegan.py's compiled run, four networks.)"""
    strategy = STRATEGIES["one"]
    want, want_losses, _, want_kernels = train_gan(strategy(), compiled=False)
    got, losses, function, kernels = train_gan(strategy(), compiled=True)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    assert losses == pytest.approx(want_losses, rel=1e-5, abs=1e-6)
    # The discriminator on real, on fake.detach() and on fake (2 each), the generator (2).
    assert kernels == want_kernels == 8
    assert function.experimental_get_tracing_count() >= 2  # at least the two networks' forwards


def test_networks_compiled_apart_keep_their_forward_outside_the_compiled_step():
    """While a td.function call lasts, each network's forward is the one that runs it compiled
    from the replica step; elsewhere (the distributed step's own code) it runs eagerly, and
    after the call (also one that raises) the module has its own forward again, a forward
    set on the instance included."""
    strategy = STRATEGIES["one"]()
    with strategy.scope():
        first, second = nn.Linear(2, 2), nn.Linear(2, 1)
    own_forward = second.forward = lambda x: nn.Linear.forward(second, x) * 2
    seen = []

    def replica_step(x):
        return second(first(x)).sum()

    @td.function
    def step(x, fail=False):
        total = strategy.run(replica_step, args=(x,))
        outside = first(x)
        seen.append((type(outside.grad_fn).__name__, "forward" in vars(first)))
        if fail:
            raise Boom("after run")
        return total

    x = torch.randn(3, 2)
    want = float(second(first(x)).sum().detach())
    assert float(step(x)) == pytest.approx(want, rel=1e-6)
    with pytest.raises(Boom):
        step(x, fail=True)
    assert seen == [("AddmmBackward0", True)] * 2
    assert "forward" not in vars(first) and vars(second)["forward"] is own_forward
    assert step.experimental_get_tracing_count() >= 2


def test_a_network_copied_during_a_call_runs_with_its_own_weights():
    """An EMA network made in the step (``copy.deepcopy`` of a network while td.function has
    its forward replaced) computes with the copy's weights, during the call and after it."""
    import copy

    strategy = STRATEGIES["one"]()
    with strategy.scope():
        first, second = nn.Linear(2, 2), nn.Linear(2, 1)
    copies = []

    def replica_step(x):
        return second(first(x)).sum()

    @td.function
    def step(x):
        total = strategy.run(replica_step, args=(x,))
        if not copies:
            copies.append(copy.deepcopy(first))
            with torch.no_grad():
                copies[0].weight.zero_()
                copies[0].bias.fill_(1.0)
        return total, copies[0](x)

    x = torch.randn(3, 2)
    for _ in range(2):
        _, during = step(x)
        torch.testing.assert_close(during, torch.ones(3, 2))
    torch.testing.assert_close(copies[0](x), torch.ones(3, 2))
    assert first.weight.abs().sum() > 0  # the original kept its weights


def test_split_networks_option():
    """``split_networks=True``: a graph per network even for one (a single model's forward
    apart from its loss, as ``torch.compile(model)`` by hand); ``False``: the replica step as
    one graph (a GAN step that calls backward on parts of it does its whole backward each
    time, or fails); not with ``fullgraph=True``."""
    strategy = STRATEGIES["one"]()
    with strategy.scope():
        model = nn.Linear(2, 1)

    def replica_step(x):
        return (model(x) ** 2).sum()

    counts = {}
    for split in (True, False):
        torch._dynamo.reset()
        step = td.function(lambda x: strategy.run(replica_step, args=(x,)), split_networks=split)
        assert float(step(torch.ones(1, 2))) == pytest.approx(float(replica_step(torch.ones(1, 2))))
        counts[split] = step.experimental_get_tracing_count()
    assert counts == {True: 2, False: 1}  # the model's forward, then the loss / both in one
    with pytest.raises(td.InvalidArgumentError, match="split_networks must be True, False or None"):
        td.function(lambda x: x, split_networks="yes")
    with pytest.raises(td.InvalidArgumentError, match="fullgraph=True asks for one graph .* pass one of them"):
        td.function(lambda x: x, fullgraph=True, split_networks=True)
