"""`make data RECIPE=<r> [ARGS=...]`: the recipe's data as the trainer will see it, in seconds, before anything runs.

    fsdp-recipes data <recipe name or folder> [--examples N] [--field value ...]

Prints, with no process group and no model weights loaded (the tokenizer only; the tiny assets and the default's
SmolLM2 are prepared into the cache first where the recipe uses them, as `make finetune` does):
1. the format found or declared and how it maps, one line per file (data/formats/, data/declaration.py);
2. the splits: the training rows, and the eval split and where it came from (data/loading.py's rules), also
   where eval_strategy is "no"; where there is none and eval_strategy is on, the rest is shown and the preview ends
   on the launch's own refusal (its `error:` line and exit code);
3. the token lengths and what max_length cuts (data/lengths.py, data/length_report.py): the table the launcher
   prints;
4. N examples (3: the first two training rows and the longest one measured), rendered with the chat template and
   tokenized as TRL does, the tokens the loss skips «between guillemets» (dim on a terminal), the trained tokens as
   they are, and where max_length cuts; each row as its layout (data/formats/) says it is tokenized and trained.
A launch-layer tool on the data room: it parses and checks the recipe as the launcher does (train/run_checks.py)
and loads the data through the trainer kind (train/kinds/).
ARGS are the run's overrides, as for `make finetune` (ARGS="--max_length 128 --dataset_name data/qa.jsonl"); a
mistake in them, the recipe or the data is one `error:` line, the launcher's.
"""

from __future__ import annotations

import json
import os
import sys
import time
import warnings
from pathlib import Path

from fsdp_recipes import speed
from fsdp_recipes.assets import addition_preferences
from fsdp_recipes.config import model_found, recipes, run_config, value_checks
from fsdp_recipes.data import declaration, length_report, lengths, loading, recipe_tokenizer
from fsdp_recipes.data.rows import ROW_ORIGIN, count_rows, row_at, split_file
from fsdp_recipes.data.tokenizing import Truncation
from fsdp_recipes.errors import UserError, cli
from fsdp_recipes.launch.lines import unexpected_errors
from fsdp_recipes.train import kinds, run_checks

EXAMPLES = 3
SHOWN_TOKENS = 16  # trained tokens listed one by one per example
DIM, RESET = "\033[2m", "\033[0m"


def say(msg: str) -> None:
    print(f"[data] {msg}", flush=True)


USAGE = ("usage: fsdp-recipes data <recipe name or folder> [--examples N] [--field value ...] "
         "(make data RECIPE=<name> ARGS=\"...\")")


def parse(argv: list[str]) -> tuple[str, list[str], int]:
    """(recipe, the run's overrides, examples): --examples N is the preview's, everything else the run's."""
    if not argv or argv[0].startswith("-"):
        raise UserError(f"{USAGE}. Fix: name a recipe (fsdp-recipes recipes list)")
    rest, examples, i = [], EXAMPLES, 1
    while i < len(argv):
        word = argv[i]
        if word == "--examples" or word.startswith("--examples="):
            value = word.partition("=")[2] if "=" in word else (argv[i + 1] if i + 1 < len(argv) else "")
            i += 1 if "=" in word else 2
            if not value.isdigit():
                raise UserError(f"--examples {value!r}: give a number of rows to show. Fix: e.g. --examples 5")
            examples = int(value)
            continue
        rest.append(word)
        i += 1
    return argv[0], rest, examples


def load_config(name: str, overrides: list[str]):
    """The recipe and its configuration as the run parses them, checked as far as the data needs: no GPU check
    (use_cpu, as `make plan` parses), the model's folder, the data fields; the assets it uses prepared."""
    recipe = recipes.load(name, [*overrides, "--use_cpu", "true"])
    speed.check_accelerate(recipe.accelerate, recipe.accelerate_path)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        cfg = run_config.parse_args(recipe.argv(), recipe.raw,
                                    world_size=int(recipe.accelerate.get("num_processes", 1) or 1))
        value_checks.check_values(cfg)
        # the trainer kind's own settings, as the launcher checks them (train/run_checks.py): a recipe make data
        # passes is not one the launch refuses (GRPO without reward_funcs, KTO's KL term on one-row batches)
        kinds.load(cfg.trainer).check_config(cfg)
        speed.check_config(cfg, installed=False)  # the options' settings (as make plan: the training machine's packages)
    declaration.parse_spec(cfg.pack.dataset_format)  # the format's name and mapping, before any row is read
    run_checks.prepare_assets(cfg, quiet=True)
    model_found.check_local_model(cfg.model.model_name_or_path, cfg.pack.continues_from)
    model_found.check_has_tokenizer(Path(os.path.expandvars(os.path.expanduser(cfg.model.model_name_or_path))))
    if cfg.pack.addition_preferences:  # the DPO demo's pairs: made by its first launch, with the SFT model
        addition_preferences.check_target(Path(cfg.script.dataset_name))  # the user's own data is no demo's to make
        if not addition_preferences.is_current(Path(cfg.script.dataset_name), Path(cfg.model.model_name_or_path)):
            raise UserError(f"the pairs in {cfg.script.dataset_name} are made from the SFT model's own answers by "
                            f"the first launch of {recipe.name}, which loads the model; make data loads none. Fix: "
                            f"make finetune RECIPE={recipe.name} once, then make data.")
    if cfg.script.dataset_streaming:
        raise UserError("make data counts and reads the rows, and the recipe streams its dataset. Fix: ARGS=\""
                        "--dataset_streaming false\" (the preview downloads the dataset).")
    return recipe, cfg


def marked(text: str, trained: bool, color: bool) -> str:
    if trained or not text:
        return text
    return f"{DIM}{text}{RESET}" if color else f"«{text}»"


def render(seq, tokenizer, max_length: int | None, color: bool) -> str:
    """The sequence's text, the tokens the loss skips marked (marked()), and where max_length cuts it."""
    kept = seq.kept()
    runs: list[tuple[bool, bool, list[int]]] = []  # (kept, trained, ids)
    for token, keep, trained in zip(seq.ids, kept, seq.trained):
        state = (keep, trained and keep)
        if runs and runs[-1][:2] == state:
            runs[-1][2].append(token)
        else:
            runs.append((*state, [token]))
    out = []
    for i, (keep, trained, ids) in enumerate(runs):
        if i and keep != runs[i - 1][0]:
            out.append(f" |max_length {max_length} cuts here| ")
        out.append(marked(tokenizer.decode(ids, skip_special_tokens=False, clean_up_tokenization_spaces=False),
                          trained, color))
    return "".join(out)


def show_example(k: int, n: int, label: str, row: dict, tokenizer, t, template, color: bool) -> None:
    sequences = lengths.example(row, tokenizer, t, template)
    layout = lengths.layout_of(list(row), row, t)
    extra = layout.describe_row(row) if layout is not None else ""
    for seq in sequences:
        kept = seq.kept()
        trained = [tok for tok, on, keep in zip(seq.ids, seq.trained, kept) if on and keep]
        cut = len(seq.ids) - sum(kept)
        name = f", {seq.name}" if seq.name else ""
        say(f"example {k} of {n} ({label}){extra}{name}: {len(seq.ids)} tokens, {len(trained)} trained"
            + (f", {cut} cut by max_length {t.max_length}" if cut else ""))
        text = render(seq, tokenizer, t.max_length, color)
        for line in (text[:-1] if text.endswith("\n") else text).split("\n"):  # a last newline: no empty line
            print(f"    {line}", flush=True)
        if trained:
            pieces = [repr(tokenizer.decode([tok], skip_special_tokens=False, clean_up_tokenization_spaces=False))
                      for tok in trained[:SHOWN_TOKENS]]
            more = f" and {len(trained) - SHOWN_TOKENS} more" if len(trained) > SHOWN_TOKENS else ""
            print(f"    trained tokens: {' '.join(pieces)}{more}", flush=True)


def located(where: str, split: str, i: int, rows: int) -> str:
    """Where row i of the split is in its file (data/rows.py row_at), or "" where the trainer kind made the rows
    from the file's otherwise (KTO unpairs each pair into two rows): a line would name another row."""
    file = split_file(where, split)
    if file is not None:
        origin = ROW_ORIGIN.get((where, split))
        written = len(origin[1]) if origin else count_rows(file)
        if written != rows:
            return ""
    return row_at(where, split, i)


def chosen_rows(rows: int, measured, n: int) -> list[tuple[int, str]]:
    """(index, label) of the rows to show: the first n training rows, the last of them (from 3 on) replaced by the
    longest row measured where that is not one of the others."""
    picked = [(i, f"train row {i + 1}") for i in range(min(n, rows))]
    if len(picked) >= 3 and measured and measured[0].sampled:
        m = measured[0]
        longest = m.index[max(range(m.sampled), key=m.whole.__getitem__)]
        if longest >= len(picked) - 1:
            picked[-1] = (longest, f"train row {longest + 1}, the longest of the {m.sampled} measured")
    return picked


def preview(name: str, overrides: list[str], examples: int = EXAMPLES, color: bool = False) -> None:
    t0 = time.time()
    recipe, cfg = load_config(name, overrides)
    import datasets
    import transformers

    datasets.disable_progress_bars()
    datasets.utils.logging.set_verbosity(datasets.utils.logging.CRITICAL)
    transformers.logging.set_verbosity_error()
    kind = kinds.load(cfg.trainer)
    where = cfg.script.dataset_name or "mixture"
    say(f"recipe {recipe.name} ({recipe.folder}), trainer {recipe.trainer}, data {where}")
    splits = kind.load_datasets(cfg, want_eval=loading.IF_ANY)
    train, evaluation = splits
    notes = [line for line in loading.NOTES if not line.startswith("eval split")]
    for line in notes:
        say(line)
    if not notes:
        say(f"data {where}: taken as it is ({', '.join(train.column_names)})")
    say(f"train split: `{cfg.script.dataset_train_split}`, {len(train)} rows")
    # the launch loads with eval on where eval_strategy is not "no" (train/kinds/: load_datasets), and refuses data
    # without an eval split: its refusal, the preview's last line and exit code
    refusal = loading.NO_EVAL[0] if evaluation is None and cfg.training.eval_strategy != "no" and loading.NO_EVAL \
        else None
    for line in loading.NOTES:
        if line.startswith("eval split") and refusal is not None:
            strategy = getattr(cfg.training.eval_strategy, "value", cfg.training.eval_strategy)
            say(f"eval split: none in {where}, and eval_strategy is \"{strategy}\": a launch of "
                f"{recipe.name} stops here (the error below)")
        elif line.startswith("eval split"):
            say(line + ("; eval_strategy is \"no\": not evaluated during training" if evaluation is not None
                        and cfg.training.eval_strategy == "no" else ""))
    for line in loading.WARNINGS:
        say(f"warning: {line}")
    tokenizer, template = recipe_tokenizer.load_tokenizer(cfg)
    for line in kind.check_data(cfg, splits, tokenizer):
        say(f"warning: {line}")
    n = min(examples, len(train))
    if tokenizer is None:
        say(f"no tokenizer: {cfg.model.model_name_or_path} is a hub id whose files are not on this machine, so no "
            "token lengths and no tokens. Fix: download it once (hf download <id>), or name a local "
            "model folder")
        for i in range(n):
            at = located(where, cfg.script.dataset_train_split, i, len(train))
            say(f"example {i + 1} of {n} (train row {i + 1}{', ' + at if at else ''}), as loaded:")
            print(f"    {json.dumps(train[i], ensure_ascii=False)}", flush=True)
        say(f"read and checked in {time.time() - t0:.1f}s; no process group, no model weights")
        if refusal is not None:
            raise refusal
        return
    measured = lengths.measure_splits(cfg, splits, tokenizer, template)
    table, cut = length_report.report(measured, cfg, tokenizer, where)
    for line in table:
        say(line)
    for line in cut:
        say(f"warning: {line}")
    t = Truncation.of(cfg.training)
    if n:
        legend = "dim" if color else "«between guillemets»"
        trained = lengths.what_is_trained(train.column_names, t, train[0])
        say(f"{n} example(s), rendered and tokenized as the trainer will; the loss counts {trained}, the tokens it "
            f"skips are {legend}")
    for k, (i, label) in enumerate(chosen_rows(len(train), measured, n), 1):
        at = located(where, cfg.script.dataset_train_split, i, len(train))
        show_example(k, n, f"{label}, {at}" if at else label, train[i], tokenizer, t, template, color)
    say(f"read, checked and tokenized in {time.time() - t0:.1f}s; no process group, no model weights")
    if refusal is not None:
        raise refusal


@cli
def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] in (["-h"], ["--help"]):
        print(f"{USAGE}\n\nThe recipe's data as its run reads it: the format found, the splits, the token lengths "
              f"against max_length, and --examples rows (default {EXAMPLES}) with the tokens it trains on.")
        return 0
    name, overrides, examples = parse(argv)
    color = sys.stdout.isatty() and not os.environ.get("NO_COLOR")
    with unexpected_errors("previewing the data"):
        preview(name, overrides, examples, color)
    return 0


if __name__ == "__main__":
    sys.exit(main())
