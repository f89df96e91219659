"""SFT throughput: ours (Ray Train worker(s), FSDP2, best-fit-decreasing packing, assistant-only loss, our loader)
against TRL's SFTTrainer (packing, completion-only loss) on the same model, data, sequence length, global batch and
cores, in the same run. Prints JSON with tokens/s and MFU of each and the ratio.

    .venv/bin/python bench/train_vs_trl.py [--steps 30] [--workers 1] [--threads 2] [--compile]

`--compile` compiles both sides (ours: torch.compile per decoder block; TRL: its `torch_compile` option); run it with
and without to see both ways.
Model: Llama, hidden 256, 4 layers, vocab 8192 (≈7.5 M parameters), seq 256, global batch 8. Data: the Debian FAQ
(European Portuguese) as question-answer conversations; a byte-level BPE tokenizer trained here on the Debian
manuals. Tokens/s counts real tokens (padding excluded on both sides) over the steps after the first 3 (warm-up);
MFU: model FLOPs per token (core/flops.py) × tokens/s over one peak for both sides, a matmul measured here with the
same threads. End-to-end wall times (start-up included) are reported too.
"""

from __future__ import annotations

import argparse
import gzip
import json
import os
import tempfile
import time
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import torch

FAQ = Path("/usr/share/doc/debian/FAQ/debian-faq.pt.txt.gz")
MANUAL = Path("/usr/share/debian-reference/debian-reference.pt.txt.gz")
WARMUP = 3


def bench_model(seq_len: int):
    """The benchmark's model (a local Ray without token auth, tokenizers without their own threads)."""
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    from amalia_ray.core.config import ModelConfig

    return ModelConfig(hidden_size=256, intermediate_size=768, num_layers=4, num_heads=4, num_kv_heads=4,
                       max_position_embeddings=max(512, seq_len))


def build_inputs(tmp: Path) -> tuple[Path, Path, list[dict]]:
    from amalia_ray.core.config import TokenizerConfig
    from amalia_ray.core.formats.conversations import write_conversations
    from amalia_ray.data.posttrain.faq_chats import faq_conversations
    from amalia_ray.data.tokenize.tokenizer import train_tokenizer

    corpus = tmp / "corpus"
    corpus.mkdir()
    texts = [p for f in (MANUAL, FAQ) for p in gzip.open(f, "rt", encoding="utf-8").read().split("\n\n") if p.strip()]
    pq.write_table(pa.table({"text": texts}), corpus / "part.parquet")
    train_tokenizer(corpus, tmp / "tok", TokenizerConfig(vocab_size=8192))
    conversations = faq_conversations(gzip.open(FAQ, "rt", encoding="utf-8").read())
    write_conversations(conversations, tmp / "chats.jsonl")
    return tmp / "chats.jsonl", tmp / "tok", conversations


def run_ours(args, chats: Path, tok_dir: Path, model_cfg, tmp: Path) -> dict:
    import ray

    from amalia_ray.core.config import SFTStage
    from amalia_ray.train.train_stage import run_train_stage

    ray.init(address="local", num_cpus=max(8, os.cpu_count() or 1), include_dashboard=False, log_to_driver=False)
    stage = SFTStage(name="sft", objective="sft", dataset=str(chats), seq_len=args.seq_len, steps=args.steps,
                     global_batch_size=args.batch, micro_batch_size=args.batch // args.workers,
                     num_workers=args.workers, cpus_per_worker=args.threads, lr=1e-3, warmup_steps=0,
                     compile=args.compile, lora=getattr(args, "lora", None),
                     checkpoint_every=10**6, log_every=10**6)
    t0 = time.perf_counter()
    run_train_stage(stage, model_cfg, data_dir=chats, tokenizer_dir=tok_dir, init_hf_dir=None,
                    stage_dir=tmp / "ours", ray_run_name="bench-sft", seed=0, use_gpu=False)
    wall = time.perf_counter() - t0
    ray.shutdown()
    everything = [json.loads(ln) for ln in (tmp / "ours" / "metrics.jsonl").read_text().splitlines()]
    history = everything[WARMUP:]
    seconds = sum(h["step_time_s"] for h in history)
    return {"tokens_per_s": sum(h["tokens"] for h in history) / seconds, "wall_s": wall,
            "mean_loss": sum(h["loss"] for h in everything) / len(everything),
            "peak_rss_gb": max(h["memory_gb"] for h in everything)}


def run_trl(args, conversations: list[dict], tok_dir: Path, hf_config, tmp: Path, peft_config=None) -> dict:
    from datasets import Dataset
    from transformers import AutoTokenizer, LlamaForCausalLM, TrainerCallback
    from trl import SFTConfig, SFTTrainer

    torch.set_num_threads(args.threads * args.workers)
    tok = AutoTokenizer.from_pretrained(str(tok_dir))
    rows = [{"prompt": c["messages"][:-1], "completion": c["messages"][-1:]} for c in conversations]
    torch.manual_seed(0)
    model = LlamaForCausalLM(hf_config)
    config = SFTConfig(output_dir=str(tmp / "trl"), max_length=args.seq_len, packing=True,
                       per_device_train_batch_size=args.batch, max_steps=args.steps, learning_rate=1e-3,
                       lr_scheduler_type="constant", report_to=[], use_cpu=True, bf16=False, logging_steps=10**6,
                       save_strategy="no", dataloader_num_workers=0, seed=0, torch_compile=args.compile)
    t0 = time.perf_counter()
    trainer = SFTTrainer(model=model, args=config, processing_class=tok, train_dataset=Dataset.from_list(rows),
                         peft_config=peft_config)
    tokens_per_step: list[int] = []
    collate = trainer.data_collator

    def counting_collator(examples):
        tokens_per_step.append(sum(len(e["input_ids"]) for e in examples))
        return collate(examples)

    trainer.data_collator = counting_collator
    step_times: list[float] = []

    class Timer(TrainerCallback):
        def on_step_begin(self, *a, **k):
            self.t0 = time.perf_counter()

        def on_step_end(self, *a, **k):
            step_times.append(time.perf_counter() - self.t0)

    trainer.add_callback(Timer())
    result = trainer.train()
    wall = time.perf_counter() - t0
    seconds = sum(step_times[WARMUP:])
    tokens_per_s = sum(tokens_per_step[WARMUP:len(step_times)]) / seconds
    import resource

    return {"tokens_per_s": tokens_per_s, "wall_s": wall, "mean_loss": result.training_loss,
            "peak_rss_gb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--workers", type=int, default=1, help="our Ray Train workers (FSDP2 when > 1)")
    parser.add_argument("--threads", type=int, default=2, help="torch threads per worker; TRL gets workers×threads")
    parser.add_argument("--compile", action="store_true", help="compile both: ours per decoder block, TRL's "
                        "torch_compile")
    parser.add_argument("--seq-len", type=int, default=256)
    parser.add_argument("--batch", type=int, default=8)
    args = parser.parse_args()
    model_cfg = bench_model(args.seq_len)

    from transformers import LlamaConfig

    from amalia_ray.core.flops import flops_per_token_of
    from amalia_ray.train.train_metrics import matmul_peak_flops
    from amalia_ray.train.train_stage import hf_config_dict

    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        chats, tok_dir, conversations = build_inputs(tmp)
        hf_config = LlamaConfig.from_dict(hf_config_dict(model_cfg, tok_dir))
        ours = run_ours(args, chats, tok_dir, model_cfg, tmp)
        torch.set_num_threads(args.threads * args.workers)
        peak = matmul_peak_flops(torch.device("cpu"), torch.float32, seconds=2.0)
        flops = flops_per_token_of(hf_config, args.seq_len)
        trl = run_trl(args, conversations, tok_dir, hf_config, tmp)
        for side in (ours, trl):
            side["mfu"] = flops * side["tokens_per_s"] / peak
    params = sum(p.numel() for p in __import__("transformers").LlamaForCausalLM(hf_config).parameters())
    print(json.dumps({
        "benchmark": "train_vs_trl (SFT)", "model_parameters": params, "seq_len": args.seq_len,
        "global_batch": args.batch, "steps": args.steps, "ours_workers": args.workers, "compiled_both": args.compile,
        "threads_per_worker": args.threads,
        "mfu_peak": f"measured fp32 matmul on cpu, {args.threads * args.workers} threads, {peak / 1e9:.1f} GFLOP/s",
        "ours": {k: round(v, 4) for k, v in ours.items()}, "trl_sft_trainer": {k: round(v, 4) for k, v in trl.items()},
        "ratio_tokens_per_s_ours_over_trl": round(ours["tokens_per_s"] / trl["tokens_per_s"], 3),
    }, indent=2))


if __name__ == "__main__":
    main()
