"""How attention memory grows with the packed row's length under each kernel training offers on any machine: sdpa
(a dense seq² document mask) and flex_attention (torch's block-sparse mask, compiled as training runs it). Prints
JSON.

    .venv/bin/python bench/packed_attention_memory.py [--lengths 2048,4096,8192,16384] [--document 512]

Per kernel and length, in a fresh process: a one-layer Llama (hidden 256, 4 heads of 64) on one packed row of that
many tokens made of documents of `--document` tokens (positions restarting at each, as pretraining with
document_masking feeds them), one forward and backward pass after a warm-up pass (flex_attention's compilation);
the peak resident memory that pass adds. Linear growth doubles with the length, quadratic quadruples.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

STEP = r"""
import json, resource, sys, torch
from transformers import LlamaConfig, LlamaForCausalLM
kernel, length, document = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
torch.manual_seed(0)
model = LlamaForCausalLM(LlamaConfig(vocab_size=512, hidden_size=256, intermediate_size=512, num_hidden_layers=1,
                                     num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=length,
                                     attn_implementation=kernel))
ids = torch.randint(0, 512, (1, length))
positions = (torch.arange(length) % document).unsqueeze(0)

def step():
    out = model(input_ids=ids, position_ids=positions, labels=ids, use_cache=False)
    out.loss.backward()
    model.zero_grad(set_to_none=True)

step()  # flex_attention compiles here; its code and caches are not attention memory
before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
step()
print(json.dumps({"added_mb": (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before) / 1024}))
"""


def measure(kernel: str, length: int, document: int) -> dict:
    # a fresh process per point: ru_maxrss only grows, so each measurement needs its own
    done = subprocess.run([sys.executable, "-c", STEP, kernel, str(length), str(document)], capture_output=True,
                          text=True, env={**os.environ, "OMP_NUM_THREADS": "2"})
    if done.returncode:
        raise SystemExit(f"{kernel} at {length}: {done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--lengths", default="2048,4096,8192,16384")
    parser.add_argument("--document", type=int, default=512)
    args = parser.parse_args()
    lengths = [int(n) for n in args.lengths.split(",")]
    rows = {}
    for kernel in ("sdpa", "flex_attention"):
        rows[kernel] = {str(n): round(measure(kernel, n, args.document)["added_mb"], 1) for n in lengths}
    first, last = str(lengths[0]), str(lengths[-1])
    print(json.dumps({
        "benchmark": "packed_attention_memory", "document_tokens": args.document, "added_mb": rows,
        "growth_first_to_last": {k: round(v[last] / max(v[first], 1e-9), 2) for k, v in rows.items()},
        "length_ratio": lengths[-1] / lengths[0],
    }, indent=2))


if __name__ == "__main__":
    main()
