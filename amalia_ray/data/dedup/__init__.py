"""Deduplication: the keep rules every duplicate decision uses and the exact-copy keys (keep.py); near duplicates
by MinHash-LSH (minhash.py), as steps over Arrow tables (dedup_steps.py) that two executors run, Ray Data for the
corpus (ray_executor.py, connected components: components.py) and one process for a small input (in_process.py);
and corpora with planted near-duplicates to measure it (planted.py)."""
