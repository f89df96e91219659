"""The evaluation stage: benchmark tasks in several formats scored against served models only over HTTP
(OpenAI-compatible completions): log-likelihood of choices, generation scored by rules or an LLM judge, scores with
their standard errors, and an export lm-evaluation-harness reads."""
