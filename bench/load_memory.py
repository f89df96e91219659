"""Peak memory of loading a base model into FSDP2 workers: each worker builds the model on the meta device and
reads only its own rows of each safetensors tensor. Prints JSON per worker: how much its peak resident memory grew
while loading, against the whole model's fp32 size (1.0 would mean a worker held all of it).

    .venv/bin/python bench/load_memory.py [--workers 2] [--hidden 1024] [--layers 6] [--vocab 16000]

The checkpoint is a random Llama written by transformers in bf16, sharded into 50 MB files with an index (the
hub's layout). The same measurement, with a bound, is tests/test_base_model.py::test_no_worker_holds_the_whole_model.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

import torch.multiprocessing as mp

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # the tests' checkpoint maker and worker


def main() -> None:
    from transformers import AutoConfig, AutoModelForCausalLM

    from tests.base_models import make_base_model
    from tests.conftest import free_port
    from tests.test_base_model import _rss_while_loading

    parser = argparse.ArgumentParser()
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--layers", type=int, default=6)
    parser.add_argument("--vocab", type=int, default=16000)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        folder = make_base_model(Path(tmp) / "model", "llama", hidden=args.hidden, layers=args.layers,
                                 vocab=args.vocab, shard_size="50MB", with_tokenizer=False)
        import torch

        with torch.device("meta"):
            params = sum(p.numel() for p in AutoModelForCausalLM.from_config(
                AutoConfig.from_pretrained(str(folder))).parameters())
        out = Path(tmp) / "rss"
        out.mkdir()
        mp.spawn(_rss_while_loading, args=(args.workers, free_port(), str(folder), str(out)), nprocs=args.workers)
        rows = []
        for rank in range(args.workers):
            r = json.loads((out / f"rank{rank}.json").read_text())
            grew = r["peak"] - r["before"]
            rows.append({"rank": rank, "peak_growth_mb": round(grew / 1e6), "of_model": round(grew / (4 * params), 3)})
    print(json.dumps({"parameters": params, "model_fp32_mb": round(4 * params / 1e6), "workers": args.workers,
                      "per_worker": rows}, indent=1))


if __name__ == "__main__":
    main()
