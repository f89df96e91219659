"""The layer every stage stands on, importing none of them: the recipe's pydantic models (config/, which imports
nothing else of ours) and their loading with line-numbered errors, file storage and hashing, the run's storage
behind pyarrow/fsspec, the console, the files one stage writes and another reads (formats/: conversations,
preference pairs, tasks, packed token shards and the training read position), and what several stages
share: rule-based rewards (training and synthetic data), the OpenAI-API client (evaluation and synthesis), the
pt-PT / pt-BR variety scorers, base models by hub id or folder, a run's stop request."""
