"""evals stage."""
