"""Post-training data made by code: conversations and preference pairs from a FAQ's real Q&A text (faq_chats.py),
verifiable arithmetic tasks for RL (arithmetic_tasks.py), and synthetic samples from a served model (synthesize.py)."""
