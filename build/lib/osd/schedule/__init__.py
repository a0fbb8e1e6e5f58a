"""Many requests at once: the step loop over sequences (schedule -> propose -> verify -> commit -> observe)."""
