"""Ray job entrypoints: `ray job submit --working-dir . -- python -m jobs.<name> RECIPE`."""
