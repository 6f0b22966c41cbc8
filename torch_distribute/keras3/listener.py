"""How the strategies find Keras 3 models: a listener on every strategy's scope.

The strategies layer tells its scope listeners (``strategies/interception.py``) when a scope
is entered and of every submodule registered in one. A Keras 3 layer on the torch backend is a
``torch.nn.Module`` that registers its variables' tensors (a ``ParameterDict``) when it is
built, and a model registers its layers: so a model built in the scope, or one whose layers
are made there (a subclassed model), is seen there, and served (``serving.serve``). A model
that has no weights yet and no layer registered (a ``keras.Sequential`` whose first layer has
no input shape) registers nothing in torch: it is found when it is made, through
``keras.Model.__init__`` (``keras_seams``), and served all the same; its weights are then
built in the strategy's scope at its first batch.

On entering a scope, with Keras imported: Keras must use the torch backend
(``KerasBackendError`` otherwise: its models would not be torch modules, and would train
without the strategy), Keras' own distribution must not be set (``KerasUnsupportedError``),
and Keras makes its variables on the strategy's device while the scope lasts
(``keras.device``), so that the tensors a layer holds are the ones the strategy captured.

>>> LISTENER.scope_entered.__doc__.split(":")[0]
'Check Keras and place its variables on the strategy'
"""

from __future__ import annotations

from contextlib import AbstractContextManager
from typing import TYPE_CHECKING, Any, cast

from torch import nn

from torch_distribute.keras3 import keras_seams, loaded, serving
from torch_distribute.strategies import interception
from torch_distribute.strategies.interception import ScopedStrategy

if TYPE_CHECKING:
    from torch_distribute.strategies import Strategy


class KerasScopeListener:
    """The scope listener of the Keras 3 integration (one per process: ``LISTENER``)."""

    def scope_entered(self, strategy: ScopedStrategy) -> AbstractContextManager[Any] | None:
        """Check Keras and place its variables on the strategy: what the scope holds open."""
        keras = loaded.imported_keras()
        if keras is None:
            return None
        serving.check_no_keras_distribution(keras, cast("Strategy", strategy))
        # A Keras optimizer made here sums its replicas' gradients; a model made here is served.
        keras_seams.install(keras, model_made=self.model_made)
        return keras.device(str(strategy.extended.primary_device))

    def model_made(self, model: Any) -> None:
        """A ``keras.Model`` was just made (``keras_seams``' ``Model.__init__``): in a strategy's
        scope, that strategy serves it from now on, weights or not, as in TensorFlow."""
        strategy = interception.scope_strategy()
        keras = loaded.imported_keras() if strategy is not None else None
        if strategy is not None and keras is not None:
            serving.serve(model, cast("Strategy", strategy), keras)

    def submodule_captured(self, strategy: ScopedStrategy, parent: nn.Module, name: str,
                           child: nn.Module) -> None:
        """Serve a Keras model made or built in the scope; refuse a Keras layer in the scope of
        a strategy that cannot train one."""
        keras = loaded.imported_keras()
        if keras is None or not isinstance(parent, keras.layers.Layer):
            return
        if isinstance(parent, keras.Model):
            serving.serve(parent, cast("Strategy", strategy), keras)
        else:
            serving.check_strategy(cast("Strategy", strategy), f"A Keras layer ({type(parent).__name__})")


LISTENER = KerasScopeListener()
