"""What train_step is given (runtime/inputs.py), in one process: the whole batch or this rank's
shard, micro-batch order, one clear error for other sizes, non-tensor inputs baked at capture."""

from __future__ import annotations

import pytest
import torch

from galvatron_fx.errors import ConfigError
from galvatron_fx.runtime.inputs import match_inputs, split, to_shards


def test_a_whole_batch_becomes_this_ranks_rows_of_each_micro_batch():
    batch = torch.arange(12).view(12, 1)
    # 2 micro-batches of 6 rows, 3 shards: shard 1 holds rows 2-3 of each micro-batch
    (shard, scalar), given_as_shards = to_shards([batch, torch.tensor(5)], 12, 1, 3, 2, "train_step")
    assert not given_as_shards and shard.flatten().tolist() == [2, 3, 8, 9] and int(scalar) == 5
    assert [c.flatten().tolist() for c in split(shard, 2)] == [[2, 3], [8, 9]]
    # the union over shards is the global batch
    rows = sorted(r for i in range(3) for r in to_shards([batch], 12, i, 3, 2, "t")[0][0].flatten().tolist())
    assert rows == list(range(12))


def test_a_shard_passes_through_and_other_sizes_name_the_allowed_ones():
    shard = torch.arange(4).view(4, 1)
    (got,), given_as_shards = to_shards([shard], 12, 0, 3, 2, "train_step")
    assert given_as_shards and got is shard
    with pytest.raises(ConfigError, match=r"whole global batch \(12 samples\) or this rank's shard \(4 samples"):
        to_shards([torch.zeros(5, 1)], 12, 0, 3, 2, "train_step")
    with pytest.raises(ConfigError, match="does not split into micro_batches=8 x 3 input shards"):
        to_shards([torch.zeros(12, 1)], 12, 0, 3, 8, "train_step")
    assert to_shards([None, shard], 12, 0, 3, 2, "t")[0][0] is None   # a stage that reads no input


def test_non_tensor_inputs_given_at_capture_may_be_repeated_not_changed():
    names, baked = ["input_ids", "pixel_values"], {"return_loss": True}
    ids, px = torch.zeros(2, 3), torch.zeros(2, 1)
    values, _ = match_inputs(names, (), dict(input_ids=ids, pixel_values=px, return_loss=True), "t", baked)
    assert values[0] is ids and values[1] is px
    with pytest.raises(ConfigError, match="return_loss=False, but the model was captured with return_loss=True"):
        match_inputs(names, (), dict(input_ids=ids, pixel_values=px, return_loss=False), "t", baked)
    with pytest.raises(ConfigError, match=r"unexpected input\(s\) \['mask'\]"):
        match_inputs(names, (), dict(input_ids=ids, pixel_values=px, mask=ids), "t", baked)


def test_capture_records_the_baked_inputs():
    tf = pytest.importorskip("transformers")
    import galvatron_fx as gfx

    cfg = tf.CLIPConfig(text_config=dict(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                         num_attention_heads=2, max_position_embeddings=16, bos_token_id=0,
                                         eos_token_id=1, pad_token_id=1),
                        vision_config=dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                           num_attention_heads=2, image_size=16, patch_size=8))
    kw = dict(input_ids=torch.randint(2, 64, (4, 8)), pixel_values=torch.randn(4, 3, 16, 16), return_loss=True)
    gm = gfx.capture(tf.CLIPModel(cfg), (), kwargs=kw, method="dynamo")
    info = gm.meta["galvatron"]
    assert info.input_names == ["input_ids", "pixel_values"] and info.baked_inputs == {"return_loss": True}
