"""Where the recipe's model is, checked before anything is launched: a local folder (its config.json, its weights, not
a LoRA run's adapter folder), or a hub id in the hub cache or on a hub that answers; and its config.json, read
without loading the model (config/model_check.py builds the meta-device copy from it).
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from fsdp_recipes.errors import UserError
from fsdp_recipes.model_folders import adapter_beside_weights, without_weights
from fsdp_recipes.paths import in_pack_cache


def model_config_source(model_name_or_path: str, recipe: Path | None, revision: str | None = None) -> Path | None:
    """Where the model's config.json is known without the network: the model's own (a local folder's, or a hub id's
    in the hub cache), else the recipe's shipped copy of the hub config (`model_config.json`) when it is for the
    same model."""
    own = model_config_json(model_name_or_path, revision)
    if own is not None:
        return own
    shipped = recipe / "model_config.json" if recipe else None
    if shipped and shipped.is_file() and json.loads(shipped.read_text()).get("_name_or_path") == model_name_or_path:
        return shipped
    return None


def model_config_json(model_name_or_path: str, revision: str | None = None) -> Path | None:
    """The model's own config.json, read without the network: a local folder's, else the hub cache's
    (huggingface_hub's try_to_load_from_cache, the file from_pretrained would use offline)."""
    local = Path(model_name_or_path) / "config.json"
    if local.is_file():
        return local
    if not hub_shaped(model_name_or_path):
        return None
    from huggingface_hub import try_to_load_from_cache

    try:
        cached = try_to_load_from_cache(model_name_or_path, "config.json", revision=revision)
    except ValueError:  # not a valid repo id: no cache entry either
        return None
    return Path(cached) if isinstance(cached, str) else None


def hub_shaped(path: str) -> bool:
    """Could be a hub id (`org/name` or `name`), there being no such local folder."""
    return not looks_local(path) and path.count("/") <= 1


# One HEAD request to the hub, before any rank starts: from_pretrained in a rank retries an unreachable hub with
# backoff before it fails (issue 42: 24 retry lines and 47 s).
HUB_TIMEOUT_S = 5


def check_model_found(path: str | None, continues_from: str | None = None, revision: str | None = None) -> Path | None:
    """The model exists where the ranks will look: a local folder with config.json (check_local_model), or a hub id
    in the cache or on a hub that answers within HUB_TIMEOUT_S; then its config.json (fetched: a few KB the ranks
    would fetch anyway), None for a local path. The launcher's, before the ranks start; never a retry. Not for none
    (the parse names the missing field) nor a model the checks build in the pack's cache (tiny and SmolLM2 assets)."""
    if path is None or in_pack_cache(path):
        return None
    check_local_model(path, continues_from)
    folder = Path(os.path.expandvars(os.path.expanduser(path)))
    if why := without_weights(folder):
        raise UserError(f"model not found: {path} {why}")
    check_has_tokenizer(folder)
    if not hub_shaped(path):
        return None
    if (cached := model_config_json(path, revision)) is not None:
        return cached
    from huggingface_hub import constants, hf_hub_download, hf_hub_url
    from huggingface_hub.file_download import get_hf_file_metadata

    where = f"there is no folder {path} here ({absolute_where(path) or path}), and as a hub id it is not in the hub " \
            f"cache ({constants.HF_HUB_CACHE})"
    fix = (f"Fix: point model_name_or_path at the model's folder (the one holding config.json), or download the "
           f"model where there is network (`hf download {path}`) into this machine's hub cache")
    if constants.HF_HUB_OFFLINE:
        raise UserError(f"model not found: {where}, and HF_HUB_OFFLINE is set. {fix}.")
    try:
        get_hf_file_metadata(hf_hub_url(path, "config.json", revision=revision), timeout=HUB_TIMEOUT_S)
        return Path(hf_hub_download(path, "config.json", revision=revision, etag_timeout=HUB_TIMEOUT_S))
    except Exception as err:  # noqa: BLE001 -- every way the hub can fail to serve it is one line
        raise UserError(f"model not found: {where}, and {hub_failure(err, path, revision)}. {fix}.") from None


# the files one of transformers' tokenizers loads its vocabulary from (tokenizer_config.json alone names a class, and
# loads none; tekken.json: Mistral's own format); besides these names, any vocab.*, *.model (SentencePiece,
# ChatGLM's, Kimi's) or *.tiktoken (Qwen1's) file: generous, a folder refused here is one whose tokenizer would be empty
VOCABULARY_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json", "vocab.txt", "spiece.model", "merges.txt",
                    "tekken.json")
VOCABULARY_PATTERNS = ("vocab.*", "*.model", "*.tiktoken")


def holds_tokenizer(folder: Path) -> bool:
    """Whether a model folder holds a tokenizer's vocabulary (VOCABULARY_FILES, VOCABULARY_PATTERNS)."""
    return any((folder / name).is_file() for name in VOCABULARY_FILES) or any(
        p.is_file() for pattern in VOCABULARY_PATTERNS for p in folder.glob(pattern))


def save_tokenizer_fix(folder: Path) -> str:
    """The fix for a model folder without its tokenizer: the trainer loads the tokenizer from model_name_or_path (TRL's
    trainers take no separate tokenizer path, and neither does the pack), so the tokenizer goes into that folder."""
    return (f"save the tokenizer there too (tokenizer.save_pretrained(\"{folder}\")), or copy in the tokenizer files "
            "(tokenizer.json, tokenizer_config.json, ...) of the model it was trained from: the trainer loads the "
            "tokenizer from model_name_or_path")


def check_has_tokenizer(folder: Path) -> None:
    """A model folder without a tokenizer (a model's save_pretrained writes none): transformers 5 built an empty
    tokenizer from its config (a GPT-NeoX folder: 2 tokens, every row 1 token, a run that trained on nothing and
    failed at its end), or said "Couldn't instantiate the backend tokenizer from one of:". A file-only check: the
    launcher's for any local model (check_model_found), and data/recipe_tokenizer.py's before it loads one."""
    if folder.is_dir() and (folder / "config.json").is_file() and not holds_tokenizer(folder):
        raise UserError(f"model_name_or_path {folder} holds no tokenizer (none of {', '.join(VOCABULARY_FILES)}): a "
                        "model's save_pretrained does not write one, and transformers would build an empty one. Fix: "
                        f"{save_tokenizer_fix(folder)}.")


def hub_failure(err: Exception, path: str, revision: str | None) -> str:
    """What the hub's answer (or its absence) means, in words."""
    from huggingface_hub import errors

    if isinstance(err, errors.GatedRepoError):
        return (f"{path} is gated on the hub: accept its terms on https://huggingface.co/{path} and log in here "
                "(`hf auth login`, or HF_TOKEN)")
    if isinstance(err, errors.RepositoryNotFoundError):
        return f"the hub has no model {path} (or it is private: log in with `hf auth login`, or set HF_TOKEN)"
    if isinstance(err, errors.RevisionNotFoundError):
        return f"the hub's {path} has no revision {revision}"
    if isinstance(err, errors.EntryNotFoundError):
        return f"the hub's {path} has no config.json: not a transformers model"
    first = next((x.strip() for x in str(err).splitlines() if x.strip()), "")
    return f"the hub cannot be reached from here ({type(err).__name__}: {first}; waited {HUB_TIMEOUT_S} s at most)"


RELATIVE = "a relative path is taken from the folder the command runs in, not from the recipe's folder"


def absolute_where(path) -> str:
    """A relative path's absolute one and where relative paths are taken from, for a `not found` line (the data's
    and the model's alike); "" for an absolute path, which says where it is already."""
    p = Path(os.path.expandvars(os.path.expanduser(str(path))))
    return "" if p.is_absolute() else f"{p.absolute()}; {RELATIVE}"


def looks_local(path: str) -> bool:
    """A hub id is `org/name`; anything absolute, relative-explicit, home- or file-like is a local path."""
    return path.startswith(("/", "./", "../", "~", "$")) or path.endswith(
        (".json", ".jsonl", ".parquet", ".csv", ".gguf", ".safetensors")
    ) or os.path.exists(path)


def check_local_model(path: str, continues_from: str | None = None) -> None:
    """A local model folder must hold config.json. `continues_from`: the recipe whose output `path` is (a DPO run
    on the SFT run's merged model): then the fix is to run that recipe first."""
    check_not_an_adapter(path)
    mixed = adapter_beside_weights(Path(os.path.expandvars(os.path.expanduser(path))))
    if mixed:  # the ranks would train on the full weights with the adapter applied on top, without a word
        raise UserError(f"model_name_or_path: {mixed}")
    # a hub id is `org/name`: a path with more parts (runs/<recipe>/merged) is the other run's output
    if continues_from and (looks_local(path) or path.count("/") > 1) and not (Path(path) / "config.json").is_file():
        raise UserError(
            f"model not found: {path} is the output of recipe {continues_from}, which has not run here yet. "
            f"Fix: run `make finetune RECIPE={continues_from}` first (or point model_name_or_path at another model)."
        )
    if looks_local(path) and not (Path(path) / "config.json").is_file():
        raise UserError(f"model not found: {not_a_model_folder(path)}.")


TOKENIZER_FILES = (*VOCABULARY_FILES, "tokenizer_config.json", "special_tokens_map.json")  # a tokenizer's folder
FOLDER_FIX = ("point model_name_or_path at a transformers model's folder (its config.json beside its *.safetensors "
              "weights) or a hub id")


def not_a_model_folder(path: str) -> str:
    """Why a local `path` without config.json is no model the ranks can load, and the fix that fits it: a file (a
    GGUF file: llama.cpp's format, which the pack exports but does not train from), a folder holding a tokenizer or
    weights alone, a path that does not exist; the tiny default's builder only for a path in the pack's cache."""
    p = Path(path)
    gguf = p.suffix.lower() == ".gguf"
    if p.is_file() or gguf:
        what = "a GGUF file (llama.cpp's format)" if gguf else "a file"
        missing = f"does not exist ({absolute_where(p) or p})" if not p.exists() else f"is {what}, not a model folder"
        return (f"{path} {missing}: the pack trains from a transformers model folder (config.json and its weights). "
                f"Fix: {FOLDER_FIX}" + ("; for a GGUF, the model it was converted from (the hub id its name "
                                        "gives)" if gguf else ""))
    if not p.exists():
        fix = ("build the tiny default with `python -m fsdp_recipes.assets.tiny_assets`" if in_pack_cache(path)
               else f"{FOLDER_FIX}; check the path for a typo")
        return f"{path} does not exist ({absolute_where(p) or p}). Fix: {fix}"
    if not p.is_dir():
        return f"{path} is not a folder. Fix: {FOLDER_FIX}"
    names = sorted(f.name for f in p.iterdir())
    if (p / "pytorch_model_fsdp_0" / ".metadata").is_file():  # a sharded (DCP) checkpoint: a model once exported
        return (f"{path} is a sharded checkpoint (pytorch_model_fsdp_0/, one file per rank), not a model folder. Fix: "
                f"make export CKPT={path} OUT=<folder> writes its model or adapter, then point model_name_or_path at "
                f"that folder (an adapter's: its merged model), or resume the run with --resume_from_checkpoint")
    tokenizer = [n for n in names if n in TOKENIZER_FILES]
    # a model's weights (a trainer's optimizer.pt, scheduler.pt and rng_state.pth are a checkpoint's state, not these)
    weights = [n for n in names if n.endswith((".safetensors", ".bin", ".gguf"))
               and not n.startswith(("optimizer", "scheduler", "rng_state", "training_args"))]
    if in_pack_cache(path):
        fix = "build the tiny default again with `python -m fsdp_recipes.assets.tiny_assets --force`"
    elif weights:
        fix = ("save the model with save_pretrained, which writes config.json beside its weights, or copy the "
               f"model's config.json there; or {FOLDER_FIX}")
    else:
        fix = FOLDER_FIX
    held = (f": it holds {'weights (' + ', '.join(weights[:3]) + ')' if weights else 'a tokenizer'} but no model "
            "config" if weights or tokenizer else (": it is empty" if not names else ""))
    return f"{path} has no config.json{held}. Fix: {fix}"


def check_not_an_adapter(path: str) -> None:
    """A LoRA run's output folder (or one of its checkpoints) holds the adapter, not a model: adapter_config.json
    and no config.json. A recipe that trains on that run's model (DPO, GRPO after SFT) wants its `merged/`, which
    save_merged_model writes: named, with the path, instead of "has not run here yet"."""
    p = Path(os.path.expandvars(os.path.expanduser(path)))
    if not (p / "adapter_config.json").is_file() or (p / "config.json").is_file():
        return
    run = p.parent if p.name.startswith("checkpoint-") else p
    merged = run / "merged"
    try:
        base = json.loads((p / "adapter_config.json").read_text()).get("base_model_name_or_path")
    except (OSError, ValueError):
        base = None
    of = f" of {base}" if base else ""
    if (merged / "config.json").is_file():
        fix = f"set model_name_or_path to {merged} (the run's base model with this adapter merged into it)"
    else:
        fix = (f"rerun that recipe with --save_merged_model true, which writes {merged} (the base model with the "
               "adapter merged), and point model_name_or_path there")
    raise UserError(f"model_name_or_path {p} is a LoRA adapter{of} (adapter_config.json, no config.json), the output "
                    f"of a LoRA run, not a model to train. Fix: {fix}.")
