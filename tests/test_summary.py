"""The end-of-run summary prints what a terminal shows cleanly, and generates samples only where that is cheap."""

import json
import math

import pytest

from fsdp_recipes.evaluation import scoring
from fsdp_recipes.evaluation.scores import preference
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
    from fsdp_recipes.launch import ending

    monkeypatch.setenv("FSDP_RECIPES_LAUNCH_ARGS", "--num_machines 2 --machine_rank 1 --main_process_ip n0")
    assert ending.summary_args("runs/x") == ["runs/x", "--machine-rank", "1"]
    monkeypatch.delenv("FSDP_RECIPES_LAUNCH_ARGS")
    assert ending.summary_args("runs/x") == ["runs/x", "--machine-rank", "0"]


def fabricated_check(correct: dict[str, list[bool]], loss: dict[str, float], held_out: bool = True) -> dict:
    """What learning_check returns for stages whose answers were right or wrong as `correct` says (the first
    stage is the base model), with these held-out losses: the paired counts and intervals as it computes them."""
    from fsdp_recipes.evaluation import intervals

    names = list(correct)
    n = len(correct[names[0]])
    right = list(correct.values())
    examples = [{"prompt": f"What is {i} + 1?", "expected": str(i + 1), "base": str(i + 1) if right[0][i] else "no",
                 "trained": str(i + 1) if right[-1][i] else "no"} for i in range(n)]
    return {
        "n": n, "rows": n, "held_out": held_out, "split": "the `test` split (100 rows)", "eval_rows_in_train": 0,
        "exact_match": True, "base_correct": sum(right[0]), "trained_correct": sum(right[-1]),
        "base_model": "base", "trained_model": "merged",
        "loss": {"rows": n, "tokens": 3 * n, "rows_cut": 0, "max_tokens": 2048},
        "stages": [{"stage": name, "model": name, **intervals.share(sum(r), n), "loss": loss[name],
                    "perplexity": math.exp(loss[name])} for name, r in correct.items()],
        "changes": [{"from": a, "to": b, **intervals.paired(correct[a], correct[b])} for a, b in zip(names, names[1:])],
        "examples": examples,
    }


def test_the_exact_match_goes_into_metrics_json_and_the_console(tmp_path, monkeypatch, capsys):
    """The counts the summary prints are the ones metrics.json's `eval` section keeps, next to the report's own
    fields; every answer goes to sample_generations.json."""
    run = fake_run(tmp_path)
    check = fabricated_check({"base": [False] * 100, "sft": [True] * 100}, {"base": 2.5, "sft": 0.25})
    monkeypatch.setattr(summary, "model_size", lambda _: (1000, 4000))  # small: generate
    monkeypatch.setattr(summary, "learning_check", lambda run_dir, run_args, n, cfg=None: check)
    assert summary.main([str(run)]) == 0
    out = capsys.readouterr().out
    # Wilson 95% for 0/100 and 100/100: 0-3.70% and 96.30-100% (Newcombe's closed form, z = 1.96: z^2/(n + z^2));
    # exact McNemar for 100 rows right only after: 2 / 2^100
    assert ("exact match on 100 eval prompts: base model 0/100 (0.0-3.7%) -> trained 100/100 (96.3-100.0%): better "
            "(p<0.001; 0 right only before, 100 only after)") in out
    metrics = json.loads((run / "metrics.json").read_text())
    assert metrics["status"] == "completed" and metrics["world_size"] == 16  # the report's fields are kept
    ev = metrics["eval"]
    assert (ev["prompts"], ev["base_correct"], ev["trained_correct"]) == (100, 0, 100)
    assert [s["wilson95"] for s in ev["stages"]] == [[0.0, 0.037], [0.963, 1.0]]
    assert ev["changes"][0]["verdict"] == "better" and ev["changes"][0]["mcnemar_exact_p"] == 2 / 2 ** 100
    assert (ev["held_out_loss"]["base"], ev["held_out_loss"]["trained"]) == (2.5, 0.25)
    assert ev["samples"] == check["examples"][:summary.SHOWN_SAMPLES]
    assert json.loads((run / "sample_generations.json").read_text())["examples"] == check["examples"]


def test_93_to_92_of_the_same_100_reads_no_change():
    """93 -> 92 right of 100, the trained model right on 3 the base model missed and wrong on 4 it got: 7
    discordant rows, 4 against 3, exact McNemar p = 2 x P(X <= 3 | X ~ Bin(7, 1/2)) = 2 x 64/128 = 1. Wilson 95%:
    93/100 86.25-96.57%, 92/100 85.00-95.89% (Newcombe 1998's closed form, by hand)."""
    base = [True] * 89 + [True] * 4 + [False] * 3 + [False] * 4
    trained = [True] * 89 + [False] * 4 + [True] * 3 + [False] * 4
    check = fabricated_check({"base": base, "sft": trained}, {"base": 0.31, "sft": 0.3})
    assert summary.eval_lines(check) == [
        "held-out loss on 100 eval rows (300 answer tokens): base model 0.310 (perplexity 1.36) -> trained 0.300 "
        "(perplexity 1.35)",
        "exact match on 100 eval prompts: base model 93/100 (86.3-96.6%) -> trained 92/100 (85.0-95.9%): no change "
        "(p=1.00; 4 right only before, 3 only after)",
        "            95% Wilson intervals; a change: exact McNemar test on the prompts only one side got right "
        "(p < 0.05)"]


def test_eval_rows_the_training_data_holds_are_no_held_out_loss():
    """Every smoke run's and the tests' recipe's eval rows are among its training rows (tiny-arith draws both from
    100 facts): the summary said "held-out loss on 64 eval rows", then "64 of these 64 ... are not held out"."""
    check = {**fabricated_check({"base": [False] * 4, "sft": [True] * 4}, {"base": 2.0, "sft": 0.5}),
             "eval_rows_in_train": 4}
    lines = summary.eval_lines(check)
    assert lines[0].startswith("loss on 4 eval rows (12 answer tokens): base model 2.000"), lines[0]
    assert summary.rows_note(check) == ["            4 of these 4 eval rows also appear in the training data: their "
                                        "answers are not held out"]


def test_a_chain_of_stages_reads_base_sft_then_the_stage_each_step_judged_on_the_same_prompts():
    """DPO, GRPO, KTO, RLOO after SFT: base -> sft -> <kind>. 10 prompts: the base model right on none, SFT on 7
    (7 right only after: p = 2/2^7 = 0.0156), DPO on 6 of those 7 (1 right only before: p = 1)."""
    check = fabricated_check({"base": [False] * 10, "sft": [True] * 7 + [False] * 3,
                              "dpo": [True] * 6 + [False] * 4}, {"base": 3.0, "sft": 0.5, "dpo": 0.6})
    assert summary.eval_lines(check) == [
        "held-out loss on 10 eval rows (30 answer tokens): base 3.000 (perplexity 20.1) -> sft 0.500 (perplexity "
        "1.65) -> dpo 0.600 (perplexity 1.82)",
        "exact match on 10 eval prompts: base 0/10 (0.0-27.8%) -> sft 7/10 (39.7-89.2%) -> dpo 6/10 (31.3-83.2%)",
        "            on the same prompts: base -> sft better (p=0.016; 0 right only before, 7 only after); sft -> dpo "
        "no change (p=1.00; 1 right only before, 0 only after)",
        "            95% Wilson intervals; a change: exact McNemar test on the prompts only one side got right "
        "(p < 0.05)"]


def test_preference_rates_carry_their_intervals_too(tmp_path):
    """The KTO run's held-out pairs (docs/training.md): the chosen answer preferred by base 57, sft 93, kto 94 of
    100; kto's margin above sft's (the implicit reward) on 37. Wilson 95% by hand: 47.2-66.3%, 86.3-96.6%,
    87.5-97.2%, 28.2-46.8%."""
    check = fabricated_check({"base": [False] * 100, "sft": [True] * 100, "kto": [True] * 100},
                             {"base": 2.7, "sft": 0.05, "kto": 0.05})
    base = [1.0] * 57 + [-1.0] * 43  # mean +0.14
    sft = [1.0] * 93 + [-1.0] * 7  # mean +0.86
    kto = [1.1] * 36 + [0.9] * 57 + [0.5] + [-1.0] * 6  # 94 above 0; above sft's on 36 + 1; mean +0.854
    preference.add_preference(check, [base, sft, kto])
    run = fake_run(tmp_path)
    lines = summary.render(run, json.loads((run / "metrics.json").read_text()), check).splitlines()
    assert next(line for line in lines if line.startswith("preference on")) == (
        "preference on 100 eval pairs, log p(chosen) > log p(rejected): base 57/100 (47.2-66.3%) margin +0.14 -> sft "
        "93/100 (86.3-96.6%) margin +0.86 -> kto 94/100 (87.5-97.2%) margin +0.85; implicit-reward accuracy 37/100 "
        "(28.2-46.8%)")
    assert check["preference"]["reward_wilson95"] == [0.2818, 0.4678]
    assert [s["preference_wilson95"] for s in check["stages"]] == [[0.4722, 0.6627], [0.8625, 0.9657],
                                                                   [0.8752, 0.9722]]


def test_long_answers_are_not_scored_by_exact_match_and_say_why():
    check = fabricated_check({"base": [False] * 4, "sft": [False] * 4}, {"base": 2.0, "sft": 1.0})
    check.update(exact_match=False, base_correct=None, trained_correct=None, changes=[],
                 exact_match_note="3 of the 4 reference answers are over 16 tokens (exact match is for short "
                                  "answers; the loss is the measure)")
    for stage in check["stages"]:
        stage.update(correct=None)
    lines = summary.eval_lines(check)
    assert lines[0].startswith("held-out loss on 4 eval rows (12 answer tokens): base model 2.000")
    assert lines[1:] == ["exact match not scored: 3 of the 4 reference answers are over 16 tokens (exact match is for "
                         "short answers; the loss is the measure)"]
    assert scoring.eval_section(check)["base_correct"] is None
    # a 4-bit run (QLoRA of a user's model on HumanEval, 2026-11-27: the line had lost its 4-bit score): the loss
    check["four_bit"] = {"adapted": None, "adapted_loss": 1.0004, "merged_same_answers": 4, "answers_compared": 4}
    assert summary.eval_lines(check)[-1] == ("4 bits      the base scored in 4 bits, as it trained; the 4-bit base + "
                                             "adapter held-out loss 1.000; the merged model (dequantised base + "
                                             "adapter) gives its answer on 4/4")
    check["four_bit"] = {"adapted": None, "adapted_loss": None, "merged_same_answers": 0, "answers_compared": 0}
    assert summary.eval_lines(check)[-1] == "4 bits      the base scored in 4 bits, as it trained"  # nothing scored


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
        # the `fsdp-recipes` form works wherever the pack is installed (a copied recipe, a wheel); make in a checkout
        f"            llama.cpp / Ollama: fsdp-recipes gguf {run} (make gguf RUN={run}), then llama-server -m "
        f"{run}/gguf/run.f16.gguf, or ollama create run -f {run}/gguf/Modelfile",
        f"            check they answer like this run: fsdp-recipes serve-check {run} (make serve-check RUN={run})"]
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


def test_the_two_eval_losses_say_which_tokens_each_counts(tmp_path, monkeypatch, capsys):
    """`eval 6.188` and `held-out loss ... trained 6.518` for the same rows, unlabelled (2026-11-29): TRL's eval loss
    counts the tokens training counts (a chat row's prompt too, without assistant_only_loss), the summary's the
    reference answers alone."""
    run = fake_run(tmp_path)
    metrics = json.loads((run / "metrics.json").read_text())
    metrics.update(first_train_loss=6.62, final_train_loss=6.166, final_eval_loss=6.1875, steps=40,
                   tokens={"non_padding": 17079})
    (run / "metrics.json").write_text(json.dumps(metrics))
    (run / "run_args.json").write_text(json.dumps({"sft_config": {"assistant_only_loss": False,
                                                                   "completion_only_loss": None}}))
    check = fabricated_check({"base": [False] * 4, "sft": [False] * 4}, {"base": 6.933, "sft": 6.518})
    monkeypatch.setattr(summary, "model_size", lambda _: (1000, 4000))
    monkeypatch.setattr(summary, "learning_check", lambda run_dir, run_args, n, cfg=None: check)
    assert summary.main([str(run)]) == 0
    out = capsys.readouterr().out.splitlines()
    at = out.index("loss        6.620 -> 6.166 (train), eval 6.188")
    assert out[at + 1] == (
        "            eval: TRL's, on the eval split during training, over the tokens the training loss counts: every "
        "token of a chat `messages` row, its prompt included (assistant_only_loss off), or a prompt/completion "
        "row's completion; the held-out loss below: the reference answers' tokens alone, no prompt")
    assert any(line.startswith("held-out loss on 4 eval rows (12 answer tokens)") for line in out)
    run_args = {"sft_config": {"assistant_only_loss": True}}
    assert summary.eval_loss_counts(metrics, run_args).endswith("counts: the assistant tokens alone "
                                                                "(assistant_only_loss)")
    assert summary.eval_loss_counts({"trainer": "dpo"}, {}) == "TRL's DPO loss on the eval split during training"


def test_the_summary_offers_no_gguf_command_llama_cpps_converter_would_refuse(tmp_path, monkeypatch, capsys):
    """Every smoke run's summary offered `make gguf`, which failed: the tiny tokenizer's pre-tokenizer is none
    llama.cpp knows (2026-11-29). Where the installed converter says so, the block says it instead."""
    from fsdp_recipes.serving import llamacpp_converter

    run = fake_run(tmp_path)
    why = "llama.cpp's converter (llama-cpp-python 0.3.36) does not know the byte-level BPE pre-tokenizer of X"
    monkeypatch.setattr(llamacpp_converter, "unknown_pre_tokenizer", lambda folder: why)
    monkeypatch.setenv(summary.FORCE_ENV, "0")
    assert summary.main([str(run)]) == 0
    out = capsys.readouterr().out.splitlines()
    serve = out[out.index(next(line for line in out if line.startswith("serve it"))):]
    assert serve[1:] == [f"            llama.cpp / Ollama: not offered: {why}",
                         f"            check they answer like this run: fsdp-recipes serve-check {run} --engine vllm "
                         f"(make serve-check RUN={run} ENGINE=vllm)"]


def test_without_the_converter_the_gguf_line_says_it_may_be_refused(tmp_path, monkeypatch, capsys):
    """No converter installed: whether llama.cpp knows a byte-level BPE tokenizer cannot be told, and the line says
    how to find out rather than promise a command that works."""
    run = fake_run(tmp_path)
    (run / "merged" / "tokenizer.json").write_text(json.dumps({"model": {"type": "BPE", "byte_fallback": False}}))
    monkeypatch.setenv("FSDP_RECIPES_LLAMACPP_CONVERTER", str(tmp_path / "none"))
    monkeypatch.setenv(summary.FORCE_ENV, "0")
    assert summary.main([str(run)]) == 0
    line = next(line for line in capsys.readouterr().out.splitlines() if "llama.cpp / Ollama" in line)
    assert line.startswith(f"            llama.cpp / Ollama: fsdp-recipes gguf {run} (make gguf RUN={run}) (llama.cpp's "
                           "converter refuses a byte-level BPE tokenizer it does not know; with the converter "
                           f"installed, fsdp-recipes gguf --install-converter, `fsdp-recipes gguf {run} --check-only` "
                           "tells in seconds), then llama-server")
