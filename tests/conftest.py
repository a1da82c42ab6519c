"""Shared fixtures: an isolated asset cache, and a helper that runs pack commands as a user would."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
BIN = Path(sys.executable).parent  # the venv's bin: python, accelerate
# torchao, for the float8 tests only: `make venv` installs it here, outside site-packages (the Makefile says why)
FLOAT8_SITE = BIN.parent / "float8-site"


def in_ci() -> bool:
    """The one place that decides "are we in CI": .ci/run exports CI=true (CI services set it too)."""
    return os.environ.get("CI", "").lower() in ("1", "true")


def skip_or_fail(reason: str) -> None:
    """A test whose tool or file is missing: skipped on a developer's machine, failed in CI, where nothing may
    skip silently."""
    (pytest.fail if in_ci() else pytest.skip)(reason)


def need_module(name: str):
    """Import a test-extra module, or skip_or_fail."""
    import importlib

    try:
        return importlib.import_module(name)
    except ImportError:
        skip_or_fail(f"{name} is in the test extra: pip install -e .[test]")


def torchao_site() -> str:
    """FLOAT8_SITE, for a test that needs torchao (skip_or_fail without it)."""
    if not (FLOAT8_SITE / "torchao").is_dir():
        skip_or_fail(f"no torchao in {FLOAT8_SITE}: `make venv` installs it there")
    return str(FLOAT8_SITE)


@pytest.fixture(scope="session")
def cache_dir(tmp_path_factory) -> Path:
    """A fresh $FSDP_RECIPES_CACHE with the tiny assets built once for the whole session."""
    root = tmp_path_factory.mktemp("cache")
    os.environ["FSDP_RECIPES_CACHE"] = str(root)
    from fsdp_recipes.assets.tiny_assets import ensure_assets

    ensure_assets(root, quiet=True)
    return root


def pack_env(cache: Path, **extra) -> dict:
    env = dict(os.environ)
    env.update(FSDP_RECIPES_CACHE=str(cache), PATH=f"{BIN}:{env.get('PATH', '')}", PYTHONUNBUFFERED="1")
    env.pop("MASTER_PORT", None)
    env.update(extra)
    return env


def run(cmd: list[str], cache: Path, cwd: Path = REPO, timeout: int = 600, **env) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, cwd=cwd, env=pack_env(cache, **env), capture_output=True, text=True, timeout=timeout)


def launch(args: list[str], cache: Path, cwd: Path = REPO, timeout: int = 600) -> subprocess.CompletedProcess:
    """`python -m fsdp_recipes.launch.launcher ...`, what every recipe's launch.sh runs."""
    return run([sys.executable, "-m", "fsdp_recipes.launch.launcher", *args], cache, cwd=cwd, timeout=timeout)


def fsdp1_recipe(parent: Path, train_lm_head: bool = False, **fsdp_config) -> Path:
    """The tiny recipe with the FSDP1 settings the seeds use (accelerate_configs/fsdp1_1node.yaml: use_orig_params,
    sync_module_states + cpu_ram_efficient_loading, backward prefetch), on 2 CPU processes. Without
    lora_modules_to_save unless `train_lm_head`: the LM head's tests are their own (peft_fsdp.py, workaround 3)."""
    import shutil

    import yaml

    dst = parent / "tiny-fsdp1"
    if not dst.exists():
        shutil.copytree(REPO / "recipes" / "tiny-cpu-lora", dst)
        acc = yaml.safe_load((REPO / "accelerate_configs" / "fsdp1_1node.yaml").read_text())
        acc.update(num_processes=2, mixed_precision="no")
        acc["fsdp_config"].update(fsdp_config)
        (dst / "accelerate.yaml").write_text(yaml.safe_dump(acc))
        if not train_lm_head:
            sft = (dst / "sft.yaml").read_text().replace("lora_modules_to_save: [lm_head]", "")
            (dst / "sft.yaml").write_text(sft)
    return dst
