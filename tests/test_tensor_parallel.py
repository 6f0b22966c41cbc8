"""Tensor parallelism on a 2-D mesh, sharded initialization and their memory, with real
worker processes on loopback (Gloo, CPU).

Two jobs, each run once per module and checked for many properties:

- ``job``: 4 workers (``tests/multiworker/tp_job.py``): a small GPT trained on meshes
  (2, 2), (1, 4), (4, 1), with per-dimension layouts, sequence parallelism and torch's own
  plan; replicas, reductions, metrics and datasets on the mesh; ``fit``; bf16; a checkpoint
  written on (2, 2) restored on (4, 1) and (1, 4); transformers' Llama; workers that disagree
  on the layout or the mesh; and a model whose training state exceeds what a worker may hold;
- ``build_job``: 2 workers build a 1 GiB stack of ``nn.Linear`` (``build_memory_job.py``).

Everything is compared with one process training the same model on the same global batches
(``tp_model.py``). The rest runs here without processes: layouts refused at build time,
deferred initialization against eager construction, and the argument checks.
"""

from __future__ import annotations

import contextlib
import io
import json
import math
import os
import signal
import sys
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch import nn

import torch_distribute as td
from torch_distribute.cluster import SimpleClusterResolver
from torch_distribute.cluster.launcher import launch
from torch_distribute.strategies.deferred_init import defer, is_deferred, materialize, realized_by
from torch_distribute.strategies.mesh import check_all_matched, plan_for

sys.path.insert(0, str(Path(__file__).resolve().parent / "multiworker"))
import proc_helpers as P  # noqa: E402
import tp_model as M  # noqa: E402

pytestmark = [
    pytest.mark.skipif(not hasattr(os, "killpg"), reason="POSIX process groups"),
    pytest.mark.filterwarnings("ignore:FSDP2-wrapped module .* returned a view tensor"),
    pytest.mark.filterwarnings("ignore:.*redistribut.*"),
]

REPO = Path(__file__).resolve().parents[1]
JOB = str(REPO / "tests" / "multiworker" / "tp_job.py")
BUILD_JOB = str(REPO / "tests" / "multiworker" / "build_memory_job.py")
JOB_TIMEOUT_S = 60
LAUNCH_TIMEOUT_S = 240
TOLERANCE = 1e-5
GIB = 2 ** 30


def _launch(argv: list[str], nproc: int) -> str:
    out, err = io.StringIO(), io.StringIO()
    before = set(P.descendants(os.getpid()))
    try:
        code = launch(argv, nproc, env_mode="torchrun", grace_period=2, timeout=LAUNCH_TIMEOUT_S,
                      extra_env=P.WORKER_START_ENV, stdout=out, stderr=err)
    finally:
        for pid in set(P.descendants(os.getpid())) - before:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(pid, signal.SIGKILL)
            with contextlib.suppress(ChildProcessError, OSError):
                os.waitpid(pid, 0)
    assert code == 0, f"launcher exit {code}:\n{out.getvalue()[-4000:]}\n{err.getvalue()[-4000:]}"
    return out.getvalue()


@pytest.fixture(scope="module")
def job(tmp_path_factory):
    text = _launch([JOB, str(tmp_path_factory.mktemp("tp")), "--timeout", str(JOB_TIMEOUT_S)], 4)
    results = M.parse_results(text)
    assert sorted(results.get("total", {})) == [0, 1, 2, 3], f"missing workers:\n{text[-4000:]}"
    return results


def _section(job: dict, name: str) -> dict[int, dict]:
    """Every worker's value of one section (which must have run without an error)."""
    found = job[name]
    assert sorted(found) == [0, 1, 2, 3], f"{name}: workers {sorted(found)}"
    for rank, entry in found.items():
        assert "error" not in entry, f"worker {rank}, {name}: {entry['error']}"
    return {rank: entry["value"] for rank, entry in found.items()}


def _same_on_every_worker(values: dict[int, dict], key: str) -> torch.Tensor:
    """The chief's tensor ``key``; every other worker reported the digest of the same bytes."""
    import hashlib

    chief = values[0][key]
    digest = "sha256:" + hashlib.sha256(chief.encode()).hexdigest()
    for rank in (1, 2, 3):
        assert values[rank][key] == digest, f"worker {rank}'s {key} differs from the chief's"
    return M.decode(chief)


@pytest.fixture(scope="module")
def reference():
    return M.train(None)


# -- 1. training on each mesh equals one device ------------------------------------------------
@pytest.mark.timeout(300)
@pytest.mark.parametrize("name", ["train", "sequence", "torch_plan", "mesh14", "mesh41"])
def test_gpt_on_each_mesh_and_layout_equals_one_device(job, reference, name):
    """Initial values are one device's (bit for bit, never whole on a worker), and after 5
    AdamW steps the parameters and the per-step global losses are one device's (1e-5)."""
    values = _section(job, name)
    init = _same_on_every_worker(values, "init")
    assert torch.equal(init, reference["init"])
    params = _same_on_every_worker(values, "params")
    torch.testing.assert_close(params, reference["params"], rtol=0, atol=TOLERANCE)
    assert not torch.equal(reference["params"], reference["init"])
    for rank, value in values.items():
        assert value["losses"] == pytest.approx(reference["losses"], abs=TOLERANCE), rank
        data, model = {"mesh14": (1, 4), "mesh41": (4, 1)}.get(name, (2, 2))
        assert value["replicas"] == data and value["replica_id"] == rank // model


@pytest.mark.timeout(300)
def test_layouts_split_the_layers_and_each_worker_holds_a_quarter(job):
    values = _section(job, "train")
    placements = values[0]["placements"]
    # FSDP2 over the data axis and the layout over the model axis: 2-D placements.
    assert placements["blocks.0.attn.q.weight"] == "(_StridedShard(dim=0, sf=2), Shard(dim=0))"
    assert placements["blocks.0.attn.o.weight"] == "(Shard(dim=0), Shard(dim=1))"
    assert placements["blocks.1.mlp.down.weight"] == "(Shard(dim=0), Shard(dim=1))"
    assert placements["head.weight"] == "(_StridedShard(dim=0, sf=2), Shard(dim=0))"
    assert placements["blocks.0.ln1.weight"] == "(Shard(dim=0),)"  # not split: FSDP2 only
    sequence = _section(job, "sequence")[0]["placements"]
    assert sequence["blocks.0.ln1.weight"] == "(Shard(dim=0), Replicate())"  # SequenceParallel
    whole = values[0]["whole_numel"]
    held = [v["local_numel"] for v in values.values()]
    assert all(n < 0.3 * whole for n in held), (held, whole)


# -- 2. replicas, reductions, metrics and datasets -------------------------------------------------
@pytest.mark.timeout(300)
def test_a_replica_is_a_data_position_and_counts_once(job):
    """Workers 0-1 are replica 0 and read rows 0-1 of the global batch, workers 2-3 replica
    1 with rows 2-3; every reduction, gather, all-reduce and metric counts each replica once."""
    for rank, value in _section(job, "semantics").items():
        replica = rank // 2
        assert value["replicas"] == 2 and value["replica"] == replica and value["id"] == replica
        assert value["input_pipelines"] == [2, replica]
        assert value["rows"] == [2.0 * replica, 2.0 * replica + 1]
        assert value["sum"] == 6.0 and value["mean"] == 3.0 and value["mean_axis0"] == 1.5
        assert value["all_reduce"] == 6.0 and value["metric"] == 6.0
        assert value["gather"] == [0.0, 1.0] and value["gather_rows"] == [0.0, 1.0, 2.0, 3.0]


@pytest.mark.timeout(300)
def test_keras_fit_on_the_mesh_equals_one_process(job):
    want = M.keras_reference()
    values = _section(job, "keras")
    torch.testing.assert_close(_same_on_every_worker(values, "params"), want["params"], rtol=0, atol=TOLERANCE)
    for value in values.values():
        assert value["loss"] == pytest.approx(want["loss"], abs=TOLERANCE)


@pytest.mark.timeout(300)
def test_bf16_mixed_precision_on_the_mesh_tracks_float32(job, reference):
    values = _section(job, "bf16")
    assert values[0]["dtypes"] == ["torch.float32"]  # kept in float32, computed in bf16
    losses = values[0]["losses"]
    assert all(math.isfinite(v) for v in losses) and losses[-1] < losses[0]
    assert losses == pytest.approx(reference["losses"], abs=3e-2)
    torch.testing.assert_close(_same_on_every_worker(values, "params"), reference["params"], rtol=0, atol=5e-2)


# -- 3. checkpoints reshard between meshes ---------------------------------------------------------
@pytest.mark.timeout(300)
def test_checkpoint_from_2x2_restores_on_4x1_1x4_and_one_process(job, reference):
    """3 steps on (2, 2), saved; restored on (4, 1), on (1, 4) and here without a strategy,
    then 2 more steps: all end where 5 uninterrupted steps end. Each worker read only its
    shards of the parameters and of AdamW's state (which did not exist before the restore)."""
    want = reference
    values = _section(job, "checkpoint")
    whole = values[0]["whole_numel"]
    for shape in ("41", "14"):
        got = _same_on_every_worker({r: v[shape] for r, v in values.items()}, "params")
        torch.testing.assert_close(got, want["params"], rtol=0, atol=TOLERANCE)
        for rank, value in values.items():
            assert value[shape]["losses"] == pytest.approx(want["losses"][3:], abs=TOLERANCE)
            assert value[shape]["state_types"] == ["DTensor", "Tensor"]  # exp_avg sharded; step whole
            # Parameters, exp_avg and exp_avg_sq: 3 x whole if read whole; a share if not.
            share = 0.26 if shape == "41" else 0.32  # (1, 4) keeps norms and embeddings whole
            assert value[shape]["read_elements"] < share * 3 * whole, (shape, rank, value[shape]["read_elements"])
    model = M.GPT()
    optimizer = M.make_optimizer(model.parameters())
    td.Checkpoint(model=model, optimizer=optimizer).restore(values[0]["saved"]).assert_consumed()
    got = M.train(None, steps=2, model=model, optimizer=optimizer, first_step=3)
    torch.testing.assert_close(got["params"], want["params"], rtol=0, atol=TOLERANCE)


# -- 4. a transformer from a model library -----------------------------------------------------------
@pytest.mark.timeout(300)
def test_transformers_llama_with_a_layout_map_equals_one_process(job):
    pytest.importorskip("transformers")
    values = _section(job, "hf")
    want = M.train_llama(None)
    torch.testing.assert_close(_same_on_every_worker(values, "params"), want["params"], rtol=0, atol=TOLERANCE)
    for value in values.values():
        assert value["losses"] == pytest.approx(want["losses"], abs=TOLERANCE)
    placements = values[0]["placements"]
    assert placements["model.layers.0.self_attn.q_proj.weight"] == "(_StridedShard(dim=0, sf=2), Shard(dim=0))"
    assert placements["model.layers.0.mlp.down_proj.weight"] == "(Shard(dim=0), Shard(dim=1))"


# -- 5. workers that disagree ---------------------------------------------------------------------------
@pytest.mark.timeout(300)
def test_a_worker_with_another_layout_or_mesh_is_a_named_error(job):
    for rank, value in _section(job, "mismatch").items():
        assert value["layout"].startswith("ReplicaMismatchError"), (rank, value["layout"])
        assert "modules split over 'model'" in value["layout"]  # what each worker was about to do
        assert value["mesh"].startswith("ReplicaMismatchError"), (rank, value["mesh"])
        assert "mesh (1, 4)" in value["mesh"] and "mesh (2, 2)" in value["mesh"]


# -- 6. memory -------------------------------------------------------------------------------------------
@pytest.mark.timeout(300)
def test_training_state_larger_than_a_worker_may_hold_trains_on_four(job):
    """A 128 MiB stack of nn.Linear (512 MiB with gradients and Adam's two moments) trains a step on
    (2, 2) with each worker's address space limited to 0.6 x that; its resident memory grew
    by at most 0.6 x the whole training state."""
    for rank, value in _section(job, "memory").items():
        assert value["peak_growth_bytes"] <= 0.6 * value["state_bytes"], (rank, value)
        assert value["local_numel"] * 4 * 4 <= 0.3 * value["state_bytes"]


@pytest.fixture(scope="module")
def build_job():
    text = _launch([BUILD_JOB, "--timeout", str(JOB_TIMEOUT_S)], 2)
    found = {}
    for line in text.splitlines():
        if "BUILDRESULT " in line:
            payload = json.loads(line.split("BUILDRESULT ", 1)[1])
            found[payload["rank"]] = payload
    assert sorted(found) == [0, 1], text[-4000:]
    return found


@pytest.mark.timeout(300)
def test_building_a_1_gib_stack_on_two_workers_grows_each_by_at_most_0_6_gib(build_job):
    for rank, value in build_job.items():
        assert value["whole_bytes"] >= GIB and value["types"] == ["DTensor"]
        assert value["local_bytes"] <= 0.51 * value["whole_bytes"]
        assert value["peak_growth_bytes"] <= 0.6 * GIB, (rank, value)


# -- 7. layouts refused at build time (no processes) ----------------------------------------------------
def _layout_map(shape=(1, 2), **entries):
    layout_map = td.LayoutMap(td.DeviceMesh(shape, ("data", "model")))
    for key, layout in entries.items():
        layout_map[key] = layout
    return layout_map


def _plan(model, entries, shape=(1, 2)):
    """The plan for ``model`` of a layout map with ``entries`` (keys as given, not kwargs)."""
    layout_map = td.LayoutMap(td.DeviceMesh(shape, ("data", "model")))
    for key, layout in entries.items():
        layout_map[key] = layout
    plan = plan_for(model, layout_map, "data")
    check_all_matched(layout_map, plan.matched_keys, [model])
    return plan


class _Odd(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 6)
        self.fc2 = nn.Linear(4, 8)
        self.conv = nn.Conv1d(4, 4, 1)
        self.attn = nn.MultiheadAttention(4, 2)


@pytest.mark.parametrize("entries, match", [
    ({r"fc\.weight": ("model", None)}, "'fc.weight' has 6 elements along dimension 0, which the 'model' axis \\(4 workers\\)"),
    ({r"nothing\.here": ("model", None)}, "matches no parameter"),
    ({r"conv\.weight": ("model", None, None)}, r"conv \(Conv1d\) has split parameters.*only nn.Linear"),
    ({r"attn\.in_proj_weight": ("model", None)}, "fused in_proj_weight"),
    ({r"fc\.weight": ("model", "model")}, "splits 2 dimensions"),
    ({r"fc\.weight": ("data", None)}, "batch axis 'data'"),
    ({r"fc\.weight": ("model",)}, "has 1 dimensions but the parameter has 2"),
    ({r"fc2\.bias": ("model",)}, "splits its bias but not its weight"),
    ({r"fc2\.": ("model", None)}, "has 2 dimensions but the parameter has 1"),
    ({r"fc2\.weight": (None, "model"), r"fc2\.bias": ("model",)}, r"rowwise .*so its bias must be \(None,\)"),
    ({"fc2.output": ("data", None, "model"), r"fc2\.weight": ("model", None)}, "output is split along its features"),
    ({r"f.*weight": (None, "model"), r"fc\.weight": (None, "model")}, "matches the LayoutMap keys"),
    ({"fc2.output": ("data", "model", None), r"fc2\.weight": (None, "model")}, None),
    ({"nope.output": ("data", "model")}, "matches no module output"),
], ids=["indivisible", "unmatched", "conv", "mha", "both-dims", "batch-axis", "rank", "bias-only", "bias-rank",
        "bias-mismatch", "colwise-output", "two-keys", "ok-output", "unmatched-output"])
def test_impossible_layouts_are_named_errors(entries, match):
    if match is None:
        plan = _plan(_Odd(), entries, shape=(1, 4))
        assert type(plan.styles["fc2"]).__name__ == "RowwiseParallel"  # its output is the sequence split
        return
    with pytest.raises(td.LayoutError, match=match):
        _plan(_Odd(), entries, shape=(1, 4))


def test_torch_styles_are_accepted_as_is_and_checked():
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, SequenceParallel

    model = M.GPT()
    style = ColwiseParallel()
    plan = _plan(model, {"blocks.*.attn.q": style, "blocks.0.ln1": SequenceParallel()})
    assert plan.styles["blocks.0.attn.q"] is style and plan.styles["blocks.1.attn.q"] is style
    with pytest.raises(td.LayoutError, match="RowwiseParallel splits only nn.Linear and nn.Embedding"):
        _plan(model, {"blocks.0.ln1": RowwiseParallel()})
    with pytest.raises(td.LayoutError, match="matches no module"):
        _plan(model, {"blocks.*.attention.q": ColwiseParallel()})
    with pytest.raises(td.LayoutError, match="does not divide"):
        _plan(model, {"head": ColwiseParallel()}, shape=(1, 3))
    with pytest.raises(td.LayoutError, match="has a ColwiseParallel .* and a layout"):
        _plan(model, {"head": ColwiseParallel(), r"head\.weight": ("model", None)})


def test_megatron_pairs_keep_activations_split_between_them():
    from torch.distributed.tensor import Replicate, Shard

    plan = _plan(M.GPT(), M.layouts())
    q, o, head = plan.styles["blocks.0.attn.q"], plan.styles["blocks.0.attn.o"], plan.styles["head"]
    assert q.output_layouts == (Shard(-1),) and o.input_layouts == (Shard(-1),)  # heads stay split
    assert o.output_layouts == (Replicate(),) and head.output_layouts == (Replicate(),)  # whole logits
    sequence = _plan(M.GPT(), M.layouts("sequence"))
    assert sequence.styles["blocks.0.attn.q"].input_layouts == (Shard(1),)
    assert sequence.styles["blocks.0.attn.o"].output_layouts == (Shard(1),)
    assert type(sequence.styles["blocks.0.ln1"]).__name__ == "SequenceParallel"
    assert type(sequence.styles["embed"]).__name__ == "PrepareModuleOutput"


@pytest.mark.parametrize("make, match", [
    (lambda: td.DeviceMesh(4, ("data",)), "tuple of positive ints"),
    (lambda: td.DeviceMesh((2, 0), ("data", "model")), "tuple of positive ints"),
    (lambda: td.DeviceMesh((2, 2), ("data",)), "one name per axis"),
    (lambda: td.DeviceMesh((2, 2), ("data", "data")), "distinct"),
    (lambda: _layout_map(**{"w": ("tensor", None)}), "names the axis 'tensor'"),
    (lambda: _layout_map(**{"w": "model"}), "one mesh axis name"),
    (lambda: _layout_map(**{"w(": ("model",)}), "not a regular expression"),
    (lambda: td.LayoutMap((2, 2)), "needs a td.DeviceMesh"),
], ids=["int-shape", "zero", "names", "duplicate", "axis", "str-layout", "regex", "no-mesh"])
def test_bad_meshes_and_layout_maps_are_named_errors(make, match):
    with pytest.raises(td.LayoutError, match=match):
        make()


def _two_worker_resolver() -> SimpleClusterResolver:
    from torch_distribute.cluster.launcher import free_ports

    return SimpleClusterResolver({"worker": [f"127.0.0.1:{free_ports(1)[0]}", "127.0.0.1:1"]}, "worker", 0)


@pytest.mark.parametrize("kwargs, error, match", [
    ({"mesh": td.DeviceMesh((2, 2), ("data", "model"))}, td.LayoutError, "holds 4 workers but the job has 2"),
    ({"mesh": td.DeviceMesh((1, 2), ("data", "model")), "batch_dim_name": "batch"}, td.LayoutError, "not an axis"),
    ({"layout_map": {"w": ("model", None)}}, td.LayoutError, "needs mesh="),
    ({"mesh": td.DeviceMesh((1, 2), ("data", "model")), "mesh_shape": (1, 2)}, td.InvalidArgumentError, "not both"),
    ({"mesh": (1, 2)}, td.LayoutError, "must be a td.DeviceMesh"),
    ({"layout_map": _layout_map((2, 1)), "mesh": td.DeviceMesh((1, 2), ("data", "model"))}, td.LayoutError, "differs"),
], ids=["size", "batch-axis", "dict-no-mesh", "both", "tuple-mesh", "two-meshes"])
def test_bad_strategy_mesh_arguments_fail_before_any_rendezvous(kwargs, error, match):
    started = time.monotonic()
    with pytest.raises(error, match=match):
        td.FullyShardedStrategy(cluster_resolver=_two_worker_resolver(), **kwargs)
    assert time.monotonic() - started < 5 and not dist.is_initialized()


@contextlib.contextmanager
def _one_worker(**kwargs):
    strategy = td.FullyShardedStrategy(cluster_resolver=SimpleClusterResolver({}), **kwargs)
    try:
        yield strategy
    finally:
        strategy.extended.worker_group.close()


@pytest.mark.timeout(60)
def test_a_refused_layout_leaves_the_model_as_it_was():
    with _one_worker(layout_map=_layout_map((1, 1), **{r"fc\.weight": ("model", None), "nope": ("model",)})) as strategy:
        with pytest.raises(td.LayoutError, match="'nope' matches no parameter"):
            with strategy.scope():
                model = _Odd()
                torch.optim.SGD(model.parameters(), lr=0.1)
        assert all(is_deferred(p) for p in model.parameters())  # untouched, still to be sharded
        assert not any(type(m).__name__.startswith("FSDP") for m in model.modules())


# -- 8. sharded initialization: the values one device builds ---------------------------------------------
class _Custom(nn.Module):
    """Initialization as libraries write it: nn.init on views and .data, values given
    directly, a buffer, a rejection sampler (trunc_normal_ reads its values), a source tensor
    changed after it was added in."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(10, 8, padding_idx=2)
        self.fc = nn.Linear(8, 8)
        self.given = nn.Parameter(torch.randn(4, 4))
        self.truncated = nn.Parameter(torch.empty(6, 6))
        nn.init.trunc_normal_(self.truncated, std=0.02)
        self.orthogonal = nn.Parameter(torch.empty(5, 3))
        nn.init.orthogonal_(self.orthogonal)
        self.register_buffer("positions", torch.arange(5.0))
        self.fc.weight.data.normal_(0.0, 0.02)
        self.fc.bias.data.zero_()
        source = torch.full((8,), 0.5)  # a source changed after it was copied in
        self.fc.bias.data.add_(source)
        source.zero_()


@pytest.mark.parametrize("build", [
    lambda: nn.TransformerEncoderLayer(16, 4, 32, batch_first=True),
    lambda: nn.Sequential(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4), nn.LSTM(4, 5)),
    _Custom, M.GPT,
], ids=["transformer-layer", "conv-bn-lstm", "custom", "gpt"])
def test_deferred_tensors_replay_to_what_eager_construction_gives(build):
    from torch.nn.modules import module as torch_module

    def capture(_module, _name, tensor):
        if tensor is None or is_deferred(tensor):
            return None
        deferred = defer(tensor)
        return nn.Parameter(deferred, tensor.requires_grad) if isinstance(tensor, nn.Parameter) else deferred

    torch.manual_seed(5)
    eager = build()
    eager_next = torch.rand(3)
    hooks = [torch_module.register_module_parameter_registration_hook(capture),
             torch_module.register_module_buffer_registration_hook(capture)]
    try:
        torch.manual_seed(5)
        deferred = build()
    finally:
        for hook in hooks:
            hook.remove()
    assert torch.equal(torch.rand(3), eager_next)  # the generator moved on exactly as eagerly
    want = dict([*eager.named_parameters(), *eager.named_buffers()])
    got = dict([*deferred.named_parameters(), *deferred.named_buffers()])
    assert sorted(want) == sorted(got)
    for name, tensor in got.items():
        assert is_deferred(tensor), name
        assert torch.equal(materialize(tensor), want[name].detach()), name
    early = {name for name, tensor in got.items() if realized_by(tensor)}
    assert early <= {"truncated"}  # only the rejection sampler had to read its values


@pytest.mark.timeout(60)
def test_model_built_on_the_meta_device_needs_init_weights():
    class Titan(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.fc = nn.Linear(4, 4)

        def forward(self, x):
            return self.fc(x)

        def init_weights(self):
            with torch.no_grad():
                for p in self.parameters():
                    p.fill_(0.5)

    with _one_worker() as strategy:
        with strategy.scope(), torch.device("meta"):
            model = Titan()
        assert {type(p).__name__ for p in model.parameters()} == {"DTensor"}
        assert all(float(p.detach().full_tensor().min()) == 0.5 for p in model.parameters())
    with _one_worker() as strategy:
        with pytest.raises(td.InvalidArgumentError, match="meta device.*init_weights"):
            with strategy.scope(), torch.device("meta"):
                model = nn.Linear(4, 4)  # noqa: F841 - held: a module gone is never sharded


# -- 9. a compiled step on the mesh -------------------------------------------------------------------
@pytest.mark.slow
@pytest.mark.timeout(400)
def test_td_function_step_with_a_layout_equals_eager():
    """A Megatron MLP pair split by a layout map on a one-worker (1, 1) mesh (DTensors in the
    graph) trained by a ``td.function`` step: one process's values, no recompilation per step."""
    def build():
        return nn.Sequential(nn.Linear(8, 16), nn.GELU(), nn.Linear(16, 4))

    data = [(torch.randn(4, 8, generator=torch.Generator().manual_seed(s)), torch.randn(4, 4)) for s in range(3)]
    torch.manual_seed(0)
    eager = build()
    eager_optimizer = torch.optim.AdamW(eager.parameters(), lr=1e-2, eps=1e-4)
    for x, y in data:
        (eager(x) - y).square().sum(1).mean().backward()
        eager_optimizer.step()
        eager_optimizer.zero_grad()
    torch._dynamo.reset()
    layout_map = _layout_map((1, 1), **{r"^0\.weight": ("model", None), r"^2\.weight": (None, "model")})
    try:
        with _one_worker(layout_map=layout_map) as strategy:
            torch.manual_seed(0)
            with strategy.scope():
                model = build()
                optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, eps=1e-4)
            assert strategy.extended.tensor_parallel_plan(model) is not None

            def replica_step(x, y):
                loss = td.compute_average_loss((model(x) - y).square().sum(1), global_batch_size=4)
                loss.backward()
                optimizer.step()
                optimizer.zero_grad()
                return loss

            @td.function
            def step(x, y):
                return strategy.reduce("sum", strategy.run(replica_step, args=(x, y)), axis=None)

            for x, y in data:
                step(x, y)
            traced = step.experimental_get_tracing_count()
            got = torch.cat([p.detach().full_tensor().reshape(-1) for p in model.parameters()])
    finally:
        torch._dynamo.reset()
    want = torch.cat([p.detach().reshape(-1) for p in eager.parameters()])
    torch.testing.assert_close(got, want, rtol=0, atol=TOLERANCE)
    assert 1 <= traced <= 12  # the step's graphs, traced once (not once per step)


# -- 10. the example ------------------------------------------------------------------------------------
@pytest.mark.timeout(200)
def test_the_example_trains_on_two_workers_with_sequence_parallelism():
    text = _launch([str(REPO / "examples" / "gpt_tensor_parallel.py"), "--mesh", "1,2", "--sequence-parallel",
                    "--steps", "12", "--layers", "1", "--width", "64", "--seq-len", "16",
                    "--global-batch-size", "4", "--lr", "3e-3", "--val-batches", "1", "--log-every", "6"], 2)
    results = P.parse_results(text, "GPTRESULT ")
    assert sorted(results) == [0, 1], text[-4000:]
    for result in results.values():
        assert result["mesh"] == [1, 2] and result["steps"] == 12
        assert result["last_loss"] < result["first_loss"]
        assert result["local_bytes"] < 0.8 * result["whole_bytes"]
        assert result["last_loss"] == results[0]["last_loss"]
