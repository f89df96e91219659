"""Training stages on Ray Train: one loop run by every FSDP2 worker (loop.py), the objectives it runs
(objectives/), the model built on the meta device and loaded shard by shard, LoRA adapters, signed DCP
checkpoints, the vLLM rollout engine for on-policy objectives, and the HF export."""
