"""The Keras this process imported, checked: the ``torch`` backend, a tested version.

Keras reads its backend once, when it is first imported (``KERAS_BACKEND``, else
``~/.keras/keras.json``, else TensorFlow). Nothing here imports Keras: a program that never
imports it pays nothing, and the package imports without Keras installed.

>>> import sys
>>> imported_keras() is sys.modules.get("keras") or imported_keras() is None
True
"""

from __future__ import annotations

import sys
import warnings
from types import ModuleType

from torch_distribute.errors import KerasBackendError

#: The Keras releases this integration is tested with (``pyproject.toml``'s ``keras`` extra).
TESTED_KERAS = ((3, 15), (3, 15))

_warned: set[str] = set()


def imported_keras() -> ModuleType | None:
    """Keras, if this process imported it (with the ``torch`` backend), else ``None``.

    Raises:
        KerasBackendError: Keras was imported with another backend.
    """
    keras = sys.modules.get("keras")
    if keras is None or not hasattr(keras, "backend"):  # not imported, or still importing
        return None
    check_backend(keras)
    return keras


def check_backend(keras: ModuleType) -> None:
    """Refuse a Keras that computes with another backend than torch; warn once about a
    Keras version this integration was not tested with."""
    backend = keras.backend.backend()
    if backend != "torch":
        raise KerasBackendError(
            f"Keras was imported with the {backend!r} backend, so a Keras model made in a "
            "torch-distribute strategy's scope would not be a torch module and would train "
            "without the strategy. Set the environment variable KERAS_BACKEND=torch before the "
            "first `import keras` (for example `os.environ['KERAS_BACKEND'] = 'torch'` at the "
            "top of the program, or in the shell that starts it)."
        )
    version = getattr(keras, "__version__", "0")
    try:
        major_minor = tuple(int(part) for part in version.split(".")[:2])
    except ValueError:
        major_minor = (0, 0)
    low, high = TESTED_KERAS
    if not low <= major_minor <= high and version not in _warned:
        _warned.add(version)
        warnings.warn(
            f"torch-distribute's Keras 3 integration is tested with Keras "
            f"{low[0]}.{low[1]}-{high[0]}.{high[1]}; this is Keras {version}. If a strategy "
            "trains a Keras model to other numbers than one device, report it, and pin "
            f"keras<{high[0]}.{high[1] + 1} meanwhile.",
            stacklevel=3,
        )
