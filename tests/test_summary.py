"""The end-of-run summary prints what a terminal shows cleanly, and generates samples only where that is cheap."""

import json

import pytest

from fsdp_recipes.launch import summary
from fsdp_recipes.launch.summary import shown


def test_undecodable_generations_are_escaped_not_printed_as_mojibake():
    # what a random-weight model's generation decodes to: byte-level pieces that are not valid UTF-8
    garbled = b"\xe4\xb8".decode("utf-8", errors="replace") * 4
    assert shown(garbled) == "'" + "\\ufffd" * 4 + "'"
    assert shown("ok\x07") == "'ok\\x07'"  # a control character (BEL) too
    assert shown("14") == "'14'" and shown("café") == "'café'"  # ordinary text stays as it was


def test_a_replica_rank_shows_no_warnings_or_progress_bars(monkeypatch):
    """What ranks other than 0 switch off, so that the console shows each library warning and bar once."""
    import warnings
    from types import SimpleNamespace

    import datasets
    import transformers

    from fsdp_recipes.train.entry import quiet_replica

    monkeypatch.setattr(warnings, "filters", list(warnings.filters))  # restored after the test
    cfg = SimpleNamespace(training=SimpleNamespace(log_level_replica="warning"))
    try:
        quiet_replica(cfg)
        with warnings.catch_warnings(record=True) as caught:
            warnings.warn("from a replica", FutureWarning)
        assert caught == []
        assert not transformers.utils.logging.is_progress_bar_enabled()
        assert datasets.is_progress_bar_enabled() is False
        assert cfg.training.log_level_replica == "error"
        cfg.training.log_level_replica = "info"  # a recipe's own choice stays
        quiet_replica(cfg)
        assert cfg.training.log_level_replica == "info"
    finally:
        transformers.utils.logging.enable_progress_bar()
        datasets.enable_progress_bars()


BIG = (23_572_403_200, 47_144_806_400)  # a 24B model in bf16: what model_size reads from its safetensors headers


def never(*_):
    raise AssertionError("the model's size was read, or a model loaded, where the decision needs neither")


def test_only_the_first_node_generates():
    note = summary.skip_generations("runs/x", "runs/x/merged", machine_rank="1", force=True, size=never)
    assert note == "skipped on this node (machine rank 1): the first node generates them"


def test_a_big_model_is_skipped_with_the_way_to_get_its_generations():
    note = summary.skip_generations("runs/x", "runs/x/merged", machine_rank="0", force=False, size=lambda _: BIG)
    assert note == ("skipped: the model has 23.6B parameters (the limit is 1B), and loading it and the base model on "
                    "CPU would take about 87.8 GiB of host memory; run `python -m fsdp_recipes.launch.summary runs/x "
                    "--generate` where the memory is, or set FSDP_RECIPES_SUMMARY_GENERATIONS=1 for the launcher")
    assert summary.skip_generations("runs/x", "m", "0", force=True, size=never) is None  # forced: no size read
    assert summary.skip_generations("runs/x", "m", "0", force=False, size=lambda _: (999_999_999, 4 * 10**9)) is None
    assert summary.skip_generations("runs/x", "m", "0", False, size=lambda _: (10**9, 4 * 10**9)).startswith("skipped")
    assert summary.skip_generations("runs/x", "m", "0", False, size=lambda _: None).startswith("skipped: no safetensors")


def test_the_size_comes_from_the_safetensors_headers(tmp_path):
    from transformers import MistralConfig, MistralForCausalLM

    model = MistralForCausalLM(MistralConfig(vocab_size=32, hidden_size=16, intermediate_size=32,
                                             num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1))
    model.save_pretrained(tmp_path)
    params, nbytes = summary.model_size(tmp_path)
    assert params == model.num_parameters()
    assert nbytes == (tmp_path / "model.safetensors").stat().st_size > 4 * params
    assert summary.model_size(tmp_path / "nothing") is None


def fake_run(tmp_path):
    """A finished LoRA run with a merged model, as far as the summary reads it (no weights)."""
    run = tmp_path / "run"
    (run / "merged").mkdir(parents=True)
    (run / "merged" / "config.json").write_text("{}")
    (run / "run_args.json").write_text("{}")
    (run / "metrics.json").write_text(json.dumps({
        "recipe": "big-lora", "status": "completed", "wall_clock_s": 10.0, "tokens_per_second": None, "mfu": None,
        "mfu_note": "cpu", "peak_memory": {"host_rss_bytes": 2**30}, "sharding_strategy": "FULL_SHARD",
        "fsdp_version": 2, "world_size": 16, "num_nodes": 2, "device": {"type": "cuda", "name": "H100"}}))
    return run


def generations_line(capsys) -> str:
    """The summary's `generations ...` line (the `serve it` block comes after it)."""
    return next(line for line in capsys.readouterr().out.splitlines() if line.startswith("generations "))


def test_the_summary_skips_big_models_without_loading_them(tmp_path, monkeypatch, capsys):
    run = fake_run(tmp_path)
    monkeypatch.delenv(summary.FORCE_ENV, raising=False)
    monkeypatch.setattr(summary, "model_size", lambda _: BIG)
    monkeypatch.setattr(summary, "learning_check", never)
    assert summary.main([str(run)]) == 0
    assert generations_line(capsys).startswith("generations skipped: the model has 23.6B parameters")
    assert summary.main([str(run), "--machine-rank", "1"]) == 0
    assert generations_line(capsys) == (
        "generations skipped on this node (machine rank 1): the first node generates them")
    assert not (run / "sample_generations.json").exists()


@pytest.mark.parametrize("how", ["flag", "env"])
def test_generations_can_be_forced(tmp_path, monkeypatch, capsys, how):
    run = fake_run(tmp_path)
    ran = []
    monkeypatch.setattr(summary, "model_size", lambda _: BIG)
    monkeypatch.setattr(summary, "learning_check", lambda run_dir, run_args, n, cfg=None: ran.append((run_dir, n)))
    if how == "env":
        monkeypatch.setenv(summary.FORCE_ENV, "1")
    else:
        monkeypatch.delenv(summary.FORCE_ENV, raising=False)
    monkeypatch.delenv(summary.PROMPTS_ENV, raising=False)
    summary.main([str(run), *(["--generate"] if how == "flag" else [])])
    assert ran == [(run, 128)] and "skipped" not in capsys.readouterr().out


def test_the_number_of_eval_prompts_can_be_set_and_a_bad_one_is_one_line(tmp_path, monkeypatch, capsys):
    run = fake_run(tmp_path)
    ran = []
    monkeypatch.setattr(summary, "model_size", lambda _: (1000, 4000))
    monkeypatch.setattr(summary, "learning_check", lambda run_dir, run_args, n, cfg=None: ran.append(n))
    monkeypatch.setenv(summary.PROMPTS_ENV, "7")
    summary.main([str(run)])
    assert ran == [7]
    for bad in ("0", "ten", "-3"):
        monkeypatch.setenv(summary.PROMPTS_ENV, bad)
        with pytest.raises(SystemExit) as stop:
            summary.main([str(run)])
        assert stop.value.code == 2
        err = capsys.readouterr().err.strip()
        assert err == (f"error: FSDP_RECIPES_SUMMARY_PROMPTS={bad!r} is not a positive whole number. Fix: set it to "
                       "how many eval prompts the summary should generate for (default 128), or unset it.")
    assert ran == [7]


def test_generations_can_be_turned_off_whatever_the_size(tmp_path, monkeypatch, capsys):
    run = fake_run(tmp_path)
    monkeypatch.setattr(summary, "model_size", lambda _: (1000, 4000))  # tiny: generated by default
    monkeypatch.setattr(summary, "learning_check", never)
    monkeypatch.setenv(summary.FORCE_ENV, "0")
    assert summary.main([str(run)]) == 0
    assert generations_line(capsys) == "generations skipped: FSDP_RECIPES_SUMMARY_GENERATIONS=0"
    assert not (run / "sample_generations.json").exists()


def test_the_launcher_tells_the_summary_its_node(monkeypatch):
    from fsdp_recipes.launch import launcher

    monkeypatch.setenv("FSDP_RECIPES_LAUNCH_ARGS", "--num_machines 2 --machine_rank 1 --main_process_ip n0")
    assert launcher.summary_args("runs/x") == ["runs/x", "--machine-rank", "1"]
    monkeypatch.delenv("FSDP_RECIPES_LAUNCH_ARGS")
    assert launcher.summary_args("runs/x") == ["runs/x", "--machine-rank", "0"]


def test_the_exact_match_goes_into_metrics_json_and_the_console(tmp_path, monkeypatch, capsys):
    """The counts the summary prints are the ones metrics.json's `eval` section keeps, next to the report's own
    fields; every answer goes to sample_generations.json."""
    run = fake_run(tmp_path)
    examples = [{"prompt": f"What is {i} + 1?", "expected": str(i + 1), "base": "no", "trained": str(i + 1)}
                for i in range(100)]
    check = {"n": 100, "base_correct": 0, "trained_correct": 100, "base_model": "base", "trained_model": "merged",
             "examples": examples}
    monkeypatch.setattr(summary, "model_size", lambda _: (1000, 4000))  # small: generate
    monkeypatch.setattr(summary, "learning_check", lambda run_dir, run_args, n, cfg=None: check)
    assert summary.main([str(run)]) == 0
    out = capsys.readouterr().out
    assert "exact match on 100 eval prompts: base model 0/100 -> trained 100/100" in out
    metrics = json.loads((run / "metrics.json").read_text())
    assert metrics["status"] == "completed" and metrics["world_size"] == 16  # the report's fields are kept
    ev = metrics["eval"]
    assert (ev["prompts"], ev["base_correct"], ev["trained_correct"]) == (100, 0, 100)
    assert ev["samples"] == examples[:summary.SHOWN_SAMPLES]
    assert json.loads((run / "sample_generations.json").read_text())["examples"] == examples


def test_preference_margins_are_the_answers_log_probabilities(cache_dir):
    """summary.preference_margins against each sequence scored on its own, unpadded: log p(chosen) - log p(rejected),
    summed over the answer's tokens (those after the rendered prompt), on the tiny model."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from fsdp_recipes.assets.tiny_assets import ensure_assets

    model_dir = str(ensure_assets(quiet=True)["model"])
    tok, model = AutoTokenizer.from_pretrained(model_dir), AutoModelForCausalLM.from_pretrained(model_dir).eval()
    pairs = [([{"role": "user", "content": "What is 2 + 3?"}], "5", "16"),
             ([{"role": "user", "content": "What is 9 + 9?"}], "18", "7")]

    def alone(prompt, answer):
        head = tok.apply_chat_template(prompt, tokenize=False, add_generation_prompt=True)
        full = tok.apply_chat_template(prompt + [{"role": "assistant", "content": answer}], tokenize=False)
        assert full.startswith(head)
        ids = tok(full, add_special_tokens=False, return_tensors="pt")["input_ids"]
        n_head = len(tok(head, add_special_tokens=False)["input_ids"])
        with torch.no_grad():
            logp = torch.log_softmax(model(input_ids=ids).logits[0, :-1].float(), -1)
        return sum(float(logp[t - 1, ids[0, t]]) for t in range(n_head, ids.shape[1]))

    expected = [alone(p, c) - alone(p, r) for p, c, r in pairs]
    assert summary.preference_margins(model_dir, pairs) == pytest.approx(expected, abs=1e-4)


def test_the_summary_ends_with_how_to_serve_the_run(tmp_path, monkeypatch, capsys):
    run = fake_run(tmp_path)
    (run / "adapter_config.json").write_text(json.dumps({"base_model_name_or_path": "org/base", "r": 24}))
    (run / "tokenizer_config.json").write_text("{}")
    monkeypatch.setenv(summary.FORCE_ENV, "0")
    assert summary.main([str(run)]) == 0
    out = capsys.readouterr().out.splitlines()
    serve = out[out.index(next(line for line in out if line.startswith("serve it"))):]
    assert serve == [
        f"serve it    vLLM: vllm serve {run / 'merged'}",
        # rank 24: vLLM accepts --max-lora-rank 1, 8, 16, 32, ... only
        f"            vLLM, base + adapter: vllm serve org/base --enable-lora --max-lora-rank 32 --lora-modules run={run} "
        f"--tokenizer {run}",
        f"            llama.cpp / Ollama: make gguf RUN={run}, then llama-server -m {run}/gguf/run.f16.gguf, or "
        f"ollama create run -f {run}/gguf/Modelfile",
        f"            check they answer like this run: make serve-check RUN={run}"]
    (run / "adapter_config.json").unlink()
    (run / "merged" / "config.json").unlink()  # no model to serve: no block
    assert summary.main([str(run)]) == 0
    assert not any(line.startswith("serve it") for line in capsys.readouterr().out.splitlines())


@pytest.mark.parametrize("config, why", [
    ({"r": 16, "modules_to_save": ["lm_head"]},
     "it trains whole modules (modules_to_save ['lm_head']), which vLLM does not load"),
    ({"r": 1024}, "its LoRA rank 1024 is above vLLM's largest --max-lora-rank (512)"),
], ids=["modules-to-save", "rank"])
def test_the_summary_offers_no_adapter_command_vllm_would_refuse(tmp_path, monkeypatch, capsys, config, why):
    run = fake_run(tmp_path)
    (run / "adapter_config.json").write_text(json.dumps({"base_model_name_or_path": "org/base", **config}))
    monkeypatch.setenv(summary.FORCE_ENV, "0")
    assert summary.main([str(run)]) == 0
    out = capsys.readouterr().out.splitlines()
    serve = out[out.index(next(line for line in out if line.startswith("serve it"))):]
    assert serve[:2] == [f"serve it    vLLM: vllm serve {run / 'merged'}",
                         f"            vLLM, base + adapter: not offered: vLLM refuses this adapter ({why}); serve "
                         "the merged model above"]
    assert not any("--enable-lora" in line for line in serve)


def test_labelled_answers_are_expected_only_where_labelled_desirable():
    """KTO's unpaired rows hold wrong answers too: the summary's exact match must not expect one of those."""
    from datasets import Dataset

    from fsdp_recipes.launch.summary import prompts_of

    q = [{"role": "user", "content": "What is 2 + 3?"}]
    rows = Dataset.from_list([{"prompt": q, "completion": [{"role": "assistant", "content": "5"}], "label": True},
                              {"prompt": q, "completion": [{"role": "assistant", "content": "6"}], "label": False}])
    assert prompts_of(rows) == [(q, "5")]
