"""How attention memory grows with the packed row's length under each kernel training offers without flash-attn:
sdpa (a dense seq² document mask) and flex_attention (torch's block-sparse mask, compiled as training runs it).
Prints JSON.

    .venv/bin/python bench/packed_attention_memory.py [--lengths 2048,4096,8192,16384] [--document 512]

Per kernel and length, in a fresh process: a one-layer Llama (hidden 256, 4 heads of 64) on one packed row of that
many tokens made of documents of `--document` tokens (positions restarting at each, as pretraining with
document_masking feeds them), one pass after a warm-up pass (flex_attention's compilation); the peak memory that
pass adds. On a CUDA GPU the pass is a forward and backward pass and the memory is CUDA's peak allocation; on CPU,
where torch's FlexAttention has no backward pass, it is a forward pass (the masks are built there) and the memory
the peak of the resident set, sampled every 0.2 ms, over what it was before the pass. Linear growth doubles with
the length, quadratic quadruples.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

STEP = r"""
import json, os, sys, threading, time, torch
from transformers import LlamaConfig, LlamaForCausalLM
kernel, length, document = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
torch.manual_seed(0)
model = LlamaForCausalLM(LlamaConfig(vocab_size=512, hidden_size=256, intermediate_size=512, num_hidden_layers=1,
                                     num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=length,
                                     attn_implementation=kernel))
cuda = torch.cuda.is_available()
device = torch.device("cuda" if cuda else "cpu")
model = model.to(device)
ids = torch.randint(0, 512, (1, length), device=device)
positions = (torch.arange(length, device=device) % document).unsqueeze(0)

def step():
    with torch.set_grad_enabled(cuda):
        out = model(input_ids=ids, position_ids=positions, labels=ids, use_cache=False)
    if cuda:
        out.loss.backward()
        model.zero_grad(set_to_none=True)

def resident():
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")

step()  # flex_attention compiles here; its code and caches are not attention memory
if cuda:
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated()
    step()
    peak = torch.cuda.max_memory_allocated()
else:  # the resident set sampled every 0.2 ms through the pass (large tensors are mmapped: freed, they leave it)
    before, highest, running = resident(), [0], [True]
    def sample():
        while running[0]:
            highest[0] = max(highest[0], resident())
            time.sleep(0.0002)
    watcher = threading.Thread(target=sample)
    watcher.start()
    step()
    running[0] = False
    watcher.join()
    peak = highest[0]
print(json.dumps({"added_mb": (peak - before) / 2**20, "pass": "forward+backward" if cuda else "forward",
                  "device": device.type}))
"""


def measure(kernel: str, length: int, document: int) -> dict:
    # a fresh process per point: ru_maxrss only grows, so each measurement needs its own
    done = subprocess.run([sys.executable, "-c", STEP, kernel, str(length), str(document)], capture_output=True,
                          text=True, env={**os.environ, "OMP_NUM_THREADS": "2",
                                          "MALLOC_MMAP_THRESHOLD_": "65536"})  # a freed tensor leaves the resident set
    if done.returncode:
        raise SystemExit(f"{kernel} at {length}: {done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--lengths", default="2048,4096,8192,16384")
    parser.add_argument("--document", type=int, default=512)
    args = parser.parse_args()
    lengths = [int(n) for n in args.lengths.split(",")]
    rows, passes = {}, set()
    for kernel in ("sdpa", "flex_attention"):
        points = {n: measure(kernel, n, args.document) for n in lengths}
        rows[kernel] = {str(n): round(p["added_mb"], 1) for n, p in points.items()}
        passes |= {(p["pass"], p["device"]) for p in points.values()}
    first, last = str(lengths[0]), str(lengths[-1])
    (measured, device), = passes
    print(json.dumps({
        "benchmark": "packed_attention_memory", "device": device, "pass": measured,
        "document_tokens": args.document, "added_mb": rows,
        "growth_first_to_last": {k: round(v[last] / max(v[first], 1e-9), 2) for k, v in rows.items()},
        "length_ratio": lengths[-1] / lengths[0],
    }, indent=2))


if __name__ == "__main__":
    main()
