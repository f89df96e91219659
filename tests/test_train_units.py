import numpy as np
import pytest

from amalia_ray.train.loop import local_micro_batches
from amalia_ray.train.lr_schedule import lr_at


@pytest.mark.parametrize("world", [1, 2, 4])
def test_micro_batches_partition_the_global_batch(world):
    rows = np.arange(16)
    parts = [m for r in range(world) for m in local_micro_batches(rows, 2, r, world)]
    assert sorted(np.concatenate(parts).tolist()) == list(range(16))


def test_schedules():
    kw = dict(total=100, peak=1.0, warmup=10, min_ratio=0.1)
    assert lr_at(0, schedule="cosine", **kw) == pytest.approx(0.1)
    assert lr_at(9, schedule="cosine", **kw) == pytest.approx(1.0)
    assert lr_at(99, schedule="cosine", **kw) == pytest.approx(0.1, abs=1e-3)
    assert lr_at(50, schedule="wsd", **kw) == 1.0
    assert lr_at(99, schedule="wsd", **kw) == pytest.approx(0.1)
    assert lr_at(50, schedule="constant", **kw) == 1.0


def test_document_masking_keeps_attention_within_each_document():
    """Restarting positions make transformers mask attention across packed documents: the logits of the second
    document do not depend on the first."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from amalia_ray.core.shards import PackedSplit
    from amalia_ray.train.objectives import Pretrain

    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(vocab_size=50, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                         num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=16))
    second = [7, 8, 9, 10, 11]
    tokens = np.array([[1, 2, 3] + second, [4, 5, 6] + second])
    objective = Pretrain.__new__(Pretrain)
    objective.train = PackedSplit(tokens, np.array(["a", "a"], dtype=object), [[0, 3], [0, 3]])
    objective.document_masking = True
    batch = objective.batch(np.array([0, 1]))
    with torch.no_grad():
        masked = objective.logits(model, batch)
        plain = objective.logits(model, {"input_ids": batch["input_ids"]})
    assert torch.allclose(masked[0, 3:], masked[1, 3:], atol=1e-5), "document 2 sees only itself"
    assert not torch.allclose(plain[0, 3:], plain[1, 3:], atol=1e-3), "without masking it sees document 1"
