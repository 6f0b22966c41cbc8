"""Parameters whose initial values are recorded while a model is built, and computed later,
one tensor at a time, where the strategy shards them.

Under ``FullyShardedStrategy.scope()`` every parameter and buffer a module registers becomes
a ``DeferredTensor``: a tensor with its shape, dtype and device but no memory. What the
module's constructor then does to it (``reset_parameters``, ``nn.init.*``, a model's own
``_init_weights``: ``uniform_``, ``normal_``, ``fill_``, ``mul_``, ``copy_``, writes into
views such as ``weight[padding_idx].fill_(0)``) is recorded with, for each random draw, the
state of the generator it drew from. Each draw is made once on a scratch tensor of the
same size, freed at once, so the generator advances exactly as it would have, and
everything drawn afterwards (the next layer, dropout, shuffling) matches one device.

``materialize(tensor)`` replays the writes on a new whole tensor, restoring each draw's
generator state first: the values one device would have built, bit for bit. The strategy
does that for one tensor at a time, keeps this worker's shard and drops the rest, so no
worker ever holds the whole model.

What cannot be recorded is computed on the spot (``realize``): an operation that reads a
deferred tensor's values (``w.sum()``, a forward pass before the model is sharded, a copy
from one parameter into another) makes that tensor whole at once, with its exact values; it
then costs its whole size until the strategy shards it. A tensor registered with values
already in it (``nn.Parameter(torch.randn(8))``) keeps them until its first complete
overwrite. A tensor registered on the meta device has no values to record
(``has_values(t)`` is False): its module must initialize it after sharding.

>>> import torch
>>> torch.manual_seed(0)  # doctest: +ELLIPSIS
<torch._C.Generator object at ...>
>>> eager = torch.nn.Linear(3, 2).weight.detach()
>>> torch.manual_seed(0)  # doctest: +ELLIPSIS
<torch._C.Generator object at ...>
>>> weight = defer(torch.empty(2, 3))
>>> _ = torch.nn.init.kaiming_uniform_(weight, a=5 ** 0.5)
>>> type(weight).__name__, torch.equal(materialize(weight), eager)
('DeferredTensor', True)
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, TypeGuard

import torch
from torch.utils._pytree import tree_flatten, tree_map

from torch_distribute import log
from torch_distribute.errors import InvalidArgumentError

__all__ = [
    "DeferredTensor",
    "RandomDraw",
    "defer",
    "has_values",
    "is_deferred",
    "materialize",
    "random_draws",
    "realized_by",
    "release_buffers",
]

_log = log.get_logger("deferred_init")

aten = torch.ops.aten

# In-place operations that overwrite every element of their target without reading it:
# whatever was written before is dead (only its generator draws mattered, and those were
# made when it was recorded).
_OVERWRITES = frozenset({
    aten.fill_, aten.zero_, aten.uniform_, aten.normal_, aten.random_, aten.bernoulli_,
    aten.exponential_, aten.geometric_, aten.cauchy_, aten.log_normal_, aten.copy_,
})

# Operations that read only a tensor's shape, dtype and device, never its values.
_METADATA_ONLY = frozenset({
    aten.new_empty, aten.new_empty_strided, aten.new_zeros, aten.new_ones, aten.new_full,
    aten.empty_like, aten.zeros_like, aten.ones_like, aten.full_like, aten.rand_like,
    aten.randn_like, aten.randint_like, aten.is_same_size, aten.is_nonzero,
})


@dataclass
class RandomDraw:
    """The state of the generator one recorded write drew from, just before it drew."""

    device: torch.device
    state: torch.Tensor  # uint8, as ``Generator.get_state()`` gives it
    explicit: bool  # the write was given its own generator (``generator=``)


@dataclass
class _Write:
    views: tuple[Any, ...]  # how the written tensor is reached from the whole one
    func: Any
    args: tuple[Any, ...]  # without the target (args[0])
    kwargs: dict[str, Any]
    draw: RandomDraw | None

    def apply(self, whole: torch.Tensor) -> None:
        target = _apply_views(whole, self.views)
        kwargs = dict(self.kwargs)
        if self.draw is None:
            self.func(target, *self.args, **kwargs)
            return
        if self.draw.explicit:
            generator = torch.Generator(self.draw.device)
            generator.set_state(self.draw.state)
            kwargs["generator"] = generator
            self.func(target, *self.args, **kwargs)
            return
        with _generator_state(self.draw.device, self.draw.state):
            self.func(target, *self.args, **kwargs)


@dataclass
class _Storage:
    """One deferred tensor's storage: what it is, and what was written into it."""

    size: tuple[int, ...]
    stride: tuple[int, ...]
    dtype: torch.dtype
    device: torch.device
    initial: torch.Tensor | None  # values it was registered with (None: none that matter)
    has_values: bool  # False: registered on the meta device, nothing to replay
    writes: list[_Write] = field(default_factory=list)
    realized: torch.Tensor | None = None  # whole, once something read its values
    realized_by: str | None = None

    def meta(self) -> torch.Tensor:
        return torch.empty_strided(self.size, self.stride, dtype=self.dtype, device="meta")

    def replay(self, reuse: bool = False) -> torch.Tensor:
        if self.realized is not None:
            return self.realized
        if reuse:
            whole = _shared_buffer("whole", self.size, self.stride, self.dtype, self.device)
        else:
            whole = torch.empty_strided(self.size, self.stride, dtype=self.dtype, device=self.device)
        with torch.no_grad():
            if self.initial is not None:
                whole.copy_(self.initial)
            for write in self.writes:
                write.apply(whole)
        return whole


class DeferredTensor(torch.Tensor):
    """A tensor whose values are recorded, not computed, until the strategy shards it (see
    the module docstring). It reports its real device, shape and dtype.

    ``deferred_storage``: the whole tensor's record, shared by its views; ``deferred_views``:
    how this one is reached from it; ``deferred_meta``: a meta tensor of this one's shape
    (for shape checks). This module's own; read through the functions below.
    """

    deferred_storage: _Storage
    deferred_views: tuple[Any, ...]
    deferred_meta: torch.Tensor

    @staticmethod
    def __new__(cls, storage: _Storage, views: tuple[Any, ...], meta: torch.Tensor,
                requires_grad: bool = False) -> DeferredTensor:
        tensor = torch.Tensor._make_wrapper_subclass(
            cls, meta.size(), strides=meta.stride(), storage_offset=meta.storage_offset(),
            dtype=meta.dtype, device=storage.device, requires_grad=requires_grad)
        tensor.deferred_storage = storage
        tensor.deferred_views = views
        tensor.deferred_meta = meta
        return tensor

    def __repr__(self, *, tensor_contents: Any = None) -> str:  # type: ignore[override]
        if self.deferred_storage.realized is not None:
            return f"DeferredTensor({self.real_view()!r})"
        return (f"DeferredTensor(size={tuple(self.shape)}, dtype={self.dtype}, device={self.device}: "
                "values computed where the strategy shards it)")

    def __reduce_ex__(self, protocol: Any) -> Any:
        return (_rebuild_real, (self.real_copy(),))

    def real_view(self) -> torch.Tensor:
        """This view of the storage, made whole now if it was not yet (``realize``)."""
        if self.deferred_storage.realized is None:
            _realize(self.deferred_storage, "reading it")
        assert self.deferred_storage.realized is not None
        return _apply_views(self.deferred_storage.realized, self.deferred_views)

    def real_copy(self) -> torch.Tensor:
        """A copy of ``real_view()``."""
        return self.real_view().detach().clone()

    @classmethod
    def __torch_dispatch__(cls, func: Any, types: Any, args: tuple = (),  # type: ignore[override]
                           kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        flat, _ = tree_flatten((args, kwargs))
        deferred = [a for a in flat if isinstance(a, DeferredTensor)]
        packet = func.overloadpacket
        target = args[0] if args else None
        if isinstance(target, DeferredTensor) and target.deferred_storage.realized is None and len(deferred) == 1:
            if func.is_view:
                return _view(func, target, args, kwargs)
            if _writes_first_argument(func) and "out" not in kwargs:
                _record(func, target, args, kwargs)
                return target
        if packet in _METADATA_ONLY:
            return func(*tree_map(_shape_proxy, args), **tree_map(_shape_proxy, kwargs))
        for tensor in deferred:
            if tensor.deferred_storage.realized is None:
                _realize(tensor.deferred_storage, str(packet))
        out = func(*tree_map(_unwrap, args), **tree_map(_unwrap, kwargs))
        if _writes_first_argument(func) and isinstance(target, DeferredTensor):
            return target
        return out


def _rebuild_real(tensor: torch.Tensor) -> torch.Tensor:
    return tensor


def _writes_first_argument(func: Any) -> bool:
    arguments = func._schema.arguments
    info = arguments[0].alias_info if arguments else None
    return info is not None and info.is_write


def _apply_views(whole: torch.Tensor, views: tuple[Any, ...]) -> torch.Tensor:
    out = whole
    for func, args, kwargs, index in views:
        out = func(out, *args, **kwargs)
        if index is not None:
            out = out[index]
    return out


def _view(func: Any, target: DeferredTensor, args: tuple, kwargs: dict) -> Any:
    meta_out = func(target.deferred_meta, *args[1:], **kwargs)
    if isinstance(meta_out, torch.Tensor):
        return DeferredTensor(target.deferred_storage, (*target.deferred_views, (func, args[1:], kwargs, None)), meta_out)
    return type(meta_out)(
        DeferredTensor(target.deferred_storage, (*target.deferred_views, (func, args[1:], kwargs, k)), m)
        for k, m in enumerate(meta_out))


def _record(func: Any, target: DeferredTensor, args: tuple, kwargs: dict) -> None:
    storage = target.deferred_storage
    # Checked on meta tensors first: a wrong shape fails here, as it would have eagerly.
    meta_kwargs = {k: v for k, v in tree_map(_meta_of, kwargs).items() if k != "generator"}
    func(target.deferred_meta, *tree_map(_meta_of, args[1:]), **meta_kwargs)
    if not storage.has_values:
        return  # a meta tensor stays a meta tensor: nothing to draw, nothing to replay
    draw = None
    if torch.Tag.nondeterministic_seeded in func.tags:
        draw = _draw(func, target, args, kwargs)
        if draw is None:
            _realize(storage, f"{func.overloadpacket} on {storage.device}")
            func(target.real_view(), *args[1:], **kwargs)
            return
    # The values the write reads, as they are now: a source changed in place later (a scratch
    # tensor reused, a loaded tensor updated) must not change what is replayed.
    write = _Write(target.deferred_views, func, tuple(tree_map(_values_now, args[1:])),
                   {k: v if k == "generator" else tree_map(_values_now, v) for k, v in kwargs.items()}, draw)
    if func.overloadpacket in _OVERWRITES and _covers_storage(target):
        storage.initial = None
        storage.writes = [write]
    else:
        storage.writes.append(write)


def _values_now(value: Any) -> Any:
    """A copy of a plain tensor argument (a deferred one is replayed from its own record)."""
    if isinstance(value, torch.Tensor) and not isinstance(value, DeferredTensor):
        return value.detach().clone()
    return value


def _covers_storage(view: DeferredTensor) -> bool:
    storage = view.deferred_storage
    return (tuple(view.shape) == storage.size and tuple(view.stride()) == storage.stride
            and view.storage_offset() == 0)


def _draw(func: Any, target: DeferredTensor, args: tuple, kwargs: dict) -> RandomDraw | None:
    """The generator state before ``func`` draws; the draw itself made on a scratch tensor
    of the target's size, so that the generator moves on as it would have."""
    device = target.deferred_storage.device
    generator = kwargs.get("generator")
    explicit = generator is not None
    if generator is None:
        generator = _default_generator(device)
        if generator is None:
            return None
    draw = RandomDraw(device, generator.get_state(), explicit)
    scratch = _shared_buffer("scratch", tuple(target.shape), tuple(target.stride()), target.dtype, device)
    func(scratch, *args[1:], **kwargs)
    return draw


# Reused buffers, one per purpose, dtype and device, grown to the largest tensor asked for:
# allocating and freeing a buffer per tensor leaves the allocator's heap holding (and
# resident) what was freed, so memory would grow with the model instead of its largest tensor.
_buffers: dict[tuple[str, torch.dtype, torch.device], torch.Tensor] = {}


def _shared_buffer(purpose: str, size: tuple[int, ...], stride: tuple[int, ...], dtype: torch.dtype,
                   device: torch.device) -> torch.Tensor:
    needed = 1 + sum((n - 1) * st for n, st in zip(size, stride, strict=True)) if all(size) else 0
    key = (purpose, dtype, device)
    buffer = _buffers.get(key)
    if buffer is None or buffer.numel() < needed:
        _buffers.pop(key, None)
        buffer = _buffers[key] = torch.empty(max(needed, 1), dtype=dtype, device=device)
    return buffer.as_strided(size, stride)


def release_buffers() -> None:
    """Free the buffers draws and ``materialize(..., reuse=True)`` reuse (until next needed)."""
    _buffers.clear()


def _default_generator(device: torch.device) -> torch.Generator | None:
    if device.type == "cpu":
        return torch.default_generator
    if device.type == "cuda":
        index = device.index if device.index is not None else torch.cuda.current_device()
        return torch.cuda.default_generators[index]
    return None


@contextmanager
def _generator_state(device: torch.device, state: torch.Tensor) -> Iterator[None]:
    generator = _default_generator(device)
    assert generator is not None, "a draw is recorded only where there is a default generator"
    saved = generator.get_state()
    generator.set_state(state)
    try:
        yield
    finally:
        generator.set_state(saved)


def _realize(storage: _Storage, reason: str) -> None:
    if not storage.has_values:
        raise InvalidArgumentError(
            f"A tensor made on the meta device (size {storage.size}) was read ({reason}) before the "
            "strategy materialized it. Leave out torch.device('meta') inside the strategy's scope: "
            "the scope already builds the model without allocating it."
        )
    storage.realized = storage.replay()
    storage.realized_by = reason
    storage.initial = None
    storage.writes = []
    _log.debug("a deferred tensor of size %s was made whole early: %s", storage.size, reason)


def _unwrap(value: Any) -> Any:
    return value.real_view() if isinstance(value, DeferredTensor) else value


def _meta_of(value: Any) -> Any:
    if isinstance(value, DeferredTensor):
        return value.deferred_meta
    if isinstance(value, torch.Tensor) and not value.is_meta:
        return value.to("meta")
    return value


def _shape_proxy(value: Any) -> Any:
    """A real tensor of ``value``'s shape, dtype and device, never written (for operations
    that read only those)."""
    if isinstance(value, DeferredTensor):
        return torch.empty_strided(value.shape, value.stride(), dtype=value.dtype, device=value.device)
    return value


def defer(tensor: torch.Tensor, requires_grad: bool | None = None,
          device: torch.device | None = None) -> DeferredTensor:
    """``tensor`` as a ``DeferredTensor``: its current values (if it was registered with
    some) are kept until its first complete overwrite, every later write is recorded.

    ``device``: where it lives from now on (its values moved there), so that the writes
    recorded later draw from that device's generator, as they would on a tensor moved there
    when it was registered (what the mirrored strategies do). A tensor on the meta device has
    no values: ``has_values`` is False for it, and it stays on the meta device.
    """
    data = tensor.detach()
    if device is not None and not data.is_meta and data.device != device:
        data = data.to(device)
    storage = _Storage(
        size=tuple(data.shape), stride=tuple(data.stride()), dtype=data.dtype,
        device=data.device if not data.is_meta else torch.device("meta"),
        initial=None if data.is_meta else data, has_values=not data.is_meta)
    if data.is_meta:
        storage.device = torch.device("meta")
    return DeferredTensor(storage, (), storage.meta(),
                          requires_grad=tensor.requires_grad if requires_grad is None else requires_grad)


def is_deferred(tensor: Any) -> TypeGuard[DeferredTensor]:
    """Whether ``tensor`` is a ``DeferredTensor`` (a view of one included)."""
    return isinstance(tensor, DeferredTensor)


def has_values(tensor: torch.Tensor) -> bool:
    """Whether ``tensor`` can be materialized (False: it was made on the meta device)."""
    return not is_deferred(tensor) or tensor.deferred_storage.has_values


def materialize(tensor: torch.Tensor, reuse: bool = False) -> torch.Tensor:
    """The values of ``tensor``, computed now (on its device; the deferred tensor itself is
    left as it is, so each call computes them again).

    ``reuse``: into a buffer every such call shares (valid until the next call), so that
    materializing tensors one after the other holds one at a time.
    """
    assert is_deferred(tensor), "only a DeferredTensor is materialized"
    if not tensor.deferred_storage.has_values:
        raise ValueError("a tensor made on the meta device has no values to materialize")
    return _apply_views(tensor.deferred_storage.replay(reuse=reuse), tensor.deferred_views).detach()


def random_draws(tensors: list[torch.Tensor]) -> list[RandomDraw]:
    """Every generator state the writes into ``tensors`` start from, in order (each storage
    once): replacing their ``state`` in place makes ``materialize`` draw from those."""
    draws: list[RandomDraw] = []
    seen: set[int] = set()
    for tensor in tensors:
        if not is_deferred(tensor):
            continue
        storage = tensor.deferred_storage
        if id(storage) in seen:
            continue
        seen.add(id(storage))
        draws.extend(w.draw for w in storage.writes if w.draw is not None)
    return draws


def realized_by(tensor: torch.Tensor) -> str | None:
    """What made ``tensor`` whole before it was sharded (None: it never was, or it is not
    deferred)."""
    return tensor.deferred_storage.realized_by if is_deferred(tensor) else None


def recipe_signature(tensor: torch.Tensor) -> str:
    """What ``tensor`` holds and how it is built (shapes and operations, no values): equal on
    every worker that built the same model."""
    if not is_deferred(tensor):
        return f"{tuple(tensor.shape)}:{tensor.dtype}"
    storage = tensor.deferred_storage
    ops = ",".join(str(w.func) for w in storage.writes)
    return f"{storage.size}:{storage.dtype}:{int(storage.initial is not None)}:{ops}"

