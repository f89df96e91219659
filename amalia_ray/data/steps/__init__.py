"""The per-document steps of the data stage, on one protocol (base.py): an Arrow batch of documents in, the same
rows out with their text rewritten, columns added, or a `drop_reason` set (a filter never deletes: the stage reports
and keeps what each dropped). Cleaning, language and variety, heuristic and learned quality, decontamination; the
list a recipe runs is built from its `data` section (recipe_steps.py)."""
