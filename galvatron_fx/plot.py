"""Draw a plan: layers by pipeline stage, coloured by strategy, beside per-device memory bars.

Needs matplotlib (``pip install 'galvatron_fx[plot]'``); everything else in galvatron_fx works
without it. ``plot_plan(plan, path)`` writes a PNG/SVG/PDF (by the path's suffix).
"""

from __future__ import annotations

from .errors import ConfigError
from .plan import Plan


def plot_plan(plan: Plan, path: str) -> str:
    """Left: one row per pipeline stage, one cell per layer, coloured by the layer's strategy (the
    legend maps colours to labels such as ``tp2·dp4·zero3·ckpt``). Right: per-device memory of each
    stage, split into states / activations / transient / reserve, with the budget as a line."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise ConfigError("--plot needs matplotlib: pip install 'galvatron_fx[plot]' (or matplotlib)") from None

    labels = [layer.strategy.label for layer in plan.layers]
    kinds = list(dict.fromkeys(labels))
    cmap = plt.get_cmap("tab20")
    colour = {k: cmap(i % 20) for i, k in enumerate(kinds)}
    rows = (len(kinds) + 3) // 4
    fig, (ax, bars) = plt.subplots(1, 2, figsize=(12, 2.2 + 0.6 * plan.pp + 0.25 * rows),
                                   gridspec_kw={"width_ratios": [3, 1]})
    for k, (first, last) in enumerate(plan.stages):
        for i in range(first, last + 1):
            ax.barh(k, 1, left=i, color=colour[labels[i]], edgecolor="white", linewidth=0.5)
    ax.set_yticks(range(plan.pp), [f"stage {k}" for k in range(plan.pp)])
    ax.invert_yaxis()
    ax.set_xlabel("layer")
    ax.set_xlim(0, plan.num_layers)
    ax.set_title(f"{plan.world_size} devices, pp={plan.pp}, {plan.schedule}, m={plan.micro_batches}, "
                 f"global batch {plan.global_batch_size}")
    fig.legend(handles=[plt.Rectangle((0, 0), 1, 1, color=colour[k]) for k in kinds], labels=kinds,
               loc="lower left", ncol=min(4, len(kinds)), fontsize=8, frameon=False)

    est = plan.estimate or {}
    per = est.get("per_device") or {}
    gib = 2**30
    if per:
        left = [0.0] * plan.pp
        parts = [("states", per["states_bytes"]), ("activations", per["activation_bytes"]),
                 ("transient", per["transient_bytes"]), ("reserve", [per.get("reserve_bytes", 0)] * plan.pp)]
        for name, values in parts:
            widths = [v / gib for v in values]
            bars.barh(range(plan.pp), widths, left=left, label=name)
            left = [a + b for a, b in zip(left, widths)]
        budget = plan.extra.get("memory_budget_bytes")
        if budget:
            bars.axvline(budget / gib, color="black", linestyle="--", label="budget")
        fig.legend(*bars.get_legend_handles_labels(), loc="lower right", ncol=3, fontsize=8, frameon=False)
    else:
        bars.text(0.5, 0.5, "no estimate", ha="center", va="center", transform=bars.transAxes)
    bars.set_yticks(range(plan.pp), [f"stage {k}" for k in range(plan.pp)])
    bars.invert_yaxis()
    bars.set_xlabel("GiB per device")
    fig.tight_layout(rect=(0, 0.12 + 0.06 * rows, 1, 1))
    fig.savefig(path, dpi=120, bbox_inches="tight")
    plt.close(fig)
    return path
