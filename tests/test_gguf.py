"""`make gguf`: llama.cpp's own converter writes each family the pack trains (Llama 3.1's rope scaling, Qwen3-MoE and
Mixtral with their experts merged), and what the pack refuses around it, one line each, leaving nothing behind. The
default's real model exported and read back by transformers: tests/test_default_recipe.py; llama.cpp computing the
same logits from these files: tests/test_serving_engines.py (make test-serve)."""

import json
import shutil
from pathlib import Path
import subprocess
import sys

import pytest

from conftest import REPO
from fsdp_recipes.errors import UserError
from fsdp_recipes.serving import gguf_export, llamacpp_converter
from gguf_tiny import VARIABLE, check_family_export, use_converter


@pytest.fixture
def tiny(cache_dir, tmp_path):
    from fsdp_recipes.assets.tiny_assets import ensure_assets

    folder = tmp_path / "model"
    shutil.copytree(ensure_assets(quiet=True)["model"], folder)
    return folder


def edit_config(folder, **fields):
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, **fields}))


@pytest.mark.parametrize("case", ["type", "exists", "qwen3-moe-routing", "no-converter"])
def test_what_is_refused_before_converting_is_one_line_and_leaves_the_output_alone(tiny, tmp_path, monkeypatch, case):
    out = tmp_path / "out" / "model.f16.gguf"
    qtype, said = "f16", None
    if case == "type":
        qtype, said = "q4_k", "GGUF type 'q4_k' is not one of f16, bf16, q8_0, f32. Fix: choose one of them."
    elif case == "exists":  # an earlier export (or anything else) under that name is not replaced without --force
        out.parent.mkdir()
        out.write_bytes(b"earlier")
        said = f"{out} exists. Fix: delete it, or add --force (make gguf ... FORCE=1) to replace it."
    elif case == "qwen3-moe-routing":  # llama.cpp's qwen3moe renormalises the top-k weights whatever the config says
        edit_config(tiny, model_type="qwen3_moe", norm_topk_prob=False)
        said = f"{tiny} has norm_topk_prob false, and llama.cpp's qwen3moe always renormalises"
    else:
        monkeypatch.setenv(VARIABLE, str(tmp_path / "nowhere"))
        said = (f"no llama.cpp converter at {tmp_path / 'nowhere'} (convert_hf_to_gguf.py with its gguf-py). Fix: "
                "fsdp-recipes gguf --install-converter (in a checkout of the pack also make gguf-converter")
    with pytest.raises(UserError) as err:
        gguf_export.export(tiny, out, qtype)
    assert str(err.value).startswith(said) and "\n" not in str(err.value)
    left = sorted(p.name for p in out.parent.iterdir()) if out.parent.exists() else []
    assert left == (["model.f16.gguf"] if case == "exists" else [])
    assert case != "exists" or out.read_bytes() == b"earlier"


@pytest.mark.slow
def test_a_converter_failure_is_one_line_with_its_reason_and_its_log(tiny, tmp_path, monkeypatch, capsys):
    """The pack's own tiny model: its 268-token byte-level BPE tokenizer is none llama.cpp knows by hash."""
    use_converter(monkeypatch)
    # the pack's own check refuses this tokenizer first (test_an_unknown_pre_tokenizer_is_refused_before_converting);
    # taken away here, the converter's own failure is what is said
    monkeypatch.setattr(llamacpp_converter, "unknown_pre_tokenizer", lambda folder: None)
    out = tmp_path / "out" / "tiny.f16.gguf"
    with pytest.raises(SystemExit) as code:
        gguf_export.main([str(tiny), "--out", str(out)])
    errors = capsys.readouterr().err.strip().splitlines()
    assert code.value.code == 2 and len(errors) == 1, errors
    assert errors[0].startswith(f"error: llama.cpp's converter (llama-cpp-python 0.3.36) could not convert {tiny}: "
                                "NotImplementedError: BPE pre-tokenizer was not recognized")
    assert "llama.cpp does not know this byte-level BPE tokenizer" in errors[0]
    assert errors[0].endswith(f"Its log: {out}.log.")
    assert "Traceback" in (tmp_path / "out" / "tiny.f16.gguf.log").read_text()
    assert sorted(p.name for p in out.parent.iterdir()) == ["tiny.f16.gguf.log"]  # no file, no .partial


@pytest.mark.slow
@pytest.mark.parametrize("family", ["llama-3.1", "mixtral"])
def test_the_converter_writes_llama_31_rope_scaling_and_merged_experts(tmp_path, monkeypatch, capsys, family):
    """Before, the hand-written writer refused both (rope scaling; MixtralForCausalLM unknown). Qwen3-MoE, which needs
    a tokenizer llama.cpp knows, is checked the same way on the default's (test_default_recipe.py)."""
    check_family_export(family, tmp_path, monkeypatch, capsys)


def test_a_run_without_a_merged_model_and_a_bad_type_are_one_line(tmp_path):
    (tmp_path / "adapter_config.json").write_text("{}")
    with pytest.raises(UserError, match="holds a LoRA adapter but no merged model. Fix: run it with "
                                        "--save_merged_model true"):
        gguf_export.model_folder(tmp_path)
    with pytest.raises(UserError, match="holds no model"):
        gguf_export.model_folder(tmp_path / "adapter_config.json")
    res = subprocess.run([sys.executable, "-m", "fsdp_recipes.serving.gguf_export", str(tmp_path / "missing")],
                         capture_output=True, text=True, cwd=REPO)
    assert res.returncode == 2 and res.stderr.strip().count("\n") == 0, res.stderr
    assert res.stderr.startswith("error: ") and "is not a folder. Fix: " in res.stderr


def test_make_gguf_without_a_run_is_one_line():
    res = subprocess.run(["make", "-s", "gguf"], capture_output=True, text=True, cwd=REPO)
    assert res.returncode == 2 and "make gguf needs RUN=" in res.stderr


CHKTXT = "Hello  world 333 3.3 I've"


def fake_converter(folder, known=()):
    """A converter folder whose get_vocab_base_pre lists the hashes `known`, laid out as llama.cpp 0.3.36's
    (conversion/base.py: the test string, then `if chkhsh == "..."` per tokenizer, then its end marker)."""
    (folder / "conversion").mkdir(parents=True)
    (folder / "convert_hf_to_gguf.py").write_text("")
    cases = "".join(f'        if chkhsh == "{h}":\n            res = "known"\n' for h in known)
    (folder / "conversion" / "base.py").write_text(
        "class TextModel:\n    def get_vocab_base_pre(self, tokenizer) -> str:\n"
        f"        chktxt = {CHKTXT!r}\n        chktok = tokenizer.encode(chktxt)\n{cases}"
        "        # Marker: End get_vocab_base_pre\n")
    return folder


def tokenizer_hash(folder) -> str:
    import hashlib

    from transformers import AutoTokenizer

    return hashlib.sha256(str(AutoTokenizer.from_pretrained(str(folder)).encode(CHKTXT)).encode()).hexdigest()


def test_an_unknown_pre_tokenizer_is_refused_before_converting(tiny, tmp_path, monkeypatch, capsys):
    """`make gguf RUN=runs/tiny-cpu-lora` (every smoke run: the tiny tokenizer) was offered by the summary and failed
    in llama.cpp's converter, "BPE pre-tokenizer was not recognized" (2026-11-29): --check-only now says so in a
    second, from the installed converter's own list of hashes; a tokenizer it lists passes."""
    monkeypatch.setenv(VARIABLE, str(fake_converter(tmp_path / "converter")))
    with pytest.raises(SystemExit) as code:
        gguf_export.main([str(tiny), "--check-only"])
    errors = capsys.readouterr().err.strip().splitlines()
    assert code.value.code == 2 and len(errors) == 1, errors
    assert errors[0].startswith(f"error: llama.cpp's converter (llama-cpp-python 0.3.36) does not know the byte-level "
                                f"BPE pre-tokenizer of {tiny}'s tokenizer (its hash ")
    assert '"BPE pre-tokenizer was not recognized". Fix: export a model whose tokenizer llama.cpp knows' in errors[0]
    assert not (tiny / "gguf").exists()
    monkeypatch.setenv(VARIABLE, str(fake_converter(tmp_path / "knows", [tokenizer_hash(tiny)])))
    assert gguf_export.main([str(tiny), "--check-only"]) == 0
    monkeypatch.setenv(VARIABLE, str(tmp_path / "none"))  # no converter: it cannot tell, and does not guess
    assert llamacpp_converter.unknown_pre_tokenizer(tiny) is None


def test_the_real_converter_does_not_know_the_tiny_tokenizer(tiny, monkeypatch):
    """The check reads llama.cpp 0.3.36's own list: the tiny tokenizer, which its converter refuses
    (test_a_converter_failure_is_one_line_with_its_reason_and_its_log), is not in it."""
    converter = use_converter(monkeypatch)
    chktxt, hashes = llamacpp_converter.known_pre_tokenizers(converter)
    assert len(hashes) > 50 and "\n" in chktxt
    assert "does not know the byte-level BPE pre-tokenizer" in llamacpp_converter.unknown_pre_tokenizer(tiny)


def test_the_converter_installs_without_make(tmp_path, monkeypatch, capsys):
    """A wheel user has no Makefile: `fsdp-recipes gguf --install-converter` does what make gguf-converter does
    (pip download of the llama-cpp-python sdist, its vendor/llama.cpp converter files unpacked, sentencepiece into
    site/). pip is stood in for here: no network in the tests."""
    import tarfile

    version = llamacpp_converter.VERSION
    made = tmp_path / "sdist"
    vendor = made / f"llama_cpp_python-{version}" / "vendor" / "llama.cpp"
    fake_converter(vendor)
    (vendor / "gguf-py" / "gguf").mkdir(parents=True)
    (vendor / "LICENSE").write_text("MIT")
    (vendor / "ggml").mkdir()  # the rest of llama.cpp's source: not kept
    sdist = tmp_path / f"llama_cpp_python-{version}.tar.gz"
    with tarfile.open(sdist, "w:gz") as tar:
        tar.add(made / f"llama_cpp_python-{version}", arcname=f"llama_cpp_python-{version}")
    calls = []

    def pip(cmd, **kwargs):
        calls.append(cmd[3:])
        if cmd[3] == "download":
            shutil.copy(sdist, cmd[cmd.index("-d") + 1])
        else:
            (Path(cmd[cmd.index("--target") + 1]) / "sentencepiece").mkdir(parents=True)
        return subprocess.CompletedProcess(cmd, 0)

    monkeypatch.setattr(llamacpp_converter.subprocess, "run", pip)
    monkeypatch.setenv("FSDP_RECIPES_CACHE", str(tmp_path / "cache"))
    monkeypatch.delenv(VARIABLE, raising=False)
    assert gguf_export.main(["--install-converter"]) == 0
    folder = tmp_path / "cache" / "serve-env" / "llamacpp-converter"
    assert sorted(p.name for p in folder.iterdir()) == ["LICENSE", "conversion", "convert_hf_to_gguf.py", "gguf-py",
                                                        "site"]
    assert [c[0] for c in calls] == ["download", "install"] and "sentencepiece==0.2.3" in calls[1]
    assert llamacpp_converter.location() == folder
    assert gguf_export.main(["--install-converter"]) == 0  # kept: nothing downloaded again
    assert len(calls) == 2 and capsys.readouterr().out.splitlines()[-1] == f"[gguf] llama.cpp's converter is at {folder}"


def test_the_makefile_builds_llama_cpp_from_the_sdist_the_converter_comes_from():
    """make serve-env builds llama-cpp-python from the sdist that install() unpacked the converter from: one
    llama.cpp commit for both, so the Makefile's version is the module's."""
    import re

    from conftest import REPO
    from fsdp_recipes.serving import llamacpp_converter

    makefile = (REPO / "Makefile").read_text()
    assert re.search(r"^LLAMACPP_VERSION = (\S+)$", makefile, re.M).group(1) == llamacpp_converter.VERSION
    assert "@$(CLI) gguf --install-converter" in makefile  # one way to install it, the module's
