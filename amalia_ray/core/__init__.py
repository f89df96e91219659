"""Core: config models, recipe loading, storage and hashing, run manifest, console/errors. Imports no stage."""
