"""What a model folder holds, read from its files as transformers will read them: full weights, a PEFT adapter, or
both. Pure file reads (no torch), for every phase that writes or reads a model folder. (Weights saved quantized are
the 4-bit option's to name: speed/four_bit.py `saved_quantized`.)

Both at once is a trap: transformers' `from_pretrained(folder)` with peft installed loads the full weights and then
the adapter on top of them (`integrations/peft.py` maybe_load_adapters: a folder with config.json keeps its own
weights and still loads the adapter it finds), so a merged model that still carries its adapter files computes
base + 2 x the update, with no word, while llama.cpp and vLLM read the full weights alone (issue 61).
"""

from __future__ import annotations

from pathlib import Path

ADAPTER_FILES = ("adapter_config.json", "adapter_model.safetensors", "adapter_model.bin")
WEIGHT_GLOBS = ("model*.safetensors", "pytorch_model*.bin", "model.safetensors.index.json",
                "pytorch_model.bin.index.json")


def adapter_files(folder: Path) -> list[str]:
    """The PEFT adapter files in `folder` (what transformers' adapter lookup finds: adapter_config.json)."""
    return [name for name in ADAPTER_FILES if (Path(folder) / name).is_file()]


def full_weights(folder: Path) -> list[str]:
    """The full model's weight files in `folder`, beside its config.json; [] without a config.json."""
    folder = Path(folder)
    if not (folder / "config.json").is_file():
        return []
    return sorted({p.name for pattern in WEIGHT_GLOBS for p in folder.glob(pattern) if p.is_file()})


def without_weights(folder: Path) -> str | None:
    """Why `folder`, a model folder by its config.json, cannot be loaded for want of weights (None: it has them, or
    it is no model folder): a copy that left them out is said before the ranks start, not by rank 0's load."""
    if not (Path(folder) / "config.json").is_file() or full_weights(folder):
        return None
    return (f"holds config.json but no weights ({' or '.join(WEIGHT_GLOBS[:2])}), so from_pretrained would fail on "
            f"every rank. Fix: copy the model's weight files into {folder}, or point model_name_or_path at the "
            f"folder that holds them.")


def adapter_beside_weights(folder: Path) -> str | None:
    """One line when `folder` holds a full model and a PEFT adapter side by side (None otherwise): which one
    transformers loads, and the fix."""
    folder = Path(folder)
    adapters, weights = adapter_files(folder), full_weights(folder)
    if "adapter_config.json" not in adapters or not weights:
        return None
    return (f"{folder} holds a full model ({', '.join(['config.json', *weights[:2]])}) and a LoRA adapter "
            f"({', '.join(adapters)}) side by side: transformers' from_pretrained loads the full weights and then "
            f"applies the adapter on top of them again (a merged model's logits change), while llama.cpp and vLLM "
            f"read the full weights alone. Fix: if the weights are the merged model, delete {' and '.join(adapters)} "
            f"from {folder}; if they are the base model, load the adapter with PEFT instead "
            f"(PeftModel.from_pretrained), or keep the adapter in a folder of its own.")

