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
