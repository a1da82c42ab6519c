"""A small random Qwen2 with SmolLM2-135M-Instruct's tokenizer, saved as a model folder: the stand-in for a user's own
model of another family in docs/training.md's walk ("Bring your own data and model"), where no hub is reachable.

    python scripts/stand_in_model.py models/qwen2-small      (after `make smollm2`, which prepares the tokenizer)
"""

import sys

from transformers import AutoTokenizer, Qwen2Config, Qwen2ForCausalLM

from fsdp_recipes.api import cache_dir


def main(out: str) -> None:
    tok = AutoTokenizer.from_pretrained(cache_dir() / "smollm2-135m-instruct")
    config = Qwen2Config(vocab_size=len(tok), hidden_size=256, intermediate_size=768, num_hidden_layers=4,
                         num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True,
                         eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
    model = Qwen2ForCausalLM(config)
    model.save_pretrained(out)
    tok.save_pretrained(out)
    print(f"{out}: a random Qwen2, {sum(p.numel() for p in model.parameters()) / 1e6:.1f}M parameters, "
          f"SmolLM2's tokenizer")


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit(__doc__)
    main(sys.argv[1])
