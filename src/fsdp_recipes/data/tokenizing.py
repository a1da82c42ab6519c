"""How the trainer tokenizes a row, as the lengths (data/lengths.py), `make data`'s examples and the formats' own
measuring (data/formats/: plan_row, sequences) share it: what the trainer's settings cut (Truncation), texts queued
for one tokenizer call (Batch, Planned), and one row's sequences tokenized one by one (RowTokens, Sequence).

Tokenized as TRL 1.16 does (trl/trainer/sft_trainer.py and dpo_trainer.py `tokenize_fn`): chat rows are rendered with
the chat template and tokenized without special tokens, text rows with them; text answers get the EOS token.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field


class TemplateRefused(Exception):
    """The chat template's own error on one row's turns (jinja2's TemplateError: a template's raise_exception, e.g.
    "Conversation roles must alternate user/assistant/user/assistant/..."; a TypeError where it adds text to a
    missing content): data/chat_render.py names the row."""


def template_kwargs(row: dict, template: str | None) -> dict:
    """What TRL's tokenize_fn passes apply_chat_template for a row: its tools (a JSON string is read, as TRL reads
    it), its chat_template_kwargs, and the template the trainer renders with."""
    tools = row.get("tools")
    kwargs = {"tools": json.loads(tools) if isinstance(tools, str) else tools,
              **(row.get("chat_template_kwargs") or {})}
    if template is not None:
        kwargs["chat_template"] = template
    return kwargs


def apply_template(tokenizer, turns: list, **kwargs):
    """tokenizer.apply_chat_template, its template's own error on these turns raised as TemplateRefused."""
    from jinja2 import TemplateError

    try:
        return tokenizer.apply_chat_template(turns, **kwargs)
    except (TemplateError, TypeError) as err:
        first = str(err).strip().splitlines()[0] if str(err).strip() else ""
        raise TemplateRefused(f"{type(err).__name__}: {first}") from err


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
        return self.add(apply_template(self.tokenizer, turns, tokenize=False, **template_kwargs(row, self.template),
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


class RowTokens:
    """One row's texts tokenized one by one, as TRL's tokenize_fn does: chat turns with the template (the row's tools
    and template arguments; with the assistant tokens' mask where asked), text with the special tokens."""

    def __init__(self, tokenizer, row: dict, template: str | None = None) -> None:
        self.tokenizer = tokenizer
        self.kwargs = template_kwargs(row, template)
        self.eos = tokenizer.eos_token or ""

    def __call__(self, x, generation_prompt: bool = False, masks: bool = False) -> dict:
        if isinstance(x, list):
            out = apply_template(self.tokenizer, x, tokenize=True, return_dict=True,
                                 add_generation_prompt=generation_prompt, return_assistant_tokens_mask=masks,
                                 **self.kwargs)
            return {k: list(v) for k, v in out.items()}
        return {"input_ids": list(self.tokenizer(text=x)["input_ids"])}

    def with_eos(self, text: str) -> str:
        """An answer ends with the EOS token, which TRL adds where it is missing."""
        return text if text.endswith(self.eos) else text + self.eos
