"""Peak memory of a training worker reading packed pretraining data, against the split's size: the worker streams
the Parquet row groups its batches need (a few cached), so its memory stays flat as the split grows; loading the
whole split, as training once did, grows with it. Prints JSON per split size.

    .venv/bin/python bench/packed_stream_memory.py [--base-rows 4000] [--seq-len 256] [--scales 1 20 100]

Splits are written in the pack stage's layout and row-group size (`core/formats/shards.py`), with random tokens; the base
size is about the demo's training split (`amalia run recipes/demo.yaml`: the pack stage's train_sequences). Each
reading runs in a fresh process, one of two workers reading 200 global batches of 64 sequences. The same
measurement, with a bound, is tests/test_shards.py::test_a_worker_streams_the_packed_split_in_memory_flat_in_its_size.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # the tests' split writer and measurement


def main() -> None:
    from amalia_ray.core.formats.shards import rows_per_group
    from tests.test_shards import _in_fresh_process, write_packed_split

    parser = argparse.ArgumentParser()
    parser.add_argument("--base-rows", type=int, default=4000)
    parser.add_argument("--seq-len", type=int, default=256)
    parser.add_argument("--scales", type=int, nargs="+", default=[1, 20, 100])
    args = parser.parse_args()
    results = []
    with tempfile.TemporaryDirectory() as tmp:
        for scale in args.scales:
            folder = Path(tmp) / f"x{scale}"
            size = write_packed_split(folder, args.base_rows * scale, args.seq_len, rows_per_group(args.seq_len))
            read = (str(folder), 200, 64, 2)
            results.append({"scale": scale, "sequences": args.base_rows * scale, "split_mb": round(size / 2**20, 1),
                            "streamed_peak_growth_mb": round(_in_fresh_process(*read, False), 1),
                            "whole_split_peak_growth_mb": round(_in_fresh_process(*read, True), 1)})
            print(json.dumps(results[-1]), flush=True)
    print(json.dumps({"seq_len": args.seq_len, "rows_per_group": rows_per_group(args.seq_len), "results": results}))


if __name__ == "__main__":
    main()
