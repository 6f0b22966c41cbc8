"""Model architectures in the spirit of ``keras.applications`` (no pretrained downloads)."""

from torch_distribute.keras.applications import mobilenet_v2
from torch_distribute.keras.applications.mobilenet_v2 import MobileNetV2

__all__ = ["MobileNetV2", "mobilenet_v2"]
