"""llama.cpp's own Hugging Face -> GGUF converter (convert_hf_to_gguf.py, its `conversion` package and its gguf-py),
as a subprocess of the pack's python.

Where it comes from: the llama-cpp-python 0.3.36 source distribution, the one `make serve-env` builds llama.cpp
from; `make gguf-converter` (run by `make gguf` and `make serve-env`) keeps that sdist's vendor/llama.cpp converter
files under $FSDP_RECIPES_CACHE/serve-env/llamacpp-converter, so the converter and the llama.cpp that serves its
files are the same llama.cpp commit. FSDP_RECIPES_LLAMACPP_CONVERTER names another folder holding
convert_hf_to_gguf.py (a llama.cpp checkout).

Which python: the pack's own (sys.executable), not the llama.cpp environment's: the converter needs torch,
transformers and safetensors to read the model and its tokenizer, which the pack's environment has and the llama.cpp
one does not (it holds llama-cpp-python and numpy). The one thing the converter imports that the pack lacks,
sentencepiece (for every Llama-family model, SentencePiece tokenizer or not), is installed by `make gguf-converter`
into the converter folder's site/, put on PYTHONPATH here. The converter puts its own gguf-py ahead of the installed
`gguf` package (convert_hf_to_gguf.py inserts it at sys.path[1]): its tensor maps are the ones this llama.cpp reads.
"""

from __future__ import annotations

import os
import re
import struct
import subprocess
import sys
from pathlib import Path

from fsdp_recipes.errors import UserError
from fsdp_recipes.paths import cache_dir

SOURCE = "llama-cpp-python 0.3.36"  # the sdist the Makefile's gguf-converter target unpacks (LLAMACPP_VERSION)
VARIABLE = "FSDP_RECIPES_LLAMACPP_CONVERTER"
SCRIPT = "convert_hf_to_gguf.py"


def location() -> Path:
    """The folder holding convert_hf_to_gguf.py; a missing one is one line with the fix."""
    folder = Path(os.environ.get(VARIABLE) or cache_dir() / "serve-env" / "llamacpp-converter")
    if not (folder / SCRIPT).is_file():
        raise UserError(f"no llama.cpp converter at {folder} ({SCRIPT} with its gguf-py). Fix: make gguf-converter "
                        f"(unpacks it from the {SOURCE} source from PyPI once, about 2 minutes), or set {VARIABLE} "
                        f"to a llama.cpp checkout.")
    return folder


def failure(log_text: str) -> str:
    """The converter's own reason, from its log: a traceback's last line ("NotImplementedError: ...") or its last
    ERROR line, shortened; the fix for the two reasons a user meets."""
    lines = [line.strip() for line in log_text.splitlines() if line.strip()]
    errors = [line for line in lines if re.match(r"^([\w.]+(Error|Exception)\b|ERROR:)", line)]
    reason = (errors or lines or ["no output"])[-1][:240]
    if re.fullmatch(r"[\w.]+(Error|Exception)", reason):  # a bare `assert`: the line of code that failed says what
        code = [line for line in lines if not line.startswith(("File ", "Traceback")) and line.strip("^~ ")]
        reason = f"{reason} at `{code[-2][:160]}`" if len(code) > 1 else reason
    if "pre-tokenizer was not recognized" in reason:
        return (f"{reason}: llama.cpp does not know this byte-level BPE tokenizer (it names the pre-tokenizer by "
                f"hashing the tokens of a test string). Fix: export a model whose tokenizer llama.cpp knows, or "
                f"add the tokenizer with llama.cpp's convert_hf_to_gguf_update.py in a llama.cpp checkout and set "
                f"{VARIABLE} to it")
    if re.search(r"Model \S+ is not supported", reason):
        return f"{reason} by the converter of {SOURCE}. Fix: convert it with a newer llama.cpp ({VARIABLE})"
    return reason


def convert(folder: Path, out: Path, qtype: str, name: str, log: Path) -> None:
    """convert_hf_to_gguf.py folder --outfile out --outtype qtype, its output in `log`; a failure is one UserError
    naming the converter's reason and the log."""
    converter = location()
    site = converter / "site"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in (str(site), os.environ.get("PYTHONPATH")) if p)}
    cmd = [sys.executable, str(converter / SCRIPT), str(folder), "--outfile", str(out), "--outtype", qtype,
           "--model-name", name]
    log.parent.mkdir(parents=True, exist_ok=True)
    with open(log, "w") as f:
        f.write(" ".join(cmd) + "\n")
        f.flush()
        done = subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT, env=env)
    if done.returncode != 0:
        raise UserError(f"llama.cpp's converter ({SOURCE}) could not convert {folder}: "
                        f"{failure(log.read_text(errors='replace'))}. Its log: {log}.")


def header(path: Path) -> tuple[str, int]:
    """(general.architecture, tensor count) from a GGUF file's header, without parsing its whole metadata (gguf's
    reader parses every vocabulary string: 10-15 s for SmolLM2's). The writer puts general.architecture first."""
    with open(path, "rb") as f:
        magic, _version, tensors, _kvs, key_len = struct.unpack("<4sIQQQ", f.read(32))
        key = f.read(key_len).decode()
        value_type, value_len = struct.unpack("<IQ", f.read(12))
        if magic != b"GGUF" or key != "general.architecture" or value_type != 8:  # 8: string
            return "?", tensors
        return f.read(value_len).decode(), tensors
