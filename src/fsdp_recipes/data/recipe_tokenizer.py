"""The recipe's tokenizer with the chat template the trainer renders with, for the lengths (data/lengths.py) and
`make data`.
"""

from __future__ import annotations

import os
from pathlib import Path

from fsdp_recipes.config.model_found import looks_local
from fsdp_recipes.errors import UserError


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


# the files one of transformers' tokenizers loads from (tokenizer_config.json alone names a class, and loads none)
TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json", "vocab.txt", "spiece.model")


def check_has_tokenizer(folder: Path) -> None:
    """A model folder without a tokenizer (a model's save_pretrained writes none): transformers said "Couldn't
    instantiate the backend tokenizer from one of:" and stopped there."""
    if folder.is_dir() and not any((folder / name).is_file() for name in TOKENIZER_FILES):
        raise UserError(f"model_name_or_path {folder} holds no tokenizer (none of {', '.join(TOKENIZER_FILES)}): a "
                        "model's save_pretrained does not write one. Fix: save the tokenizer there too "
                        f"(tokenizer.save_pretrained(\"{folder}\")).")


def load_tokenizer(cfg, cached: bool = True):
    """The recipe's tokenizer with the chat template the trainer uses, and that template (chat_template): from the
    model's folder or, with `cached`, a hub id's files already on this machine; (None, None) when neither."""
    from transformers import AutoTokenizer

    model = cfg.model.model_name_or_path
    if looks_local(model):
        try:
            tokenizer = AutoTokenizer.from_pretrained(model)
        except (OSError, ValueError):
            check_has_tokenizer(Path(os.path.expandvars(os.path.expanduser(model))))
            raise
    elif not cached:
        return None, None
    else:
        try:
            tokenizer = AutoTokenizer.from_pretrained(model, local_files_only=True)
        except (OSError, ValueError):
            return None, None
    return tokenizer, chat_template(tokenizer, cfg.training)
