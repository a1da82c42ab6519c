"""The end-of-run summary: what the run did, from its run report, and what the model learned.

    python -m fsdp_recipes.launch.summary runs/tiny-cpu-lora [--generate | --no-generate]

Loads the base model and the trained model (and any stage between: base -> sft -> dpo) with plain transformers (no
FSDP, no accelerate) and scores each on the same rows of the eval split: the held-out loss and perplexity of the
reference answers, and where the answers are short the exact match of its greedy answers, with 95% Wilson intervals
and an exact McNemar test between consecutive stages (metrics/intervals.py). The summary doubles as a check that
the saved model reloads.

That holds two whole models in host memory, so the generations run only where that is cheap: on the first node of
a job (the launcher runs this on every node), and for a model under 1B parameters (counted from the safetensors
headers, nothing loaded). Elsewhere the summary says in one line that they were skipped and how to get them:
`--generate` here, or FSDP_RECIPES_SUMMARY_GENERATIONS=1 for the launcher (size limit lifted; still the first node
only). FSDP_RECIPES_SUMMARY_GENERATIONS=0 skips them whatever the size (a pipeline with its own evaluation; the test
suite, outside the tests that check them).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import warnings
from pathlib import Path

from fsdp_recipes import library_logs
from fsdp_recipes.speed.four_bit import load_4bit, recorded
from fsdp_recipes.errors import UserError, cli
from fsdp_recipes.train import kinds
from fsdp_recipes.train.eval_rows import (EVAL_PROMPTS, SHORT_ANSWER_TOKENS, answer, answer_lengths, chat_rows,
                                           eval_rows, exact_match_tokens, explicit_prompts, prompts_of, scored_rows,
                                           texts_of)
from fsdp_recipes.metrics.report import human_bytes
from fsdp_recipes.metrics import gates, intervals, metrics_file


def pairs_of(rows) -> list[tuple[list[dict], str, str]]:
    """(chat prompt, chosen, rejected) when the rows are preference pairs, else []."""
    if not chat_rows(rows, {"prompt", "chosen", "rejected"}):
        return []
    return [(r["prompt"], answer(r["chosen"]), answer(r["rejected"])) for r in rows]


def load_prompts(run_args: dict, limit: int, cfg=None) -> list[tuple[list[dict], str]]:
    """prompts_of the run's eval split's first `limit` rows."""
    return prompts_of(explicit_prompts(eval_rows(run_args, limit, cfg)))


def stages(run_dir: Path, run_args: dict, trained: Path) -> list[tuple[str, str]]:
    """(name, model folder) from the first base model to this run's trained model. A model that is another run's
    output (its folder or `merged/` beside that run's run_args.json: the SFT model a DPO run continues from) is
    named by that run's trainer, and its own base comes before it."""
    chain = [(run_args.get("pack_args", {}).get("trainer", "trained"), str(trained))]
    model = run_args["model_args"]["model_name_or_path"]
    for _ in range(8):  # a chain of runs, each continuing from the one before
        folder = Path(model)
        source = folder.parent if folder.name == "merged" else folder
        if not (source / "run_args.json").is_file():
            break
        before = json.loads((source / "run_args.json").read_text())
        chain.append((before.get("pack_args", {}).get("trainer", "trained"), model))
        model = before["model_args"]["model_name_or_path"]
    chain.append(("base", model))
    return chain[::-1]


GENERATION_LIMIT = 1_000_000_000  # parameters: two such models in fp32 are ~8 GB of host memory
# The launcher has no flag for it: "1" generates whatever the size, "0" never; unset (or "auto"): by size.
FORCE_ENV = "FSDP_RECIPES_SUMMARY_GENERATIONS"
FORCE_VALUES = ("0", "1", "auto")


def generation_setting() -> str:
    """FSDP_RECIPES_SUMMARY_GENERATIONS, checked: one of FORCE_VALUES."""
    value = os.environ.get(FORCE_ENV, "auto")
    if value not in FORCE_VALUES:
        raise UserError(f"{FORCE_ENV}={value!r} is not one of 0 (never), 1 (whatever the size), auto (by size). "
                        f"Fix: set one of those, or unset it.")
    return value


def trained_model_dir(run_dir: Path) -> Path | None:
    """The model directory the generations load: `merged/` of a LoRA run, else the run's own full model; None for a
    LoRA run without a merged model (nothing loadable without peft here)."""
    merged = run_dir / "merged"
    trained = merged if (merged / "config.json").exists() else run_dir
    return trained if (trained / "config.json").exists() else None


def model_size(model_dir: Path) -> tuple[int, int] | None:
    """(parameters, bytes) of the safetensors files in `model_dir`, from their headers and file sizes: no tensor
    is read. None without safetensors files."""
    from safetensors import safe_open

    files = sorted(Path(model_dir).glob("*.safetensors"))
    if not files:
        return None
    params = 0
    for f in files:
        with safe_open(str(f), framework="pt") as h:
            for key in h.keys():
                n = 1
                for dim in h.get_slice(key).get_shape():
                    n *= dim
                params += n
    return params, sum(f.stat().st_size for f in files)


def skip_generations(run_dir: Path, trained: Path, machine_rank: str, force: bool, size=None) -> str | None:
    """None: generate; else the one line saying why the generations were skipped and how to get them. `size`
    replaces model_size (tests)."""
    how = (f"run `python -m fsdp_recipes.launch.summary {run_dir} --generate` where the memory is, or set "
           f"{FORCE_ENV}=1 for the launcher")
    if str(machine_rank) != "0":
        return f"skipped on this node (machine rank {machine_rank}): the first node generates them"
    if force:
        return None
    found = (size or model_size)(trained)
    if found is None:
        return f"skipped: no safetensors files in {trained} to tell the model's size; {how}"
    params, nbytes = found
    if params >= GENERATION_LIMIT:
        return (f"skipped: the model has {params / 1e9:.1f}B parameters (the limit is {GENERATION_LIMIT / 1e9:g}B), "
                f"and loading it and the base model on CPU would take about {human_bytes(2 * nbytes)} of host "
                f"memory; {how}")
    return None


PROMPTS_ENV = "FSDP_RECIPES_SUMMARY_PROMPTS"  # fewer (or more) eval prompts than EVAL_PROMPTS
SHOWN_SAMPLES = 3


def eval_prompts() -> int:
    """How many eval prompts the generations answer: FSDP_RECIPES_SUMMARY_PROMPTS, else EVAL_PROMPTS. On CPU the
    prompts' prefill is most of the time (the default's 100 questions, base and trained model: 61 s on 2 cores
    while another test ran)."""
    value = os.environ.get(PROMPTS_ENV, str(EVAL_PROMPTS))
    if not value.isdigit() or int(value) < 1:
        raise UserError(f"{PROMPTS_ENV}={value!r} is not a positive whole number. Fix: set it to how many eval "
                        f"prompts the summary should generate for (default {EVAL_PROMPTS}), or unset it.")
    return int(value)


def settings() -> tuple[int, str]:
    """(eval_prompts(), generation_setting()): the launcher reads them before the training, so that a bad value is
    one line before any rank starts rather than after the run."""
    return eval_prompts(), generation_setting()


SAMPLE_TOKENS = 64  # where some are longer: generated per answer, to read (not scored) ...
SAMPLE_ROWS = 16  # ... for this many prompts


def margins(model, tok, pairs: list[tuple[list[dict], str, str]]) -> list[float]:
    """log p(chosen) - log p(rejected) of each pair's answer after its chat prompt (the quantity DPO's implicit
    reward is built from), summed over the answer's tokens (metrics/answer_loss.py)."""
    from fsdp_recipes.metrics.answer_loss import answer_logps

    prompts = [p for p, _, _ in pairs]
    chosen = answer_logps(model, tok, prompts, [c for _, c, _ in pairs])
    rejected = answer_logps(model, tok, prompts, [r for _, _, r in pairs])
    return [c - r for c, r in zip(chosen, rejected)]


def preference_margins(model_dir: str, pairs: list[tuple[list[dict], str, str]]) -> list[float]:
    """margins of a saved model; plain transformers."""
    from fsdp_recipes.assets.generation import load

    return margins(*load(model_dir), pairs)


def score_stage(model_dir: str, items: list[tuple[list[dict] | str | None, str]],
                pairs: list[tuple[list[dict], str, str]], loaded=None) -> dict:
    """One model's scores on the scored rows, the model loaded once with plain transformers: `loss`, the held-out
    loss of the reference answers (prompt None: of the text; metrics/answer_loss.py); `answers`, its greedy answers
    to the prompts, all of them where every reference is at most SHORT_ANSWER_TOKENS tokens (`long_answers` 0),
    else the first SAMPLE_ROWS up to SAMPLE_TOKENS tokens each; `margins` on preference pairs. `loaded`: (model,
    tokenizer) loaded already (a 4-bit one: four_bit_scores) instead of `model_dir`'s."""
    from fsdp_recipes.assets import generation
    from fsdp_recipes.metrics.answer_loss import held_out_loss

    model, tok = loaded or generation.load(model_dir)
    out = {"loss": held_out_loss(model, tok, items), "answers": [], "long_answers": 0}
    prompted = [(p, a) for p, a in items if p is not None]
    if prompted:
        lengths = answer_lengths(tok, [a for _, a in prompted])
        out["long_answers"] = sum(n > SHORT_ANSWER_TOKENS for n in lengths)
        if out["long_answers"]:
            prompts, cap = [p for p, _ in prompted[:SAMPLE_ROWS]], SAMPLE_TOKENS
        else:  # room to see the answer end: a model that goes on past the expected answer does not match it
            prompts, cap = [p for p, _ in prompted], exact_match_tokens(lengths)
        out["answers"] = generation.answers(model, tok, prompts, max_new_tokens=cap)
    if pairs:
        out["margins"] = margins(model, tok, pairs)
    return out


def four_bit_scores(base: str, run_dir: Path, model_args: dict, items, pairs) -> tuple[dict, dict]:
    """A 4-bit run's base as it trained on it (loaded in 4 bits with the run's settings) and that base with the run's
    adapter: their score_stage scores. One load serves both (the adapter goes on the same model)."""
    from peft import PeftModel

    from fsdp_recipes.assets import generation
    from fsdp_recipes.train import console  # it imports transformers: the launcher's checks run before that

    model = load_4bit(base, model_args).eval()
    tok = generation.load_tokenizer(base)
    base_scores = score_stage(base, items, pairs, loaded=(model, tok))
    with warnings.catch_warnings():  # peft's read of a property transformers deprecated: off the console, as in
        for category, pattern in console.LOG_ONLY_WARNINGS:  # the ranks (train/console.py)
            warnings.filterwarnings("ignore", message=pattern, category=category)
        adapted = PeftModel.from_pretrained(model, str(run_dir)).eval()
    return base_scores, score_stage(base, items, pairs, loaded=(adapted, generation.load_tokenizer(str(run_dir))))


def add_four_bit(check: dict, adapted: dict, right_adapted: list[bool] | None) -> None:
    """A 4-bit run: the 4-bit base + adapter's exact match, and on how many prompts the merged model (the dequantised
    base + adapter, scored as `trained`) gives the same answer; its answers in the examples."""
    merged = [e["trained"] for e in check["examples"]]
    check["four_bit"] = {"base": "loaded in 4 bits with the run's BitsAndBytesConfig, the model it trained on",
                         "adapted": intervals.share(sum(right_adapted), len(right_adapted)) if right_adapted else None,
                         "adapted_loss": adapted["loss"]["loss"],
                         "merged_same_answers": sum(a == m for a, m in zip(adapted["answers"], merged)),
                         "answers_compared": min(len(merged), len(adapted["answers"]))}
    for example, a in zip(check["examples"], adapted["answers"]):
        example["trained_4bit"] = a


def add_preference(check: dict, margins_per_stage: list[list[float]]) -> None:
    """Each stage's preference for the chosen answer of the eval pairs (its log p(chosen) - log p(rejected) above 0),
    with its Wilson 95% interval, and DPO's implicit-reward accuracy of the last stage against the one before it."""
    for stage, m in zip(check["stages"], margins_per_stage):
        preferred = sum(x > 0 for x in m)
        stage.update(preference_accuracy=preferred / len(m), preferred=preferred,
                     preference_wilson95=intervals.share(preferred, len(m))["wilson95"],
                     mean_logp_margin=sum(m) / len(m))
    # DPO's implicit reward r = beta * (log pi - log pi_ref), pi_ref the model the run started from: the chosen
    # answer's reward above the rejected one's (beta > 0 leaves the sign alone)
    reward = [t - r for t, r in zip(margins_per_stage[-1], margins_per_stage[-2])]
    right = sum(x > 0 for x in reward)
    check["preference"] = {"pairs": len(reward), "reward_accuracy": right / len(reward), "reward_correct": right,
                           "reward_wilson95": intervals.share(right, len(reward))["wilson95"],
                           "mean_reward_margin_over_beta": sum(reward) / len(reward)}


def learning_check(run_dir: Path, run_args: dict, n: int = EVAL_PROMPTS, cfg=None) -> dict | None:
    """Every stage's model (base, then each run it went through: SFT, DPO) on the eval split's first `n` rows: the
    held-out loss of the reference answers (of the text, for a text field), the exact match of its greedy answers
    where the answers are short, with 95% intervals and a paired test between consecutive stages; for preference
    data also each model's preference for the chosen answer."""
    trained = trained_model_dir(run_dir)
    if trained is None:
        return None
    rows, held, shared, text_field = scored_rows(run_args, n, cfg)  # loaded once: the prompts and any pairs
    rows = explicit_prompts(rows)
    refs = prompts_of(rows)
    items = refs or [(None, t) for t in texts_of(rows, text_field)]
    if not items:
        return {"n": 0, "rows": 0,
                "note": f"skipped: the data ({', '.join(rows.column_names)}) has no prompt with an expected answer "
                        f"and no `{text_field}` text to score (chat `messages`, prompt + completion, or a text field)"}
    preference = pairs_of(rows)
    chain = stages(run_dir, run_args, trained)
    four_bit = len(chain) == 2 and recorded(run_args["model_args"]) is not None  # a 4-bit run, its base
    if four_bit:  # the base as it trained, in 4 bits; the 4-bit model + adapter beside the merged one
        base_scores, adapted = four_bit_scores(chain[0][1], run_dir, run_args["model_args"], items, preference)
        scores = [base_scores, score_stage(chain[1][1], items, preference)]
    else:
        scores = [score_stage(model, items, preference) for _, model in chain]
    expected = [a.strip() for _, a in refs]
    long = max(s["long_answers"] for s in scores)  # every stage generated for every prompt, or none scored
    right = [[o == e for o, e in zip(s["answers"], expected)] for s in scores] if refs and not long else None
    check = {
        "n": len(refs),
        "rows": len(items),
        "held_out": held is not None,
        "split": held or "training rows, not held out: the data has no eval split (eval_split_size holds rows out)",
        "eval_rows_in_train": shared,
        "exact_match": right is not None,
        "base_correct": sum(right[0]) if right else None,
        "trained_correct": sum(right[-1]) if right else None,
        "base_model": chain[0][1],
        "trained_model": str(trained),
        "loss": {k: scores[-1]["loss"][k] for k in ("rows", "tokens", "rows_cut", "max_tokens")},
        "stages": [{"stage": name, "model": model,
                    **(intervals.share(sum(r), len(r)) if right else {"correct": None}),
                    "loss": s["loss"]["loss"], "perplexity": s["loss"]["perplexity"]}
                   for (name, model), s, r in zip(chain, scores, right or [None] * len(chain))],
        "changes": [{"from": a, "to": b, **intervals.paired(ra, rb)}
                    for (a, _), (b, _), ra, rb in zip(chain, chain[1:], right, right[1:])] if right else [],
        "examples": [
            {"prompt": p if isinstance(p, str) else p[-1]["content"], "expected": e,
             "base": outs[0], "trained": outs[-1], **({"stage_answers": list(outs)} if len(chain) > 2 else {})}
            for (p, _), e, *outs in zip(refs, expected, *(s["answers"] for s in scores))
        ],
    }
    if refs and long:
        check["exact_match_note"] = (
            f"{long} of the {len(refs)} reference answers are over {SHORT_ANSWER_TOKENS} tokens (exact match is for "
            f"short answers; the loss is the measure); sample_generations.json has the first {SAMPLE_ROWS} prompts "
            f"answered, up to {SAMPLE_TOKENS} tokens each")
    elif not refs:
        check["exact_match_note"] = f"text rows (`{text_field}`) have no prompt to answer: the loss is the measure"
    if four_bit:
        add_four_bit(check, adapted, [o == e for o, e in zip(adapted["answers"], expected)] if right else None)
    if preference:
        add_preference(check, [s["margins"] for s in scores])
    return check


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
        "eval_rows_in_train": check.get("eval_rows_in_train", 0),
        "base_correct": check["base_correct"],
        "trained_correct": check["trained_correct"],
        "exact_match_note": check.get("exact_match_note"),
        "interval": "Wilson score interval, 95% (each stage's wilson95; metrics/intervals.py)",
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
        "loaded_with": "transformers AutoModelForCausalLM.from_pretrained, no FSDP",
        "samples": check["examples"][:SHOWN_SAMPLES],
        "all_answers": "sample_generations.json",
    }


def eval_lines(check: dict) -> list[str]:
    """The summary's lines for the scores: the held-out loss of every stage, the exact match with 95% intervals and
    the paired verdict (SFT: base model -> trained; a chain: base -> sft -> dpo, then each step's verdict)."""
    held = check.get("held_out", True)
    chain = check["stages"]
    names = ["base model", "trained"] if len(chain) == 2 else [s["stage"] for s in chain]
    lines = []
    loss = check.get("loss")
    if loss and all(s.get("loss") is not None for s in chain):
        rows = f"{loss['rows']} eval rows" if held else f"{loss['rows']} training rows (not held out)"
        cut = f"; {loss['rows_cut']} rows cut at {loss['max_tokens']} tokens" if loss.get("rows_cut") else ""
        scored = "answer tokens" if check["n"] else "tokens"
        per_stage = " -> ".join(f"{name} {s['loss']:.3f}" + (f" (perplexity {s['perplexity']:.3g})" if s.get(
            "perplexity") is not None else "") for name, s in zip(names, chain))
        label = "held-out loss" if held else "loss"
        lines.append(f"{label} on {rows} ({loss['tokens']:,} {scored}{cut}): {per_stage}")
    n = check["n"]
    what = "eval prompts" if held else "training prompts (not held out)"
    if check.get("exact_match", True) and n:
        rates = " -> ".join(f"{name} {intervals.rate_text(s['correct'], n)}" for name, s in zip(names, chain))
        changes = check.get("changes") or []
        if len(chain) == 2 and changes:
            lines.append(f"exact match on {n} {what}: {rates}: {intervals.change_text(changes[0])}")
        else:
            lines.append(f"exact match on {n} {what}: {rates}")
            if changes:
                lines.append("            on the same prompts: " + "; ".join(
                    f"{c['from']} -> {c['to']} {intervals.change_text(c)}" for c in changes))
        lines.append(f"            95% Wilson intervals; a change: exact McNemar test on the prompts only one side "
                     f"got right (p < {intervals.ALPHA})")
    elif check.get("exact_match_note"):
        lines.append(f"exact match not scored: {check['exact_match_note']}")
    if check.get("four_bit"):
        q = check["four_bit"]
        # its exact match where answers are scored, else its held-out loss (long answers); no answers: text rows
        parts = ["the base scored in 4 bits, as it trained"]
        if q.get("adapted"):
            parts.append(f"the 4-bit base + adapter {intervals.rate_text(q['adapted']['correct'], n)}")
        elif q.get("adapted_loss") is not None:
            parts.append(f"the 4-bit base + adapter held-out loss {q['adapted_loss']:.3f}")
        if q.get("answers_compared"):
            parts.append(f"the merged model (dequantised base + adapter) gives its answer on "
                         f"{q['merged_same_answers']}/{q['answers_compared']}")
        lines.append("4 bits      " + "; ".join(parts))
    return lines


def shown(text: str) -> str:
    """A generation as a quoted literal a terminal prints cleanly: a random or untrained model emits token pieces
    that decode to U+FFFD or control characters, which become escapes (`\\ufffd`) instead of mojibake."""
    if text.isprintable() and "\ufffd" not in text:
        return repr(text)
    return ascii(text)


def render(run_dir: Path, metrics: dict, check: dict | None, skipped: str | None = None) -> str:
    m = metrics
    lines = [f"== {m.get('recipe') or run_dir.name}: {m['status']} in {m['wall_clock_s']:.0f}s =="]
    if m.get("first_train_loss") is not None:
        ev = f", eval {m['final_eval_loss']:.3f}" if m.get("final_eval_loss") is not None else ""
        lines.append(f"loss        {m['first_train_loss']:.3f} -> {m['final_train_loss']:.3f} (train){ev}")
    tps = m.get("tokens_per_second")
    lines.append(
        f"throughput  {tps:,.0f} tokens/s ({m['tokens_per_second_per_device']:,.0f} per device), "
        f"{m['steps']} steps, {m['tokens']['non_padding']:,} tokens" if tps else "throughput  n/a"
    )
    if m.get("trainer") in kinds.names():  # the kind's own lines (GRPO: what was sampled, and what it scored)
        lines += kinds.load(m["trainer"]).summary_lines(m)
    mfu = f"{100 * m['mfu']:.1f}%" if m.get("mfu") is not None else f"n/a ({m.get('mfu_note')})"
    source = m.get("peak_flops_source")
    lines.append(f"MFU         {mfu}" + (f" {source}" if source and m.get("mfu") is not None else ""))
    pm = m["peak_memory"]
    dev = (
        f"device {human_bytes(pm['device_allocated_bytes'])} allocated / {human_bytes(pm['device_reserved_bytes'])} reserved, "
        if pm.get("device_allocated_bytes") is not None else ""
    )
    lines.append(f"peak memory {dev}host RSS {human_bytes(pm['host_rss_bytes'])} (max over ranks)")
    lines += gates.lines(m.get("gates") or {})
    lines.append(
        f"sharding    {m['sharding_strategy']} (FSDP{m['fsdp_version'] or '-'}), world size {m['world_size']}, "
        f"{m['num_nodes']} node(s), {m['device']['type']}: {m['device']['name']}"
    )
    shards = m.get("param_shards") or {}
    if shards.get("dtensor_params"):
        shares = ", ".join(f"{100 * n / shards['global_numel']:.1f}%" for n in shards["local_numel_per_rank"])
        lines.append(
            f"shards      {shards['dtensor_params']} parameters are DTensors; the ranks hold {shares} "
            f"of {shards['global_numel'] / 1e6:.2f}M"
        )
    files = [p.name + ("/" if p.is_dir() else "") for p in sorted(run_dir.iterdir()) if not p.name.startswith(".")]
    lines.append(f"files       {run_dir}/: {', '.join(files)}")
    if check:
        lines += eval_lines(check)
    if check and not check.get("held_out", True):
        lines.append("            the data has no eval split (test, validation, valid, eval, dev): these rows were "
                     "trained on; eval_split_size: 0.1 holds 10% out")
    elif check and check.get("eval_rows_in_train"):
        shared, scored = check["eval_rows_in_train"], check.get("rows", check["n"])
        lines.append(f"            {shared} of these {scored} eval rows also appear in the training data: their "
                     "answers are not held out")
    if check and check.get("preference"):
        pref = check["preference"]
        n = pref["pairs"]
        lines.append(f"preference on {n} eval pairs, log p(chosen) > log p(rejected): " + " -> ".join(
            f"{s['stage']} {intervals.rate_text(s['preferred'], n)} margin {s['mean_logp_margin']:+.2f}"
            for s in check["stages"]) + f"; implicit-reward accuracy {intervals.rate_text(pref['reward_correct'], n)}")
    if check:
        for ex in check["examples"][:SHOWN_SAMPLES]:
            lines.append(
                f"  {shown(ex['prompt'])}: expected {shown(ex['expected'])} | base {shown(ex['base'])} | "
                f"trained {shown(ex['trained'])}"
            )
    if skipped:
        lines.append(f"generations {skipped}")
    lines += serve_lines(run_dir)
    return "\n".join(lines)


def serve_lines(run_dir: Path) -> list[str]:
    """How to serve what this run made: vLLM on its merged (or full) model, and on the base model with its LoRA
    adapter; llama.cpp and Ollama through `make gguf`; `make serve-check` to compare their answers (docs/serving.md)."""
    model = trained_model_dir(run_dir)
    if model is None:
        return []
    from fsdp_recipes.config.engine_rules import vllm_lora_refusals, vllm_max_lora_rank

    lines = [f"serve it    vLLM: vllm serve {model}"]
    adapter = run_dir / "adapter_config.json"
    if adapter.is_file():
        config = json.loads(adapter.read_text())
        base = config.get("base_model_name_or_path")
        refused = vllm_lora_refusals(config)  # vLLM's own rules for an adapter (config/engine_rules.py)
        if refused:
            offer = "serve the merged model above" if model != run_dir else "serve the model above"
            lines.append(f"            vLLM, base + adapter: not offered: vLLM refuses this adapter "
                         f"({'; '.join(refused)}); {offer}")
        else:
            tokenizer = f" --tokenizer {run_dir}" if (run_dir / "tokenizer_config.json").is_file() else ""  # its template
            lines.append(f"            vLLM, base + adapter: vllm serve {base} --enable-lora --max-lora-rank "
                         f"{vllm_max_lora_rank(config)} --lora-modules {run_dir.name}={run_dir}{tokenizer}")
    name = run_dir.resolve().name  # serving/gguf_export.py's file name for it
    lines.append(f"            llama.cpp / Ollama: make gguf RUN={run_dir}, then llama-server -m "
                 f"{run_dir}/gguf/{name}.f16.gguf, or ollama create {name} -f {run_dir}/gguf/Modelfile")
    lines.append(f"            check they answer like this run: make serve-check RUN={run_dir}")
    return lines


@cli
def main(argv: list[str] | None = None, recipe=None) -> int:
    """`recipe`: the launcher's loaded recipe (config/recipes.py), whose parsed settings the generations use;
    run from the command line, the run's run_args.json says them."""
    library_logs.divert(lambda text: None)  # run alone: loading the 4-bit base imports bitsandbytes here
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("run_dir", type=Path)
    gen = ap.add_mutually_exclusive_group()
    gen.add_argument("--no-generate", action="store_true", help="skip the before/after generation")
    gen.add_argument("--generate", action="store_true",
                     help=f"generate whatever the model's size (default: under {GENERATION_LIMIT / 1e9:g}B parameters; "
                          f"also {FORCE_ENV}=1)")
    ap.add_argument("--machine-rank", default="0", help="this node's rank in the job: only node 0 generates")
    args = ap.parse_args(argv)
    prompts, setting = settings()
    metrics_path = args.run_dir / "metrics.json"
    if not metrics_path.is_file():
        raise UserError(f"no run report at {metrics_path}. Fix: pass the output_dir of a finished run.")
    metrics = json.loads(metrics_path.read_text())
    run_args = json.loads((args.run_dir / "run_args.json").read_text())
    check = skipped = None
    trained = None if args.no_generate else trained_model_dir(args.run_dir)
    if trained is not None:
        if setting == "0" and not args.generate:
            skipped = f"skipped: {FORCE_ENV}=0"
        else:
            skipped = skip_generations(args.run_dir, trained, args.machine_rank, args.generate or setting == "1")
        if skipped is None:
            check = learning_check(args.run_dir, run_args, prompts, recipe.cfg if recipe is not None else None)
            if check and not check.get("rows"):  # nothing to score: the line says why
                skipped, check = check.get("note"), None
    if check:
        (args.run_dir / "sample_generations.json").write_text(json.dumps(check, indent=2) + "\n")
        metrics = metrics_file.amend(args.run_dir, lambda m: {**m, "eval": eval_section(check)})
    print(render(args.run_dir, metrics, check, skipped))
    code = gates.exit_code(metrics)
    if code:
        print(f"error: {gates.verdict_line(metrics['gates'])}", file=sys.stderr, flush=True)
    return code


if __name__ == "__main__":
    sys.exit(main())
