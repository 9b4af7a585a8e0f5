"""galvatron_fx: automatic hybrid parallelism for PyTorch training, as a torch.fx compiler.

Public API (see ../shared/CONTRACT.md and README.md)::

    gm = gfx.capture(model, example_args, method="dynamo")
    gfx.layers(gm)
"""

from . import checkpoint, models
from ._version import __version__
from .capture import capture, layers
from .cluster import Cluster
from .errors import CaptureError, ConfigError, GalvatronError, InfeasibleError, PlanMismatchError
from .plan import Plan
from .planner import baselines, estimate, search
from .transform import transform
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
    "format_bytes",
    "parse_bytes",
]
