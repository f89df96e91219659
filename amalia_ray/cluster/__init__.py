"""Where a run executes: connecting to a Ray cluster or starting an embedded one on this machine
(token-authenticated), submitting the pipeline as a Ray job, running it in a Slurm allocation, and `amalia plan`'s
arithmetic of memory, time and cost before anything starts."""
