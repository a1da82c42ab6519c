"""The lengths table and what max_length cuts, as lines: the launcher's before any rank starts (launch/launcher.py
check_recipe), `make data`'s (launch/data_preview.py), and rank 0's where the launcher could not measure (a hub
dataset or model). The lengths themselves: data/lengths.py.
"""

from __future__ import annotations

from fsdp_recipes.config.model_found import looks_local
from fsdp_recipes.data.lengths import Lengths, measure_splits, spread
from fsdp_recipes.data.loading import is_local
from fsdp_recipes.data.rows import row_at
from fsdp_recipes.data.tokenizing import Truncation
from fsdp_recipes.errors import UserError


def tokenizer_name(tokenizer, model: str) -> str:
    name = str(model).rstrip("/").rsplit("/", 1)[-1] or str(model)
    chat = " and chat template" if getattr(tokenizer, "chat_template", None) else ""
    return f"{name}'s tokenizer{chat}"


def table(measured: list[Lengths], t: Truncation, source: str) -> list[str]:
    """The length table, a line each (no prefix), and the verdict line when nothing is cut (else cut_warning says
    so). `source`: whose tokenizer (tokenizer_name)."""
    if not measured:
        return []
    how = " (rows: a seeded sample of a larger split)" if any(m.sampled < m.rows for m in measured) else ""
    lines = [f"token lengths under {source}, median / p95 / max{how}:"]
    names = measured[0].answer_names
    head = ["split", "rows"] + (["prompt"] if measured[0].has_prompt else []) + list(names)
    if names:
        head.append("whole")
    cuts = t.cuts and bool(names)
    if cuts:
        head.append(f"cut at max_length {t.max_length}")
    body = []
    for m in measured:
        cells = [m.split, f"{m.sampled} of {m.rows}" if m.sampled < m.rows else str(m.rows)]
        if m.has_prompt:
            cells.append(spread(m.prompt))
        cells += [spread(m.answers[n]) for n in names]
        if names:
            cells.append(spread(m.whole))
        if cuts:
            cut = m.cut(t)[0]
            cells.append(f"{cut} ({100 * cut / m.sampled:.0f}%)" if cut else "0")
        body.append(cells)
    widths = [max(len(r[i]) for r in [head, *body]) for i in range(len(head))]
    for cells in [head, *body]:
        lines.append("  " + "  ".join(c.ljust(w) for c, w in zip(cells, widths)).rstrip())
    keep = max(m.keeps() for m in measured)
    if not names:
        lines.append("prompts only: the answers are generated, so max_length cuts nothing here")
    elif t.max_length is None:
        lines.append(f"max_length is not set: nothing is cut; {keep} would keep 99% of rows whole")
    elif not t.cuts:
        lines.append(f"packing ({t.packing}): a row longer than max_length {t.max_length} goes on in the next "
                     "sequence; nothing is cut")
    elif not any(m.cut(t)[0] for m in measured):
        lines.append(f"max_length {t.max_length} cuts no answer; {keep} keeps 99% of rows whole")
    prompts = sum(m.cut(t)[2] for m in measured)
    if prompts:
        lines.append(f"truncation_mode keep_end: {prompts} row(s) longer than max_length {t.max_length} lose the "
                     "start of their prompt instead")
    return lines


def cut_warning(measured: list[Lengths], t: Truncation) -> str | None:
    """One line where max_length cuts answers: how many rows of each split, and the max_length that keeps 99% of
    rows whole. None where it cuts none."""
    cut = [(m, *m.cut(t)) for m in measured]
    if not any(c for _, c, _, _ in cut):
        return None
    parts = []
    for m, c, _, _ in cut:
        if c:
            of = f"{m.sampled} sampled" if m.sampled < m.rows else f"the {m.rows}"
            parts.append(f"{c} of {of} `{m.split}` rows ({100 * c / m.sampled:.0f}%)")
    wholly = sum(w for _, _, w, _ in cut)
    what = "answers" if measured[0].answer_names == ("answer",) else "chosen or rejected answers"
    line = f"max_length {t.max_length} cuts the {what} of {' and '.join(parts)}"
    if wholly:
        line += f"; {wholly} of them {'loses' if wholly == 1 else 'lose'} the whole answer (the prompt alone fills " \
                "max_length)"
    return line + f". Fix: {fix(measured, t)}"


def fix(measured: list[Lengths], t: Truncation) -> str:
    """The max_length to suggest: the smallest that keeps 99% of rows whole, or where max_length does that already
    (and cuts the longest 1%), the one that keeps every row whole."""
    keep, share = max(m.keeps() for m in measured), "99% of rows"
    if t.max_length is not None and keep <= t.max_length:
        keep, share = max(max(m.whole) for m in measured), "every row"
    return f"max_length {keep} keeps {share} whole (--max_length {keep}, or max_length: {keep} in the recipe)"


def check_learnable(measured: list[Lengths], t: Truncation, where: str) -> None:
    """A split in which no row keeps any of its answer: nothing to learn (SFT) or compare (DPO), one line."""
    for m in measured:
        cut, wholly, _ = m.cut(t)
        if wholly and wholly == m.sampled:
            of = f" (a sample of {m.sampled} of {m.rows})" if m.sampled < m.rows else ""
            pairs = m.answer_names == ("chosen", "rejected")
            first = (f"no usable pair: every pair{of} of the `{m.split}` split of {where} has a prompt of max_length "
                     f"{t.max_length} tokens or more, so truncation leaves no answer to compare" if pairs else
                     f"every row{of} of the `{m.split}` split of {where} has a prompt of max_length {t.max_length} "
                     "tokens or more, so truncation leaves no completion to learn")
            raise UserError(f"{first}. Fix: {fix([m], t)}, or shorten the prompts.")


def report(measured: list[Lengths], cfg, tokenizer, where: str) -> tuple[list[str], list[str]]:
    """(the table's lines, the warnings) of measure_splits' lengths, for the launcher and `make data`; raises where
    nothing can be learned."""
    t = Truncation.of(cfg.training)
    check_learnable(measured, t, where)
    warnings = [w for w in (cut_warning(measured, t), system_warning(measured, tokenizer, cfg),
                            short_warning(measured, tokenizer, cfg, where)) if w]
    return table(measured, t, tokenizer_name(tokenizer, cfg.model.model_name_or_path)), warnings


def short_warning(measured: list[Lengths], tokenizer, cfg, where: str) -> str | None:
    """One counted line where rows tokenize to 1 token or fewer (their end-of-text token alone): a tokenizer with no
    vocabulary (transformers built an empty one from a model folder without tokenizer files: every row `1 tokens`,
    and a run that trained on nothing), or empty rows. None where every row has more."""
    hit = [(m, [i for i, w in zip(m.index or range(m.sampled), m.whole) if w <= 1]) for m in measured]
    hit = [(m, short) for m, short in hit if short]
    if not hit:
        return None
    counts = " and ".join(f"{len(short)} of the {m.sampled if m.sampled < m.rows else m.rows}"
                          f"{' sampled' if m.sampled < m.rows else ''} rows of `{m.split}`" for m, short in hit)
    first = row_at(where, hit[0][0].split, hit[0][1][0])
    every = all(len(short) == m.sampled for m, short in hit) and len(hit) == len(measured)
    model = str(cfg.model.model_name_or_path).rstrip("/")
    why = f"{model.rsplit('/', 1)[-1] or model}'s tokenizer has {len(tokenizer):,} tokens, " if every else ""
    return (f"{counts} tokenize to 1 token or fewer (first: {first}): {why}nothing there to learn. Fix: check that "
            "model_name_or_path holds the model's own tokenizer files (tokenizer.json, ...), and that those rows "
            "have text in the column read (dataset_text_field, dataset_format)")


def system_warning(measured: list[Lengths], tokenizer, cfg) -> str | None:
    """One line where the chat template dropped the system turns of some rows (data/chat_render.py Dropped): the
    trainer trains on the rendering, so the model never sees the system prompt, and nothing else says so."""
    hit = [m for m in measured if m.system_dropped is not None]
    if not hit:
        return None
    counts = " and ".join(f"{m.system_dropped.rows} of the {m.rows} rows of `{m.split}`" for m in hit)
    first = hit[0].system_dropped
    text = first.text if len(first.text) <= 40 else first.text[:37] + "..."
    path, model = getattr(cfg.training, "chat_template_path", None), str(cfg.model.model_name_or_path).rstrip("/")
    whose = f"the chat template {path}" if path else f"{model.rsplit('/', 1)[-1] or model}'s chat template"
    return (f"{whose} leaves out system turns: {counts} have one, and its text is not in the conversation the "
            f"trainer renders (first: {first.first}, system {text!r}), so the model never sees it. Fix: set "
            "chat_template_path to a template that renders the system role (or use a model whose template does), or "
            "fold the system text into the first user turn in the data (the pack does not fold it)")


def measured_by_launcher(cfg) -> bool:
    """Whether the launcher measures the lengths before the ranks start: local data and a local model. Else rank 0
    does, once the trainer has its tokenizer (in_rank)."""
    return is_local(cfg.script, cfg.mixture) and looks_local(cfg.model.model_name_or_path)


def in_rank(cfg, splits, trainer) -> list[str]:
    """The table and the warning for rank 0 to print where the launcher could not measure (a hub dataset, or a hub
    model, whose tokenizer only the ranks download): with the trainer's own tokenizer and training template."""
    processing = trainer.processing_class
    tokenizer = getattr(processing, "tokenizer", processing)  # a processor's tokenizer
    measured = measure_splits(cfg, splits, tokenizer, getattr(trainer, "chat_template", None))
    table, warnings = report(measured, cfg, tokenizer, cfg.script.dataset_name or "mixture")
    return table + [f"warning: {w}" for w in warnings]
