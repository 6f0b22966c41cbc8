"""Keras 3 models (``KERAS_BACKEND=torch``) trained by this library's strategies.

Nothing to call: with ``KERAS_BACKEND=torch`` set before ``import keras``, a Keras model made
in a strategy's scope trains with Keras' own ``compile``/``fit``/``evaluate``/``predict`` as
one device would with the same global batches, under ``OneDeviceStrategy``,
``MirroredStrategy``, ``CentralStorageStrategy`` and ``MultiWorkerMirroredStrategy``::

    os.environ["KERAS_BACKEND"] = "torch"   # before the first `import keras`
    import keras, torch_distribute as td

    strategy = td.MirroredStrategy(["cpu:0", "cpu:1"])
    with strategy.scope():
        model = keras.Sequential([keras.Input((28, 28, 1)), keras.layers.Flatten(), keras.layers.Dense(10)])
        model.compile(optimizer="adam", loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    model.fit(x, y, batch_size=64, epochs=2)

Keras is optional: this package never imports it (``loaded.imported_keras`` looks for it), so
``torch_distribute`` imports without it. Importing ``torch_distribute`` adds the scope
listener that finds Keras models (``listener.py``); Keras is changed only when a strategy's
scope is first entered with Keras imported (``keras_seams.py`` lists what, and why).

>>> from torch_distribute import keras3
>>> keras3.served_by(object()) is None
True
"""

from torch_distribute.keras3.listener import LISTENER
from torch_distribute.keras3.loaded import TESTED_KERAS
from torch_distribute.keras3.serving import served_by
from torch_distribute.strategies import interception

interception.add_scope_listener(LISTENER)

__all__ = ["TESTED_KERAS", "served_by"]
