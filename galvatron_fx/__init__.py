"""galvatron_fx: automatic hybrid parallelism for PyTorch training, as a torch.fx compiler.

Public API (README.md, docs/)::

    gm = gfx.capture(model, example_args, method="dynamo")       # annotated torch.fx.GraphModule
    gfx.layers(gm)                                                # ordered layer records
    cluster = gfx.Cluster.preset("8xA100-80GB")                   # or .load(path), .profile()
    plan = gfx.search(gm, cluster=cluster, memory_budget="16GiB", global_batch_size=32)
    gfx.estimate(gm, plan, cluster); gfx.baselines(gm, cluster, "16GiB", 32)
    dist_model = gfx.transform(gm, plan=plan)                     # under torchrun
    gfx.checkpoint.save(dist_model, optimizer, path, step=...)
    torch.compile(model, backend="galvatron", options={...})      # entry point, no import needed
"""

from . import checkpoint, models
from ._version import __version__
from .api import search, transform
from .cluster import Cluster
from .errors import (
    CaptureError,
    ConfigError,
    GalvatronError,
    InfeasibleError,
    PlanMismatchError,
    TrainingError,
)
from .frontend import capture, layers
from .plan import Plan
from .planner import baselines, estimate
from .units import format_bytes, parse_bytes

__all__ = [
    "__version__",
    "capture",
    "checkpoint",
    "Cluster",
    "Plan",
    "baselines",
    "estimate",
    "search",
    "transform",
    "layers",
    "models",
    "CaptureError",
    "ConfigError",
    "GalvatronError",
    "InfeasibleError",
    "PlanMismatchError",
    "TrainingError",
    "format_bytes",
    "parse_bytes",
]
