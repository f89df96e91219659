"""The objectives the one training loop (train/loop.py) runs: the interface and what an objective reads
(base.py), one module per objective (pretrain, sft, dpo, grpo), and the registry mapping a recipe's `objective`
to its class (registry.py)."""
