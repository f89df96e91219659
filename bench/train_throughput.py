"""Training throughput of our loop (Ray Train, FSDP2 workers) against a bare single-process PyTorch loop on the same
tiny Llama, batch and thread budget, in the same run. Prints JSON; the ratio is what to compare across machines.

    .venv/bin/python bench/train_throughput.py [--steps 30] [--workers 2]
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import torch


def bare_torch(hf_config: dict, data: np.ndarray, steps: int, batch: int, threads: int) -> float:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.set_num_threads(threads)
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig.from_dict(hf_config))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    tokens, elapsed = 0, 0.0
    for step in range(steps):
        ids = torch.from_numpy(data[(step * batch) % len(data):][:batch])
        t0 = time.perf_counter()
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
        if step >= 3:  # skip warm-up steps
            elapsed += time.perf_counter() - t0
            tokens += ids.numel()
    return tokens / elapsed


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--seq-len", type=int, default=256)
    parser.add_argument("--batch", type=int, default=8)
    args = parser.parse_args()
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")

    import ray

    from amalia_ray.core.config import ModelConfig, PretrainStage
    from amalia_ray.train.model import llama_config
    from amalia_ray.train.train_stage import run_train_stage

    vocab = 4096
    rng = np.random.default_rng(0)
    data = rng.integers(0, vocab, size=(512, args.seq_len), dtype=np.int64)
    model_cfg = ModelConfig()
    hf_config = llama_config(model_cfg, vocab, 1, [2], 0).to_dict()
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        (tmp / "pack" / "train").mkdir(parents=True)
        pq.write_table(pa.table({"input_ids": pa.FixedSizeListArray.from_arrays(
            pa.array(data.reshape(-1).astype(np.int32)), args.seq_len)}), tmp / "pack" / "train" / "part.parquet")
        (tmp / "tok").mkdir()
        ray.init(address="local", num_cpus=8, include_dashboard=False, log_to_driver=False)
        stage = PretrainStage(name="bench", objective="pretrain", steps=args.steps, global_batch_size=args.batch,
                              micro_batch_size=args.batch // args.workers, num_workers=args.workers,
                              warmup_steps=0, checkpoint_every=10**6, log_every=10**6)
        run_train_stage(stage, model_cfg, data_dir=tmp / "pack", tokenizer_dir=tmp / "tok", init_hf_dir=None,
                        stage_dir=tmp / "stage", ray_run_name="bench", seed=0, use_gpu=False,
                        hf_config=hf_config)  # synthetic tokens: no tokenizer needed
        ray.shutdown()
        history = [json.loads(ln) for ln in (tmp / "stage" / "metrics.jsonl").read_text().splitlines()][3:]
        ours = sum(h["tokens"] for h in history) / sum(h["step_time_s"] for h in history)
    peer = bare_torch(hf_config, data, args.steps, args.batch, threads=args.workers)
    print(json.dumps({
        "benchmark": "train_throughput", "model": "llama hidden 256, 4 layers, vocab 4096",
        "seq_len": args.seq_len, "global_batch": args.batch, "workers": args.workers, "steps": args.steps,
        "ours_ray_train_fsdp2_tokens_per_s": round(ours, 1), "peer_bare_torch_tokens_per_s": round(peer, 1),
        "ratio_ours_over_peer": round(ours / peer, 3),
    }, indent=2))


if __name__ == "__main__":
    main()
