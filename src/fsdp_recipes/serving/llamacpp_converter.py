"""llama.cpp's own Hugging Face -> GGUF converter (convert_hf_to_gguf.py, its `conversion` package and its gguf-py),
as a subprocess of the pack's python.

Where it comes from: the llama-cpp-python 0.3.36 source distribution, the one `make serve-env` builds llama.cpp
from; `make gguf-converter` (run by `make gguf` and `make serve-env`), or without make `fsdp-recipes gguf
--install-converter` (install() here: the same steps), keeps that sdist's vendor/llama.cpp converter
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

import ast
import hashlib
import json
import os
import re
import shutil
import struct
import subprocess
import sys
import tarfile
from pathlib import Path

from fsdp_recipes.errors import UserError
from fsdp_recipes.paths import cache_dir

VERSION = "0.3.36"  # = the Makefile's LLAMACPP_VERSION, the sdist `make serve-env` builds llama.cpp from
SOURCE = f"llama-cpp-python {VERSION}"  # the sdist install() unpacks the converter from
VARIABLE = "FSDP_RECIPES_LLAMACPP_CONVERTER"
SCRIPT = "convert_hf_to_gguf.py"
FILES = ("convert_hf_to_gguf.py", "conversion", "gguf-py", "LICENSE")
SENTENCEPIECE = "sentencepiece==0.2.3"
INSTALL = "fsdp-recipes gguf --install-converter"  # works wherever the pack is installed; `make gguf-converter` too


def default_location() -> Path:
    return cache_dir() / "serve-env" / "llamacpp-converter"


def location() -> Path:
    """The folder holding convert_hf_to_gguf.py; a missing one is one line with the fix."""
    folder = Path(os.environ.get(VARIABLE) or default_location())
    if not (folder / SCRIPT).is_file():
        raise UserError(f"no llama.cpp converter at {folder} ({SCRIPT} with its gguf-py). Fix: {INSTALL} (in a "
                        f"checkout of the pack also make gguf-converter: either unpacks it from the {SOURCE} source "
                        f"from PyPI once, about 2 minutes, and pip-installs {SENTENCEPIECE} beside it), or set "
                        f"{VARIABLE} to a llama.cpp checkout.")
    return folder


def install(folder: Path | None = None, say=print) -> Path:
    """`make gguf-converter` and `fsdp-recipes gguf --install-converter` (a wheel user has no Makefile): pip downloads
    the llama-cpp-python sdist once into the serve-env folder, its vendor/llama.cpp FILES are unpacked into `folder`
    (default_location()) and sentencepiece is pip-installed into its site/. Kept where it is already complete."""
    folder = Path(folder or default_location())
    if (folder / SCRIPT).is_file() and (folder / "site" / "sentencepiece").is_dir():
        say(f"[gguf] llama.cpp's converter is at {folder}")
        return folder
    envs = folder.parent
    envs.mkdir(parents=True, exist_ok=True)
    log = folder.with_name(folder.name + ".log")
    sdist = envs / f"llama_cpp_python-{VERSION}.tar.gz"

    def pip(*args: str) -> None:
        with open(log, "a") as f:
            done = subprocess.run([sys.executable, "-m", "pip", *args], stdout=f, stderr=subprocess.STDOUT)
        if done.returncode != 0:
            raise UserError(f"pip {args[0]} failed while installing llama.cpp's converter (it needs PyPI once). "
                            f"Fix: read {log}, then run {INSTALL} again.")

    if not sdist.is_file():
        say(f"[gguf] downloading llama-cpp-python {VERSION}'s source to {envs} (once; its log: {log})")
        pip("download", "--no-deps", "--no-binary", ":all:", f"llama-cpp-python=={VERSION}", "-d", str(envs))
    say(f"[gguf] unpacking llama.cpp's converter into {folder}")
    tmp = folder.with_name(folder.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    prefix = f"llama_cpp_python-{VERSION}/vendor/llama.cpp/"
    with tarfile.open(sdist) as tar:
        for member in tar.getmembers():
            if member.name.startswith(prefix) and member.name[len(prefix):].split("/")[0] in FILES:
                member.name = member.name[len(prefix):]
                # the data filter (no links out, no devices) where this Python has it: 3.10.12 and later
                tar.extract(member, tmp, **({"filter": "data"} if hasattr(tarfile, "data_filter") else {}))
    if not (tmp / SCRIPT).is_file():
        raise UserError(f"{sdist} holds no vendor/llama.cpp/{SCRIPT}. Fix: delete it and run {INSTALL} again.")
    pip("install", "--no-deps", "--target", str(tmp / "site"), SENTENCEPIECE)
    shutil.rmtree(folder, ignore_errors=True)
    tmp.rename(folder)
    return folder


def known_pre_tokenizers(converter: Path) -> tuple[str, set[str]] | None:
    """(the test string, the hashes it knows) of the converter's get_vocab_base_pre: llama.cpp names a byte-level BPE
    pre-tokenizer by sha256(str(tokenizer.encode(chktxt))) and refuses one whose hash it does not list. None where
    the converter's source does not read so (another llama.cpp's layout)."""
    for source in (converter / "conversion" / "base.py", converter / SCRIPT):
        if not source.is_file():
            continue
        text = source.read_text(encoding="utf-8")
        start = text.find("def get_vocab_base_pre(")
        found = re.search(r"^\s*chktxt = (.+)$", text[start:], re.M) if start >= 0 else None
        if found:
            try:
                chktxt = ast.literal_eval(found.group(1))
            except (ValueError, SyntaxError):
                return None
            end = text.find("Marker: End get_vocab_base_pre", start)
            return chktxt, set(re.findall(r'chkhsh == "([0-9a-f]{64})"', text[start:end if end > 0 else None]))
    return None


def byte_level_bpe(folder: Path) -> bool:
    """Whether the converter names this folder's tokenizer by its hash: a tokenizer.json BPE without byte fallback
    and no SentencePiece tokenizer.model (those go another way)."""
    path = folder / "tokenizer.json"
    if not path.is_file() or (folder / "tokenizer.model").is_file():
        return False
    try:
        model = json.loads(path.read_text(encoding="utf-8")).get("model") or {}
    except (OSError, ValueError):
        return False
    return model.get("type") == "BPE" and not model.get("byte_fallback", False)


def unknown_pre_tokenizer(folder: Path) -> str | None:
    """Why the converter will refuse `folder`'s tokenizer ("BPE pre-tokenizer was not recognized"), found in about a
    second without converting: the folder's tokenizer (transformers' AutoTokenizer, as the converter loads it)
    encodes the converter's test string, and the hash is not one it lists. None where it will take it, and where
    this cannot tell (no converter installed, not a byte-level BPE tokenizer)."""
    if not byte_level_bpe(folder):
        return None
    try:
        converter = location()
    except UserError:
        return None
    known = known_pre_tokenizers(converter)
    if known is None:
        return None
    chktxt, hashes = known
    from transformers import AutoTokenizer

    try:
        tokenizer = AutoTokenizer.from_pretrained(str(folder))
    except Exception:  # noqa: BLE001 - a tokenizer transformers cannot load: the converter's own error says why
        return None
    digest = hashlib.sha256(str(tokenizer.encode(chktxt)).encode()).hexdigest()
    if digest in hashes:
        return None
    return (f"llama.cpp's converter ({SOURCE}) does not know the byte-level BPE pre-tokenizer of {folder}'s tokenizer "
            f"(its hash {digest[:12]}... is not among the {len(hashes)} it lists) and refuses it: \"BPE pre-tokenizer "
            f"was not recognized\"")


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
