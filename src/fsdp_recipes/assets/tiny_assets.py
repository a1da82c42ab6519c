"""Build the embedded default's assets: a synthetic chat dataset, a tokenizer trained on it, a tiny Mistral.

Everything is deterministic (fixed seeds) and local: nothing is downloaded. The outputs are ordinary
Hugging Face artefacts (a `save_pretrained` model directory and JSONL files), so the training entry point
loads them with the same `from_pretrained` / `load_dataset` calls it uses for hub models and datasets.

    python -m fsdp_recipes.assets.tiny_assets            # builds into $FSDP_RECIPES_CACHE (default ~/.cache/fsdp_recipes)
    python -m fsdp_recipes.assets.tiny_assets --force    # rebuild
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
import time
from pathlib import Path

from fsdp_recipes.paths import cache_dir

# Bump when the data, tokenizer or model definition changes, so that stale caches are rebuilt.
ASSETS_VERSION = "v1"
MODEL_DIRNAME = "tiny-mistral"
DATA_DIRNAME = "tiny-arith"
PREFERENCES_DIRNAME = "tiny-arith-preferences"

# Mistral-style chat template: [INST] user [/INST] answer</s>. A rendered prompt (with the generation
# prompt) is a prefix of the rendered prompt + completion, which TRL's prompt-completion path relies on.
CHAT_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}"
    "{% if message['role'] == 'user' %}[INST] {{ message['content'] }} [/INST]"
    "{% elif message['role'] == 'assistant' %} {{ message['content'] }}{{ eos_token }}"
    "{% endif %}{% endfor %}"
)
SPECIAL_TOKENS = ["<unk>", "<s>", "</s>", "<pad>", "[INST]", "[/INST]"]


def make_example(rng: random.Random) -> dict:
    """One conversational prompt-completion example: single-digit addition.

    The 100 facts are few enough that LoRA on a random base learns them in a few CPU minutes, so the loss
    and the generations visibly change. The test split draws from the same facts: it shows that training
    took, not that a 3M-parameter random model generalises arithmetic.
    """
    a, b = rng.randint(0, 9), rng.randint(0, 9)
    return {
        "prompt": [{"role": "user", "content": f"What is {a} + {b}?"}],
        "completion": [{"role": "assistant", "content": str(a + b)}],
    }


def write_dataset(out: Path, n_train: int = 4000, n_test: int = 64, seed: int = 0) -> None:
    """train.jsonl / test.jsonl: `load_dataset(<dir>)` turns these file names into train and test splits."""
    out.mkdir(parents=True, exist_ok=True)
    rng = random.Random(seed)
    for split, n in (("train", n_train), ("test", n_test)):
        with open(out / f"{split}.jsonl", "w") as f:
            for _ in range(n):
                f.write(json.dumps(make_example(rng)) + "\n")


def make_preference(rng: random.Random) -> dict:
    """One conversational preference pair for DPO's smoke runs: the right sum chosen, a near miss rejected."""
    example = make_example(rng)
    right = int(example["completion"][0]["content"])
    wrong = right + rng.choice([-2, -1, 1, 2])
    return {"prompt": example["prompt"], "chosen": example["completion"],
            "rejected": [{"role": "assistant", "content": str(wrong)}]}


def write_preferences(out: Path, n_train: int = 512, n_test: int = 32, seed: int = 1) -> None:
    """train.jsonl / test.jsonl of preference pairs (prompt / chosen / rejected, TRL's conversational layout)."""
    out.mkdir(parents=True, exist_ok=True)
    rng = random.Random(seed)
    for split, n in (("train", n_train), ("test", n_test)):
        tmp = out / f".{split}.jsonl.{os.getpid()}.tmp"  # two processes building at once each write their own
        with open(tmp, "w") as f:
            for _ in range(n):
                f.write(json.dumps(make_preference(rng)) + "\n")
        tmp.replace(out / f"{split}.jsonl")


def train_tokenizer(data_dir: Path, out: Path):
    """A byte-level BPE trained on the dataset, digits split one per token, saved with a chat template."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    def texts():
        for line in open(data_dir / "train.jsonl"):
            ex = json.loads(line)
            yield ex["prompt"][0]["content"] + " " + ex["completion"][0]["content"]

    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Digits(individual_digits=True), pre_tokenizers.ByteLevel(add_prefix_space=False)]
    )
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=384,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts(), trainer=trainer)
    hf_tok = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        unk_token="<unk>",
        bos_token="<s>",
        eos_token="</s>",
        pad_token="<pad>",
        additional_special_tokens=["[INST]", "[/INST]"],
    )
    hf_tok.chat_template = CHAT_TEMPLATE
    hf_tok.model_max_length = 512
    hf_tok.save_pretrained(out)
    return hf_tok


TINY_SHAPE = dict(hidden_size=256, intermediate_size=688, num_hidden_layers=4, num_attention_heads=4,
                  num_key_value_heads=2, head_dim=64)


def build_model(tokenizer, out: Path, seed: int = 0, shape: dict | None = None):
    """A randomly initialised Mistral (MistralForCausalLM; ~3.0M parameters by default) saved as safetensors."""
    import torch
    from transformers import MistralConfig, MistralForCausalLM

    config = MistralConfig(
        vocab_size=len(tokenizer),
        **(shape or TINY_SHAPE),
        max_position_embeddings=512,
        sliding_window=None,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        tie_word_embeddings=False,
        dtype="float32",
    )
    torch.manual_seed(seed)
    model = MistralForCausalLM(config)
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    return model


def ensure_assets(root: Path | None = None, force: bool = False, quiet: bool = False) -> dict[str, Path]:
    """Build the assets once into `root` (idempotent: a marker file says a build completed)."""
    root = Path(root) if root else cache_dir()
    model_dir, data_dir = root / MODEL_DIRNAME, root / DATA_DIRNAME
    marker = root / f".tiny-assets-{ASSETS_VERSION}.done"
    paths = {"model": model_dir, "data": data_dir, "preferences": root / PREFERENCES_DIRNAME}
    if not (paths["preferences"] / "test.jsonl").is_file() or force:  # beside the marker: older caches gain it
        write_preferences(paths["preferences"])
    if marker.exists() and not force:
        return paths
    say = (lambda *a: None) if quiet else (lambda *a: print("[tiny-assets]", *a, flush=True))
    t0 = time.time()
    say(f"building into {root}")
    write_dataset(data_dir)
    say(f"dataset: {data_dir} (train.jsonl, test.jsonl)")
    tok = train_tokenizer(data_dir, model_dir)
    say(f"tokenizer: {len(tok)} tokens, chat template saved")
    model = build_model(tok, model_dir)
    n = sum(p.numel() for p in model.parameters())
    say(f"model: MistralForCausalLM, {n / 1e6:.2f}M parameters -> {model_dir} ({time.time() - t0:.1f}s)")
    marker.write_text(json.dumps({k: str(v) for k, v in paths.items()}))
    return paths


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, default=None, help="cache root (default: $FSDP_RECIPES_CACHE)")
    ap.add_argument("--force", action="store_true", help="rebuild even when present")
    args = ap.parse_args(argv)
    paths = ensure_assets(args.out, force=args.force)
    print(f"[tiny-assets] ready: model {paths['model']}, data {paths['data']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
