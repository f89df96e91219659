"""One-shot GPU check of the cluster path, for the day two CUDA GPUs are lent: in one go on an embedded Ray,
1. SFT of a ~1B random Llama (bf16, FSDP2 over 2 GPU workers, activation checkpointing) for 50 steps, printing
   tokens/s and MFU against the measured matmul peak;
2. GRPO for 5 steps from that export (1 training worker; the vLLM rollout engine on the other GPU — the engine is
   not colocated with training yet), printing the KL and completion lengths;
3. the SFT export served by Ray Serve + vLLM with tensor_parallel_size 2 (one replica over both GPUs), one
   completion over HTTP.
Prints one JSON line per part and a summary; a part that fails prints its error and the rest still run.

    .venv/bin/python bench/gpu/one_shot.py          # two CUDA GPUs (GPU extra installed)
    .venv/bin/python bench/gpu/one_shot.py --cpu    # the same parts here on a tiny model (serving on 1 CPU replica)
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
import traceback
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the tests' tokenizer maker and FAQ text


def make_model(folder: Path, on_cpu: bool) -> Path:
    """A random Llama (~1 B parameters on GPU, tiny on CPU) with a byte-level BPE tokenizer and chat template."""
    import torch
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    from tests.base_models import family_tokenizer

    folder.mkdir(parents=True)
    family_tokenizer(folder, "llama", vocab_size=2000 if on_cpu else 16000)
    vocab = -(-len(AutoTokenizer.from_pretrained(str(folder))) // 64) * 64
    dims = dict(hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2) if on_cpu else dict(
        hidden_size=2048, intermediate_size=5632, num_hidden_layers=22, num_attention_heads=16, num_key_value_heads=8)
    config = LlamaConfig(vocab_size=vocab, max_position_embeddings=4096, bos_token_id=1, eos_token_id=2,
                         pad_token_id=0, **dims)
    torch.manual_seed(0)
    LlamaForCausalLM(config).to(torch.bfloat16).save_pretrained(str(folder), max_shard_size="2GB")
    return folder


def sft(base: Path, work: Path, on_cpu: bool) -> dict:
    from amalia_ray.core.config import ModelConfig, SFTStage
    from amalia_ray.data.posttrain.faq_chats import write_faq_conversations
    from amalia_ray.train.train_stage import run_train_stage
    from tests.base_models import FAQ

    chats = work / "faq-chat.jsonl"
    write_faq_conversations(FAQ, chats)
    steps = 5 if on_cpu else 50
    stage = SFTStage(name="sft", objective="sft", dataset=str(chats), steps=steps,
                     seq_len=256 if on_cpu else 2048, global_batch_size=8 if on_cpu else 32,
                     micro_batch_size=4, num_workers=2, warmup_steps=2, lr=1e-5, checkpoint_every=steps,
                     log_every=1, activation_checkpointing=not on_cpu,
                     precision="fp32" if on_cpu else "bf16")
    started = time.monotonic()
    run_train_stage(stage, ModelConfig.model_validate({"from": str(base)}), data_dir=chats, tokenizer_dir=base,
                    init_hf_dir=base, base_dir=base, stage_dir=work / "sft", ray_run_name="one-shot-sft", seed=0,
                    use_gpu=not on_cpu, progress=False)
    history = [json.loads(ln) for ln in (work / "sft" / "metrics.jsonl").read_text().splitlines() if ln]
    steady = history[len(history) // 2:]  # past compilation and warm-up
    return {"steps": len(history), "loss": [history[0]["loss"], history[-1]["loss"]],
            "tokens_per_s": sum(h["tokens_per_s"] for h in steady) / len(steady),
            "mfu_vs_measured_matmul_peak": sum(h["mfu"] for h in steady) / len(steady),
            "memory_gb": max(h.get("memory_gb") or 0 for h in history), "wall_s": round(time.monotonic() - started)}


def grpo(base: Path, work: Path, on_cpu: bool) -> dict:
    from amalia_ray.core.config import GRPOStage, ModelConfig
    from amalia_ray.core.formats.rl_tasks import write_tasks
    from amalia_ray.data.posttrain.arithmetic_tasks import arithmetic_tasks
    from amalia_ray.train.train_stage import run_train_stage

    tasks = work / "arithmetic.jsonl"
    write_tasks(arithmetic_tasks(64, seed=0), tasks)
    stage = GRPOStage(name="grpo", objective="grpo", dataset=str(tasks), steps=5, seq_len=256,
                      global_batch_size=8, micro_batch_size=4, num_workers=1 if on_cpu else 2, warmup_steps=0,
                      lr=1e-6,
                      checkpoint_every=5, log_every=1, num_generations=4, max_completion_length=32,
                      kl_coef=0.05, rewards=["format", "exact_answer", "has_number"],
                      reward_weights=[1.0, 1.0, 0.2],  # a signal a random model can already earn
                      precision="fp32" if on_cpu else "bf16")  # the rollout engine's defaults: colocated, sized
    started = time.monotonic()
    run_train_stage(stage, ModelConfig.model_validate({"from": str(base)}), data_dir=tasks, tokenizer_dir=base,
                    init_hf_dir=work / "sft" / "hf", base_dir=base, stage_dir=work / "grpo",
                    ray_run_name="one-shot-grpo", seed=0, use_gpu=not on_cpu, progress=False)
    history = [json.loads(ln) for ln in (work / "grpo" / "metrics.jsonl").read_text().splitlines() if ln]
    return {"steps": len(history), "kl": [h["kl"] for h in history],
            "completion_length": [h["completion_length"] for h in history],
            "rollout": "vLLM colocated with the first worker, asleep between rollouts on GPU", "wall_s": round(time.monotonic() - started)}


def serve(work: Path, on_cpu: bool) -> dict:
    import httpx

    from amalia_ray.core.config import ServeConfig
    from amalia_ray.serve import app as serve_app
    from tests.conftest import free_port

    cfg = ServeConfig(port=free_port(), gpus_per_replica=0 if on_cpu else 2,
                      engine={"max_model_len": 512, "gpu_memory_utilization": 0.1 if on_cpu else 0.5})
    models = {"one-shot-sft": work / "sft" / "hf"}
    placement = serve_app.replica_placement(cfg, use_gpu=not on_cpu)
    started = time.monotonic()
    url = serve_app.start(models, cfg, use_gpu=not on_cpu, name="amalia-bench").base_url
    try:
        r = httpx.post(f"{url}/completions", timeout=120, json={"model": "one-shot-sft", "prompt": "O Debian é",
                                                                "max_tokens": 8, "temperature": 0})
        r.raise_for_status()
        return {"tensor_parallel_size": placement["engine_kwargs"].get("tensor_parallel_size", 1),
                "bundles": placement["placement_group_config"]["bundles"],
                "completion_tokens": r.json()["usage"]["completion_tokens"],
                "ready_s": round(time.monotonic() - started)}
    finally:
        serve_app.stop("amalia-bench")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--cpu", action="store_true", help="run the parts here on a tiny model")
    args = parser.parse_args()
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    import ray
    import torch

    if not args.cpu and torch.cuda.device_count() < 2:
        sys.exit("two CUDA GPUs are needed (or --cpu)")
    ray.init(num_cpus=8, num_gpus=0 if args.cpu else 2, include_dashboard=False, log_to_driver=False)
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        base = make_model(work / "base", args.cpu)
        for name, part in (("sft", lambda: sft(base, work, args.cpu)), ("grpo", lambda: grpo(base, work, args.cpu)),
                           ("serve", lambda: serve(work, args.cpu))):
            try:
                results[name] = {"ok": True, **part()}
            except Exception as e:  # noqa: BLE001 - one failed part must not hide the others' results
                results[name] = {"ok": False, "error": f"{type(e).__name__}: {e}"[:2000],
                                 "traceback": traceback.format_exc()[-3000:]}
            print(json.dumps({"part": name, **results[name]}), flush=True)
    ray.shutdown()
    print(json.dumps({"device": "cpu" if args.cpu else torch.cuda.get_device_name(0),
                      "ok": all(r["ok"] for r in results.values())}))


if __name__ == "__main__":
    main()
