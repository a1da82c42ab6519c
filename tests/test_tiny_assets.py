"""The embedded default's assets are deterministic, local, and load through the hub code paths."""

import hashlib

from transformers import AutoModelForCausalLM, AutoTokenizer

from fsdp_recipes.assets import tiny_assets


def digest(path):
    return hashlib.sha256(path.read_bytes()).hexdigest()


def test_build_is_deterministic_and_idempotent(tmp_path, cache_dir):
    a = tiny_assets.ensure_assets(tmp_path / "a", quiet=True)
    b = tiny_assets.ensure_assets(tmp_path / "b", quiet=True)
    for rel in ("tiny-arith/train.jsonl", "tiny-arith/test.jsonl", "tiny-mistral/model.safetensors",
                "tiny-mistral/tokenizer.json"):
        assert digest(tmp_path / "a" / rel) == digest(tmp_path / "b" / rel), rel
    stamp = (a["model"] / "model.safetensors").stat().st_mtime_ns
    tiny_assets.ensure_assets(tmp_path / "a", quiet=True)  # second call: nothing rebuilt
    assert (a["model"] / "model.safetensors").stat().st_mtime_ns == stamp
    assert b["data"] == tmp_path / "b" / "tiny-arith"


def test_model_and_tokenizer_load_with_from_pretrained(cache_dir):
    model_dir = cache_dir / tiny_assets.MODEL_DIRNAME
    tok = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir)
    assert type(model).__name__ == "MistralForCausalLM"
    assert 2e6 < sum(p.numel() for p in model.parameters()) < 5e6
    text = tok.apply_chat_template([{"role": "user", "content": "What is 2 + 3?"},
                                    {"role": "assistant", "content": "5"}], tokenize=False)
    assert text == "<s>[INST] What is 2 + 3? [/INST] 5</s>"
    ids = tok(text, add_special_tokens=False)["input_ids"]
    assert tok.decode(ids) == text  # lossless round trip
    assert tok.convert_ids_to_tokens(ids).count("</s>") == 1
