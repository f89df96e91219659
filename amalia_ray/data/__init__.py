"""The data stage on Ray Data: the corpus's files listed, fingerprinted and cut into read tasks, read into
documents (jsonl, Parquet, text, HTML, WARC/ARC) with unreadable records quarantined, cleaned, filtered,
deduplicated exactly and near (MinHash-LSH, run on Ray or in one process for a small input) with keys moving
through byte-sized exchanges and the text written once; then the tokenizer and the packed token shards the
pretraining stage reads; and the post-training data generators and the pt-PT / pt-BR classifier's training data."""
