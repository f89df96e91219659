"""What sits on top of a trained decoder: the LM head (a causal LM), or a score head with one output (a reward model:
a transformers sequence classifier, which reads the last token that is not padding)."""

from __future__ import annotations

HEADS = ("lm", "score")


def auto_class(head: str):
    """transformers' Auto class of a model with this head."""
    import transformers

    if head not in HEADS:
        raise ValueError(f"head '{head}': one of {HEADS}")
    return transformers.AutoModelForCausalLM if head == "lm" else transformers.AutoModelForSequenceClassification
