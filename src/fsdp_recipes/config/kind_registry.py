"""The registry of trainer kinds: each kind's name, the TRL config class whose fields its recipes' <kind>.yaml holds,
and the default. Here, in the config layer, because recipe finding and argument parsing need the names before any
training code loads; the kinds' behaviour is in train/kinds/ (one module each, checked against its interface when
train/kinds builds its registry from these names). Adding a kind: a line here and its module there."""

from __future__ import annotations

TRAINERS = {"sft": "SFTConfig", "dpo": "DPOConfig", "grpo": "GRPOConfig"}
DEFAULT_TRAINER = "sft"
