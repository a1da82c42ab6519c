"""Which rows a finished run is scored on, and their prompts, reference answers and preference pairs: read by the
scoring (evaluation/scoring.py, the summary's) and by the served-model check (serving/engine_check.py), so that both
ask the rows the run held out, found or carved off as the run did (data/loading.py)."""

from __future__ import annotations

from fsdp_recipes.config.run_config import PackArguments
from fsdp_recipes.data.loading import held_out, load_raw, shared_rows
from fsdp_recipes.evaluation.generation import ANSWER_TOKENS

EVAL_PROMPTS = 128  # at most this many eval rows are scored, by every stage (base and trained model, ...)
SHORT_ANSWER_TOKENS = 16  # exact match is scored where every reference answer is at most this many tokens
SAMPLE_TOKENS = 64  # where some are longer: generated per answer, to read (not scored) ...
SAMPLE_ROWS = 16  # ... for this many prompts


def run_settings(run_args: dict, cfg=None):
    """(script, mixture, pack, seed, text field) of a run: the launcher's parsed recipe (config/recipes.py
    Recipe.cfg), else what its run_args.json says."""
    import dataclasses

    from trl import DatasetMixtureConfig, ScriptArguments

    if cfg is not None:
        return (cfg.script, cfg.mixture, cfg.pack, cfg.training.seed,
                getattr(cfg.training, "dataset_text_field", None) or "text")
    names = {f.name for f in dataclasses.fields(PackArguments)}
    pack = PackArguments(**{k: v for k, v in run_args.get("pack_args", {}).items() if k in names})
    training = run_args.get(f"{pack.trainer}_config") or {}
    return (ScriptArguments(**run_args["script_args"]), DatasetMixtureConfig(**run_args["dataset_mixture"]), pack,
            training.get("seed", 42), training.get("dataset_text_field") or "text")


def scored_rows(run_args: dict, limit: int, cfg=None):
    """(rows, held_out, shared, text field): the first `limit` rows of the run's eval split, found or carved off as
    the run did (data/loading.py held_out, the same seed), and a description of it; without an eval split the first
    training rows and held_out None (they are not called held out); shared: how many of the rows are training rows
    too; the text field a language-modelling row holds its text in."""
    import copy

    script, mixture, pack, seed, text_field = run_settings(run_args, cfg)
    ds = load_raw(script, mixture, pack, text_field, seed)
    train, evaluation, how = held_out(ds, copy.copy(script), pack, seed, script.dataset_name or "mixture")
    rows = train if evaluation is None else evaluation
    rows = rows.select(range(min(limit, len(rows))))
    return rows, how, (shared_rows(train, rows) if evaluation is not None else 0), text_field


def eval_rows(run_args: dict, limit: int, cfg=None):
    """The first `limit` rows scored (scored_rows): the eval split's, else the training split's."""
    return scored_rows(run_args, limit, cfg)[0]


def answer(turns) -> str:
    return turns[-1]["content"] if isinstance(turns, list) else str(turns)


def explicit_prompts(rows):
    """Preference pairs whose prompt is inside the answers (the implicit-prompt layout) with the prompt taken out as
    TRL's DPOTrainer takes it (trl.data_utils.maybe_extract_prompt); other rows as they are."""
    if "prompt" in rows.column_names or not {"chosen", "rejected"} <= set(rows.column_names) or not len(rows):
        return rows
    from trl.data_utils import maybe_extract_prompt

    return rows.map(maybe_extract_prompt)


def chat_rows(rows, columns: set[str]) -> bool:
    """Whether the rows hold these columns and chat prompts (the summary generates from chat prompts only)."""
    return columns <= set(rows.column_names) and len(rows) > 0 and isinstance(rows[0]["prompt"], list)


def pairs_of(rows) -> list[tuple[list[dict], str, str]]:
    """(chat prompt, chosen, rejected) when the rows are preference pairs, else []."""
    if not chat_rows(rows, {"prompt", "chosen", "rejected"}):
        return []
    return [(r["prompt"], answer(r["chosen"]), answer(r["rejected"])) for r in rows]


def load_prompts(run_args: dict, limit: int, cfg=None) -> list[tuple[list[dict], str]]:
    """prompts_of the run's eval split's first `limit` rows."""
    return prompts_of(explicit_prompts(eval_rows(run_args, limit, cfg)))


def prompts_of(rows) -> list[tuple[list[dict] | str, str]]:
    """(prompt, reference answer) of every row that has both, as it is written (the exact match strips both sides):
    from prompt-completion rows, chat or plain text (a text prompt is generated from as it is, without the chat
    template); from `messages` (ShareGPT's converted too; the turns before the last assistant turn, which is the
    reference); from preference pairs (the chosen answer) or labelled answers (those labelled desirable);
    [] for other layouts (a text field has no prompt to answer)."""
    if "messages" in rows.column_names and "prompt" not in rows.column_names:
        out = []
        for r in rows:
            turns = r["messages"] or []
            last = max((i for i, t in enumerate(turns) if t.get("role") == "assistant"), default=None)
            if last and isinstance(turns[last].get("content"), str):  # an answer after at least one turn to answer
                out.append((turns[:last], turns[last]["content"]))
        return out
    key = next((k for k in ("completion", "chosen") if k in rows.column_names), None)
    if key is None or "prompt" not in rows.column_names or not len(rows):
        return []
    labelled = "label" in rows.column_names  # unpaired preference rows: an undesirable answer is not the expected one
    return [(r["prompt"], answer(r[key])) for r in rows if not labelled or r["label"] is True]


def texts_of(rows, text_field: str) -> list[str]:
    """The texts of language-modelling rows (a text field, no prompt): scored by their loss only."""
    if text_field not in rows.column_names or "prompt" in rows.column_names:
        return []
    return [r[text_field] for r in rows if isinstance(r[text_field], str) and r[text_field]]


def answer_lengths(tok, answers: list[str]) -> list[int]:
    """Each reference answer's length in tokens, stripped as exact match compares it."""
    return [len(tok(a.strip(), add_special_tokens=False)["input_ids"]) for a in answers]


def exact_match_tokens(lengths: list[int]) -> int:
    """Tokens to generate per answer where exact match is scored (every answer at most SHORT_ANSWER_TOKENS): the
    usual ANSWER_TOKENS, or room to see the longest answer end (a model that goes on past it does not match)."""
    return max(ANSWER_TOKENS, max(lengths) + 2)
