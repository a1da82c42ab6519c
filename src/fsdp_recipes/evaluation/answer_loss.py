"""Held-out loss and perplexity of a loaded model (plain transformers, no FSDP): the mean negative log-likelihood, in
nats per token, of the tokens SFT trains on in each scored row, and its exponential.

The tokens are TRL's (trl 1.16 SFTTrainer): for a chat prompt, the answer's tokens after the longest common prefix
of the rendered prompt (with the generation prompt) and the rendered conversation, the template's end-of-turn
marker included; for a plain-text prompt, the completion's tokens after the prompt's with the EOS token appended
as TRL appends it; for a text row (language modelling), every token after the first, EOS appended. The summary's
scores (evaluation/scoring.py, for evaluation/scores/held_out_loss.py and preference.py) take the reference answer
this way: the completion, the last assistant turn of a `messages` row, the chosen answer of a preference pair.
"""

from __future__ import annotations

import math

MAX_TOKENS = 2048  # of one scored row; a longer row is cut on the right, and counted as cut
BATCH_TOKENS = 4096  # tokens (padded) per forward: bounds the logits' memory (4096 x vocabulary x 4 bytes)


def token_ids(tok, x, **chat) -> list[int]:
    """Token ids of a chat (the template, tokenised; `chat`: apply_chat_template's options) or a text (the
    tokenizer's special tokens added, as TRL adds them)."""
    out = tok.apply_chat_template(x, tokenize=True, **chat) if isinstance(x, list) else tok(x)
    return list(out["input_ids"] if hasattr(out, "keys") else out)


def sequence(tok, prompt, answer: str) -> tuple[list[int], int]:
    """(token ids of the whole row, index of its first scored token) for a chat prompt and its answer, a text prompt
    and its completion, or (prompt None) a text row."""
    from trl.data_utils import common_prefix_length

    eos = tok.eos_token or ""
    ended = answer if answer.endswith(eos) else answer + eos  # a text answer ends with EOS, as TRL appends it
    if prompt is None:  # language modelling: every token but the first is predicted
        return token_ids(tok, ended), 1
    if isinstance(prompt, list):
        head = token_ids(tok, prompt, add_generation_prompt=True)
        full = token_ids(tok, prompt + [{"role": "assistant", "content": answer}])
    else:
        head = token_ids(tok, prompt)
        full = token_ids(tok, prompt + ended)
    return full, common_prefix_length(head, full)


def token_logps(model, tok, rows: list[tuple[list[int], int]], max_tokens: int = MAX_TOKENS,
                batch_tokens: int = BATCH_TOKENS) -> list[tuple[float, int, bool]]:
    """(summed log p of the row's scored tokens, how many, whether the row was cut at max_tokens) per
    (token ids, first scored token) row, in the rows' order; padding on the right, batches of at most batch_tokens
    padded tokens (rows sorted by length), logsumexp instead of a full log_softmax."""
    import torch

    cut = [len(ids) > max_tokens for ids, _ in rows]
    rows = [(ids[:max_tokens], first) for ids, first in rows]
    order = sorted(range(len(rows)), key=lambda i: len(rows[i][0]))
    out: list[tuple[float, int, bool] | None] = [None] * len(rows)
    pad = tok.pad_token_id if tok.pad_token_id is not None else 0
    start = 0
    while start < len(order):
        end = start + 1  # rows sorted by length: the batch's width is its last row's
        while end < len(order) and (end + 1 - start) * len(rows[order[end]][0]) <= batch_tokens:
            end += 1
        chunk = [rows[i] for i in order[start:end]]
        width = max(len(ids) for ids, _ in chunk)
        input_ids = torch.tensor([ids + [pad] * (width - len(ids)) for ids, _ in chunk])
        mask = torch.tensor([[1] * len(ids) + [0] * (width - len(ids)) for ids, _ in chunk])
        with torch.no_grad():  # on the model's device (a 4-bit model is on the GPU where there is one), back here
            logits = model(input_ids=input_ids.to(model.device),
                           attention_mask=mask.to(model.device)).logits[:, :-1].float().cpu()
        targets = input_ids[:, 1:]
        logps = logits.gather(-1, targets.unsqueeze(-1)).squeeze(-1) - logits.logsumexp(-1)
        position = torch.arange(targets.shape[1]).unsqueeze(0)  # target t is token t + 1 of the row
        first = torch.tensor([f for _, f in chunk]).unsqueeze(1)
        scored = (position >= first - 1) & mask[:, 1:].bool()
        for j, i in enumerate(order[start:end]):
            out[i] = (float((logps[j] * scored[j]).sum()), int(scored[j].sum()), cut[i])
        start = end
    return out


def answer_logps(model, tok, prompts: list[list[dict]], answers: list[str]) -> list[float]:
    """log p(answer | chat prompt) of each answer, summed over its tokens (those `sequence` scores)."""
    return [s for s, _, _ in token_logps(model, tok, [sequence(tok, p, a) for p, a in zip(prompts, answers)])]


def margins(model, tok, pairs: list[tuple[list[dict], str, str]]) -> list[float]:
    """log p(chosen) - log p(rejected) of each pair's answer after its chat prompt (the quantity DPO's implicit
    reward is built from), summed over the answer's tokens."""
    prompts = [p for p, _, _ in pairs]
    chosen = answer_logps(model, tok, prompts, [c for _, c, _ in pairs])
    rejected = answer_logps(model, tok, prompts, [r for _, _, r in pairs])
    return [c - r for c, r in zip(chosen, rejected)]


def held_out_loss(model, tok, items: list[tuple[list[dict] | str | None, str]]) -> dict:
    """The mean loss per scored token over (prompt, answer) items (prompt None: a text row), its perplexity, and
    what was counted: rows, tokens, rows cut at MAX_TOKENS. Loss and perplexity None with no token scored."""
    scores = token_logps(model, tok, [sequence(tok, p, a) for p, a in items])
    tokens = sum(n for _, n, _ in scores)
    loss = -sum(s for s, _, _ in scores) / tokens if tokens else None
    return {"loss": loss, "perplexity": math.exp(min(loss, 700)) if tokens else None, "rows": len(items),
            "tokens": tokens, "rows_cut": sum(c for _, _, c in scores), "max_tokens": MAX_TOKENS}
