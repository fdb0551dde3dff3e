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
from remat.core.compat import register_moved

from . import zoo
from .applying import apply
from .base import default_loss, fixed_bytes, plain_step_peaks
from .measuring import Measurement, StorageTracker, measure, measure_peak
from .tracing import trace

__all__ = ["trace", "apply", "default_loss", "fixed_bytes", "plain_step_peaks", "measure", "Measurement",
           "measure_peak", "StorageTracker", "zoo"]

# module paths of the layout before docs/design.md's, kept importable (with a warning);
# `remat.frontends.trace` and `.measure` are this package's functions now
register_moved({"remat.frontends.trace": "remat.frontends.tracing", "remat.frontends.measure": "remat.frontends.measuring",
                "remat.frontends.stages": "remat.frontends.segments"})
