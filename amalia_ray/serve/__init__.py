"""Serving checkpoints: Ray Serve with vLLM behind an OpenAI-compatible API (ray.serve.llm's ingress, with an
API key and a request size cap), every model and LoRA adapter tried end to end before it is reported ready."""
