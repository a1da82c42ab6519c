"""`make gguf`: what the GGUF writer refuses, one line each, leaving nothing behind. The export of the real model and
its read-back by transformers' own GGUF reader: tests/test_default_recipe.py (it has the trained model)."""

import json
import shutil
import subprocess
import sys

import pytest

from conftest import REPO
from fsdp_recipes.errors import UserError
from fsdp_recipes.serving import gguf_export


@pytest.fixture
def tiny(cache_dir, tmp_path):
    from fsdp_recipes.assets.tiny_assets import ensure_assets

    folder = tmp_path / "model"
    shutil.copytree(ensure_assets(quiet=True)["model"], folder)
    return folder


def edit_config(folder, **fields):
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, **fields}))


@pytest.mark.parametrize("fields, fragment", [
    ({"architectures": ["GPT2LMHeadModel"]}, "is a GPT2LMHeadModel, which this GGUF writer does not support"),
    ({"rope_scaling": {"rope_type": "llama3", "factor": 8.0}}, "uses rope scaling 'llama3'"),
    ({"rope_parameters": {"rope_type": "llama3", "rope_theta": 5e5, "factor": 8.0}}, "uses rope scaling 'llama3'"),
    ({}, "no known llama.cpp pre-tokenizer for a mistral model with a 268-token byte-level BPE vocabulary"),
], ids=["architecture", "rope-scaling", "rope-parameters", "unknown-tokenizer"])
def test_what_the_writer_cannot_write_is_refused_and_leaves_nothing(tiny, tmp_path, fields, fragment):
    edit_config(tiny, **fields)
    out = tmp_path / "out" / "model.f16.gguf"
    with pytest.raises(UserError, match=fragment.replace("(", r"\(")):
        gguf_export.export(tiny, out, "f16")
    assert not out.parent.exists() or not any(out.parent.iterdir())  # no file, no .partial


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
