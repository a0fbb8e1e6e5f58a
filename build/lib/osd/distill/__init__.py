"""Offline distillation: the target-output cache, sample sources, the trainer, acceptance evaluation."""
