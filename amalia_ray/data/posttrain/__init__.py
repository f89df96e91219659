"""Post-training data made by code: conversations and preference pairs from real Q&A text (conversations.py),
verifiable tasks for RL (rl_tasks.py), and synthetic samples from a served model (synthesize.py)."""
