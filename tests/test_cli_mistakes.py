"""Every ordinary CLI mistake ends in one line on stderr, non-zero, before any expensive work.

The first group is the table of mistakes a new user made (each once ended in a traceback, a silent
default or a misleading line); the second is more of the same kind. Each runs ``main`` in this
process (the console script adds only the interpreter's start) and must exit non-zero within 10 s
with exactly one line on stderr, naming the problem, and no traceback.
"""

from __future__ import annotations

import json
import time

import pytest

from galvatron_fx.cli import main

pytest.importorskip("transformers")

LLAMA = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 256, "hidden_size": 64,
         "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
         "max_position_embeddings": 512}
FILES = {
    "cfg.json": json.dumps(LLAMA),
    "heads.json": json.dumps(dict(LLAMA, hidden_size=4096, num_attention_heads=30, num_key_value_heads=30)),
    "mamba.json": json.dumps({"architectures": ["MambaForCausalLM"], "model_type": "mamba", "vocab_size": 256,
                              "hidden_size": 64, "state_size": 8, "num_hidden_layers": 2}),
    "broken.json": "{oops",
    "notype.json": json.dumps({"hidden_size": 64}),
    "plan.json": "{oops",
    "nohost.json": json.dumps({"format": "galvatron_fx.cluster/1", "memory_bytes": 2**34, "devices_per_node": 8,
                               "peak_flops": {"fp32": 1e13, "bf16": 1e14, "fp16": 1e14},
                               "intra_bandwidth": 1e11, "intra_latency": 1e-5}),
}
C = ["--cluster", "8xA100-80GB"]

REPORTED = [   # (argv, what the line must say)
    (["plan", "cfg.json", *C, "--json", "/nonexistent/dir/p.json"], "no such directory /nonexistent/dir"),
    (["plan", "cfg.json", *C, "--seq-len", "-5"], "--seq-len: expected a positive integer, got '-5'"),
    (["plan", "cfg.json", *C, "--seq-len", "0"], "--seq-len: expected a positive integer, got '0'"),
    (["plan", "mamba.json", *C], "cannot build a model for model_type 'mamba'"),
    (["plan", "heads.json", *C], "transformers rejects this config: The hidden size (4096) is not a multiple"),
    (["plan", "cfg/nope.json", *C], "'cfg/nope.json': no such file"),
    (["plan", "{tmp}", *C], "no config.json in this directory"),
    (["plan", "cfg.json", *C, "--memory-budget", "16"], "give a unit, e.g. 16GiB"),
    (["plan", "cfg.json", *C, "--memory-budget", "100GiB"], "exceeds the device memory of 8xA100-80GB"),
    (["plan", "cfg.json", *C, "--memory-budget", "-16GiB"], "memory budget must be positive"),
    (["plan", "cfg.json", *C, "--ep", "2"], "is a dense model (its config names no experts); drop --ep"),
]
MORE = [
    (["plan", "cfg.json", *C, "--global-batch-size", "0"], "--global-batch-size: expected a positive integer"),
    (["plan", "cfg.json", "--cluster", "0xA100-80GB"], "needs at least one node and one device"),
    (["plan", "cfg.json", "--cluster", "nocluster.json"], "cannot read cluster file 'nocluster.json'"),
    (["plan", "cfg.json", *C, "--precision", "fp64"], "invalid choice: 'fp64'"),
    (["plan", "cfg.json", *C, "--micro-batches", "0"], "--micro-batches: expected a positive integer"),
    (["plan", "cfg.json", *C, "--reserve", "-1GiB"], "--reserve: size must be positive"),
    (["plan", "cfg.json", *C, "--reserve", "5"], "--reserve: give a unit, e.g. 5GiB"),
    (["plan", "cfg.json", *C, "--pp", "3"], "--pp 3: a pipeline degree must divide the 8 devices"),
    (["plan", "cfg.json", *C, "--cp", "3"], "--cp 3: a context-parallel degree must divide the 8 devices"),
    (["plan", "cfg.json", *C, "--cp", "2,x"], "--cp takes degrees like 4 or 1,2,4,8"),
    (["plan", "cfg.json", *C, "--set", "bogus=1"], "the config has no attribute 'bogus'"),
    (["plan", "cfg.json", *C, "--set", "layers"], "is not KEY=VALUE"),
    (["plan", "broken.json", *C], "is not a valid JSON file"),
    (["plan", "cfg.json", "--cluster", "nohost.json", "--offload"], "has no host memory apart from its devices"),
    (["plan", "notype.json", *C], "Should have a `model_type` key"),
    (["plan", "cfg.json"], "the following arguments are required: --cluster"),
    (["show", "nonexistent.json"], "cannot read plan file 'nonexistent.json'"),
    (["show", "plan.json"], "is not valid JSON"),
    (["train", "cfg.json", "--json", "log.json"], "the training log is --log-json log.json"),
    (["train", "gpt-tiny", "--steps", "0"], "--steps: expected a positive integer"),
    (["frobnicate"], "invalid choice: 'frobnicate'"),
]


@pytest.fixture
def workdir(tmp_path, monkeypatch):
    for name, text in FILES.items():
        (tmp_path / name).write_text(text)
    (tmp_path / "empty").mkdir()
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("RANK", raising=False)
    return tmp_path


@pytest.mark.parametrize("argv, needle", REPORTED + MORE, ids=lambda v: " ".join(v) if isinstance(v, list) else None)
def test_a_mistake_is_one_line_before_any_work(workdir, capsys, argv, needle):
    argv = [a.replace("{tmp}", str(workdir / "empty")) for a in argv]
    t0 = time.perf_counter()
    try:
        code = main(argv)
    except SystemExit as exc:   # argparse's own errors exit
        code = exc.code
    took = time.perf_counter() - t0
    err = capsys.readouterr().err
    assert code not in (0, None), err
    assert err.count("\n") == 1 and err.startswith("galvatron-fx"), err   # exactly one line
    assert needle in err and "Traceback" not in err, err
    assert took < 10, f"{took:.1f} s before the error"
