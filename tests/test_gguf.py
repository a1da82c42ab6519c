"""`make gguf`: llama.cpp's own converter writes each family the pack trains (Llama 3.1's rope scaling, Qwen3-MoE and
Mixtral with their experts merged), and what the pack refuses around it, one line each, leaving nothing behind. The
default's real model exported and read back by transformers: tests/test_default_recipe.py; llama.cpp computing the
same logits from these files: tests/test_serving_engines.py (make test-serve)."""

import json
import shutil
import subprocess
import sys

import pytest

from conftest import REPO
from fsdp_recipes.errors import UserError
from fsdp_recipes.serving import gguf_export
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
                "make gguf-converter")
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
