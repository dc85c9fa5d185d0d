"""Training runs, baselines and accuracy judgement for low-precision recipes."""
