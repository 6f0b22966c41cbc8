"""A ``LayoutMap`` turned into torch's ``parallelize_module`` plan for one model, with every
layout that cannot work refused before anything is split.

Parameter layouts become styles per module (Megatron's pairs, as torchtitan writes them):

- ``nn.Linear``: weight ``(axis, None)`` (output features split): ``ColwiseParallel``;
  ``(None, axis)`` (input features split): ``RowwiseParallel``. Its bias, if the map names
  it, is split like the output (``(axis,)``) of a colwise layer and whole (``(None,)``) for
  a rowwise one; left out, it follows the weight.
- ``nn.Embedding``: weight ``(None, axis)`` (embedding dims split): colwise;
  ``(axis, None)`` (vocabulary split): rowwise.

Activations between them: a colwise layer whose parent module also holds a rowwise layer
keeps its output split (the attention heads, the MLP's hidden units) for that rowwise layer,
which takes it split; any other colwise layer gathers its output whole, any other rowwise
layer takes a whole input. Output layouts that split the sequence (sequence parallelism)
make norms and dropouts run on their sequence shard (``SequenceParallel``), other modules
hand their output on split (``PrepareModuleOutput``), every colwise layer gather the
sequence first and every rowwise layer scatter its sum back over it (torchtitan's recipe).

Refused with ``LayoutError``: a pattern that matches nothing, a parameter that several
patterns match, a layout with the wrong number of dimensions, an axis that is not the model
axis, a split dimension the axis does not divide, both dimensions split, a module that no
tensor-parallel style splits (``nn.MultiheadAttention``'s fused projection, a convolution),
and torch styles on modules they do not support.

>>> import torch
>>> from torch_distribute.strategies.mesh.device_mesh import DeviceMesh
>>> from torch_distribute.strategies.mesh.layout_map import LayoutMap
>>> model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 4))
>>> layout_map = LayoutMap(DeviceMesh((1, 2), ("data", "model")))
>>> layout_map[r"0\\.weight"] = ("model", None)
>>> layout_map[r"2\\.weight"] = (None, "model")
>>> plan = plan_for(model, layout_map, "data")
>>> {name: type(style).__name__ for name, style in plan.styles.items()}
{'0': 'ColwiseParallel', '2': 'RowwiseParallel'}
"""

from __future__ import annotations

import fnmatch
import hashlib
import re
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

from torch import nn

from torch_distribute.errors import LayoutError
from torch_distribute.strategies.mesh.layout_map import OUTPUT_SUFFIX, LayoutMap, is_parallel_style

__all__ = ["TensorParallelPlan", "check_all_matched", "plan_for"]

_SPLITTABLE = (nn.Linear, nn.Embedding)
_SEQUENCE_LOCAL = (nn.LayerNorm, nn.Dropout, *((nn.RMSNorm,) if hasattr(nn, "RMSNorm") else ()))


@dataclass
class TensorParallelPlan:
    """What ``parallelize_module`` gets: a style for each module path (no patterns left)."""

    axis: str | None
    axis_size: int
    styles: dict[str, Any] = field(default_factory=dict)
    split_parameters: dict[str, tuple[str | None, ...]] = field(default_factory=dict)
    matched_keys: set[str] = field(default_factory=set)

    @property
    def is_empty(self) -> bool:
        return not self.styles

    def describe(self) -> str:
        """The plan in a few words and a digest of all of it: equal on every worker that
        made the same plan, short enough to read in a mismatch error."""
        if not self.styles:
            return "no tensor parallelism"
        whole = ";".join(f"{path}={style!r}" for path, style in sorted(self.styles.items()))
        kinds = Counter(type(style).__name__ for style in self.styles.values())
        counted = ", ".join(f"{n} {kind}" for kind, n in sorted(kinds.items()))
        digest = hashlib.sha256(whole.encode()).hexdigest()[:12]
        return f"{len(self.styles)} modules split over {self.axis!r} x{self.axis_size} ({counted}; plan {digest})"

    def apply(self, root: nn.Module, axis_mesh: Any) -> None:
        """Split ``root``'s modules over ``axis_mesh`` (torch's 1-D mesh of the model axis).

        Each worker cuts its own part of what it holds (``src_data_rank=None``): the values
        are the same on every worker, or not there yet (the meta device).
        """
        from torch.distributed.tensor.parallel import parallelize_module

        if self.styles:
            parallelize_module(root, axis_mesh, dict(self.styles), src_data_rank=None)


def plan_for(root: nn.Module, layout_map: LayoutMap | None, batch_axis: str) -> TensorParallelPlan:
    """The plan ``layout_map`` gives for ``root`` (see the module docstring)."""
    if layout_map is None or not len(layout_map):
        return TensorParallelPlan(None, 1)
    mesh = layout_map.device_mesh
    model_axes = [name for name in mesh.axis_names if name != batch_axis]
    if len(model_axes) != 1:
        raise LayoutError(
            f"Tensor parallelism splits over one model axis besides the batch axis {batch_axis!r}; "
            f"the mesh has axes {mesh.axis_names}. Use a (data, model) mesh.")
    axis = model_axes[0]
    plan = TensorParallelPlan(axis, mesh.axis_size(axis))
    modules = dict(root.named_modules())
    parameters = dict(root.named_parameters())
    parameter_keys = [k for k, v in layout_map.items() if not is_parallel_style(v) and not k.endswith(OUTPUT_SUFFIX)]
    output_keys = [k for k, v in layout_map.items() if not is_parallel_style(v) and k.endswith(OUTPUT_SUFFIX)]
    style_keys = [k for k, v in layout_map.items() if is_parallel_style(v)]

    layouts = _parameter_layouts(parameters, layout_map, parameter_keys, axis, batch_axis, plan.axis_size,
                                 plan.matched_keys)
    plan.split_parameters = {p: layout for p, layout in layouts.items() if any(a is not None for a in layout)}
    roles = _roles(modules, layouts, axis)
    sequence_dim, outputs = _output_layouts(modules, layout_map, output_keys, axis, batch_axis, plan.matched_keys)
    for path, (role, module) in roles.items():
        plan.styles[path] = _style(role, module, path, roles, sequence_dim)
    for path, dim in outputs.items():
        if path in roles:
            if roles[path][0] == "colwise":
                raise LayoutError(
                    f"{path!r} is split colwise, so its output is split along its features; give the "
                    "sequence-split output layout to a module after it (a norm, the block).")
            continue  # a rowwise layer already hands its output on split along the sequence
        plan.styles[path] = _sequence_style(modules[path], dim)
    for key in style_keys:
        style = layout_map[key]
        paths = _module_paths(modules, key)
        if paths:
            plan.matched_keys.add(key)
        for path in paths:
            if path in plan.styles:
                raise LayoutError(
                    f"Module {path!r} has a {type(style).__name__} from {key!r} and a layout from "
                    "other LayoutMap entries; give it one.")
            _check_style(style, modules[path], path, plan.axis_size)
            plan.styles[path] = style
    return plan


def check_all_matched(layout_map: LayoutMap | None, matched: set[str], roots: list[nn.Module]) -> None:
    """Raise ``LayoutError`` for a key of ``layout_map`` that matched nothing in ``roots`` (nor
    in any model ``matched`` was gathered from)."""
    if layout_map is None:
        return
    unmatched = [key for key in layout_map if key not in matched]
    if not unmatched:
        return
    key = unmatched[0]
    value = layout_map[key]
    names: dict[str, Any]
    if is_parallel_style(value) or key.endswith(OUTPUT_SUFFIX):
        names = {name: None for root in roots for name, _ in root.named_modules() if name}
        what = "module" if is_parallel_style(value) else f"module output (module path + {OUTPUT_SUFFIX!r})"
    else:
        names = {name: None for root in roots for name, _ in root.named_parameters()}
        what = "parameter"
    raise LayoutError(
        f"The LayoutMap key {key!r} matches no {what} of {', '.join(type(r).__name__ for r in roots)}; "
        f"they are named like {_examples(names)}. Fix the pattern or remove it"
        + (f" (also unmatched: {unmatched[1:]})." if len(unmatched) > 1 else "."))


def _parameter_layouts(parameters: dict[str, nn.Parameter], layout_map: LayoutMap, keys: list[str], axis: str,
                       batch_axis: str, axis_size: int, matched_keys: set[str]) -> dict[str, tuple[str | None, ...]]:
    layouts: dict[str, tuple[str | None, ...]] = {}
    owner: dict[str, str] = {}
    for key in keys:
        matched = [path for path in parameters if re.search(key, path)]
        if matched:
            matched_keys.add(key)
        layout = tuple(layout_map[key])  # the key itself: its own entry
        for path in matched:
            if path in owner:
                raise LayoutError(
                    f"Parameter {path!r} matches the LayoutMap keys {owner[path]!r} and {key!r}; "
                    "make the patterns exclusive.")
            owner[path] = key
            _check_layout(path, tuple(parameters[path].shape), layout, axis, batch_axis, axis_size)
            layouts[path] = layout
    return layouts


def _check_layout(path: str, shape: tuple[int, ...], layout: tuple[str | None, ...], axis: str,
                  batch_axis: str, axis_size: int) -> None:
    if len(layout) != len(shape):
        raise LayoutError(
            f"The layout {layout} for {path!r} has {len(layout)} dimensions but the parameter has "
            f"{len(shape)} (shape {shape}).")
    if batch_axis in layout:
        raise LayoutError(
            f"The layout {layout} for {path!r} splits it over the batch axis {batch_axis!r}: "
            "FullyShardedStrategy already shards every parameter over that axis; name the model axis.")
    split = [d for d, a in enumerate(layout) if a is not None]
    if len(split) > 1:
        raise LayoutError(f"The layout {layout} for {path!r} splits {len(split)} dimensions; split at most one.")
    for d in split:
        if shape[d] % axis_size:
            raise LayoutError(
                f"{path!r} has {shape[d]} elements along dimension {d}, which the {axis!r} axis "
                f"({axis_size} workers) does not divide; pick sizes that are multiples of {axis_size}.")


def _roles(modules: dict[str, nn.Module], layouts: dict[str, tuple[str | None, ...]],
           axis: str) -> dict[str, tuple[str, nn.Module]]:
    """``{module path: ("colwise" | "rowwise", module)}`` from the parameter layouts."""
    by_module: dict[str, dict[str, tuple[str | None, ...]]] = {}
    for path, layout in layouts.items():
        module_path, _, name = path.rpartition(".")
        by_module.setdefault(module_path, {})[name] = layout
    roles: dict[str, tuple[str, nn.Module]] = {}
    for module_path, named in by_module.items():
        module = modules[module_path]
        if not any(a is not None for layout in named.values() for a in layout):
            continue  # everything whole: nothing to split
        where = f"{module_path or '(the root)'} ({type(module).__name__})"
        if not isinstance(module, _SPLITTABLE):
            hint = (" Its fused in_proj_weight mixes the query, key and value heads: build attention "
                    "from separate q/k/v nn.Linear layers to split it."
                    if isinstance(module, nn.MultiheadAttention) else "")
            raise LayoutError(
                f"{where} has split parameters {sorted(named)}, but layouts split only nn.Linear and "
                f"nn.Embedding.{hint} Give the module a torch ParallelStyle in the LayoutMap, or leave it whole.")
        weight = named.get("weight")
        if weight is None:
            raise LayoutError(f"{where}: the LayoutMap splits its bias but not its weight; give the weight a layout.")
        output_split = weight[0] is not None
        if isinstance(module, nn.Linear):
            role = "colwise" if output_split else "rowwise"
        else:  # nn.Embedding: (vocabulary, embedding dims)
            role = "rowwise" if output_split else "colwise"
        bias = named.get("bias")
        if bias is not None and isinstance(module, nn.Linear):
            want = (axis,) if role == "colwise" else (None,)
            if tuple(bias) != want:
                raise LayoutError(
                    f"{where} is split {role} (weight {weight}), so its bias must be {want}, not {bias}.")
        roles[module_path] = (role, module)
    return roles


def _output_layouts(modules: dict[str, nn.Module], layout_map: LayoutMap, keys: list[str], axis: str,
                    batch_axis: str, matched_keys: set[str]) -> tuple[int | None, dict[str, int]]:
    """The sequence dimension split by output layouts (None: none is), and the modules whose
    output is split along it."""
    outputs: dict[str, int] = {}
    for key in keys:
        layout = tuple(layout_map[key])
        matched = [path for path in modules if path and re.search(key, path + OUTPUT_SUFFIX)]
        if matched:
            matched_keys.add(key)
        split = [d for d, a in enumerate(layout) if a == axis]
        if any(a not in (None, axis, batch_axis) for a in layout) or (batch_axis in layout[1:]):
            raise LayoutError(
                f"The output layout {layout} for {key!r}: the batch axis {batch_axis!r} may only split "
                f"dimension 0, the model axis {axis!r} one other dimension.")
        if len(split) > 1 or split == [0]:
            raise LayoutError(f"The output layout {layout} for {key!r} must split one non-batch dimension.")
        for path in matched:
            if split:
                outputs[path] = split[0]
    dims = set(outputs.values())
    if len(dims) > 1:
        raise LayoutError(f"Output layouts split different dimensions {sorted(dims)}; split the sequence alike everywhere.")
    return (dims.pop() if dims else None), outputs


def _style(role: str, module: nn.Module, path: str, roles: dict[str, tuple[str, nn.Module]],
           sequence_dim: int | None) -> Any:
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    parent = path.rpartition(".")[0]
    siblings = {r for p, (r, _) in roles.items() if p.rpartition(".")[0] == parent and p != path}
    sequence = Shard(sequence_dim) if sequence_dim is not None else None
    embedding = isinstance(module, nn.Embedding)
    if role == "colwise":
        keeps_split = "rowwise" in siblings and not embedding
        return ColwiseParallel(
            input_layouts=Replicate() if embedding or sequence is None else sequence,
            output_layouts=Shard(-1) if keeps_split else Replicate())
    takes_split = "colwise" in siblings and not embedding
    return RowwiseParallel(
        input_layouts=Shard(-1) if takes_split else Replicate(),
        output_layouts=sequence or Replicate())


def _sequence_style(module: nn.Module, dim: int) -> Any:
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import PrepareModuleOutput, SequenceParallel

    if isinstance(module, _SEQUENCE_LOCAL) or type(module).__name__.endswith("Norm"):
        return SequenceParallel(sequence_dim=dim)
    return PrepareModuleOutput(output_layouts=Replicate(), desired_output_layouts=Shard(dim))


def _check_style(style: Any, module: nn.Module, path: str, axis_size: int) -> None:
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    if not isinstance(style, (ColwiseParallel, RowwiseParallel)):
        return
    name = type(style).__name__
    if not isinstance(module, _SPLITTABLE):
        raise LayoutError(
            f"{name} splits only nn.Linear and nn.Embedding, but {path!r} is a {type(module).__name__}.")
    weight = module.weight
    colwise = isinstance(style, ColwiseParallel)
    dim = (0 if colwise else 1) if isinstance(module, nn.Linear) else (1 if colwise else 0)
    if weight.shape[dim] % axis_size:
        raise LayoutError(
            f"{name} on {path!r} splits its weight {tuple(weight.shape)} along dimension {dim}, which the "
            f"model axis ({axis_size} workers) does not divide.")


def _module_paths(modules: dict[str, nn.Module], pattern: str) -> list[str]:
    """Module paths matching a ``parallelize_module`` key (``*`` matches one name)."""
    if pattern == "":
        return [""]
    parts = pattern.split(".")
    return [path for path in modules if path and len(path.split(".")) == len(parts)
            and all(fnmatch.fnmatchcase(name, part) for name, part in zip(path.split("."), parts, strict=True))]


def _examples(named: dict[str, Any]) -> str:
    names = [n for n in named if n][:4]
    return ", ".join(repr(n) for n in names) + (", ..." if len(named) > 4 else "")
