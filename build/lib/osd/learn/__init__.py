"""Learning the draft: distillation losses (pure), compact target distributions, replay buffer, trainers."""
