"""The pt-PT / pt-BR variety classifier's data side: aligned training pairs read from Debian packages
(variety_corpus.py), its training and measurement (variety_training.py), and tagging a file with it
(variety_tagging.py)."""
