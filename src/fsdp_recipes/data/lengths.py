"""Token lengths of a dataset's rows under the recipe's tokenizer and chat template, tokenized as the trainer will
tokenize them, and what `max_length` cuts: the launcher's table before any rank starts (launch/launcher.py
check_recipe) and `make data`'s (launch/data_preview.py); the table itself is data/length_report.py's.

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

What a row's prompt and answers are is its layout's (data/formats/: the layout TRL takes that the data is in once
converted: plan_row, sequences, trained); the sampling kinds' rows, prompts whose answers are generated in training,
are measured as prompts alone.

Tokenized as TRL 1.16 does (trl/trainer/sft_trainer.py and dpo_trainer.py `tokenize_fn`): chat rows are rendered with
the chat template (the recipe's chat_template_path, or TRL's training template when assistant_only_loss needs
generation markers) and tokenized without special tokens, text rows with them; text completions get the EOS token;
the answer starts where the tokenized prompt and prompt + answer part (`common_prefix_length`). The rendering is per
row, the tokenizing one batch: seconds for a few thousand rows.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field

from fsdp_recipes.data import chat_render, formats, rows as row_places
from fsdp_recipes.data.tokenizing import Batch, Planned, RowTokens, Sequence, TemplateRefused, Truncation

SAMPLE = 2000  # rows measured per split at most: percentiles to within a token or two, a second or two of work
KEEP = 0.99  # the share of rows whole that the suggested max_length keeps
SEED = 0  # the sample's: the same rows every time


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
    system_dropped: chat_render.Dropped | None = None  # rows whose system turn the chat template leaves out

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



def sample_rows(ds, sample: int = SAMPLE) -> list[int]:
    """The indices of all rows, or of a seeded sample of `sample` of them (in the split's order)."""
    n = len(ds)
    return list(range(n)) if n <= sample else sorted(random.Random(SEED).sample(range(n), sample))


def layout_of(columns, first: dict | None, t: Truncation) -> formats.DataFormat | None:
    """The layout TRL takes that rows of these columns are in (data/formats/), None for prompts alone or for
    nothing to measure."""
    return formats.detect(columns, first, t.text_field, layouts_only=True)


def answer_names(columns, first: dict | None, t: Truncation) -> tuple[str, ...] | None:
    """The answers a row of these columns has; () for prompts alone (the sampling kinds generate their answers),
    None for a layout with nothing to measure."""
    layout = layout_of(columns, first, t)
    if layout is not None:
        return layout.ANSWERS
    return () if "prompt" in set(columns) else None


def plan_prompt(row: dict, batch: Batch, t: Truncation) -> Planned:
    """A sampling kind's row: the prompt the answers are generated from."""
    from trl.data_utils import is_conversational

    return Planned(batch.chat(row["prompt"], row, True) if is_conversational(row) else batch.text(row["prompt"]))


def measure(ds, tokenizer, split: str, t: Truncation, template: str | None = None,
            sample: int = SAMPLE, where: str | None = None) -> Lengths | None:
    """The token lengths of a split's rows (in the layout TRL takes: after the pack's conversion); None for a layout
    with nothing to measure. `where`: the dataset, whose rows a chat template's refusal names (data/chat_render.py)."""
    from trl.data_utils import common_prefix_length

    index = sample_rows(ds, sample)
    if not index:
        return None
    rows = (ds.select(index) if len(index) < len(ds) else ds).to_list()  # one conversion from Arrow: faster
    layout = layout_of(ds.column_names, rows[0], t)
    names = answer_names(ds.column_names, rows[0], t)
    if names is None:
        return None
    batch = Batch(tokenizer, template)
    plan = layout.plan_row if layout else plan_prompt
    at = (lambda i: row_places.row_at(where, split, i)) if where else (lambda i: f"row {i + 1} of `{split}`")
    def rendered(row: dict) -> list[str]:  # the row's chat renderings, as the trainer renders them
        batch = Batch(tokenizer, template)
        plan(row, batch, t)
        return batch.texts[True]

    dropped = chat_render.check_renders(ds, rendered, at)
    plans = []
    for k, row in enumerate(rows):
        try:
            plans.append(plan(row, batch, t))
        except TemplateRefused as err:  # a refusal that depends on the words, not the turns' roles
            raise chat_render.refused(err, at(index[k]), row, 1) from None
    batch.run()
    out = Lengths(split, len(ds), names, has_prompt=layout.HAS_PROMPT if layout else True, index=index,
                  answers={name: [] for name in names}, system_dropped=dropped)
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
            lengths = measure(ds, tokenizer, name, t, template, sample, cfg.script.dataset_name or "mixture")
            if lengths is not None:
                measured.append(lengths)
    return measured


# ----------------------------------------------------------------------------------------------- one example

def what_is_trained(columns, t: Truncation, first: dict | None = None) -> str:
    """What the loss counts for data of these columns, in words (TRL's masks)."""
    layout = layout_of(columns, first, t)
    if layout is not None:
        return layout.trained(t)
    if "prompt" in set(columns):
        return "nothing from the data (the answers are generated during training)"
    return "every token"


def example(row: dict, tokenizer, t: Truncation, template: str | None = None) -> list[Sequence]:
    """A row's training sequences, tokenized one by one as TRL's tokenize_fn does, with the loss's mask
    (completion_only_loss: the completion; assistant_only_loss: the template's assistant tokens) and the cut."""
    tokens = RowTokens(tokenizer, row, template)
    layout = layout_of(list(row), row, t)
    if layout is not None:
        sequences = layout.sequences(row, tokens, t)
    elif "prompt" in row:  # the sampling kinds: the prompt the answers are generated from; nothing is cut
        ids = tokens(row["prompt"], True)["input_ids"]
        return [Sequence("", ids, [False] * len(ids))]
    else:
        return []
    if t.cuts:
        for seq in sequences:
            if len(seq.ids) > t.max_length:
                seq.keep = slice(-t.max_length, None) if t.keep_end else slice(None, t.max_length)
    return sequences
