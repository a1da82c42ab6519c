"""The evaluation room: held-out rows, generation, exact match, answer loss, intervals and paired tests, engine rules."""
