"""The packed-shard read position: exact resume from a state dict, epochs, source weights and the curriculum."""

import json

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from pydantic import ValidationError

from amalia_ray.core.config import CurriculumConfig
from amalia_ray.core.shards import MixtureSampler, PackedSplit, load_hook, phase_schedule

SEQ = 4


def sampler(schedule=None, seed=7, sizes=(("books", 30), ("web", 90))):
    start, rows = 0, {}
    for name, n in sizes:
        rows[name] = np.arange(start, start + n)
        start += n
    return MixtureSampler(rows, SEQ, seed, schedule)


def test_resume_from_state_dict_reads_exactly_what_the_uninterrupted_run_reads():
    straight = sampler()
    expected = [straight.next_rows(8) for _ in range(20)]
    first = sampler()
    got = [first.next_rows(8) for _ in range(7)]
    state = json.loads(json.dumps(first.state_dict()))  # it travels as JSON inside the checkpoint
    resumed = sampler()
    resumed.load_state_dict(state)
    got += [resumed.next_rows(8) for _ in range(13)]
    assert all(np.array_equal(a, b) for a, b in zip(got, expected))
    assert state["tokens"] == 7 * 8 * SEQ


def test_every_sequence_of_a_source_is_read_once_per_epoch():
    only = sampler(sizes=(("books", 40),))
    rows = np.concatenate([only.next_rows(8) for _ in range(5)])
    assert sorted(rows.tolist()) == list(range(40))
    assert not np.array_equal(np.concatenate([sampler(seed=8, sizes=(("books", 40),)).next_rows(8)]), rows[:8])


def test_default_mix_is_proportional_to_packed_sequences():
    s = sampler()
    rows = np.concatenate([s.next_rows(100) for _ in range(20)])
    assert 0.2 < np.mean(rows < 30) < 0.3  # books are 30 of 120 sequences


def test_curriculum_phases_switch_the_mix_at_token_counts():
    s = sampler(phase_schedule([{"until_tokens": 10 * 8 * SEQ, "weights": {"web": 1.0}},
                                {"until_tokens": None, "weights": {"books": 3.0, "web": 1.0}}]))
    early = np.concatenate([s.next_rows(8) for _ in range(10)])
    late = np.concatenate([s.next_rows(8) for _ in range(50)])
    assert (early >= 30).all(), "first phase: web only"
    assert 0.65 < np.mean(late < 30) < 0.85, "second phase: books 3:1"


def test_curriculum_hook_and_errors():
    assert load_hook("json:dumps") is json.dumps
    with pytest.raises(ValueError, match="package.module:function"):
        load_hook("nocolon")
    with pytest.raises(ValueError, match="unknown source"):
        sampler(lambda tokens, names: {"news": 1.0}).next_rows(4)
    with pytest.raises(ValueError, match="weight 0"):
        sampler(lambda tokens, names: {"web": 0.0}).next_rows(4)
    s = sampler()
    s.next_rows(4)
    with pytest.raises(ValueError, match="packed data changed"):
        sampler(sizes=(("books", 30),)).load_state_dict(s.state_dict())


def test_curriculum_config_validation():
    CurriculumConfig(phases=[{"until_tokens": 100, "weights": {"a": 1}}, {"weights": {"a": 1, "b": 1}}])
    CurriculumConfig(hook="my_pkg.mix:weights")
    for bad in ({}, {"phases": [{"weights": {"a": 1}}], "hook": "m:f"},
                {"phases": [{"weights": {"a": 1}}, {"until_tokens": 5, "weights": {"a": 1}}]},
                {"phases": [{"until_tokens": 9, "weights": {"a": 1}}, {"until_tokens": 5, "weights": {"a": 1}}]},
                {"phases": [{"weights": {"a": 0}}]}):
        with pytest.raises(ValidationError):
            CurriculumConfig(**bad)


def test_packed_split_reads_sources_and_document_starts(tmp_path):
    table = pa.table({"input_ids": pa.FixedSizeListArray.from_arrays(pa.array(np.arange(12, dtype=np.int32)), 4),
                      "doc_starts": [[0, 2], [0], [1]], "source": ["web", "books", "web"]})
    pq.write_table(table, tmp_path / "part-0.parquet")
    split = PackedSplit.read(tmp_path)
    assert split.tokens.shape == (3, 4) and split.doc_starts == [[0, 2], [0], [1]]
    assert {k: v.tolist() for k, v in split.rows_by_source().items()} == {"books": [1], "web": [0, 2]}


def test_positions_restart_at_every_document():
    split = PackedSplit(np.zeros((2, 8), np.int64), np.array(["a", "a"], dtype=object), [[0, 3, 6], [2]])
    assert split.position_ids(np.array([0, 1])).tolist() == [[0, 1, 2, 0, 1, 2, 0, 1], [0, 1, 0, 1, 2, 3, 4, 5]]
