"""torch.autocast and torch.amp.GradScaler, used as PyTorch documents them, inside strategy.run:
one scale, finiteness judged on the gradient summed over every replica and worker, clipping by
the global norm after unscale_."""

from __future__ import annotations

import io
import json
import os
import sys

import pytest
import torch

import torch_distribute as td
from torch_distribute.cluster.launcher import launch

WORKERS = os.path.join(os.path.dirname(__file__), "workers")
sys.path.insert(0, WORKERS)

from amp_reference import (  # noqa: E402
    GLOBAL_BATCH,
    INIT_SCALE,
    INJECT_STEP,
    STRATEGIES,
    build,
    flat,
    make_data,
    make_scaler,
    step,
)


def _train(strategy, inject_row=None, clip=None, autocast=False):
    with strategy.scope():
        model, optimizer = build()
    scaler = make_scaler()
    scales, unchanged = [], None

    def replica_step(batch):
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            return step(model, optimizer, scaler, batch, clip)

    for index, batch in enumerate(strategy.experimental_distribute_dataset(make_data(inject_row))):
        before = flat(model).clone()
        strategy.run(replica_step, args=(batch,))
        scales.append(scaler.get_scale())
        if index == INJECT_STEP:
            unchanged = torch.equal(before, flat(model))
        for replica_model in strategy.experimental_local_results(model):
            torch.testing.assert_close(flat(replica_model), flat(model), rtol=0, atol=0)
    return flat(model), scales, unchanged, scaler


def _reference(inject_row=None, clip=None):
    model, optimizer = build()
    scaler = make_scaler()
    scales = []
    for batch in make_data(inject_row):
        step(model, optimizer, scaler, batch, clip)
        scales.append(scaler.get_scale())
    return flat(model), scales


@pytest.mark.parametrize("name", list(STRATEGIES))
@pytest.mark.parametrize("clip", [None, 0.05])
def test_scaler_under_every_strategy_matches_one_device(name, clip):
    params, scales, _, _ = _train(STRATEGIES[name](), clip=clip)
    want_params, want_scales = _reference(clip=clip)
    torch.testing.assert_close(params, want_params, rtol=1e-5, atol=1e-6)
    assert scales == want_scales and max(scales) > INIT_SCALE  # it grew, once per step


@pytest.mark.parametrize("name", ["mirrored2", "mirrored3", "central2"])
@pytest.mark.parametrize("inject_row", [0, GLOBAL_BATCH - 1])
def test_an_inf_in_one_replica_skips_the_step_everywhere_and_halves_the_scale_once(name, inject_row):
    params, scales, unchanged, _ = _train(STRATEGIES[name](), inject_row=inject_row)
    want_params, want_scales = _reference(inject_row=inject_row)
    assert unchanged is True
    assert scales[INJECT_STEP] == scales[INJECT_STEP - 1] / 2
    assert scales == want_scales
    torch.testing.assert_close(params, want_params, rtol=1e-5, atol=1e-6)


def test_bf16_autocast_with_a_scaler_trains_under_mirrored():
    params, scales, _, _ = _train(STRATEGIES["mirrored2"](), autocast=True)
    one_params, one_scales, _, _ = _train(STRATEGIES["one"](), autocast=True)
    assert scales == one_scales
    # bfloat16 rounds differently on 8-row and 16-row matmuls: close, not equal.
    torch.testing.assert_close(params, one_params, rtol=0, atol=2e-2)


def test_scaler_state_round_trips_through_a_checkpoint_across_replica_counts(tmp_path):
    _, scales, _, scaler = _train(STRATEGIES["mirrored3"](), inject_row=0)
    path = td.Checkpoint(scaler=scaler).save(str(tmp_path / "ckpt"))
    restored = torch.amp.GradScaler("cpu")
    td.Checkpoint(scaler=restored).restore(path)
    assert restored.get_scale() == scales[-1] and restored.state_dict() == scaler.state_dict()


def _run_misuse(optimizer_in_scope: bool, misuse) -> None:
    """Run ``misuse(model, optimizer, scaler, x)`` once under two CPU replicas."""
    strategy = td.MirroredStrategy(["cpu:0", "cpu:1"])
    with strategy.scope():
        model = torch.nn.Linear(8, 1)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1) if optimizer_in_scope else None
    optimizer = optimizer or torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = make_scaler()
    batch = next(iter(strategy.experimental_distribute_dataset([torch.ones(4, 8)])))
    strategy.run(lambda x: misuse(model, optimizer, scaler, x), args=(batch,))


def test_a_scaler_stepping_an_optimizer_made_outside_the_scope_is_refused():
    def step_it(model, optimizer, scaler, x):
        scaler.scale(model(x).sum()).backward()
        scaler.step(optimizer)

    with pytest.raises(td.UnmirroredStateError, match="outside MirroredStrategy.scope"):
        _run_misuse(False, step_it)


def test_unscale_twice_in_one_step_is_a_clear_error():
    def unscale_twice(model, optimizer, scaler, x):
        scaler.scale(model(x).sum()).backward()
        scaler.unscale_(optimizer)
        scaler.unscale_(optimizer)

    with pytest.raises(td.InvalidArgumentError, match="unscale_.*at most once"):
        _run_misuse(True, unscale_twice)


@pytest.mark.timeout(150)
@pytest.mark.parametrize("local_replicas,clip", [(1, None), (2, 0.05)])
def test_an_inf_in_one_workers_rows_skips_the_step_on_every_worker(local_replicas, clip):
    out, err = io.StringIO(), io.StringIO()
    argv = [os.path.join(WORKERS, "amp_scaler.py"), "--local-replicas", str(local_replicas)]
    if clip is not None:
        argv += ["--clip", str(clip)]
    code = launch(argv, nproc=2, timeout=120, grace_period=2, stdout=out, stderr=err,
                  extra_env={"PYTHONPATH": WORKERS + os.pathsep + os.environ.get("PYTHONPATH", "")})
    assert code == 0, err.getvalue()[-3000:]
    results = [json.loads(line.split("] ", 1)[1]) for line in out.getvalue().splitlines() if "{" in line]
    assert len(results) == 2 and results[0] == results[1]
    want_params, want_scales = _reference(inject_row=GLOBAL_BATCH - 1, clip=clip)
    assert results[0]["unchanged"] is True
    assert results[0]["scales"] == want_scales
    assert want_scales[INJECT_STEP] == want_scales[INJECT_STEP - 1] / 2
    torch.testing.assert_close(torch.tensor(results[0]["params"]), want_params, rtol=1e-5, atol=1e-6)
