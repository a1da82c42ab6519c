"""Recipe YAML and command-line keys: read a YAML file, and name a key or flag that no config class knows
(with the closest known one), so a typo is one line rather than a traceback from every rank.

The config classes are TRL's and transformers': importing them takes the launcher 8-10 s on a 2-core VM, and the
ranks start meanwhile. So the fields of each trainer kind (name, int/float/bool type, plain default) are remembered
in the pack's cache once a launch has parsed them, under a fingerprint of what defines them (the installed trl,
transformers, peft and accelerate, and the pack's own config and kind modules): the next launch names a typo or a
value that is no number before it imports any of them or starts a rank, and config/value_checks.py's ranges run on
those values there. A fingerprint with nothing remembered (the first launch, an upgrade, an edited kind) leaves it
all to the parser.
"""

from __future__ import annotations

import dataclasses
import difflib
import hashlib
import json
import os
from collections.abc import Callable
from pathlib import Path

import yaml

from fsdp_recipes.config.argv import yes_or_no
from fsdp_recipes.config.option_registry import OPTIONS
from fsdp_recipes.errors import UserError


def load_yaml(path: str | Path, what: str = "config") -> dict:
    path = Path(path)
    if not path.is_file():
        raise UserError(f"{what} file not found: {path}. Fix: check the path (recipes live in recipes/<name>/).")
    try:
        data = yaml.safe_load(path.read_text())
    except yaml.YAMLError as err:
        mark, context = getattr(err, "problem_mark", None), getattr(err, "context_mark", None)
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
        if mark and context and context.line < mark.line:  # "max_steps 12" without its colon: said one line on
            where = f" at line {context.line + 1} ({err.context}; noticed at line {mark.line + 1})"
        problem = getattr(err, "problem", None) or str(err).splitlines()[0]
        raise UserError(f"malformed YAML in {path}{where}: {problem}. Fix: correct the YAML syntax there.") from None
    if not isinstance(data, dict):
        raise UserError(f"{path} must hold a YAML mapping of `key: value` lines, not {type(data).__name__}.")
    return data


def known_fields(dataclass_types) -> set[str]:
    return {f.name for dc in dataclass_types for f in dataclasses.fields(dc)}


# PEFT LoraConfig fields a recipe cannot set: TRL's ModelConfig builds the LoraConfig from its own lora_* fields
# (trl.get_peft_config), and these are not among them. PEFT's own warning on a tied model names ensure_weight_tying.
PEFT_ONLY = {
    "trainable_token_indices": "PEFT's trainable_token_indices is no recipe setting (TRL builds the LoraConfig "
                               "without it). Fix: to train the input embedding, add embed_tokens to "
                               "lora_target_modules (a LoRA on it; a tied model's head keeps the base weights), or, on "
                               "a model without tied embeddings, to lora_modules_to_save (docs/training.md, \"Training "
                               "the LM head or the embeddings\")",
    "ensure_weight_tying": "PEFT's ensure_weight_tying is no recipe setting (TRL builds the LoraConfig without it); "
                           "the pack merges a tied model whose head or embedding the adapter changes into an untied "
                           "model that computes what was trained. Fix: remove it (docs/training.md, \"Training the "
                           "LM head or the embeddings\")",
}


def length_fields(known: set[str]) -> list[str]:
    """The trainer kind's own length settings among its fields (SFT's max_length; GRPO's max_completion_length): a
    `max_..._length` that is no serving engine's (vllm_max_model_length is vLLM's context, not what is trained)."""
    return sorted(k for k in known if k.startswith("max_") and k.endswith("_length"))


def _suggest(key: str, known: set[str], elsewhere: Callable[[str], list[str]] | None = None) -> str:
    """`elsewhere(key)`: the other trainer kinds that have the field (config/run_config.py kinds_with_field)."""
    if key in PEFT_ONLY:
        return PEFT_ONLY[key]
    if key.endswith(("_length", "_len")) and (own := length_fields(known)):
        # a length field of another kind (max_length in a GRPO recipe): the closest name was vLLM's context
        close = difflib.get_close_matches(key, own, n=1, cutoff=0) or own
        return f"did you mean `{close[0]}`? (the length setting{'s' * (len(own) > 1)} of this trainer kind: " \
               f"{', '.join(f'`{k}`' for k in own)})"
    close = difflib.get_close_matches(key, known, n=1)
    if close:
        return f"did you mean `{close[0]}`?"
    if kinds := (elsewhere(key) if elsewhere else []):  # a DPO field in an SFT recipe
        named = " and ".join([", ".join(kinds[:-1]), kinds[-1]] if len(kinds) > 1 else kinds)
        return (f"`{key}` is a field of the {named} trainer{'s' * (len(kinds) > 1)}, not of this "
                f"recipe's: remove it, or use a recipe of that trainer (fsdp-recipes recipes list names each one's)")
    return "remove it, or see `--help` for the valid keys"


def check_known_keys(config: dict, known: set[str], path: str | Path, elsewhere: Callable | None = None) -> None:
    """Every key must be a known field (`known`: the parser's dataclasses' field names, known_fields) or TRL's `env`."""
    known = known | {"env"}
    for key in config:
        if key not in known:
            raise UserError(f"unknown config key `{key}` in {path}. Fix: {_suggest(key, known, elsewhere)}")


def check_known_flags(argv: list[str], known: set[str], elsewhere: Callable | None = None) -> None:
    """Command-line overrides must name fields too (`--no_<bool field>` included, as HfArgumentParser allows)."""
    known = known | {"config", "help", "h"}
    for arg in argv:
        if not arg.startswith("--"):
            continue
        key = arg[2:].split("=", 1)[0]
        if key not in known and not (key.startswith("no_") and key[3:] in known):
            raise UserError(f"unknown command-line flag `--{key}`. Fix: {_suggest(key, known, elsewhere)}")


def _keys_file(kind: str, cache: Path) -> Path:
    from importlib.metadata import PackageNotFoundError, version

    parts = [kind]
    for package in ("trl", "transformers", "peft", "accelerate"):
        try:
            parts.append(f"{package} {version(package)}")
        except PackageNotFoundError:
            parts.append(f"{package} none")
    pack = Path(__file__).resolve().parent.parent  # the pack's own fields: config/ and the kinds' argument classes
    for source in sorted([*pack.glob("config/*.py"), *pack.glob("train/kinds/*.py")]):
        parts.append(hashlib.sha256(source.read_bytes()).hexdigest())
    # the speed options' own argument classes, as registered
    parts.append(" ".join(f"{name}:{getattr(arguments, '__qualname__', None)}" for name, arguments in OPTIONS.items()))
    return cache / "known-keys" / f"{kind}-{hashlib.sha256(chr(10).join(parts).encode()).hexdigest()[:20]}.json"


SCALARS = {"bool": bool, "int": int, "float": float}


def _scalar(annotation) -> str | None:
    """"int", "float" or "bool" for a field annotated so (or `X | None`); None for anything else."""
    import types
    import typing

    if isinstance(annotation, type):
        return annotation.__name__ if annotation in (bool, int, float) else None
    if typing.get_origin(annotation) in (typing.Union, types.UnionType):
        inner = [a for a in typing.get_args(annotation) if a is not type(None)]
        return _scalar(inner[0]) if len(inner) == 1 else None
    return None


def remember_keys(kind: str, dataclass_types, cache: Path) -> None:
    """After a parse: the kind's fields (name -> [int/float/bool or None, the default where it is a plain value]),
    for the next launch's early checks. A cache that cannot be written costs only that speed."""
    path = _keys_file(kind, cache)
    if path.exists():
        return
    fields = {}
    for dc in dataclass_types:
        for f in dataclasses.fields(dc):
            plain = f.default is None or isinstance(f.default, (bool, int, float, str))
            fields[f.name] = [_scalar(f.type), f.default] if plain else [_scalar(f.type)]
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f".{path.name}.{os.getpid()}")
        tmp.write_text(json.dumps(fields, sort_keys=True))
        tmp.replace(path)
    except OSError:
        pass


def _as(kind: str | None, value, flag: str):
    """A YAML or command-line value converted as the parser's argparse types do, or its one-line error."""
    if kind is None or not isinstance(value, str):
        return value
    if kind == "bool":
        if (read := yes_or_no(value)) is not None:
            return read
    else:
        try:
            return SCALARS[kind](value)
        except ValueError:
            pass
    raise UserError(f"--{flag}: invalid {kind} value: '{value}'. Fix: correct that value in the recipe YAML or on "
                    "the command line.")


def remembered_values(kind: str, config: dict, path: str | Path, argv: list[str], cache: Path,
                      elsewhere: Callable | None = None):
    """The recipe's settings as the parser would resolve its plain fields (the kind's defaults, the YAML, then the
    command line), with every key, flag and int/float/bool value checked against the fields a launch remembered
    under the same fingerprint, before any heavy import: a namespace, or None where none is remembered (the parser
    checks them later)."""
    import types

    try:
        fields = json.loads(_keys_file(kind, cache).read_text())
        assert isinstance(fields, dict)
    except (OSError, ValueError, TypeError, AssertionError):
        return None
    known = set(fields)
    check_known_keys(config, known, path, elsewhere)
    check_known_flags(argv, known, elsewhere)
    values = {name: spec[1] for name, spec in fields.items() if len(spec) > 1}
    values.update(config)
    i = 0
    while i < len(argv):
        arg, i = argv[i], i + 1
        if not arg.startswith("--"):
            continue
        key, eq, value = arg[2:].partition("=")
        if key.startswith("no_") and key not in known:
            values[key[3:]] = False
        elif eq:
            values[key] = value
        elif i < len(argv) and not argv[i].startswith("--"):
            values[key], i = argv[i], i + 1
        else:
            values[key] = True  # a bare boolean flag
    return types.SimpleNamespace(**{k: _as(fields.get(k, [None])[0], v, k) for k, v in values.items()})
