"""remat.frontends: trace and profile PyTorch models into training graphs (the only part of remat,
with the executor, that imports torch).

* `trace(model, example_inputs, loss_fn=None, ...) -> Graph` (also ``remat.trace``);
* `zoo`: ResNet-18/50, VGG-16, MobileNetV2, U-Net, GPT-2 built locally (``zoo.get(name)``);
* `measure_peak(step_fn, resident=...)`: device-agnostic peak memory of a step;
  `measure(step_fn, device)` (also ``remat.measure``): its peak and wall time.
"""
from .measure import Measurement, StorageTracker, measure, measure_peak
from .trace import default_loss, fixed_bytes, trace
from . import zoo

__all__ = ["trace", "default_loss", "fixed_bytes", "measure", "Measurement", "measure_peak", "StorageTracker", "zoo"]
