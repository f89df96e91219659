"""The data stages on Ray Data (curate.py: the corpus curated, the tokenizer, tokenize and pack, each writing one
folder). The corpus is read into documents (read/), run through per-document steps on one protocol (steps/), its
web pages decided on across documents (web/), deduplicated exactly and near (dedup/) with keys, not text, moving
through byte-sized exchanges (exchange/), and written once; then tokenized and packed for pretraining (tokenize/).
Post-training data is made by code (posttrain/), and the pt-PT / pt-BR classifier's training data read from Debian
packages (variety/)."""
