"""The evaluation room: held-out rows, generation, exact match, answer loss, intervals and paired tests, engine
rules; the metrics as registered entries (scores/), and the scoring of every stage that the summary renders."""
