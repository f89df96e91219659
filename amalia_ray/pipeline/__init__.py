"""The run: the recipe's sections wired to stages, each stage run once per input fingerprint and recorded in the
run's manifest (inputs, outputs, config hash, cost), one process per stage, tracking to MLflow / W&B, the run's
report, and sweeps over a training stage's proxy. The only layer that imports several stages."""
