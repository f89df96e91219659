"""Peak memory of one read task against the size of the file it reads, for jsonl and WARC: the readers stream
records and hand on a table every few MB of text, so the peak should not grow with the file. Prints JSON.

    .venv/bin/python bench/reader_memory.py [--sizes-gb 0.2 2]

For each format and size a file is written to a temporary folder (jsonl: one document of about 1 KB per line;
WARC: uncompressed HTML response records of about 4 KB), then read in a fresh process by the data stage's reader
(`read_file_tables`, the tables dropped as they come, as Ray Data hands them on), after a small file of the same
format has been read (so the libraries a reader loads on first use are in the baseline): reported are the documents
read, the seconds, and how much the process's peak resident memory grew while reading.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SENTENCE = "A biblioteca municipal abriu uma nova sala de leitura para os mais novos, com livros em português. "

PROBE = r"""
import resource, sys, time
from amalia_ray.core.config import SourceConfig
from amalia_ray.data.read.readers import read_file_tables
path, fmt, sample = sys.argv[1], sys.argv[2], sys.argv[3]
src = SourceConfig(name="s", paths=["x"], format=fmt)
for table in read_file_tables(sample, src):  # the libraries a reader loads on first use, before the baseline
    pass
before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
t0 = time.perf_counter()
kept = 0
for table in read_file_tables(path, src):
    kept += table["drop_reason"].null_count  # documents read (the others are quarantined records)
print(kept, time.perf_counter() - t0, (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before) * 1024)
"""


def write_jsonl(path: Path, size: int) -> None:
    line = (json.dumps({"text": SENTENCE * 10}) + "\n").encode()
    block = line * 1000
    with open(path, "wb") as f:
        for _ in range(max(1, size // len(block))):
            f.write(block)


def write_warc(path: Path, size: int) -> None:
    records = []
    for i in range(100):
        html = f"<html><body><article><p>{SENTENCE * 30}</p><p>página {i}</p></article></body></html>".encode()
        http = b"HTTP/1.1 200 OK\r\nContent-Type: text/html; charset=utf-8\r\n\r\n" + html
        head = (f"WARC/1.0\r\nWARC-Type: response\r\nWARC-Record-ID: <urn:uuid:{i:08d}-0000-0000-0000-000000000000>"
                f"\r\nWARC-Target-URI: https://arquivo.pt/{i}\r\nWARC-Date: 2024-01-01T00:00:00Z\r\n"
                f"Content-Type: application/http; msgtype=response\r\nContent-Length: {len(http)}\r\n\r\n").encode()
        records.append(head + http + b"\r\n\r\n")
    block = b"".join(records)
    with open(path, "wb") as f:
        for _ in range(max(1, size // len(block))):
            f.write(block)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--sizes-gb", type=float, nargs="+", default=[0.2, 2.0])
    args = parser.parse_args()
    results = []
    with tempfile.TemporaryDirectory() as tmp:
        for fmt, writer, suffix in (("jsonl", write_jsonl, "jsonl"), ("warc", write_warc, "warc")):
            for gb in args.sizes_gb:
                path, sample = Path(tmp) / f"corpus.{suffix}", Path(tmp) / f"sample.{suffix}"
                writer(path, int(gb * 2**30))
                writer(sample, 1)
                started = time.perf_counter()
                done = subprocess.run([sys.executable, "-c", PROBE, str(path), fmt, str(sample)], cwd=ROOT,
                                      capture_output=True, text=True)
                if done.returncode:
                    sys.exit(done.stderr[-3000:])
                documents, seconds, grew = done.stdout.split()
                results.append({"format": fmt, "file_mb": round(path.stat().st_size / 2**20),
                                "documents": int(documents), "read_s": round(float(seconds), 1),
                                "command_s": round(time.perf_counter() - started, 1),
                                "peak_growth_mb": round(int(grew) / 2**20)})
                path.unlink()
    print(json.dumps({"benchmark": "reader_memory", "results": results}, indent=2))


if __name__ == "__main__":
    main()
