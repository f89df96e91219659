"""The GPU checks for one H100 / H200, in one script of at most 570 s, printing JSON (a line per part, then a
summary): what a lent device is for.

1. `train`: step MFU and tokens/s of pretraining random models with the shapes of two public configs (Qwen2.5-0.5B and
   Qwen2.5-1.5B; built here, nothing downloaded) on packed rows of 4,096 and 16,384 tokens: one FSDP2 worker, bf16,
   FlexAttention document masks, activation checkpointing; MFU against the measured matmul peak. The stage's one
   checkpoint gives DCP save seconds per GB (`last_checkpoint_s`).
2. `rollout`: `bench/rollout_scaling.py --gpu`: a one-engine fleet's sampling rate, and 3 GRPO steps with the engine
   colocated on the trainer's GPU, asleep while the trainer steps and woken for each rollout.
3. `serve`: `bench/serve_overhead.py`: Ray Serve against a bare `vllm serve` on that GPU, tokens/s.

Goals: MFU >= 40% at 1.5 B / 4 k; serve >= 0.9x bare vLLM. A part that fails prints its error and the rest still
run. The whole check keeps within --budget (570 s on a GPU: one device command): a train run starts only while
the rollout part (up to 300 s: two engine starts, each compiling and capturing CUDA graphs, and a Ray Train stage)
and the serve part (up to 150 s) have 390 s left, and each gets what remains. The times are estimates: this script
has not run on a GPU yet. One GPU cannot check the weight push over NCCL or tensor-parallel engines (both need
engines on GPUs of their own). One checkpoint at a time is kept on disk (a 1.5 B model's, with its AdamW state, is
~18 GB).

    .venv/bin/python bench/gpu/one_gpu.py          # one CUDA GPU (the GPU extra installed)
    .venv/bin/python bench/gpu/one_gpu.py --cpu    # the plumbing here: tiny shapes, a few steps
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))  # the tests' model and data makers

# the later parts' most seconds on a GPU (two engine starts compiling and capturing CUDA graphs and a Ray Train
# stage; two eager engines), and the least the rollout part is left by the train part
ROLLOUT_S, SERVE_S, ROLLOUT_LEAST_S = 300, 150, 240

# public configs' shapes (Qwen2.5-0.5B and -1.5B), vocabulary included; the weights are random
SHAPES = {
    "0.5b": dict(hidden_size=896, intermediate_size=4864, num_hidden_layers=24, num_attention_heads=14,
                 num_key_value_heads=2, vocab_size=151936),
    "1.5b": dict(hidden_size=1536, intermediate_size=8960, num_hidden_layers=28, num_attention_heads=12,
                 num_key_value_heads=2, vocab_size=151936),
}
TINY = {"tiny": dict(hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
                     num_key_value_heads=2, vocab_size=2048)}


def make_model(folder: Path, dims: dict, max_len: int) -> Path:
    """A random Qwen 2 of `dims`, saved in bf16 with a byte-level BPE tokenizer."""
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from tests.base_models import family_tokenizer

    folder.mkdir(parents=True)
    family_tokenizer(folder, "chatml", vocab_size=min(16000, dims["vocab_size"] - 64))  # room for special tokens
    config = Qwen2Config(max_position_embeddings=max(max_len, 2048), tie_word_embeddings=True, **dims)
    torch.manual_seed(0)
    # on the host: built on the GPU, the driver's allocator would keep the memory through the parts after it
    Qwen2ForCausalLM(config).to(torch.bfloat16).save_pretrained(str(folder), max_shard_size="2GB")
    return folder


def train(work: Path, on_cpu: bool, stop_at: float) -> dict:
    from amalia_ray.core.config import ModelConfig, PretrainStage
    from amalia_ray.train.train_stage import run_train_stage
    from tests.test_shards import write_packed_split

    shapes, lengths, steps = (TINY, [128, 256], 3) if on_cpu else (SHAPES, [4096, 16384], 6)
    out = {}
    for name, dims in shapes.items():
        base = make_model(work / f"base-{name}", dims, max(lengths))
        for seq_len in lengths:
            key, batch = f"{name}@{seq_len}", max(1, 16384 // seq_len) if not on_cpu else 2
            if time.monotonic() > stop_at:  # the later parts keep their time
                out[key] = {"skipped": "past the train part's share of --budget"}
                continue
            data = work / f"packed-{key}"
            for split, rows in (("train", batch * (steps + 1)), ("validation", batch)):
                write_packed_split(data / split, rows, seq_len, rows_per_group=batch, files=1, vocab=min(
                    16000, dims["vocab_size"]))
            stage = PretrainStage(name=f"pt-{key}".replace(".", "-").replace("@", "-"), objective="pretrain",
                                  steps=steps, global_batch_size=batch, micro_batch_size=batch,  # rows: seq_len
                                  num_workers=1, warmup_steps=0, lr=1e-5, log_every=1,
                                  checkpoint_every=steps - 1,  # a save's time is in the record of the step after it
                                  checkpoints_to_keep=1,  # a 1.5 B model's checkpoint with its AdamW state: ~18 GB
                                  checkpoint_async=False,  # written in place: its time is the save rate itself
                                  activation_checkpointing=not on_cpu, precision="fp32" if on_cpu else "bf16")
            # FlexAttention has no backward on CPU: there the plumbing runs on sdpa
            model = ModelConfig.model_validate({"from": str(base),
                                                "attn_implementation": "sdpa" if on_cpu else "flex_attention"})
            started = time.monotonic()
            run_train_stage(stage, model, data_dir=data, tokenizer_dir=base, init_hf_dir=base, base_dir=base,
                            stage_dir=work / stage.name, ray_run_name=f"one-gpu-{stage.name}", seed=0,
                            use_gpu=not on_cpu, progress=False)
            history = [json.loads(ln) for ln in (work / stage.name / "metrics.jsonl").read_text().splitlines()
                       if ln]
            steady = history[len(history) // 2:]  # past compilation and warm-up
            saved = [h["last_checkpoint_s"] for h in history if "last_checkpoint_s" in h]
            shards = list((work / stage.name).rglob("*.distcp"))
            checkpoint_gb = sum(f.stat().st_size for f in shards) / max(1, len({f.parent for f in shards})) / 2**30
            out[key] = {"steps": len(history), "tokens_per_s": round(sum(h["tokens_per_s"] for h in steady)
                                                                       / len(steady), 1),
                        "mfu": round(sum(h["mfu"] for h in steady) / len(steady), 4),
                        "memory_gb": max(h.get("memory_gb") or 0 for h in history),
                        "checkpoint_save_s_per_gb": round(saved[-1] / checkpoint_gb, 2) if saved and checkpoint_gb
                        else None, "wall_s": round(time.monotonic() - started)}
            shutil.rmtree(work / stage.name, ignore_errors=True)  # the disk holds one run's checkpoints at a time
            shutil.rmtree(data, ignore_errors=True)
    return out


def script(args: list[str], timeout_s: int) -> dict:
    """Another benchmark of ours, run whole, and the JSON it prints last."""
    from bench.run import last_json

    if timeout_s < 30:
        raise RuntimeError(f"{' '.join(args)} not run: {timeout_s} s of --budget left")

    try:
        done = subprocess.run([sys.executable, *args], cwd=ROOT, capture_output=True, text=True, timeout=timeout_s)
    except subprocess.TimeoutExpired as e:  # how far it got: the scripts print each phase as it starts
        tail = lambda out: (out.decode(errors="replace") if isinstance(out, bytes) else out or "")[-1500:]  # noqa: E731
        raise RuntimeError(f"{' '.join(args)} ran past {timeout_s} s; its output ends: {tail(e.stdout)} | "
                           f"{tail(e.stderr)}") from None
    if done.returncode:
        errors = [ln for ln in done.stderr.splitlines() if "Error" in ln or "error:" in ln]
        raise RuntimeError(f"{' '.join(args)} exited {done.returncode}: {' | '.join(errors[-6:])[-2000:]}")
    return last_json(done.stdout)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--cpu", action="store_true", help="the plumbing here: tiny shapes, a few steps")
    parser.add_argument("--budget", type=float, help="seconds for the whole check (default: 570 on a GPU, within "
                        "a lent device's 600-s command; 3600 with --cpu): a train run starts only while the later "
                        "parts' time (240 s + 150 s) is left, and each later part gets what remains")
    args = parser.parse_args()
    deadline = time.monotonic() + (args.budget or (3600 if args.cpu else 570))
    left = lambda keep=0: int(deadline - time.monotonic() - keep)  # noqa: E731
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    import ray
    import torch

    if not args.cpu and not torch.cuda.is_available():
        sys.exit("a CUDA GPU is needed (or --cpu)")
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        ray.init(num_cpus=8, num_gpus=0 if args.cpu else 1, include_dashboard=False, log_to_driver=False)
        try:
            results["train"] = run_part("train", lambda: train(work, args.cpu, deadline - SERVE_S - ROLLOUT_LEAST_S))
        finally:
            ray.shutdown()  # the other parts start their own
        rollout = ["bench/rollout_scaling.py", "--steps", "3"] + (
            ["--hidden", "128", "--layers", "2", "--rollout-prompts", "8"] if args.cpu else ["--gpu"])
        results["rollout"] = run_part("rollout", lambda: script(rollout, min(ROLLOUT_S, left(SERVE_S))))
        served = work / ("base-tiny" if args.cpu else "base-0.5b")
        results["serve"] = run_part("serve", lambda: script(
            ["bench/serve_overhead.py", "--checkpoint", str(served), "--requests", "16" if args.cpu else "256",
             "--rounds", "1" if args.cpu else "2", *([] if args.cpu else ["--gpu"])], min(SERVE_S, left())))
    print(json.dumps({"device": "cpu" if args.cpu else torch.cuda.get_device_name(0),
                      "ok": all(r["ok"] for r in results.values())}))


def run_part(name: str, part) -> dict:
    started = time.monotonic()
    try:
        result = {"ok": True, **part()}
    except Exception as e:  # noqa: BLE001 - one failed part must not hide the others' results
        result = {"ok": False, "error": f"{type(e).__name__}: {e}"[:2000], "traceback": traceback.format_exc()[-3000:]}
    result["part_s"] = round(time.monotonic() - started)
    print(json.dumps({"part": name, **result}), flush=True)
    return result


if __name__ == "__main__":
    main()
