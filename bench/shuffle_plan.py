"""What the data stage's keyed exchanges become at a web archive's scale, from the planning function the stage
itself uses (`plan_exchange`): parts, map tasks, Ray objects, piece and part sizes, for the three largest exchanges
of a corpus of N documents on a cluster of C CPUs, beside what a shuffle of one task per input block and two parts
per CPU would create (its input blocks: the near-dedup hashing tasks' outputs of 8,192 documents each for the LSH
rows; the corpus's 128 MB blocks of text for the other two, which that shuffle moved whole). A computation, not a
run. Prints JSON.

    .venv/bin/python bench/shuffle_plan.py [--documents 300000000] [--corpus-gb 1000] [--cpus 640]

Bytes per document of each exchange (Arrow, with string offsets): LSH band rows 14 bands × (8 B key + ~40 B id);
exact-dedup keys ~110 B (40-character hex hash, id, `_row`, offsets); capture keys ~120 B (normalised URL, date,
id, `_row`). The key rows arrive in blocks of 128 MB or less; their count does not change the plan."""

from __future__ import annotations

import argparse
import json

EXCHANGES = {"lsh_band_rows": 14 * 48, "exact_dedup_keys": 110, "capture_keys": 120}


def main() -> None:
    from amalia_ray.data.exchange.partitions import plan_exchange

    parser = argparse.ArgumentParser()
    parser.add_argument("--documents", type=int, default=300_000_000)
    parser.add_argument("--cpus", type=int, default=640)
    parser.add_argument("--corpus-gb", type=float, default=1000)
    args = parser.parse_args()
    block = 128 << 20
    text_blocks = int(args.corpus_gb * 1e9 // block)
    out = {"benchmark": "shuffle_plan", "documents": args.documents, "corpus_gb": args.corpus_gb, "cpus": args.cpus,
           "exchanges": {}}
    for name, per_doc in EXCHANGES.items():
        total = args.documents * per_doc
        blocks = max(1, total // block)
        plan = plan_exchange([total // blocks] * blocks, args.cpus)
        maps = len(plan.map_groups)
        lsh = name == "lsh_band_rows"
        old = -(-args.documents // 8192) if lsh else text_blocks
        old_bytes = total if lsh else args.corpus_gb * 1e9  # the other two moved whole documents
        out["exchanges"][name] = {
            "bytes_per_document": per_doc, "gib": round(total / 2**30, 1), "parts": plan.parts, "map_tasks": maps, "objects": plan.objects,
            "piece_mb": round(total / (maps * plan.parts) / 2**20, 2), "part_mb": round(total / plan.parts / 2**20),
            "block_per_task_two_parts_per_cpu": {"input_blocks": old, "objects": old * (2 * args.cpus + 1),
                                                 "piece_kb": round(old_bytes / (old * 2 * args.cpus) / 1024, 1)}}
    print(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()
