"""Every stage of a finished run scored on the same eval rows: the base model, then each run it went through (SFT,
DPO), each loaded once with plain transformers (no FSDP, no accelerate). What a stage's model is asked is what the
metrics that apply to the rows NEED (evaluation/scores/): the reference answers' log-probs, greedy answers to the
prompts, the preference pairs' margins; each metric then scores the stages from that, with its intervals and paired
tests. The result, the check, is what the summary renders (launch/summary.py), sample_generations.json keeps and
metrics.json's `eval` (eval_section) reports.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from pathlib import Path

from fsdp_recipes import library_logs, model_folders
from fsdp_recipes.evaluation import eval_rows, generation, intervals, scores
from fsdp_recipes.evaluation.answer_loss import held_out_loss, margins
from fsdp_recipes.evaluation.stages import EvalData, Scores, stages, trained_model_dir

SHOWN_SAMPLES = 3  # examples in the summary and metrics.json; every answer is in sample_generations.json


def log_probs(model, tok, data: EvalData) -> dict:
    return {"loss": held_out_loss(model, tok, data.items)}


def generations(model, tok, data: EvalData) -> dict:
    """Greedy answers to the prompts: all of them where every reference is at most SHORT_ANSWER_TOKENS tokens
    (`long_answers` 0), else the first SAMPLE_ROWS up to SAMPLE_TOKENS tokens each, to read."""
    out = {"answers": [], "long_answers": 0}
    prompted = data.refs
    if prompted:
        lengths = eval_rows.answer_lengths(tok, [a for _, a in prompted])
        out["long_answers"] = sum(n > eval_rows.SHORT_ANSWER_TOKENS for n in lengths)
        if out["long_answers"]:
            prompts, cap = [p for p, _ in prompted[:eval_rows.SAMPLE_ROWS]], eval_rows.SAMPLE_TOKENS
        else:  # room to see the answer end: a model that goes on past the expected answer does not match it
            prompts, cap = [p for p, _ in prompted], eval_rows.exact_match_tokens(lengths)
        out["answers"] = generation.answers(model, tok, prompts, max_new_tokens=cap)
    return out


def preference_rows(model, tok, data: EvalData) -> dict:
    return {"margins": margins(model, tok, data.pairs)}


NEEDED: dict[str, Callable] = {"log-probs": log_probs, "generations": generations, "preference rows": preference_rows}
assert set(NEEDED) == set(scores.NEEDS_KINDS), "every need a metric may name is computed here"


def score_stage(model_dir: str, items: list[tuple[list[dict] | str | None, str]],
                pairs: list[tuple[list[dict], str, str]], loaded=None) -> dict:
    """One model's answers to what the metrics that apply to these rows NEED, the model loaded once: `loss`, the
    held-out loss of the reference answers (prompt None: of the text); `answers` and `long_answers` (generations);
    `margins` on preference pairs. `loaded`: (model, tokenizer) loaded already (a 4-bit one) instead of
    `model_dir`'s."""
    model, tok = loaded or generation.load(model_dir)
    data = EvalData(items, pairs)
    out = {}
    for need in dict.fromkeys(n for m in scores.applying(data) for n in m.NEEDS):  # each once, in the metrics' order
        out.update(NEEDED[need](model, tok, data))
    return out


def preference_margins(model_dir: str, pairs: list[tuple[list[dict], str, str]]) -> list[float]:
    """answer_loss.margins of a saved model; plain transformers."""
    return margins(*generation.load(model_dir), pairs)


def four_bit_stages(base: str, run_dir: Path, load_4bit: Callable, data: EvalData) -> tuple[dict, dict]:
    """A 4-bit run's base as it trained on it (`load_4bit(base)`: loaded in 4 bits with the run's settings) and that
    base with the run's adapter: their score_stage scores. One load serves both (the adapter goes on the same model)."""
    from peft import PeftModel

    model = load_4bit(base).eval()
    tok = generation.load_tokenizer(base)
    base_scores = score_stage(base, data.items, data.pairs, loaded=(model, tok))
    with warnings.catch_warnings():  # peft's read of a property transformers deprecated: off the console, as in
        for category, pattern in library_logs.LOG_ONLY_WARNINGS:  # the ranks (train/console.py)
            warnings.filterwarnings("ignore", message=pattern, category=category)
        adapted = PeftModel.from_pretrained(model, str(run_dir)).eval()
    tok = generation.load_tokenizer(str(run_dir))
    return base_scores, score_stage(base, data.items, data.pairs, loaded=(adapted, tok))


def learning_check(run_dir: Path, run_args: dict, n: int = eval_rows.EVAL_PROMPTS, cfg=None,
                   load_4bit: Callable | None = None) -> dict | None:
    """Every stage's model (base, then each run it went through: SFT, DPO) on the eval split's first `n` rows, scored
    by every metric that applies (evaluation/scores/). `load_4bit(base)`: for a run that trained on a 4-bit base, that
    base loaded as it trained (the summary knows how), scored in place of the full-precision one, with the run's
    adapter on it scored beside the stages. None without a model to load; without rows to score, a note."""
    trained = trained_model_dir(run_dir)
    if trained is None:
        return None
    rows, held, shared, text_field = eval_rows.scored_rows(run_args, n, cfg)  # loaded once: prompts and any pairs
    rows = eval_rows.explicit_prompts(rows)
    refs = eval_rows.prompts_of(rows)
    items = refs or [(None, t) for t in eval_rows.texts_of(rows, text_field)]
    if not items:
        return {"n": 0, "rows": 0,
                "note": f"skipped: the data ({', '.join(rows.column_names)}) has no prompt with an expected answer "
                        f"and no `{text_field}` text to score (chat `messages`, prompt + completion, or a text field)"}
    chain = stages(run_dir, run_args, trained)
    data = EvalData(items, eval_rows.pairs_of(rows), text_field, four_bit=len(chain) == 2 and load_4bit is not None)
    adapted = None
    if data.four_bit:  # the base as it trained, in 4 bits; the 4-bit model + adapter beside the merged one
        base_scores, adapted = four_bit_stages(chain[0][1], run_dir, load_4bit, data)
        raw = [base_scores, score_stage(chain[1][1], data.items, data.pairs)]
    else:
        raw = [score_stage(model, data.items, data.pairs) for _, model in chain]
    check = {
        "n": len(refs),
        "rows": len(items),
        "held_out": held is not None,
        "split": held or "training rows, not held out: the data has no eval split (eval_split_size holds rows out)",
        "eval_rows_in_train": shared,
        "base_model": chain[0][1],
        "trained_model": str(trained),
        "stages": [{"stage": name, "model": model} for name, model in chain],
        "examples": [
            {"prompt": p if isinstance(p, str) else p[-1]["content"], "expected": e,
             "base": outs[0], "trained": outs[-1], **({"stage_answers": list(outs)} if len(chain) > 2 else {})}
            for (p, _), e, *outs in zip(refs, data.expected, *(s.get("answers", []) for s in raw))
        ],
    }
    chosen_again(check, run_args)
    # a stage's folder with adapter files beside its weights was scored as transformers loads it, adapter on top
    mixed = [line for _, model in chain if (line := model_folders.adapter_beside_weights(Path(model)))]
    if mixed:
        check["mixed_folders"] = mixed
    scored = Scores(data, chain, raw, adapted)
    for metric in scores.applying(data):
        metric.score(check, scored)
        check.setdefault("intervals", {})[metric.name] = metric.INTERVAL
    return check


def chosen_again(check: dict, run_args: dict) -> None:
    """A run resumed under override_resumed_settings with another eval split than its first part's (another seed,
    eval_split_size, data or split: checkpoint/resume_settings.py EVAL_ROWS): the rows scored may have been trained on,
    so the check does not call them held out, and says why."""
    # here, not at the top: resume_settings imports transformers, and the launcher imports this module (through
    # launch/summary.py) among its light ones: 5 CPU-s before its first line (an unknown recipe took 13 s, not 0.7)
    from fsdp_recipes.checkpoint import resume_settings

    moved = resume_settings.eval_rows_changed(run_args.get("resumed_with_changes"))
    if moved and check.get("held_out"):
        check.update(held_out=False, eval_rows_changed=moved,
                     split=f"{check['split']}, chosen again on resume ({resume_settings.described(moved)}): rows the "
                           "first part trained on may be among them")


def eval_section(check: dict) -> dict:
    """metrics.json's `eval`: the held-out loss, the exact-match counts with their intervals, the paired changes,
    and where they came from; every answer is in sample_generations.json."""
    chain = check.get("stages") or []
    loss = check.get("loss") or {}
    return {
        "metric": "exact match of the greedy answer with the reference answer, both stripped (null where the "
                  "answers are long: exact_match_note)",
        "prompts": check["n"],
        "split": check.get("split", "the eval split's first prompts"),
        "held_out": check.get("held_out", True),
        **({"eval_rows_changed": check["eval_rows_changed"]} if check.get("eval_rows_changed") else {}),
        "eval_rows_in_train": check.get("eval_rows_in_train", 0),
        "base_correct": check.get("base_correct"),
        "trained_correct": check.get("trained_correct"),
        "exact_match_note": check.get("exact_match_note"),
        "interval": "Wilson score interval, 95% (each stage's wilson95; evaluation/intervals.py)",
        "paired_test": "exact McNemar, two-sided, on the prompts only one of two consecutive stages got right; "
                       f"a change where p < {intervals.ALPHA}",
        "changes": check.get("changes"),
        "held_out_loss": {
            "what": "mean negative log-likelihood per scored token (nats) of the reference answers (the tokens SFT "
                    "trains on; a text row's every token); perplexity = exp(loss)",
            **loss,
            **({"base": chain[0].get("loss"), "trained": chain[-1].get("loss"),
                "base_perplexity": chain[0].get("perplexity"), "trained_perplexity": chain[-1].get("perplexity")}
               if chain else {}),
        },
        "base_model": check["base_model"],
        "trained_model": check["trained_model"],
        "four_bit": check.get("four_bit"),
        "stages": check.get("stages"),
        "preference": check.get("preference"),
        "intervals": check.get("intervals"),  # each metric's, in words
        "loaded_with": "transformers AutoModelForCausalLM.from_pretrained, no FSDP",
        "samples": check["examples"][:SHOWN_SAMPLES],
        "all_answers": "sample_generations.json",
    }
