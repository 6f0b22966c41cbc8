"""Gradient clipping inside strategy.run without a GradScaler: ``clip_grad_norm_`` and
``clip_grad_value_`` act on the gradient summed over every replica and worker, however they
were imported, so N replicas clip exactly as one device does."""

from __future__ import annotations

import io
import json
import os
import sys

import pytest
import torch
from torch.nn.utils import clip_grad_norm_  # bound by name before any strategy exists

import torch_distribute as td
from torch_distribute.cluster.launcher import launch

WORKERS = os.path.join(os.path.dirname(__file__), "workers")
sys.path.insert(0, WORKERS)

from amp_reference import GLOBAL_BATCH, STRATEGIES, build, flat, make_data, step  # noqa: E402

CLIP = 0.05  # small enough that every step clips


def _reference() -> tuple[torch.Tensor, list[float]]:
    model, optimizer = build()
    norms = []
    for x, y in make_data(None):
        loss = ((model(x) - y) ** 2).mean()
        loss.backward()
        norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)))
        torch.nn.utils.clip_grad_value_(model.parameters(), CLIP / 4)
        optimizer.step()
        optimizer.zero_grad()
    return flat(model), norms


@pytest.mark.parametrize("name", list(STRATEGIES))
def test_clipping_without_a_scaler_matches_one_device(name):
    strategy = STRATEGIES[name]()
    with strategy.scope():
        model, optimizer = build()
    for batch in strategy.experimental_distribute_dataset(make_data(None)):
        strategy.run(step, args=(model, optimizer, None, batch, CLIP))
        for replica_model in strategy.experimental_local_results(model):
            torch.testing.assert_close(flat(replica_model), flat(model), rtol=0, atol=0)
    want, _ = _reference()
    torch.testing.assert_close(flat(model), want, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("name", ["mirrored2", "central2"])
def test_every_replica_gets_the_global_norm_from_a_name_bound_before_the_strategy(name):
    strategy = STRATEGIES[name]()
    with strategy.scope():
        model, optimizer = build()

    def replica_step(x, y):
        loss = td.compute_average_loss(((model(x) - y) ** 2).squeeze(1), global_batch_size=GLOBAL_BATCH)
        loss.backward()
        norm = clip_grad_norm_(model.parameters(), CLIP)
        torch.nn.utils.clip_grad_value_(model.parameters(), CLIP / 4)
        optimizer.step()
        optimizer.zero_grad()
        return norm

    norms = []
    for x, y in strategy.experimental_distribute_dataset(make_data(None)):
        per_replica = strategy.experimental_local_results(strategy.run(replica_step, args=(x, y)))
        assert len({float(n) for n in per_replica}) == 1
        norms.append(float(per_replica[0]))
    _, want = _reference()
    assert norms == pytest.approx(want, rel=1e-5)


def test_clipping_parameters_of_no_optimizer_in_scope_is_refused():
    strategy = td.MirroredStrategy(["cpu:0", "cpu:1"])
    with strategy.scope():
        model = torch.nn.Linear(8, 1)
    torch.optim.SGD(model.parameters(), lr=0.1)  # made outside the scope: sums nothing

    def replica_step(x):
        model(x).sum().backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)

    batch = next(iter(strategy.experimental_distribute_dataset([torch.ones(4, 8)])))
    with pytest.raises(td.UnmirroredStateError, match="clip_grad_norm_.*in no such optimizer"):
        strategy.run(replica_step, args=(batch,))


def test_clipping_outside_run_is_torchs_own():
    model, _ = build()
    model(torch.ones(2, 8)).sum().backward()
    grads = [p.grad.clone() for p in model.parameters()]
    norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 1e9)
    assert float(norm) == pytest.approx(float(torch.linalg.vector_norm(torch.cat([g.reshape(-1) for g in grads]))))


@pytest.mark.timeout(150)
@pytest.mark.parametrize("local_replicas", [1, 2])
def test_clipping_across_workers_matches_one_device(local_replicas):
    out, err = io.StringIO(), io.StringIO()
    argv = [os.path.join(WORKERS, "amp_scaler.py"), "--local-replicas", str(local_replicas),
            "--clip", str(CLIP), "--no-scaler"]
    code = launch(argv, nproc=2, timeout=120, grace_period=2, stdout=out, stderr=err,
                  extra_env={"PYTHONPATH": WORKERS + os.pathsep + os.environ.get("PYTHONPATH", "")})
    assert code == 0, err.getvalue()[-3000:]
    results = [json.loads(line.split("] ", 1)[1]) for line in out.getvalue().splitlines() if "{" in line]
    assert len(results) == 2 and results[0]["params"] == results[1]["params"]
    want, _ = _reference()
    torch.testing.assert_close(torch.tensor(results[0]["params"]), want, rtol=1e-5, atol=1e-6)
