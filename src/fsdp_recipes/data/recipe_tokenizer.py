"""The recipe's tokenizer with the chat template the trainer renders with, for the lengths (data/lengths.py) and
`make data`.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from fsdp_recipes.config.model_found import check_has_tokenizer, looks_local, save_tokenizer_fix
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


def model_vocab_size(folder: Path) -> int | None:
    """config.json's vocab_size (a multimodal model's text_config's), None where it names none."""
    try:
        config = json.loads((folder / "config.json").read_text())
    except (OSError, ValueError):
        return None
    size = config.get("vocab_size") or (config.get("text_config") or {}).get("vocab_size")
    return size if isinstance(size, int) and size > 0 else None


def check_vocabulary(tokenizer, folder: Path) -> None:
    """A tokenizer whose vocabulary is far smaller than the model's embedding (under half of config.json's
    vocab_size): built from a tokenizer_config.json without its vocabulary, or another model's. Padded embeddings
    (Qwen's 151,936 rows for 151,665 tokens) are well within."""
    size = model_vocab_size(folder)
    if size is None or len(tokenizer) * 2 >= size:
        return
    raise UserError(f"the tokenizer of model_name_or_path {folder} has {len(tokenizer):,} tokens, and the model's "
                    f"config.json says vocab_size {size:,}: not the model's own tokenizer (its vocabulary files are "
                    f"missing, or they are another model's), so the rows would not be tokenized as the model reads "
                    f"them. Fix: {save_tokenizer_fix(folder)}.")


def local_tokenizer(model: str, trust_remote_code: bool = False):
    """A local model folder's tokenizer, checked: there at all (transformers 5 builds an empty one from a folder
    without), and of the model's vocabulary. `trust_remote_code`: the recipe's (a ChatGLM's own tokenizer class)."""
    from transformers import AutoTokenizer

    folder = Path(os.path.expandvars(os.path.expanduser(model)))
    check_has_tokenizer(folder)
    tokenizer = AutoTokenizer.from_pretrained(str(folder), trust_remote_code=trust_remote_code)
    check_vocabulary(tokenizer, folder)
    return tokenizer


def load_tokenizer(cfg, cached: bool = True):
    """The recipe's tokenizer with the chat template the trainer uses, and that template (chat_template): from the
    model's folder or, with `cached`, a hub id's files already on this machine; (None, None) when neither."""
    from transformers import AutoTokenizer

    model = cfg.model.model_name_or_path
    remote = bool(getattr(cfg.training, "trust_remote_code", False))
    if looks_local(model):
        tokenizer = local_tokenizer(model, remote)
    elif not cached:
        return None, None
    else:
        try:
            tokenizer = AutoTokenizer.from_pretrained(model, local_files_only=True, trust_remote_code=remote,
                                                      revision=getattr(cfg.model, "model_revision", None))
        except (OSError, ValueError):
            return None, None
    return tokenizer, chat_template(tokenizer, cfg.training)
