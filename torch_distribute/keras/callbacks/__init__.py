"""Keras callbacks for ``fit``/``evaluate``/``predict``: the same names and hooks as Keras."""

from torch_distribute.keras.callbacks.backup_and_restore import BackupAndRestore
from torch_distribute.keras.callbacks.base import Callback, CallbackList
from torch_distribute.keras.callbacks.csv_logger import CSVLogger
from torch_distribute.keras.callbacks.early_stopping import EarlyStopping
from torch_distribute.keras.callbacks.history import History
from torch_distribute.keras.callbacks.lambda_callback import LambdaCallback, TerminateOnNaN
from torch_distribute.keras.callbacks.lr_schedulers import LearningRateScheduler, ReduceLROnPlateau
from torch_distribute.keras.callbacks.model_checkpoint import ModelCheckpoint
from torch_distribute.keras.callbacks.progbar_logger import ProgbarLogger
from torch_distribute.keras.callbacks.tensorboard import TensorBoard

__all__ = [
    "BackupAndRestore",
    "CSVLogger",
    "Callback",
    "CallbackList",
    "EarlyStopping",
    "History",
    "LambdaCallback",
    "LearningRateScheduler",
    "ModelCheckpoint",
    "ProgbarLogger",
    "ReduceLROnPlateau",
    "TensorBoard",
    "TerminateOnNaN",
]
