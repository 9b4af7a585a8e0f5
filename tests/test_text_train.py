"""``galvatron-fx train CONFIG --data FILE`` and ``galvatron-fx plan CONFIG``: what a transformers user has on disk.

A tiny Llama ``config.json`` (no tokenizer.json beside it: byte tokens) trains on Python's own
standard-library sources under torchrun on 2 gloo ranks: the loss falls and the per-step JSON
records carry loss, grad_norm, lr and tokens/s; a sharded checkpoint resumes the run. The same
config plans from the meta device with ``--seq-len``. Token and block helpers are checked alone.
"""

from __future__ import annotations

import glob
import json
import os
import subprocess
import sys

import pytest
import torch

from galvatron_fx.train import read_log
from tests.dist_utils import free_port

pytest.importorskip("transformers")


def _env():
    return {**os.environ, "OMP_NUM_THREADS": "1", "GALVATRON_DEVICE": "cpu", "GALVATRON_BACKEND": "gloo"}


@pytest.fixture
def llama_dir(tmp_path):
    import transformers as tf

    cfg = tf.LlamaConfig(vocab_size=256, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                         architectures=["LlamaForCausalLM"])
    cfg.save_pretrained(tmp_path / "llama")
    return tmp_path / "llama"


@pytest.fixture
def corpus(tmp_path):
    """Real text: some of Python's standard-library sources (about 150 KB)."""
    import argparse
    import csv
    import json as json_mod

    text = "".join(open(m.__file__, encoding="utf-8").read() for m in (argparse, csv, json_mod))
    path = tmp_path / "corpus.txt"
    path.write_text(text)
    return path


def _train(llama_dir, corpus, log, ckpt, *extra):
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", f"--master-port={free_port()}",
           "-m", "galvatron_fx.cli", "train", str(llama_dir / "config.json"), "--data", str(corpus), "--seq-len",
           "32", "--global-batch-size", "12", "--lr", "3e-3", "--cluster", "2xA100-80GB", "--precision", "fp32",
           "--log-json", str(log), "--ckpt-dir", str(ckpt), *extra]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=600, env=_env())
    assert out.returncode == 0, out.stderr[-3000:]
    return out, read_log(log)["steps"]


@pytest.mark.dist
def test_train_a_config_on_a_text_file(tmp_path, llama_dir, corpus):
    import galvatron_fx as gfx

    log, ckpt, cfile = tmp_path / "log.jsonl", tmp_path / "ckpt", tmp_path / "cluster.json"
    gfx.Cluster.preset("2xA100-80GB").save(str(cfile))   # --measure 4 (the default) calibrates it
    out, records = _train(llama_dir, corpus, log, ckpt, "--steps", "40", "--save-every", "20", "--cluster", str(cfile))
    assert f"calibrated {cfile}" in out.stderr and gfx.Cluster.load(str(cfile)).time_scale > 1   # an A100 timed on a CPU
    assert len(records) == 40 and all({"loss", "grad_norm", "lr", "tokens_per_s"} <= set(r) for r in records)
    raw = [json.loads(line) for line in log.read_text().splitlines()]   # every line a step record; the last holds the run
    assert all({"loss", "grad_norm", "lr", "tokens_per_s"} <= set(r) for r in raw) and "summary" in raw[-1]["run"]
    assert records[-1]["loss"] <= 0.9 * records[0]["loss"], (records[0], records[-1])   # >= 10 % lower
    assert records[0]["lr"] < records[5]["lr"]                                              # warm-up
    assert sorted(os.path.basename(p) for p in glob.glob(str(ckpt / "step-*"))) == ["step-20", "step-40"]
    # built on the meta device, each rank initialised its parts: the first loss is one device's
    assert abs(records[0]["loss"] - _first_loss(llama_dir, corpus)) < 1e-5 * records[0]["loss"]


def _first_loss(llama_dir, corpus, pretrained=None):
    """One device, seed 0: the loss of the trainer's first batch (``initialize_weights`` as
    ``dist_model.init_weights(seed=0)`` replays it, or the ``from_pretrained`` weights)."""
    import transformers as tf

    from galvatron_fx.text_train import TextBlocks, tokenize

    if pretrained:
        model = tf.LlamaForCausalLM.from_pretrained(pretrained)
    else:
        model = tf.LlamaForCausalLM(tf.LlamaConfig.from_pretrained(llama_dir))
        for t in [*model.modules(), *model.parameters()]:
            t.__dict__.pop("_is_hf_initialized", None)
        torch.manual_seed(0)
        model.initialize_weights()
    ids, _kind = tokenize(str(corpus), str(llama_dir), 256)
    with torch.no_grad():
        return model(**TextBlocks(ids, 32, 12, seed=0).batch_at(0)).loss.item()


@pytest.mark.dist
@pytest.mark.matrix   # CI time: a second torchrun launch
def test_init_from_pretrained_then_resume_at_the_saved_step(tmp_path, llama_dir, corpus):
    import transformers as tf

    log, ckpt = tmp_path / "log.jsonl", tmp_path / "ckpt"
    torch.manual_seed(5)
    tf.LlamaForCausalLM(tf.LlamaConfig.from_pretrained(llama_dir)).save_pretrained(tmp_path / "pre")
    _out, first = _train(llama_dir, corpus, log, ckpt, "--steps", "4", "--save-every", "2",
                         "--init", str(tmp_path / "pre"))   # each rank reads only its pieces
    assert abs(first[0]["loss"] - _first_loss(llama_dir, corpus, tmp_path / "pre")) < 1e-5 * first[0]["loss"]
    out, records = _train(llama_dir, corpus, log, ckpt, "--steps", "6", "--resume")
    assert "resumed by hand: same world (2 ranks)" in out.stderr and "resumed at step 4 from" in out.stderr
    assert [r["step"] for r in records] == [1, 2, 3, 4, 5, 6]


def test_plan_a_config_from_the_meta_device(llama_dir):
    out = subprocess.run([sys.executable, "-m", "galvatron_fx.cli", "plan", str(llama_dir), "--seq-len", "64",
                          "--cluster", "8xH100-80GB", "--global-batch-size", "16"],
                         capture_output=True, text=True, timeout=300, env=_env())
    assert out.returncode == 0, out.stderr[-3000:]
    assert "plan: 8 devices" in out.stdout and "model.layers.1" in out.stdout


def test_bad_text_arguments_are_one_line(tmp_path, llama_dir):
    env = {k: v for k, v in _env().items() if k not in ("RANK", "WORLD_SIZE")}
    for extra, needle in (([], "give --data FILE"),):
        out = subprocess.run([sys.executable, "-m", "galvatron_fx.cli", "train", str(llama_dir), *extra],
                             capture_output=True, text=True, timeout=120, env=env)
        assert out.returncode == 2 and needle in out.stderr and "Traceback" not in out.stderr, out.stderr


def test_tokens_and_blocks(tmp_path, llama_dir, corpus):
    from galvatron_fx.errors import ConfigError
    from galvatron_fx.text_train import TextBlocks, tokenize

    ids, kind = tokenize(str(corpus), str(llama_dir), 256)
    assert kind == "bytes" and ids.numel() == len(corpus.read_bytes())
    blocks = TextBlocks(ids, 32, 12, seed=0)
    a, b = blocks.batch_at(0), blocks.batch_at(blocks.per_epoch)   # epoch 2 reshuffles
    assert a["input_ids"].shape == (12, 32) and torch.equal(a["input_ids"], a["labels"])
    assert not torch.equal(a["input_ids"], b["input_ids"])
    with pytest.raises(ConfigError, match="vocab_size 100 cannot hold byte tokens"):
        tokenize(str(corpus), str(llama_dir), 100)
    with pytest.raises(ConfigError, match="fewer than one global batch"):
        TextBlocks(ids[:100], 32, 12)
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers  # a tokenizer.json beside the config

    tok = Tokenizer(models.BPE(unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.train([str(corpus)], trainers.BpeTrainer(vocab_size=200, special_tokens=["[UNK]"]))
    tok.save(str(llama_dir / "tokenizer.json"))
    ids, kind = tokenize(str(corpus), str(llama_dir), 256)
    assert kind == "tokenizer.json" and 0 < ids.numel() < len(corpus.read_bytes()) and int(ids.max()) < 200
