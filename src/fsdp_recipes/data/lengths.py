"""Token lengths of a dataset's rows under the recipe's tokenizer and chat template, tokenized as the trainer will
tokenize them, and what `max_length` cuts: the launcher's table before any rank starts (launch/launcher.py
check_recipe) and `make data`'s (launch/data_preview.py).

Per row (all of a split's rows, or a seeded sample of SAMPLE of them):
    prompt   the tokens before the answer: a chat prompt with its generation prompt, or a text prompt (what TRL's
             SFT, DPO and KTO trainers tokenize as the prompt); for `messages`, the turns before the last assistant
             turn; none for a text field
    answer   the rest: the completion (a text completion with the EOS token TRL adds), the last assistant turn and
             what the template closes it with, a whole text field; preference pairs: `chosen` and `rejected`
    whole    prompt + answer, the sequence max_length applies to (a pair: its longer side)
Lengths are reported as nearest-rank percentiles: p95 is the length that 95 of every 100 rows are at most, and the
max_length that keeps 99% of rows whole is the p99 of `whole`.

A row's answer is cut when max_length ends inside it: with truncation_mode keep_start (TRL's default) when the whole
row is longer than max_length; with keep_end when the answer alone is (longer rows lose the start of their prompt).
Packing with packing_strategy bfd_split or wrapped cuts nothing (a long row goes on in the next sequence); bfd cuts
as keep_start does. A row whose prompt alone fills max_length keeps nothing of its answer (TRL's SFT and DPO
trainers drop it); when every row is such a row the launcher stops with one line (check_learnable).

Tokenized as TRL 1.16 does (trl/trainer/sft_trainer.py and dpo_trainer.py `tokenize_fn`): chat rows are rendered with
the chat template (the recipe's chat_template_path, or TRL's training template when assistant_only_loss needs
generation markers) and tokenized without special tokens, text rows with them; text completions get the EOS token;
the answer starts where the tokenized prompt and prompt + answer part (`common_prefix_length`). The rendering is per
row, the tokenizing one batch: seconds for a few thousand rows.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field

from fsdp_recipes.errors import UserError

SAMPLE = 2000  # rows measured per split at most: percentiles to within a token or two, a second or two of work
KEEP = 0.99  # the share of rows whole that the suggested max_length keeps
SEED = 0  # the sample's: the same rows every time


@dataclass(frozen=True)
class Truncation:
    """What the trainer's settings do to a row: max_length (None: nothing is cut), keep_end, the packing strategy
    (None: no packing), and the loss masks (TRL's completion_only_loss, None meaning "for prompt/completion data",
    and assistant_only_loss)."""

    max_length: int | None
    keep_end: bool = False
    packing: str | None = None
    completion_only_loss: bool | None = None
    assistant_only_loss: bool = False
    text_field: str = "text"

    @classmethod
    def of(cls, training) -> Truncation:
        """From a trainer config (SFTConfig, DPOConfig, KTOConfig; a sampling kind's has no max_length)."""
        packing = getattr(training, "packing", False) or False
        return cls(
            max_length=getattr(training, "max_length", None),
            # packing truncates as it packs (bfd keeps the start); TRL's truncation step is skipped
            keep_end=getattr(training, "truncation_mode", "keep_start") == "keep_end" and not packing,
            packing=(getattr(training, "packing_strategy", None) or "bfd") if packing else None,
            completion_only_loss=getattr(training, "completion_only_loss", None),
            assistant_only_loss=bool(getattr(training, "assistant_only_loss", False)),
            text_field=getattr(training, "dataset_text_field", None) or "text",
        )

    @property
    def cuts(self) -> bool:
        return self.max_length is not None and self.packing not in ("bfd_split", "wrapped")


@dataclass
class Lengths:
    """One split's token lengths, per measured row."""

    split: str
    rows: int  # the split's rows
    answer_names: tuple[str, ...] = ()  # ("answer",), ("chosen", "rejected"), or () for prompts alone
    prompt: list[int] = field(default_factory=list)
    answers: dict[str, list[int]] = field(default_factory=dict)
    whole: list[int] = field(default_factory=list)
    # where the loss starts (0: the whole row is trained); with assistant_only_loss, where the generation prompt
    # before the first answer ends, which a template's {% generation %} block may start a token or two after
    first_trained: list[int] = field(default_factory=list)
    has_prompt: bool = True  # False for a text field
    index: list[int] = field(default_factory=list)  # each measured row's index in the split

    @property
    def sampled(self) -> int:
        return len(self.whole)

    def cut(self, t: Truncation) -> tuple[int, int, int]:
        """(rows whose answer max_length cuts, of them the rows left with nothing to learn, rows that lose the start
        of their prompt instead: keep_end)."""
        if not t.cuts or not self.answer_names:
            return 0, 0, 0
        m = t.max_length
        longest = [max(a) for a in zip(*(self.answers[n] for n in self.answer_names))]
        if t.keep_end:
            cut = sum(a > m for a in longest)
            return cut, 0, sum(w > m >= a for w, a in zip(self.whole, longest))
        cut = sum(w > m for w in self.whole)
        wholly = sum(w > m and f >= m for w, f in zip(self.whole, self.first_trained))
        return cut, wholly, 0

    def keeps(self, share: float = KEEP) -> int:
        """The smallest max_length that keeps `share` of the rows whole."""
        return percentile(self.whole, share * 100)


def percentile(values: list[int], p: float) -> int:
    """Nearest rank: the smallest value that p% of the values are at most (0 for none)."""
    if not values:
        return 0
    ordered = sorted(values)
    rank = -(-len(ordered) * p // 100)  # ceil without floats' rounding for whole percentages
    return ordered[max(0, min(len(ordered), int(rank)) - 1)]


def spread(values: list[int]) -> str:
    return f"{percentile(values, 50)} / {percentile(values, 95)} / {max(values, default=0)}"


# ----------------------------------------------------------------------------------------------- the tokenizer

def chat_template(tokenizer, training) -> str | None:
    """The chat template the trainer renders with: the recipe's chat_template_path (a .jinja file, or a tokenizer
    whose template TRL clones), set on `tokenizer`; then, where assistant_only_loss needs `{% generation %}`
    markers the template lacks, TRL's training template for it (returned; None: the tokenizer's own)."""
    path = getattr(training, "chat_template_path", None)
    if path:
        if str(path).endswith((".jinja", ".j2")):
            with open(path, encoding="utf-8") as f:
                tokenizer.chat_template = f.read()
        else:
            from transformers import AutoTokenizer

            tokenizer.chat_template = AutoTokenizer.from_pretrained(path).chat_template
    if not getattr(training, "assistant_only_loss", False) or tokenizer.chat_template is None:
        return None
    from trl.chat_template_utils import get_training_chat_template, has_generation_markers

    if has_generation_markers(tokenizer.chat_template):
        return None
    try:
        return get_training_chat_template(tokenizer)
    except Exception:  # TRL knows a training template for the common families only (trl/chat_templates/)
        raise UserError("assistant_only_loss needs a chat template with {% generation %} markers around the "
                        "assistant's turns; the tokenizer's has none, and TRL has no training template for it. Fix: "
                        "set chat_template_path to a .jinja template with the markers, or assistant_only_loss: "
                        "false.") from None


def load_tokenizer(cfg, cached: bool = True):
    """The recipe's tokenizer with the chat template the trainer uses, and that template (chat_template): from the
    model's folder or, with `cached`, a hub id's files already on this machine; (None, None) when neither."""
    from transformers import AutoTokenizer

    from fsdp_recipes.config.model_check import looks_local

    model = cfg.model.model_name_or_path
    if looks_local(model):
        tokenizer = AutoTokenizer.from_pretrained(model)
    elif not cached:
        return None, None
    else:
        try:
            tokenizer = AutoTokenizer.from_pretrained(model, local_files_only=True)
        except (OSError, ValueError):
            return None, None
    return tokenizer, chat_template(tokenizer, cfg.training)


def measured_by_launcher(cfg) -> bool:
    """Whether the launcher measures the lengths before the ranks start: local data and a local model. Else rank 0
    does, once the trainer has its tokenizer (in_rank)."""
    from fsdp_recipes.config.model_check import looks_local
    from fsdp_recipes.train.loading import is_local

    return is_local(cfg.script, cfg.mixture) and looks_local(cfg.model.model_name_or_path)


# ----------------------------------------------------------------------------------------------- measuring

class Batch:
    """Texts to tokenize together: chat renderings (no special tokens, as apply_chat_template tokenizes them) and
    plain text (with them, as TRL's `processing_class(text=...)`), in one call each."""

    def __init__(self, tokenizer, template: str | None) -> None:
        self.tokenizer, self.template = tokenizer, template
        self.eos = tokenizer.eos_token or ""
        self.texts: dict[bool, list[str]] = {True: [], False: []}
        self.ids: dict[bool, list[list[int]]] = {}

    def add(self, text: str, chat: bool) -> tuple[bool, int]:
        self.texts[chat].append(text)
        return chat, len(self.texts[chat]) - 1

    def chat(self, turns: list, row: dict, generation_prompt: bool = False) -> tuple[bool, int]:
        """Turns rendered with the chat template, as TRL renders them (the row's tools and template arguments)."""
        kwargs = {"tools": row.get("tools"), **(row.get("chat_template_kwargs") or {})}
        if self.template is not None:
            kwargs["chat_template"] = self.template
        return self.add(self.tokenizer.apply_chat_template(turns, tokenize=False, **kwargs,
                                                           add_generation_prompt=generation_prompt), True)

    def text(self, text: str, answer: bool = False) -> tuple[bool, int]:
        """Plain text; an answer ends with the EOS token, which TRL adds where it is missing."""
        return self.add(text if not answer or text.endswith(self.eos) else text + self.eos, False)

    def run(self) -> None:
        for chat, texts in self.texts.items():
            self.ids[chat] = self.tokenizer(texts, add_special_tokens=not chat)["input_ids"] if texts else []

    def __getitem__(self, ref: tuple[bool, int] | None) -> list[int]:
        return [] if ref is None else self.ids[ref[0]][ref[1]]


@dataclass
class Planned:
    """A row's texts in a Batch: its prompt, its sequences (answer name -> prompt + answer), and where its loss
    starts: at 0 (`trains_prompt`), after `first` (an earlier answer's prompt), or after the prompt."""

    prompt: tuple[bool, int] | None = None
    full: dict = field(default_factory=dict)
    first: tuple[bool, int] | None = None
    trains_prompt: bool = False


def sample_rows(ds, sample: int = SAMPLE) -> list[int]:
    """The indices of all rows, or of a seeded sample of `sample` of them (in the split's order)."""
    n = len(ds)
    return list(range(n)) if n <= sample else sorted(random.Random(SEED).sample(range(n), sample))


def answer_names(cols: set, t: Truncation) -> tuple[str, ...] | None:
    """The answers a row of these columns has; () for prompts alone (the sampling kinds generate their answers),
    None for a layout with nothing to measure."""
    if {"chosen", "rejected"} <= cols:
        return "chosen", "rejected"
    if "messages" in cols or {"prompt", "completion"} <= cols or ("prompt" not in cols and t.text_field in cols):
        return ("answer",)
    return () if "prompt" in cols else None


def plan_row(row: dict, cols: set, names: tuple[str, ...], batch: Batch, t: Truncation) -> Planned:
    """Queue a row's texts as TRL's tokenize_fn builds them."""
    from trl.data_utils import is_conversational, maybe_extract_prompt

    chat = is_conversational(row)
    if names == ("chosen", "rejected"):
        row = maybe_extract_prompt(row) if "prompt" not in row else row
        return Planned(batch.chat(row["prompt"], row, True) if chat else batch.text(row["prompt"]),
                       {n: batch.chat(row["prompt"] + row[n], row) if chat else batch.text(row["prompt"] + row[n], True)
                        for n in names})
    if "messages" in cols:
        turns = row["messages"]
        answers = [i for i, turn in enumerate(turns) if turn.get("role") == "assistant"]
        last = answers[-1] if answers else len(turns)
        planned = Planned(batch.chat(turns[:last], row, True) if last else None, {"answer": batch.chat(turns, row)},
                          trains_prompt=not t.assistant_only_loss)
        if t.assistant_only_loss and answers and answers[0] < last:  # an earlier answer is trained too
            planned.first = batch.chat(turns[:answers[0]], row, True) if answers[0] else None
            planned.trains_prompt = answers[0] == 0
        return planned
    if "prompt" in cols:
        planned = Planned(batch.chat(row["prompt"], row, True) if chat else batch.text(row["prompt"]))
        if names:
            planned.full["answer"] = (batch.chat(row["prompt"] + row["completion"], row) if chat
                                      else batch.text(row["prompt"] + row["completion"], True))
            # TRL's default (completion_only_loss None) trains prompt/completion rows on the completion only
            planned.trains_prompt = t.completion_only_loss is False
        return planned
    return Planned(None, {"answer": batch.text(row[t.text_field], True)}, trains_prompt=True)


def measure(ds, tokenizer, split: str, t: Truncation, template: str | None = None,
            sample: int = SAMPLE) -> Lengths | None:
    """The token lengths of a split's rows (in the layout TRL takes: after the pack's conversion); None for a layout
    with nothing to measure."""
    from trl.data_utils import common_prefix_length

    index = sample_rows(ds, sample)
    cols = set(ds.column_names)
    names = answer_names(cols, t)
    if not index or names is None:
        return None
    rows = ds.select(index) if len(index) < len(ds) else ds
    batch = Batch(tokenizer, template)
    # one conversion from Arrow: iterating a selection row by row is slower
    plans = [plan_row(row, cols, names, batch, t) for row in rows.to_list()]
    batch.run()
    out = Lengths(split, len(ds), names, has_prompt=bool(cols & {"messages", "prompt", "chosen"}), index=index,
                  answers={name: [] for name in names})
    for planned in plans:
        prompt_ids = batch[planned.prompt]
        sequences = {name: batch[ref] for name, ref in planned.full.items()}
        start = min((common_prefix_length(prompt_ids, ids) for ids in sequences.values()), default=len(prompt_ids))
        out.prompt.append(start)
        for name, ids in sequences.items():
            out.answers[name].append(len(ids) - start)
        out.whole.append(max((len(ids) for ids in sequences.values()), default=start))
        if planned.trains_prompt or not sequences:
            out.first_trained.append(0)
        elif planned.first is not None:
            out.first_trained.append(common_prefix_length(batch[planned.first], next(iter(sequences.values()))))
        else:
            out.first_trained.append(start)
    return out


def measure_splits(cfg, splits, tokenizer, template: str | None = None, sample: int = SAMPLE) -> list[Lengths]:
    """Each loaded split's lengths (train, eval): what the launcher and `make data` report."""
    t = Truncation.of(cfg.training)
    names = (cfg.script.dataset_train_split, cfg.script.dataset_test_split)
    measured = []
    for name, ds in zip(names, splits):
        if ds is not None and hasattr(ds, "__len__"):  # a streamed hub dataset is not counted here
            lengths = measure(ds, tokenizer, name, t, template, sample)
            if lengths is not None:
                measured.append(lengths)
    return measured


# ----------------------------------------------------------------------------------------------- one example

@dataclass
class Sequence:
    """One training sequence of a row, as the trainer builds it: its tokens, which of them the loss counts (TRL's
    labels other than -100), and the slice of them that max_length keeps (None: all)."""

    name: str  # "", or "chosen" / "rejected" for a pair
    ids: list[int]
    trained: list[bool]
    keep: slice | None = None

    def kept(self) -> list[bool]:
        """Per token: whether max_length keeps it."""
        inside = set(range(len(self.ids))[self.keep or slice(None)])
        return [i in inside for i in range(len(self.ids))]


def what_is_trained(columns, t: Truncation) -> str:
    """What the loss counts for data of these columns, in words (TRL's masks)."""
    cols = set(columns)
    if {"chosen", "rejected"} <= cols:
        return "the chosen and the rejected answers (the prompt is not scored)"
    if "messages" in cols:
        return ("the assistant turns (assistant_only_loss)" if t.assistant_only_loss
                else "every token (assistant_only_loss is off)")
    if {"prompt", "completion"} <= cols:
        if t.completion_only_loss is False:
            return "every token (completion_only_loss is off)"
        return "the completion" + (", the assistant's tokens of it (assistant_only_loss)" if t.assistant_only_loss
                                   else "")
    if "prompt" in cols:
        return "nothing from the data (the answers are generated during training)"
    return "every token"


def example(row: dict, tokenizer, t: Truncation, template: str | None = None) -> list[Sequence]:
    """A row's training sequences, tokenized one by one as TRL's tokenize_fn does, with the loss's mask
    (completion_only_loss: the completion; assistant_only_loss: the template's assistant tokens) and the cut."""
    from trl.data_utils import common_prefix_length, is_conversational, maybe_extract_prompt

    chat = is_conversational(row)
    kwargs = {"tools": row.get("tools"), **(row.get("chat_template_kwargs") or {})}
    if template is not None:
        kwargs["chat_template"] = template
    eos = tokenizer.eos_token or ""

    def tokens(x, generation_prompt=False, masks=False) -> dict:
        if isinstance(x, list):
            out = tokenizer.apply_chat_template(x, tokenize=True, return_dict=True,
                                                add_generation_prompt=generation_prompt,
                                                return_assistant_tokens_mask=masks, **kwargs)
            return {k: list(v) for k, v in out.items()}
        return {"input_ids": list(tokenizer(text=x)["input_ids"])}

    def with_eos(text):
        return text if text.endswith(eos) else text + eos

    sequences, generated = [], False
    if "chosen" in row and "rejected" in row:
        row = maybe_extract_prompt(row) if "prompt" not in row else row
        prompt = tokens(row["prompt"], True)["input_ids"]
        for name in ("chosen", "rejected"):
            ids = tokens(row["prompt"] + row[name] if chat else row["prompt"] + with_eos(row[name]))["input_ids"]
            start = common_prefix_length(prompt, ids)
            sequences.append(Sequence(name, ids, [i >= start for i in range(len(ids))]))
    elif "messages" in row:
        out = tokens(row["messages"], masks=t.assistant_only_loss)
        ids = out["input_ids"]
        trained = [bool(m) for m in out["assistant_masks"]] if "assistant_masks" in out else [True] * len(ids)
        sequences.append(Sequence("", ids, trained))
    elif "prompt" in row and "completion" in row:
        prompt = tokens(row["prompt"], True)["input_ids"]
        out = (tokens(row["prompt"] + row["completion"], masks=t.assistant_only_loss) if chat
               else tokens(row["prompt"] + with_eos(row["completion"])))
        ids, start = out["input_ids"], common_prefix_length(prompt, out["input_ids"])
        completion = [i >= start for i in range(len(ids))]
        trained = completion if t.completion_only_loss is not False else [True] * len(ids)
        if "assistant_masks" in out:
            trained = [a and bool(m) for a, m in zip(trained, out["assistant_masks"])]
        sequences.append(Sequence("", ids, trained))
    elif "prompt" in row:  # the sampling kinds: the prompt the answers are generated from
        ids = tokens(row["prompt"], True)["input_ids"]
        sequences.append(Sequence("", ids, [False] * len(ids)))
        generated = True
    elif t.text_field in row:
        ids = tokens(with_eos(row[t.text_field]))["input_ids"]
        sequences.append(Sequence("", ids, [True] * len(ids)))
    if t.cuts and not generated:
        for seq in sequences:
            if len(seq.ids) > t.max_length:
                seq.keep = slice(-t.max_length, None) if t.keep_end else slice(None, t.max_length)
    return sequences


# ----------------------------------------------------------------------------------------------- reporting

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
    warning = cut_warning(measured, t)
    return table(measured, t, tokenizer_name(tokenizer, cfg.model.model_name_or_path)), [warning] if warning else []


def in_rank(cfg, splits, trainer) -> list[str]:
    """The table and the warning for rank 0 to print where the launcher could not measure (a hub dataset, or a hub
    model, whose tokenizer only the ranks download): with the trainer's own tokenizer and training template."""
    processing = trainer.processing_class
    tokenizer = getattr(processing, "tokenizer", processing)  # a processor's tokenizer
    measured = measure_splits(cfg, splits, tokenizer, getattr(trainer, "chat_template", None))
    table, warnings = report(measured, cfg, tokenizer, cfg.script.dataset_name or "mixture")
    return table + [f"warning: {w}" for w in warnings]
