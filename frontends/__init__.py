"""remat.frontends: trace and profile PyTorch models into training graphs, and run plans on them
(the only part of remat that imports torch).

* `trace(model, example_inputs, loss_fn=None, ...) -> Graph` (also ``remat.trace``), through one
  of the frontends of `base` (`modules.ModuleFrontend`, `joint.JointFrontend`);
* `apply(model, plan, example_inputs)` (also ``remat.apply``): the model made to train as the
  plan says (`executor`, `joint_executor`, both on `runtime`);
* `zoo`: ResNet-18/50, VGG-16, MobileNetV2, U-Net, GPT-2 built locally (``zoo.get(name)``);
* `measure_peak(step_fn, resident=...)`: device-agnostic peak memory of a step;
  `measure(step_fn, device)` (also ``remat.measure``): its peak and wall time;
  `plain_step_peaks(model, inputs)`: one plain training step's.
"""
from . import zoo
from .apply import apply
from .base import default_loss, fixed_bytes, plain_step_peaks
from .measure import Measurement, StorageTracker, measure, measure_peak
from .trace import trace

__all__ = ["trace", "apply", "default_loss", "fixed_bytes", "plain_step_peaks", "measure", "Measurement",
           "measure_peak", "StorageTracker", "zoo"]
