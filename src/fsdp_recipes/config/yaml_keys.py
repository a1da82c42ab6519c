"""Recipe YAML and command-line keys: read a YAML file, and name a key or flag that no config class knows
(with the closest known one), so a typo is one line rather than a traceback from every rank.

The config classes are TRL's and transformers': importing them takes the launcher 8-10 s on a 2-core VM, and the
ranks start meanwhile. So the known keys of each trainer kind are remembered in the pack's cache once a launch has
parsed them, under a fingerprint of what defines them (the installed trl, transformers, peft and accelerate, and the
pack's own config and kind modules): the next launch names a typo before it imports any of them or starts a rank.
A fingerprint without a remembered set (the first launch, an upgrade, an edited kind) leaves the check to the parser.
"""

from __future__ import annotations

import dataclasses
import difflib
import hashlib
import json
import os
from pathlib import Path

import yaml

from fsdp_recipes.errors import UserError


def load_yaml(path: str | Path, what: str = "config") -> dict:
    path = Path(path)
    if not path.is_file():
        raise UserError(f"{what} file not found: {path}. Fix: check the path (recipes live in recipes/<name>/).")
    try:
        data = yaml.safe_load(path.read_text())
    except yaml.YAMLError as err:
        mark = getattr(err, "problem_mark", None)
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
        problem = getattr(err, "problem", None) or str(err).splitlines()[0]
        raise UserError(f"malformed YAML in {path}{where}: {problem}. Fix: correct the YAML syntax there.") from None
    if not isinstance(data, dict):
        raise UserError(f"{path} must hold a YAML mapping of `key: value` lines, not {type(data).__name__}.")
    return data


def known_fields(dataclass_types) -> set[str]:
    return {f.name for dc in dataclass_types for f in dataclasses.fields(dc)}


def _suggest(key: str, known: set[str]) -> str:
    close = difflib.get_close_matches(key, known, n=1)
    return f"did you mean `{close[0]}`?" if close else "remove it, or see `--help` for the valid keys"



def check_known_keys(config: dict, dataclass_types, path: str | Path, known: set[str] | None = None) -> None:
    """Every key must be a field of one of the parser's dataclasses (or TRL's `env`); `known`: those fields, where
    the caller has them without the classes (remembered_keys)."""
    known = (known if known is not None else known_fields(dataclass_types)) | {"env"}
    for key in config:
        if key not in known:
            raise UserError(f"unknown config key `{key}` in {path}. Fix: {_suggest(key, known)}")


def check_known_flags(argv: list[str], dataclass_types, known: set[str] | None = None) -> None:
    """Command-line overrides must name fields too (`--no_<bool field>` included, as HfArgumentParser allows)."""
    known = (known if known is not None else known_fields(dataclass_types)) | {"config", "help", "h"}
    for arg in argv:
        if not arg.startswith("--"):
            continue
        key = arg[2:].split("=", 1)[0]
        if key not in known and not (key.startswith("no_") and key[3:] in known):
            raise UserError(f"unknown command-line flag `--{key}`. Fix: {_suggest(key, known)}")


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
    return cache / "known-keys" / f"{kind}-{hashlib.sha256(chr(10).join(parts).encode()).hexdigest()[:20]}.json"


def remember_keys(kind: str, dataclass_types, cache: Path) -> None:
    """After a parse: the kind's known keys, for the next launch's early check. A cache that cannot be written
    costs only that speed."""
    path = _keys_file(kind, cache)
    if path.exists():
        return
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f".{path.name}.{os.getpid()}")
        tmp.write_text(json.dumps(sorted(known_fields(dataclass_types))))
        tmp.replace(path)
    except OSError:
        pass


def check_remembered_keys(kind: str, config: dict, path: str | Path, argv: list[str], cache: Path) -> bool:
    """The recipe's keys and flags against the known keys a launch remembered under the same fingerprint, before
    any heavy import. False where none is remembered (the parser checks them later)."""
    try:
        known = set(json.loads(_keys_file(kind, cache).read_text()))
    except (OSError, ValueError, TypeError):
        return False
    check_known_keys(config, (), path, known)
    check_known_flags(argv, (), known)
    return True
