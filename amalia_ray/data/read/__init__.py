"""The corpus read into documents: its files listed (local, object storage, any pyarrow/fsspec filesystem),
fingerprinted and cut into read tasks, large files into byte ranges of whole records (inputs.py, ranges.py); their
bytes streamed, decompressed and hashed as read (streams.py); each format framed into documents with stable ids, an
unreadable record quarantined with its location (readers.py, archives.py, records.py)."""
