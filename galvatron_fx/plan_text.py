"""A plan as text (``Plan.explain()``): per stage and layer the strategy, step-time share and memory
against the budget, the schedules the search compared, and each dimension's lines."""

from __future__ import annotations

from . import dims


def _gib(n: float) -> str:
    return f"{n / 2**30:.2f}G" if n >= 2**27 else f"{n / 2**20:.1f}M"


def explain_plan(plan) -> str:
    """Human-readable plan: per stage and layer the strategy, step-time share and memory
    (states, in-flight activations, transient) against the budget the plan was searched for."""
    est = plan.estimate or {}
    per_layer = est.get("layers") or [None] * plan.num_layers
    budget = plan.extra.get("memory_budget_bytes")
    chunks = f" ({plan.virtual_stages} chunks per rank)" if plan.virtual_stages > 1 else ""
    lines = [f"plan: {plan.world_size} devices = pp {plan.pp} x {plan.devices_per_stage} per stage, "
             f"{plan.schedule}{chunks}, {plan.micro_batches} micro-batch(es) of {plan.micro_batch_size} "
             f"(global batch {plan.global_batch_size}), {plan.precision}"]
    if est.get("step_time_s") is not None:
        lines.append(f"estimate: {est['step_time_s'] * 1e3:.3f} ms/step, "
                     f"{est['throughput_samples_s']:.2f} samples/s")
    lines += _schedule_lines(plan.schedule, plan.extra.get("schedules") or {})
    for c, (first, last) in enumerate(plan.stages):
        k = plan.chunk_rank(c)
        mem = (est.get("memory_bytes_per_device") or [None] * plan.pp)[k]
        head = f"stage {k}: layers {first}..{last}" if plan.virtual_stages == 1 else \
            f"chunk {c} on pipeline rank {k}: layers {first}..{last}"
        if plan.virtual_stages > 1 and c >= plan.pp:
            mem = None   # NOTE: the rank's memory, shown under its first chunk
        elif plan.virtual_stages > 1 and mem is not None:
            head += f"; rank {k} (chunks {', '.join(map(str, plan.rank_chunks(k)))})"
        if mem is not None:
            head += f", {_gib(mem)} per device"
            if budget:
                head += f" of {_gib(budget)} budget ({100 * mem / budget:.0f}%)"
            pd = est.get("per_device", {})
            if pd:
                head += (f" = states {_gib(pd['states_bytes'][k])} + activations "
                         f"{_gib(pd['activation_bytes'][k])} + transient {_gib(pd['transient_bytes'][k])}"
                         f" + reserve {_gib(pd.get('reserve_bytes', 0))}")
                if (pd.get("split_held_bytes") or [0] * plan.pp)[k]:
                    head += f" + held from I to W {_gib(pd['split_held_bytes'][k])}"
        lines.append(head)
        lines.append(f"  {'#':>4}  {'layer':<26} {'strategy':<24} {'time ms':>9} {'states':>10} "
                     f"{'activ.':>10} {'transient':>10}")
        for i in range(first, last + 1):
            layer, row = plan.layers[i], per_layer[i]
            cells = (f"{row['time_s'] * 1e3:>9.3f} {_gib(row['states_bytes']):>10} "
                     f"{_gib(row['activation_bytes']):>10} {_gib(row['transient_bytes']):>10}"
                     if row else "")
            lines.append(f"  {i:>4}  {layer.name:<26} {layer.strategy.label:<24} {cells}")
    lines += dims.explain_lines(plan.layers)
    return "\n".join(lines)


def _schedule_lines(chosen: str, found: dict) -> list[str]:
    """explain(): the best plan the search found with each pipeline schedule (``extra["schedules"]``)."""
    if len(found) < 2:
        return []
    out = ["pipeline schedules (the best plan the search found with each; bubble = idle share of a step):"]
    for name, f in sorted(found.items(), key=lambda kv: -kv[1].get("throughput_samples_s", 0.0)):
        mark = "chosen" if name == chosen else "runner-up"
        if "at_most_samples_s" in f:
            out.append(f"  {mark:<9} {name:<16} not solved: its bound says at most {f['at_most_samples_s']:.2f} "
                       "samples/s")
            continue
        out.append(f"  {mark:<9} {name:<16} pp{f['pp']} m{f['micro_batches']} v{f['virtual_stages']}: "
                   f"{f['throughput_samples_s']:.2f} samples/s, bubble {100 * f['bubble_fraction']:.1f}%, "
                   f"peak activations {_gib(f['activation_bytes'])} per device")
    return out
