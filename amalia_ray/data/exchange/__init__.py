"""Moving keys, not text: keyed exchanges sized by bytes (partitions.py), decisions taken on key rows and applied
back in the documents' own blocks (decide.py), and polars frames handed on as Arrow tables (frames.py)."""
