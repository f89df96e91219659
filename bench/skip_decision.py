"""How long a no-change rerun takes to decide that the data stage is done, on a large corpus: the stage's inputs are
the corpus files, fingerprinted by their listing (path, size, modification time; the read tasks hash the content
while the stage runs). Prints JSON.

    .venv/bin/python bench/skip_decision.py [--gb 1] [--files 8]

A corpus of `--gb` GB of jsonl in `--files` files is written to a temporary folder; then, each in a fresh process:
1. cold: the data stage's first fingerprint with an empty digest cache, recorded in the run's manifest as a
   completed stage (its output folder stands in for a curated one);
2. warm: `Pipeline.execute` of the same stage, as a rerun of `amalia run` does it: it finds the stage completed with
   an unchanged fingerprint and skips (timed from the call to its return, and the whole process from its start);
3. after one file is appended to: its size changes, and the rerun runs the stage (here: its body only counts).
The bound the docs quote: a no-change decision under 2 s on 1 GB.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

STEP = r"""
import json, sys, time
started = time.perf_counter()
from pathlib import Path
from amalia_ray.core.recipe import load_recipe
from amalia_ray.pipeline import stages
from amalia_ray.pipeline.runner import Pipeline

recipe, mode = Path(sys.argv[1]), sys.argv[2]
p = Pipeline(load_recipe(recipe))
p.cluster_info = {"resources": {"CPU": 2}, "billable_cpus": 2}  # what the Ray session would say; no Ray needed here
spec = next(stages.build(p, ["data"]))
ran = []
import dataclasses
spec = dataclasses.replace(spec, body=lambda: ran.append(1) or {"documents_kept": 1})
t0 = time.perf_counter()
if mode == "cold":
    fp, cfg, inputs = p.fingerprint(spec)
    rec = p.manifest.stage("data")
    rec.status, rec.fingerprint, rec.config_hash, rec.inputs = "completed", fp, cfg, inputs
    from amalia_ray.pipeline.manifest import code_hash
    rec.code_hash = code_hash()
    p.stage_dir("data").mkdir(parents=True, exist_ok=True)
    p.save("data")
else:
    p.execute(spec)
print(json.dumps({"decision_s": time.perf_counter() - t0, "process_s": time.perf_counter() - started,
                  "stage_ran": bool(ran)}))
"""


def step(recipe: Path, mode: str, env: dict) -> dict:
    started = time.perf_counter()
    done = subprocess.run([sys.executable, "-c", STEP, str(recipe), mode], env=env, cwd=ROOT, capture_output=True,
                          text=True)
    if done.returncode:
        sys.exit(done.stderr[-3000:])
    out = json.loads(done.stdout.strip().splitlines()[-1])
    return {**out, "command_s": round(time.perf_counter() - started, 3),
            "decision_s": round(out["decision_s"], 3), "process_s": round(out["process_s"], 3)}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--gb", type=float, default=1.0)
    parser.add_argument("--files", type=int, default=8)
    args = parser.parse_args()
    import yaml

    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        corpus = tmp / "corpus"
        corpus.mkdir()
        line = (json.dumps({"text": "O sistema Debian é um sistema operativo livre. " * 20}) + "\n").encode()
        per_file = int(args.gb * 2**30 / args.files)
        block = line * max(1, (1 << 20) // len(line))
        for i in range(args.files):
            with open(corpus / f"part-{i}.jsonl", "wb") as f:
                written = 0
                while written < per_file:
                    f.write(block)
                    written += len(block)
        size = sum(f.stat().st_size for f in corpus.iterdir())
        recipe = yaml.safe_load((ROOT / "recipes" / "demo.yaml").read_text())
        recipe["run"].update(name="skip", output_dir=str(tmp / "runs"))
        recipe["data"]["sources"] = [{"name": "big", "paths": [str(corpus / "*.jsonl")], "format": "jsonl"}]
        recipe["train"] = [{k: v for k, v in recipe["train"][0].items() if k != "curriculum"}]
        path = tmp / "recipe.yaml"
        path.write_text(yaml.safe_dump(recipe, sort_keys=False))
        env = {**os.environ, "AMALIA_CACHE_DIR": str(tmp / "cache"), "RAY_AUTH_MODE": "disabled"}
        cold = step(path, "cold", env)
        warm = step(path, "warm", env)
        with open(corpus / "part-0.jsonl", "ab") as f:
            f.write(line)
        changed = step(path, "warm", env)
    print(json.dumps({
        "benchmark": "skip_decision", "corpus_gb": round(size / 2**30, 3), "files": args.files,
        "cold_fingerprint": cold, "no_change_rerun": warm, "after_one_file_changed": changed,
        "no_change_decision_under_2s": warm["decision_s"] < 2 and not warm["stage_ran"],
    }, indent=2))


if __name__ == "__main__":
    main()
