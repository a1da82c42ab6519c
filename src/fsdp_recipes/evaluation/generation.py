"""Greedy answers from a saved model with plain transformers (no FSDP, no accelerate): the end-of-run summary's
exact match (evaluation/scoring.py), `make serve-check`'s reference answers and the DPO demo's on-policy preference
pairs (assets/addition_preferences.py, handed `generate` by its caller: assets/ sits below this room) all answer
this way.
"""

from __future__ import annotations

ANSWER_TOKENS = 8  # generated per answer unless the caller asks for more (the summary: for longer answers)


def load_tokenizer(folder: str):
    """A saved tokenizer, padding on the left (for generation)."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(folder)
    tok.padding_side = "left"
    return tok


def load(model_dir: str, tokenizer_dir: str | None = None):
    """(model in eval mode, tokenizer padding on the left) from a saved model folder; plain transformers."""
    import transformers
    from transformers import AutoModelForCausalLM

    transformers.utils.logging.disable_progress_bar()  # loading bars would split the summary from the run's log
    tok = load_tokenizer(tokenizer_dir or model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir)
    model.eval()
    return model, tok


def answers(model, tok, prompts: list[list[dict] | str], batch_size: int = 128,
            max_new_tokens: int = ANSWER_TOKENS) -> list[str]:
    """Greedy answers of a loaded model (load) to chat prompts (rendered with the chat template) or plain-text ones
    (as they are), in batches of `batch_size` with left padding, stripped."""
    import torch

    out_texts = []
    for i in range(0, len(prompts), batch_size):
        batch = prompts[i:i + batch_size]
        # a plain-text prompt is the model's input as it is, with the tokenizer's special tokens as TRL adds them
        plain = all(isinstance(p, str) for p in batch)
        texts = batch if plain else [tok.apply_chat_template(p, tokenize=False, add_generation_prompt=True)
                                     for p in batch]
        # to the model's device: a 4-bit model is on the GPU where there is one (bitsandbytes' default device map)
        enc = tok(texts, return_tensors="pt", padding=True, add_special_tokens=plain).to(model.device)
        with torch.no_grad():
            out = model.generate(**enc, max_new_tokens=max_new_tokens, do_sample=False,
                                 pad_token_id=tok.pad_token_id)
        out_texts += [tok.decode(o[enc["input_ids"].shape[1]:], skip_special_tokens=True).strip() for o in out]
    return out_texts


def generate(model_dir: str, prompts: list[list[dict] | str], tokenizer_dir: str | None = None,
             batch_size: int = 128, max_new_tokens: int = ANSWER_TOKENS) -> list[str]:
    """Greedy answers to chat prompts or plain-text ones (answers), the model loaded once (load)."""
    model, tok = load(model_dir, tokenizer_dir)
    return answers(model, tok, prompts, batch_size, max_new_tokens)
