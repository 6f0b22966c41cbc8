"""``ReduceOp``: how per-replica values are combined."""

from __future__ import annotations

import enum

from torch_distribute.errors import InvalidReduceOpError


class ReduceOp(enum.Enum):
    """How values from several replicas are combined.

    >>> ReduceOp.from_value("mean") is ReduceOp.MEAN
    True
    """

    SUM = "SUM"
    MEAN = "MEAN"

    @classmethod
    def from_value(cls, value: ReduceOp | str) -> ReduceOp:
        """Accept a ``ReduceOp`` or its name in any case (``"sum"``, ``"MEAN"``)."""
        if isinstance(value, ReduceOp):
            return value
        if isinstance(value, str) and value.upper() in cls.__members__:
            return cls[value.upper()]
        raise InvalidReduceOpError(
            f"Unknown reduce op {value!r}: use td.ReduceOp.SUM or td.ReduceOp.MEAN "
            "(or the strings 'sum' / 'mean')."
        )
