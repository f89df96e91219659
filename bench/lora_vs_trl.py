"""LoRA SFT: ours (a Ray Train worker, PEFT's adapters under FSDP2, our packing and loader) against TRL's SFTTrainer
with the same `peft_config` (packing, completion-only loss), on the same model, data, sequence length, global batch
and threads, in the same run. Prints JSON with tokens/s and peak resident memory of each and the ratios.

    .venv/bin/python bench/lora_vs_trl.py [--steps 30] [--threads 2] [--r 16]

Model, data and token counting as bench/train_vs_trl.py (Llama, hidden 256, 4 layers, ≈7.5 M parameters; the Debian
FAQ as conversations; seq 256, global batch 8; tokens/s over the steps after the first 3). Adapters: r 16, alpha 32,
every linear layer but the LM head (PEFT's "all-linear"), no dropout, lr 1e-3. Peak memory: the resident set of the
process that trains — our Ray Train worker (the largest its metrics report), TRL's own process (it runs in a child
process of its own so nothing of ours is counted in it).
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import tempfile
import time
from pathlib import Path

from train_vs_trl import bench_model, build_inputs, run_ours, run_trl


def _trl_child(args, conversations, tok_dir, hf_config_dict, tmp, lora, queue) -> None:
    from peft import LoraConfig
    from transformers import LlamaConfig

    peft_config = LoraConfig(r=lora["r"], lora_alpha=lora["alpha"], lora_dropout=lora["dropout"],
                             target_modules=lora["target_modules"], task_type="CAUSAL_LM")
    queue.put(run_trl(args, conversations, tok_dir, LlamaConfig.from_dict(hf_config_dict), tmp, peft_config))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--threads", type=int, default=2, help="torch threads of our worker and of TRL's process")
    parser.add_argument("--r", type=int, default=16)
    parser.add_argument("--seq-len", type=int, default=256)
    parser.add_argument("--batch", type=int, default=8)
    args = parser.parse_args()
    args.workers, args.compile = 1, False
    args.lora = {"r": args.r, "alpha": 2.0 * args.r, "dropout": 0.0, "target_modules": "all-linear",
                 "modules_to_save": [], "merge": False}
    model_cfg = bench_model(args.seq_len)

    from amalia_ray.train.train_stage import hf_config_dict

    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        chats, tok_dir, conversations = build_inputs(tmp)
        config = hf_config_dict(model_cfg, tok_dir)
        t0 = time.perf_counter()
        ours = run_ours(args, chats, tok_dir, model_cfg, tmp)
        ours["whole_s"] = time.perf_counter() - t0
        context = multiprocessing.get_context("spawn")
        queue = context.Queue()
        t0 = time.perf_counter()
        child = context.Process(target=_trl_child, args=(args, conversations, tok_dir, config, tmp, args.lora, queue))
        child.start()
        trl = queue.get()
        child.join()
        trl["whole_s"] = time.perf_counter() - t0
    print(json.dumps({
        "benchmark": "lora_vs_trl (LoRA SFT)", "seq_len": args.seq_len, "global_batch": args.batch,
        "steps": args.steps, "threads": args.threads, "lora": args.lora,
        "ours": {k: round(v, 4) for k, v in ours.items()}, "trl_sft_trainer_peft": {k: round(v, 4) for k, v in trl.items()},
        "ratio_tokens_per_s_ours_over_trl": round(ours["tokens_per_s"] / trl["tokens_per_s"], 3),
        "ratio_peak_rss_ours_over_trl": round(ours["peak_rss_gb"] / trl["peak_rss_gb"], 3),
    }, indent=2))


if __name__ == "__main__":
    main()
