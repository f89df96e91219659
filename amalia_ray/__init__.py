"""amalia-ray: build a language model end to end on Ray — curate, pretrain, post-train, serve and evaluate."""

__version__ = "0.1.0"
