"""The packed-shard read position: exact resume from a state dict, epochs, source weights and the curriculum."""

import json

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from pydantic import ValidationError

from amalia_ray.core.config import CurriculumConfig
from amalia_ray.core.formats.shards import MixtureSampler, PackedSplit, document_positions, load_hook, phase_schedule

SEQ = 4


def sampler(schedule=None, seed=7, sizes=(("books", 30), ("web", 90))):
    start, blocks = 0, {}
    for name, n in sizes:  # blocks of 7 rows, the last one shorter: as row groups of a packed split
        blocks[name] = np.array([(a, min(7, start + n - a)) for a in range(start, start + n, 7)])
        start += n
    return MixtureSampler(blocks, SEQ, seed, schedule)


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
    pq.write_table(table, tmp_path / "part-0.parquet", row_group_size=2)
    split = PackedSplit.read(tmp_path)
    assert len(split) == 3 and split.seq_len == 4
    tokens, starts = split.take(np.array([2, 0, 1]))
    assert tokens.tolist() == [[8, 9, 10, 11], [0, 1, 2, 3], [4, 5, 6, 7]] and starts == [[1], [0, 2], [0]]
    assert {k: v.tolist() for k, v in split.rows_by_source().items()} == {"books": [1], "web": [0, 2]}
    assert {k: v.tolist() for k, v in split.blocks.items()} == {"books": [[1, 1]], "web": [[0, 1], [2, 1]]}


def test_positions_restart_at_every_document():
    assert document_positions([[0, 3, 6], [2]], 8).tolist() == [[0, 1, 2, 0, 1, 2, 0, 1], [0, 1, 0, 1, 2, 3, 4, 5]]


def write_packed_split(folder, rows: int, seq_len: int, rows_per_group: int, files: int = 4,
                       vocab: int = 32000) -> int:
    """A packed split in the pack stage's layout: random tokens below `vocab`, two sources in runs of 100
    sequences, a few documents per sequence. Returns its token bytes as int32."""
    rng = np.random.default_rng(0)
    folder.mkdir(parents=True, exist_ok=True)
    per_file = -(-rows // files)
    for i, lo in enumerate(range(0, rows, per_file)):
        n = min(per_file, rows - lo)
        tokens = rng.integers(0, vocab, size=n * seq_len, dtype=np.int32)
        starts = [sorted({0, *rng.integers(1, seq_len, size=3).tolist()}) for _ in range(n)]
        sources = ["web" if (lo + r) // 100 % 3 else "books" for r in range(n)]
        table = pa.table({"input_ids": pa.FixedSizeListArray.from_arrays(pa.array(tokens), seq_len),
                          "doc_starts": pa.array(starts, pa.list_(pa.int32())), "source": sources})
        pq.write_table(table, folder / f"part-{i:06}.parquet", row_group_size=rows_per_group)
    return rows * seq_len * 4


def peak_rss_growth_mb(split_dir: str, steps: int, global_batch: int, world: int, whole: bool) -> float:
    """Run in a fresh process: how far peak resident memory grows while one of `world` workers reads `steps`
    global batches of the split, streaming (whole=False) or after loading the whole split into memory as training
    once did (whole=True)."""
    from pathlib import Path

    def high_water_kb() -> int:
        status = Path("/proc/self/status").read_text()
        return int(status.split("VmHWM:")[1].split()[0])

    import tempfile

    with tempfile.TemporaryDirectory() as warm:  # libraries load and allocators set up outside the measurement
        write_packed_split(Path(warm), 10, 8, 4)
        tiny = PackedSplit.read(Path(warm))
        tiny.take(MixtureSampler(tiny.blocks, tiny.seq_len, 0).next_rows(4))
        pq.read_table(Path(warm) / "part-000000.parquet").column("input_ids").combine_chunks().values.to_numpy()
    Path("/proc/self/clear_refs").write_text("5")  # the peak starts again from what the process holds now
    before = high_water_kb()
    if whole:
        tables = [pq.read_table(f) for f in sorted(Path(split_dir).glob("*.parquet"))]
        ids = pa.concat_tables(tables).column("input_ids").combine_chunks()
        tokens = ids.values.to_numpy(zero_copy_only=False).reshape(-1, ids.type.list_size).astype(np.int64)
        sampler = MixtureSampler({"all": np.array([[0, len(tokens)]])}, tokens.shape[1], 0)
        for _ in range(steps):
            tokens[sampler.next_rows(global_batch)[0::world]].sum()
    else:
        split = PackedSplit.read(Path(split_dir))
        sampler = MixtureSampler(split.blocks, split.seq_len, 0)
        for _ in range(steps):
            split.take(sampler.next_rows(global_batch)[0::world])[0].sum()
    return (high_water_kb() - before) / 1024


def _in_fresh_process(*args) -> float:
    import multiprocessing as mp

    with mp.get_context("spawn").Pool(1) as pool:
        return pool.apply(peak_rss_growth_mb, args)


def test_a_worker_streams_the_packed_split_in_memory_flat_in_its_size(tmp_path):
    """A split 20× larger costs a reading worker no more memory: it holds a few row groups, never the split.
    Loading the whole split, as a check that the measurement sees it, grows by about the split's size."""
    seq_len, group = 128, 256  # 128 KiB row groups
    small, large = tmp_path / "1x", tmp_path / "20x"
    write_packed_split(small, 2_000, seq_len, group)
    large_bytes = write_packed_split(large, 40_000, seq_len, group)
    read = dict(steps=150, global_batch=64, world=2)
    streamed_small = _in_fresh_process(str(small), *read.values(), False)
    streamed_large = _in_fresh_process(str(large), *read.values(), False)
    whole_large = _in_fresh_process(str(large), *read.values(), True)
    assert whole_large > 1.5 * large_bytes / 2**20, "the measurement sees a split held in memory"
    assert streamed_large < streamed_small + 8, (streamed_small, streamed_large)
    assert streamed_large < whole_large - large_bytes / 2**20, (streamed_large, whole_large)
