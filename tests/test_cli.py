"""The galvatron-fx command line: happy paths and one-line errors for bad arguments."""

import json
import subprocess
import sys

import pytest

from galvatron_fx import Plan
from galvatron_fx.cli import main

TINY = ["--set", "layers=2", "--set", "hidden=32", "--set", "heads=4", "--set", "seq_len=16"]


def test_layers_prints_the_layer_table(capsys, tmp_path):
    assert main(["layers", "gpt-tiny", "--method", "fx", *TINY, "--json", str(tmp_path / "l.json")]) == 0
    out = capsys.readouterr().out
    assert "blocks.0" in out and "blocks.1" in out and "post" in out
    data = json.loads((tmp_path / "l.json").read_text())
    assert [r["kind"] for r in data["layers"]] == ["pre", "block", "block", "post"]


def test_plan_with_baselines_writes_a_loadable_plan(capsys, tmp_path):
    path = tmp_path / "plan.json"
    assert main(["plan", "gpt-tiny", *TINY, "--cluster", "4xA100-80GB", "--memory-budget", "2MiB",
                 "--global-batch-size", "16", "--reserve", "0", "--baselines", "--json", str(path)]) == 0
    out = capsys.readouterr().out
    assert "baselines" in out and "searched" in out and "zero3" in out
    plan = Plan.load(path)
    assert plan.world_size == 4 and plan.global_batch_size == 16
    assert set(plan.extra["baselines"]) == {"dp", "zero3", "tp", "pp", "3d", "dp+tp", "dp+pp", "megatron", "fsdp", "fsdp+tp"}
    assert "megatron" in out
    ups = plan.extra["speedups"]
    for name, est in plan.extra["baselines"].items():
        if est == "oom":
            assert ups[name] is None
        else:
            assert ups[name] == pytest.approx(plan.estimate["throughput_samples_s"] / est["throughput_samples_s"])
            assert ups[name] >= 1 - 1e-9, name  # the searched plan is never below a baseline
    assert plan.precision == "bf16-mixed"  # the A100 preset's default
    assert main(["show", str(path)]) == 0
    assert "stage 0" in capsys.readouterr().out


@pytest.mark.parametrize("argv, precision", [
    ([], "bf16-mixed"), (["--precision", "fp32"], "fp32"), (["--precision", "fp16-mixed"], "fp16-mixed"),
    (["--dtype", "bf16", "--mixed-precision"], "bf16-mixed"), (["--dtype", "fp32"], "fp32"),
])
def test_plan_precision_flag_and_default(tmp_path, argv, precision):
    path = tmp_path / "plan.json"
    assert main(["plan", "gpt-tiny", *TINY, "--cluster", "2xH100-80GB", "--global-batch-size", "8",
                 "--json", str(path), *argv]) == 0
    assert json.loads(path.read_text())["precision"] == precision


def test_plan_on_six_devices(tmp_path):
    # 6 devices in one node: TP 1 or 2 (4 heads rule out 3 and 6), DP 3 or 6, PP 1, 2 or 3; batch 12
    path = tmp_path / "plan.json"
    assert main(["plan", "gpt-tiny", *TINY, "--cluster", "6xA100-80GB", "--global-batch-size", "12",
                 "--json", str(path)]) == 0
    plan = Plan.load(path)
    assert plan.world_size == 6 and all(la.tp * la.dp * plan.pp == 6 for la in plan.layers)


def test_plot_draws_the_plan(tmp_path):
    pytest.importorskip("matplotlib")
    png = tmp_path / "plan.png"
    assert main(["plan", "gpt-tiny", *TINY, "--cluster", "4xA100-80GB", "--memory-budget", "2MiB",
                 "--global-batch-size", "16", "--reserve", "0", "--json", str(tmp_path / "p.json"),
                 "--plot", str(png)]) == 0
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 10_000
    svg = tmp_path / "plan.svg"
    assert main(["show", str(tmp_path / "p.json"), "--plot", str(svg)]) == 0
    assert "<svg" in svg.read_text()[:500]


@pytest.mark.parametrize("argv,needle", [
    (["layers", "nonexistent-model"], "unknown model 'nonexistent-model'"),
    (["plan", "gpt-tiny", "--cluster", "3xB200"], "unknown cluster preset '3xB200'"),
    (["plan", "gpt-tiny", "--cluster", "2xA100-80GB", "--memory-budget", "lots"], "cannot parse memory budget"),
    (["plan", "gpt-tiny", "--cluster", "2xA100-80GB", "--memory-budget=-4GB"], "must be positive"),
    (["plan", "gpt-tiny", "--cluster", "2xA100-80GB", "--memory-budget", "1KiB", "--global-batch-size", "8"],
     "no parallel plan fits"),
    (["layers", "gpt-tiny", "--set", "bogus=1"], "unknown override(s) bogus"),
])
def test_bad_arguments_give_one_line_errors_and_exit_2(argv, needle, capsys):
    assert main(argv) == 2
    err = capsys.readouterr().err
    errors = [line for line in err.splitlines() if line.startswith("galvatron-fx ")]
    assert len(errors) == 1 and needle in errors[0], err
    assert "Traceback" not in err


def test_console_script_help():
    out = subprocess.run([sys.executable, "-m", "galvatron_fx.cli", "--help"], capture_output=True, text=True)
    assert out.returncode == 0
    for cmd in ("layers", "plan", "show", "profile"):
        assert cmd in out.stdout


def test_profile_without_torchrun_measures_this_process(tmp_path, capsys):
    assert main(["profile", "--out", str(tmp_path / "c.json")]) == 0
    data = json.loads((tmp_path / "c.json").read_text())
    assert data["peak_flops"]["fp32"] > 0


def test_version(capsys):
    import galvatron_fx as gfx

    with pytest.raises(SystemExit) as exit_:
        main(["--version"])
    assert exit_.value.code == 0 and capsys.readouterr().out.strip() == f"galvatron-fx {gfx.__version__}"


LLAMA_CFG = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 256, "hidden_size": 64,
             "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
             "max_position_embeddings": 512}


def _error(argv, capsys) -> str:
    """stderr of a command that fails (argparse exits; a ConfigError returns non-zero)."""
    try:
        code = main(argv)
    except SystemExit as exc:
        code = exc.code
    assert code != 0
    return capsys.readouterr().err


def test_a_vision_config_plans_with_its_task_class(tmp_path, capsys):
    """A ViT config.json is built as image classification (pixel values and class labels), not refused."""
    pytest.importorskip("transformers")
    cfg = tmp_path / "config.json"
    cfg.write_text(json.dumps({"architectures": ["ViTForImageClassification"], "model_type": "vit", "hidden_size": 64,
                               "num_hidden_layers": 2, "num_attention_heads": 4, "intermediate_size": 128,
                               "image_size": 32, "patch_size": 8}))
    out = tmp_path / "plan.json"
    assert main(["plan", str(cfg), "--cluster", "8xA100-80GB", "--json", str(out)]) == 0
    assert [lp["name"] for lp in json.loads(out.read_text())["layers"]][-1] == "post"


def test_a_config_transformers_rejects_gets_its_message_in_one_line(tmp_path, capsys):
    pytest.importorskip("transformers")
    cfg = tmp_path / "config.json"
    cfg.write_text(json.dumps(dict(LLAMA_CFG, hidden_size=4096, num_attention_heads=30, num_key_value_heads=30)))
    err = _error(["plan", str(cfg), "--cluster", "8xA100-80GB"], capsys)
    assert "transformers rejects this config: The hidden size (4096) is not a multiple" in err
    assert "Traceback" not in err


def test_a_config_plans_at_its_context_length_and_says_what_it_assumed(tmp_path, capsys):
    pytest.importorskip("transformers")
    cfg = tmp_path / "config.json"
    cfg.write_text(json.dumps(LLAMA_CFG))   # max_position_embeddings 512
    out = tmp_path / "plan.json"
    assert main(["plan", str(cfg), "--cluster", "8xA100-80GB", "--global-batch-size", "16", "--micro-batches", "2",
                 "--ckpt", "--json", str(out)]) == 0
    text = capsys.readouterr().out
    assert "assumed: seq_len 512 (the config's context length); global batch 16 (given)" in text
    plan = json.loads(out.read_text())
    assert plan["seq_len"] == 512 and plan["micro_batches"] == 2 and all(lp["ckpt"] is True for lp in plan["layers"])
    assert main(["plan", str(cfg), "--cluster", "8xA100-80GB", "--global-batch-size", "16", "--micro-batches", "2",
                 "--ckpt", "selective", "--json", str(out)]) == 0
    capsys.readouterr()
    assert all(lp["ckpt"] == "selective" for lp in json.loads(out.read_text())["layers"])
    assert main(["plan", str(cfg), "--cluster", "8xA100-80GB", "--global-batch-size", "16", "--micro-batches", "2",
                 "--ckpt", "selective-op", "--json", str(out)]) == 0
    capsys.readouterr()
    assert all(lp["ckpt"] == "selective-op" for lp in json.loads(out.read_text())["layers"])
    assert main(["plan", str(cfg), "--cluster", "8xA100-80GB", "--global-batch-size", "16", "--seq-len", "64",
                 "--no-ckpt", "--json", str(out)]) == 0
    assert "seq_len 64 (--seq-len)" in capsys.readouterr().out
    plan = json.loads(out.read_text())
    assert plan["seq_len"] == 64 and not any(lp["ckpt"] for lp in plan["layers"])


def test_show_prints_the_stored_baselines(tmp_path, capsys):
    out = tmp_path / "plan.json"
    assert main(["plan", "gpt-tiny", *TINY, "--cluster", "4xA100-80GB", "--global-batch-size", "8", "--baselines",
                 "--json", str(out)]) == 0
    capsys.readouterr()
    assert main(["show", str(out)]) == 0
    text = capsys.readouterr().out
    assert "baselines (same cost model, global batch 8)" in text and "megatron" in text and "searched" in text


def test_a_config_that_leaves_sizes_to_defaults_says_which(tmp_path, capsys):
    pytest.importorskip("transformers")
    cfg = tmp_path / "config.json"
    cfg.write_text(json.dumps({"model_type": "llama", "num_hidden_layers": 2}))
    assert main(["plan", str(cfg), "--cluster", "8xA100-80GB", "--global-batch-size", "8"]) == 0
    line = next(x for x in capsys.readouterr().out.splitlines() if x.startswith("assumed:"))
    assert "hidden_size 4096" in line and "num_attention_heads 32" in line and "num_hidden_layers" not in line
    assert f"(transformers' defaults: {cfg} does not set them)" in line


def test_float8_plans_fp8_matmuls_and_is_refused_where_they_cannot_run(tmp_path, capsys):
    pytest.importorskip("transformers")
    cfg = tmp_path / "config.json"
    # Llama-3-8B's widths, 2 blocks: the matmuls outweigh the casts (at 1024 wide the casts win)
    cfg.write_text(json.dumps(dict(LLAMA_CFG, hidden_size=4096, intermediate_size=14336, num_attention_heads=32,
                                   num_key_value_heads=8, max_position_embeddings=4096)))
    out = tmp_path / "plan.json"
    base = ["plan", str(cfg), "--cluster", "8xH100-80GB", "--global-batch-size", "16", "--seq-len", "4096"]
    assert main(base + ["--json", str(out)]) == 0
    bf16 = json.loads(out.read_text())["estimate"]["step_time_s"]
    assert main(base + ["--float8", "--json", str(out)]) == 0
    assert "14 Float8 linears" in capsys.readouterr().out   # 7 per block; the output projection stays bf16
    assert json.loads(out.read_text())["estimate"]["step_time_s"] < bf16
    for argv, needle in ((["--cluster", "8xA100-80GB"], "no fp8 matmul rate"),   # the later --cluster wins
                         (["--method", "export"], "torch.export inlines and drops")):
        assert main(base + argv + ["--float8"]) == 2
        err = capsys.readouterr().err
        assert needle in err and "Traceback" not in err, err


def test_compile_and_async_tp_cost_options_from_the_command_line(tmp_path):
    """--fused-pointwise and --async-tp reach the cost model of the search and the baselines and are
    recorded in the plan."""
    pytest.importorskip("transformers")
    cfg = tmp_path / "config.json"
    cfg.write_text(json.dumps(dict(LLAMA_CFG, vocab_size=32000, hidden_size=4096, intermediate_size=14336, num_attention_heads=32,
                                   num_key_value_heads=8, max_position_embeddings=4096)))
    out = tmp_path / "plan.json"
    base = ["plan", str(cfg), "--cluster", "8xH100-80GB", "--global-batch-size", "16", "--seq-len", "4096",
            "--baselines", "--json", str(out)]
    times = {}
    for flags in ([], ["--fused-pointwise"], ["--async-tp"]):
        assert main(base + flags) == 0
        plan = json.loads(out.read_text())
        options = plan["cost_model"]
        assert all(options.get(f[2:].replace("-", "_")) is True for f in flags), options
        times[tuple(flags)] = plan["estimate"]["step_time_s"], plan["baselines"]["fsdp+tp"]["step_time_s"]
    assert times[("--fused-pointwise",)][0] < times[()][0]
    # the searched plan shards no layer over TP + SP; the FSDP + TP baseline's best degree with async TP
    # does (measured: tp 1 blocking, tp 2 with SP pipelined)
    assert times[("--async-tp",)][0] <= times[()][0]
    assert times[("--async-tp",)][1] < times[()][1]
