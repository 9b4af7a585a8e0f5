"""The optimizer step over per-parameter views vs one flat buffer per layer (one process, CPU or GPU).

    python benchmarks/optimizer_step.py [--json PATH] [--repeats 15]

The distributed model hands the user's optimizer one tensor per parameter, each a view of the
layer's flat buffer (``galvatron_fx.runtime.params.ShardedParameter``, with a ``__torch_function__``
that routes norms over ranks); before, the optimizer saw one flat ``Parameter`` per layer. This
times ``torch.optim.AdamW.step()`` (its default implementation for the device: a loop over tensors on
CPU, foreach on CUDA; and with ``foreach=True`` / ``fused=True``) on the same elements three ways:

* ``flat``: one tensor per layer (the previous runtime);
* ``plain``: one plain ``nn.Parameter`` per parameter (what DDP's optimizer steps);
* ``views``: one ``ShardedParameter`` per parameter, views of a flat buffer (what the runtime does now),

for the layers of gpt-tiny (hidden 128, 4 layers, the runtime benchmarks' model) and one 1B-class
decoder layer (Llama-3.2-1B: hidden 2048, ffn 8192; 2 norms + 7 linears). Times are the medians of
``--rounds`` interleaved rounds of ``--repeats`` steps each, after two warm-up steps; the summary
holds ``views / flat`` and ``views / plain``.
"""

from __future__ import annotations

import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(__file__))
from _common import parser, print_table, write_json  # noqa: E402

from galvatron_fx.runtime.params import ShardedGrad, ShardedParameter  # noqa: E402


def gpt_tiny_layers() -> list[list[tuple[int, ...]]]:
    import galvatron_fx as gfx

    model, _ = gfx.models.build("gpt-tiny", device="meta", hidden=128, layers=4, heads=4, seq_len=64, vocab=512)
    layers: dict[str, list] = {}
    for name, p in model.named_parameters():
        key = ".".join(name.split(".")[:2]) if name.startswith("blocks.") else name.split(".")[0]
        layers.setdefault(key, []).append(tuple(p.shape))
    return list(layers.values())


def llama_1b_layer() -> list[list[tuple[int, ...]]]:
    h, f, kv = 2048, 8192, 512
    return [[(h,), (h, h), (kv, h), (kv, h), (h, h), (h,), (f, h), (f, h), (h, f)]]


def _tensors(layers, how: str, device) -> list[torch.Tensor]:
    out = []
    for shapes in layers:
        sizes = [torch.Size(s).numel() for s in shapes]
        flat = torch.randn(sum(sizes), device=device) * 0.02
        if how == "flat":
            out.append(torch.nn.Parameter(flat))
            continue
        for part, shape in zip(flat.split(sizes), shapes):
            view = part.view(shape)
            out.append(torch.nn.Parameter(view.clone()) if how == "plain"
                       else torch.Tensor._make_subclass(ShardedParameter, view, True))
    for p in out:
        g = torch.randn(p.shape, device=device) * 1e-3
        # NOTE: the runtime's gradients are ShardedGrad views (their own __torch_function__)
        p.grad = torch.Tensor._make_subclass(ShardedGrad, g) if how == "views" else g
    return out


def time_steps(layers, device, repeats: int, rounds: int, **opt_kw) -> dict[str, float]:
    """Median step seconds of each way, measured in ``rounds`` interleaved rounds of ``repeats``
    steps (NOTE: interleaved, so that a noisy neighbour on a shared machine hits all three alike)."""
    opts = {}
    for how in HOWS:
        params = _tensors(layers, how, device)
        opts[how] = torch.optim.AdamW(params, lr=1e-3, **opt_kw)
        for _ in range(2):
            opts[how].step()
    times: dict[str, list[float]] = {how: [] for how in HOWS}
    for _ in range(rounds):
        for how, opt in opts.items():
            for _ in range(repeats):
                if device.type == "cuda":
                    torch.cuda.synchronize()
                t = time.perf_counter()
                opt.step()
                if device.type == "cuda":
                    torch.cuda.synchronize()
                times[how].append(time.perf_counter() - t)
    return {how: sorted(ts)[len(ts) // 2] for how, ts in times.items()}


HOWS = ("flat", "plain", "views")


def main() -> None:
    ap = parser(__doc__)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--rounds", type=int, default=5)
    args = ap.parse_args()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    torch.manual_seed(0)
    rows, results = [], {}
    for model, layers in (("gpt-tiny", gpt_tiny_layers()), ("llama-1b-layer", llama_1b_layer())):
        tensors = sum(len(s) for s in layers)
        for impl, kw in (("default", {}), ("foreach", dict(foreach=True)), ("fused", dict(fused=True))):
            t = time_steps(layers, device, args.repeats, args.rounds, **kw)
            results[f"{model}/{impl}"] = t
            rows.append([model, impl, tensors, t["flat"] * 1e3, t["plain"] * 1e3, t["views"] * 1e3,
                         t["views"] / t["flat"], t["views"] / t["plain"]])
    print_table(["model", "AdamW", "tensors", "flat ms", "plain ms", "views ms", "views/flat", "views/plain"], rows)
    summary = {f"{k}/views_over_flat": v["views"] / v["flat"] for k, v in results.items()}
    summary.update({f"{k}/views_over_plain": v["views"] / v["plain"] for k, v in results.items()})
    print("summary: " + ", ".join(f"{k} {v:.2f}" for k, v in summary.items() if k.endswith("default/views_over_flat")))
    write_json(args.json, {"device": str(device), "results": results, "summary": summary})


if __name__ == "__main__":
    main()
