"""From curated text to what pretraining reads: the tokenizer (trained, or a base model's, optionally extended:
tokenizer.py, vocab_extension.py), the source mix and validation split (mix.py), and tokenize-and-pack into
fixed-length rows (pack.py)."""
