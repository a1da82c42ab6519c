"""A battery of user mistakes: each is one `error:` line with the fix, no traceback, the right exit code, and an
earlier run's files in the same output_dir unchanged.

Most mistakes must be caught before any process starts, so they run through the launcher's own `main` in this
process (with `Ranks` replaced by a failure: starting a rank is a bug here). A few real launches cover what only the
ranks can find, through the rank error channel (train/failure_record.py, launch/explain_failure.py), a NaN loss
mid-run, and a launcher killed with SIGKILL.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
import types
from pathlib import Path

import pytest
import yaml

import fork_server
from conftest import REPO, launch, launcher_checks, pack_env, tagged_processes
from test_bad_input import fake_checkpoint

PROBES = REPO / "tests" / "probes"


@pytest.fixture
def recipe(tmp_path, cache_dir):
    dst = tmp_path / "my-recipe"
    shutil.copytree(REPO / "recipes" / "tiny-cpu-lora", dst)
    return dst


@pytest.fixture
def earlier_run(tmp_path, cache_dir):
    """An output_dir as a finished run leaves it: a complete checkpoint of this recipe, reports, a rank log."""
    out = tmp_path / "earlier"
    fake_checkpoint(out, cache_dir)
    (out / "metrics.json").write_text(json.dumps({"status": "completed", "steps": 10}))
    (out / "run_args.json").write_text(json.dumps({"recipe": "tiny-cpu-lora"}))
    (out / "logs").mkdir()
    (out / "logs" / "rank0.log").write_text("the earlier run's output\n")
    return out


def snapshot(folder):
    """Every file's bytes, but the output_dir lock's, which each launcher writes its own name into."""
    from fsdp_recipes.checkpoint.output_lock import LOCK_FILE

    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*"))
            if p.is_file() and p.name != LOCK_FILE}


def assert_unchanged(before: dict, folder):
    """Every earlier file is still there with the same bytes; a log may only have grown (each launch appends)."""
    after = snapshot(folder)
    for name, data in before.items():
        assert name in after, f"{name} was removed"
        if name.startswith("logs/"):
            assert after[name].startswith(data), f"{name} was rewritten"
        else:
            assert after[name] == data, f"{name} changed"


def edit(path, **changes):
    data = yaml.safe_load(path.read_text())
    data.update(changes)
    path.write_text(yaml.safe_dump(data))


def write_jsonl(path, rows):
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return path


def qa(q="What is 1 + 1?", a="2", role="assistant"):
    return {"prompt": [{"role": "user", "content": q}], "completion": [{"role": role, "content": a}]}


# Each case: how to make the mistake (a function of the recipe folder and tmp_path returning extra launcher
# arguments), and a fragment of the expected error line. The output_dir is the earlier run's, with
# --overwrite_output_dir true, unless the case sets it.
def yaml_case(**changes):
    def make(recipe, tmp):
        edit(recipe / "sft.yaml", **changes)
        return []
    return make


def cli_case(*args):
    return lambda recipe, tmp: list(args)


def data_case(rows, name="train.jsonl"):
    def make(recipe, tmp):
        return ["--dataset_name", str(write_jsonl(tmp / name, rows)), "--eval_strategy", "no"]
    return make


def env_case(**variables):
    """Environment variables for the launcher (the test sets them with its monkeypatch, which undoes them)."""
    def make(recipe, tmp):
        return []
    make.env = variables
    return make


def acc_case(top=None, **fsdp):
    """The recipe's accelerate.yaml with these fsdp_config keys (and `top`'s top-level keys) set."""
    def make(recipe, tmp):
        acc = yaml.safe_load((recipe / "accelerate.yaml").read_text())
        acc["fsdp_config"].update(fsdp)
        acc.update(top or {})
        (recipe / "accelerate.yaml").write_text(yaml.safe_dump(acc))
        return []
    return make


def output_dir_is_a_file(recipe, tmp):
    (tmp / "out.txt").write_text("not a folder")
    return ["--output_dir", str(tmp / "out.txt")]


def resume_inside_earlier_run(recipe, tmp):
    return ["--resume_from_checkpoint", str(tmp / "earlier" / "checkpoint-10")]  # earlier_run's checkpoint


def resume_another_adapter(recipe, tmp):
    return ["--resume_from_checkpoint", str(fake_checkpoint(tmp / "other", Path(os.environ["FSDP_RECIPES_CACHE"]),
                                                            peft__r=8))]


def malformed_yaml(recipe, tmp):
    sft = recipe / "sft.yaml"
    sft.write_text(sft.read_text() + "\nlearning_rate: [1e-3\n")
    return []


def empty_file(recipe, tmp):
    (tmp / "empty.jsonl").write_text("")
    return ["--dataset_name", str(tmp / "empty.jsonl"), "--eval_strategy", "no"]


def empty_folder(recipe, tmp):
    """A folder without a data file: datasets' EmptyDatasetError was told to check that "the file" is valid."""
    (tmp / "data").mkdir()
    return ["--dataset_name", str(tmp / "data"), "--eval_strategy", "no"]


def no_chat_template(recipe, tmp, cache=None):
    model = tmp / "model-without-template"
    shutil.copytree(os.environ["FSDP_RECIPES_CACHE"] + "/tiny-mistral", model)
    (model / "chat_template.jinja").unlink()
    return ["--model_name_or_path", str(model), "--lora_modules_to_save", "lm_head"]


def model_without_weights(recipe, tmp):
    """A model folder copied without its weights: rank 0's from_pretrained found it, some 20 s after the start."""
    model = tmp / "model-without-weights"
    shutil.copytree(os.environ["FSDP_RECIPES_CACHE"] + "/tiny-mistral", model)
    (model / "model.safetensors").unlink()
    return ["--model_name_or_path", str(model)]


def gguf_file(recipe, tmp):
    """A GGUF file (llama.cpp's, what `make gguf` writes) as the model: it was called a folder without config.json,
    with the tiny default's builder as the fix."""
    model = tmp / "SmolLM2-135M-Instruct.Q4_1.gguf"
    model.write_bytes(b"GGUF" + bytes(60))
    return ["--model_name_or_path", str(model)]


def tokenizer_only(recipe, tmp):
    """A folder holding the tiny tokenizer alone (no config.json, no weights)."""
    model = tmp / "tokenizer-only"
    model.mkdir()
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(os.environ["FSDP_RECIPES_CACHE"] + f"/tiny-mistral/{name}", model / name)
    return ["--model_name_or_path", str(model)]


CASES = {
    # recipe YAML: ranges the libraries accept silently or only check inside the ranks
    "yaml-negative-lr": (yaml_case(learning_rate=-1e-3), "learning_rate is -0.001; it must be positive"),
    "yaml-zero-batch": (yaml_case(per_device_train_batch_size=0), "per_device_train_batch_size is 0"),
    "yaml-zero-accumulation": (yaml_case(gradient_accumulation_steps=0), "gradient_accumulation_steps is 0"),
    "yaml-zero-max-length": (yaml_case(max_length=0), "max_length is 0"),
    "yaml-zero-steps": (yaml_case(max_steps=0), "max_steps is 0: nothing would be trained"),
    "yaml-zero-epochs": (yaml_case(max_steps=-1, num_train_epochs=0), "num_train_epochs is 0"),
    "yaml-lora-rank-zero": (yaml_case(lora_r=0), "lora_r is 0"),
    "yaml-lora-alpha-negative": (yaml_case(lora_alpha=-8), "lora_alpha is -8"),
    "yaml-unknown-key": (yaml_case(lerning_rate=1e-3), "did you mean `learning_rate`?"),
    "yaml-malformed": (malformed_yaml, "malformed YAML in"),
    "yaml-bad-scheduler": (yaml_case(lr_scheduler_type="cosine_with_typo"), "invalid configuration"),
    # command-line overrides: checked exactly as YAML values
    "cli-zero-eval-batch": (cli_case("--per_device_eval_batch_size", "0"), "per_device_eval_batch_size is 0"),
    "cli-negative-lr": (cli_case("--learning_rate", "-1"), "learning_rate is -1.0; it must be positive"),
    "cli-lora-dropout": (cli_case("--lora_dropout", "1.5"), "lora_dropout is 1.5"),
    "cli-lora-target-list": (cli_case("--lora_target_modules", "q_proj", "nope"), "['nope'] match no module"),
    "cli-lora-target-yaml-string": (cli_case("--lora_target_modules", "[q_proj, v_proj]"),
                                    "is one string, which PEFT reads as a regular expression"),
    "cli-unknown-flag": (cli_case("--max_stepz", "3"), "unknown command-line flag `--max_stepz`"),
    # argparse's own errors, without its 160-line usage
    "cli-not-an-int": (cli_case("--max_steps", "abc"), "--max_steps: invalid int value: 'abc'"),
    "cli-bad-choice": (cli_case("--dtype", "float13"), "--dtype: invalid choice: 'float13'"),
    "cli-bad-scheduler": (cli_case("--lr_scheduler_type", "bogus"), "--lr_scheduler_type: invalid choice: 'bogus'"),
    # TrainingArguments replaces 0 with logging_steps silently
    "cli-eval-steps-zero": (cli_case("--eval_strategy", "steps", "--eval_steps", "0"),
                            "eval_steps is 0; it must be positive"),
    "cli-output-dir-is-a-file": (output_dir_is_a_file, "is a file, not a directory"),
    # a resume that --overwrite_output_dir true would refuse only once it had emptied the earlier run's folder
    "cli-fp16-on-cpu": (cli_case("--fp16", "true"), "fp16 on a CPU computes in float16 with no loss scaler"),
    "cli-resume-not-found": (cli_case("--resume_from_checkpoint", "/nonexistent/run/checkpoint-10"), "does not exist"),
    "cli-resume-inside-the-emptied-output-dir": (resume_inside_earlier_run,
                                                 "which --overwrite_output_dir true empties"),
    "cli-resume-another-adapter": (resume_another_adapter, "its LoRA r is 8 and this run's is 32"),
    # data
    "data-malformed-json-line": (data_case([qa(), qa(), '{"prompt": [{"role": "user", "content": "3 + 3?"}'],
                                           name="bad.jsonl"), "bad.jsonl:3: Expecting ',' delimiter (column 50)"),
    "data-empty-file": (empty_file, "empty"),
    "data-empty-folder": (empty_folder, "the dataset folder"),
    "data-unknown-role": (data_case([qa(), qa(role="bot")]), "train.jsonl:2: role 'bot' is not one of"),
    "data-non-string-content": (data_case([qa(a=42), qa(a=7)]), "train.jsonl:1: an assistant turn's content is int"),
    "data-no-assistant-turn": (data_case([{"messages": [{"role": "user", "content": "hi"}]}] * 3),
                               "has an assistant turn"),
    "data-all-truncated": (lambda r, t: [*data_case([qa(q="long " * 100)] * 4)(r, t), "--max_length", "16"],
                           "truncation leaves no completion"),
    "data-wrong-columns": (data_case([{"question": "q", "answer": "a"}] * 2), "has columns ['answer', 'question']"),
    # model
    "model-missing": (cli_case("--model_name_or_path", "/nonexistent/model"), "model not found"),
    "model-gguf-file": (gguf_file, ".gguf is a GGUF file (llama.cpp's format), not a model folder"),
    "model-tokenizer-only": (tokenizer_only, "tokenizer-only has no config.json: it holds a tokenizer but no model"),
    "model-no-chat-template": (no_chat_template, "has no chat template"),
    "model-without-weights": (model_without_weights, "holds config.json but no weights"),
    "model-flash-attn-missing": (cli_case("--attn_implementation", "flash_attention_2"), "needs the flash-attn"),
    # accelerate YAML
    "accelerate-wrong-wrap-class": (acc_case(fsdp_transformer_layer_cls_to_wrap="LlamaDecoderLayer"),
                                    "MistralForCausalLM does not have"),
    "accelerate-fsdp1-key-under-fsdp2": (acc_case(fsdp_sharding_strategy="FULL_SHARD"), "only apply to FSDP1"),
    "accelerate-unknown-key": (acc_case(fsdp_offload_parms=True), "unknown fsdp_config key `fsdp_offload_parms`"),
    # bad values (config/accelerate_values.py): they failed in the ranks, some cryptically
    "accelerate-mixed-precision-value": (acc_case({"mixed_precision": "bf17"}),
                                         "accelerate.yaml: mixed_precision 'bf17' is not one of no, fp16, bf16, fp8"),
    "accelerate-fsdp-version-3": (acc_case(fsdp_version=3), "fsdp_config.fsdp_version 3 is not one of 1, 2"),
    "accelerate-reshard-not-yes-no": (acc_case(fsdp_reshard_after_forward="maybe"),
                                      "fsdp_reshard_after_forward 'maybe' is not one of true, false"),
    "accelerate-local-state-dict-fsdp2": (acc_case(fsdp_state_dict_type="LOCAL_STATE_DICT"),
                                          "'LOCAL_STATE_DICT' is not one of FULL_STATE_DICT, SHARDED_STATE_DICT"),
    "accelerate-wrap-policy-misspelled": (acc_case(fsdp_auto_wrap_policy="TRANSFORMERS_BASED_WRAP"),
                                          "'TRANSFORMERS_BASED_WRAP' is not one of TRANSFORMER_BASED_WRAP, "),
    "accelerate-num-processes-word": (acc_case({"num_processes": "two"}),
                                      "accelerate.yaml: num_processes 'two' is not a whole number"),
    # environment
    "env-unset-variable-in-path": (cli_case("--dataset_name", "$NO_SUCH_VAR_FOR_TEST/data"),
                                   "$NO_SUCH_VAR_FOR_TEST, which is not set here"),
    "env-summary-prompts-not-a-number": (env_case(FSDP_RECIPES_SUMMARY_PROMPTS="all"),
                                         "FSDP_RECIPES_SUMMARY_PROMPTS='all' is not a positive whole number"),
    "env-summary-generations-unknown": (env_case(FSDP_RECIPES_SUMMARY_GENERATIONS="true"),
                                        "FSDP_RECIPES_SUMMARY_GENERATIONS='true' is not one of 0 (never), 1"),
}


@pytest.mark.parametrize("name", list(CASES))
def test_mistake_is_one_line_before_any_rank(name, recipe, earlier_run, tmp_path, monkeypatch, capsys):
    make, fragment = CASES[name]
    before = snapshot(earlier_run)
    args = make(recipe, tmp_path)
    for key, value in getattr(make, "env", {}).items():
        monkeypatch.setenv(key, value)
    if "--output_dir" not in args:  # a command that would replace the earlier run once its checks passed: the
        # mistake must stop it first (a finished run is decided before the model and data checks: launch/output_dir.py)
        args += ["--output_dir", str(earlier_run), "--overwrite_output_dir", "true"]
    res = launcher_checks([str(recipe), *args], monkeypatch, capsys)
    code, out, err = res.returncode, res.stdout, res.stderr
    lines = [line for line in err.splitlines() if line.strip()]
    assert code == 2, out + err
    assert "Traceback" not in out + err, out + err
    assert len(lines) == 1 and lines[0].startswith("error: "), err
    assert fragment in lines[0], lines[0]
    assert "Fix:" in lines[0], lines[0]
    assert_unchanged(before, earlier_run)


def test_settings_that_never_fire_are_warnings(cache_dir):
    """A short trial run of a recipe (--max_steps 4) is valid: its never-firing save/eval/logging steps and its too
    long warmup are warned about, not refused."""
    from fsdp_recipes.config.run_config import parse_args
    from fsdp_recipes.config.value_checks import schedule_warnings

    cfg = parse_args(["--config", str(REPO / "recipes/tiny-cpu-lora/sft.yaml"), "--max_steps", "4", "--save_strategy",
                      "steps", "--save_steps", "1000"])
    assert schedule_warnings(cfg.training) == [
        "save_steps is 1000 but the run has only max_steps 4: the one checkpoint is the last step's (a preemption "
        "before step 4 leaves none to resume from)",
        "eval_steps is 100 but the run has only max_steps 4: the one evaluation is the last step's, at step 4",
        "logging_steps is 10 but the run has only max_steps 4, so it never fires",
        "warmup_steps is 10 and the run has 4 steps: the learning rate never leaves warmup"]
    cfg = parse_args(["--config", str(REPO / "recipes/tiny-cpu-lora/sft.yaml")])
    assert schedule_warnings(cfg.training) == []


def test_transformers_saves_and_evaluates_at_the_last_step_but_does_not_log_there():
    """What the warnings above say of save_steps, eval_steps and logging_steps past max_steps, held against
    transformers' own DefaultFlowCallback (the warning said "never fires: no checkpoint will be written", and the run
    then evaluated and saved at its last step)."""
    from transformers import TrainerControl, TrainerState, TrainingArguments
    from transformers.trainer_callback import DefaultFlowCallback

    args = TrainingArguments(output_dir="unused", eval_strategy="steps", eval_steps=100, save_strategy="steps",
                             save_steps=1000, logging_strategy="steps", logging_steps=10, max_steps=4, use_cpu=True)
    state = TrainerState(global_step=4, max_steps=4, eval_steps=100, save_steps=1000, logging_steps=10)
    control = DefaultFlowCallback().on_step_end(args, state, TrainerControl())
    assert control.should_evaluate and control.should_save and not control.should_log


def test_lora_flags_on_a_full_fine_tuning_run_are_one_warning(monkeypatch, capsys, cache_dir):
    """--use_peft false with LoRA flags: TRL ignores them silently; the launcher says so, once, and the run goes on."""
    from conftest import RanksWouldStart, launcher_until_ranks

    with pytest.raises(RanksWouldStart):
        launcher_until_ranks(["tiny-cpu-lora", "--use_peft", "false", "--lora_r", "64", "--lora_dropout=0.1"],
                             monkeypatch, capsys)
    out = capsys.readouterr().out
    assert out.count("warning: --lora_dropout, --lora_r change nothing: this run fine-tunes every weight (use_peft "
                     "false). Fix: --use_peft true to train a LoRA adapter, or leave them out") == 1, out


def test_a_max_length_past_the_models_context_is_one_warning_in_the_launcher_too(monkeypatch, capsys, cache_dir):
    """make plan warned of it and the launcher trained on without a word (speed/yarn.beyond_context says it in both)."""
    import json

    from conftest import RanksWouldStart, launcher_until_ranks

    limit = json.loads((cache_dir / "tiny-mistral" / "config.json").read_text())["max_position_embeddings"]
    with pytest.raises(RanksWouldStart):
        launcher_until_ranks(["tiny-cpu-lora", "--max_length", str(2 * limit)], monkeypatch, capsys)
    out = capsys.readouterr().out
    assert out.count(f"warning: max_length {2 * limit:,} is beyond MistralForCausalLM's context of {limit:,} tokens "
                     f"(max_position_embeddings)") == 1, out
    with pytest.raises(RanksWouldStart):
        launcher_until_ranks(["tiny-cpu-lora"], monkeypatch, capsys)
    assert "is beyond" not in capsys.readouterr().out


def test_epochs_under_the_recipes_max_steps_are_one_warning(monkeypatch, capsys, cache_dir):
    """--num_train_epochs 0.5 under the recipe YAML's max_steps: the Trainer trains max_steps and ignored the epochs
    without a word; the launcher says so, once, naming --max_steps -1. With it, or with --max_steps too, no hidden
    surprise: the first is silent, the second names the command line's max_steps."""
    from conftest import RanksWouldStart, launcher_until_ranks
    from fsdp_recipes.config.value_checks import epochs_ignored

    with pytest.raises(RanksWouldStart):
        launcher_until_ranks(["tiny-cpu-lora", "--num_train_epochs", "0.5"], monkeypatch, capsys)
    out = capsys.readouterr().out
    assert out.count("warning: --num_train_epochs 0.5 changes nothing: max_steps 300 (in the recipe YAML) decides "
                     "the run's length, so it trains 300 steps. Fix: --max_steps -1 to train by epochs") == 1, out
    by_epochs = types.SimpleNamespace(max_steps=-1)
    assert epochs_ignored(["--num_train_epochs", "0.5", "--max_steps", "-1"], by_epochs) == []
    assert epochs_ignored(["--max_steps", "4"], types.SimpleNamespace(max_steps=4)) == []
    assert "max_steps 4 (on the command line)" in epochs_ignored(["--num_train_epochs=2", "--max_steps", "4"],
                                                                 types.SimpleNamespace(max_steps=4))[0]


def test_the_battery_covers_every_class_of_mistake():
    classes = {name.split("-")[0] for name in CASES}
    assert classes == {"yaml", "cli", "data", "model", "accelerate", "env"}
    assert len(CASES) >= 25


def test_truncation_is_one_counted_warning(recipe, tmp_path, cache_dir):
    """Answers that max_length cuts are one warning line with the rows counted and the fix (data/lengths.py,
    data/length_report.py); the launcher prints it (tests/test_data_lengths.py)."""
    import datasets
    from transformers import AutoTokenizer

    from fsdp_recipes.data import length_report, lengths

    # the tiny tokenizer splits digits: "What is 1 + 1?" is a 13-token chat prompt, a 60-digit question a 65-token
    # one, an answer of n digits n + 2 tokens (a space, the digits, </s>)
    ds = datasets.Dataset.from_list([qa(q="1" * 60), qa(), qa(), qa(a="9" * 100)])
    tok = AutoTokenizer.from_pretrained(cache_dir / "tiny-mistral")
    t = lengths.Truncation(64)
    assert length_report.cut_warning([lengths.measure(ds, tok, "train", t)], t) == (
        "max_length 64 cuts the answers of 2 of the 4 `train` rows (50%); 1 of them loses the whole answer (the "
        "prompt alone fills max_length). Fix: max_length 115 keeps 99% of rows whole (--max_length 115, or "
        "max_length: 115 in the recipe)")
    assert length_report.cut_warning([lengths.measure(ds.select([1, 2]), tok, "train", t)], t) is None


# ------------------------------------------------------------------ real launches: what only the ranks find

def launch_args(out, *extra):
    return ["tiny-cpu-lora", "--eval_strategy", "no", "--save_merged_model", "false", "--logging_steps", "1",
            "--output_dir", str(out), *extra]


def one_error_line(res):
    """The ranks' own stderr (progress bars, warnings) is relayed; of it all, one line is an error, the last."""
    lines = [line for line in res.stderr.splitlines() if line.strip()]
    errors = [line for line in lines if line.startswith("error:")]
    assert len(errors) == 1 and lines[-1] == errors[0], res.stderr[-3000:]
    assert "Traceback" not in res.stdout + res.stderr, (res.stdout + res.stderr)[-3000:]
    return errors[0]


@pytest.mark.slow
def test_rank_failures_are_one_line_and_lose_nothing(tmp_path, cache_dir):
    """One output_dir, two launches. 1: the loss turns NaN at step 3 (tests/probes): training stops there with exit
    1, the report says failed, checkpoint-2 stays the one to resume from. 2: the command that resumes it carries a
    mistake only a rank finds (a hub dataset, offline): exit 2, one line, and the first run's files unchanged."""
    out = tmp_path / "run"
    probe = dict(PYTHONPATH=f"{PROBES}:{os.environ.get('PYTHONPATH', '')}", NAN_LOSS_AT_STEP="3")
    from conftest import run

    res = run([sys.executable, "-m", "fsdp_recipes.launch.launcher",
               *launch_args(out, "--max_steps", "6", "--save_strategy", "steps", "--save_steps", "2",
                           "--warmup_steps", "0")], cache_dir,
              **probe)
    line = one_error_line(res)
    assert res.returncode == 1, line
    assert "the training loss was nan at step 3" in line and f"the last good checkpoint is {out / 'checkpoint-2'}" \
        in line, line
    assert "learning rate" in line and f"Full traceback: {out / 'logs'}/rank" in line, line
    metrics = json.loads((out / "metrics.json").read_text())
    assert metrics["status"] == "failed" and metrics["error"] == line[len("error: "):], metrics
    assert metrics["failed_phase"] == "training" and metrics["failed_step"] == 3
    from fsdp_recipes.checkpoint import markers as checkpoints

    assert checkpoints.latest_complete(out) == out / "checkpoint-2"
    for rank in (0, 1):  # every rank's full output is kept
        log = (out / "logs" / f"rank{rank}.log").read_text()
        assert "==== launch at" in log
    failed_rank = int(line.split("Full traceback: ")[1].rsplit("rank", 1)[1].split(".")[0])
    assert "NonFiniteLoss" in (out / "logs" / f"rank{failed_rank}.log").read_text()
    assert "ChildFailedError" in (out / "logs" / "launch.log").read_text()  # torchrun's page: in the log only

    before = snapshot(out)
    res = run([sys.executable, "-m", "fsdp_recipes.launch.launcher",
               # another dataset on resume is refused by the launcher unless asked for (resume_settings.py): asked
               *launch_args(out, "--max_steps", "6", "--dataset_name", "no-such-org/no-such-dataset",
                            "--override_resumed_settings", "true")], cache_dir,
              HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1")
    line = one_error_line(res)
    assert res.returncode == 2, line
    assert "before the first optimizer step" in line and "no-such-dataset" in line, line
    assert "Traceback (most recent call last)" in (out / "logs" / line.rsplit("/", 1)[1]).read_text()
    assert_unchanged(before, out)


@pytest.mark.slow
def test_ranks_do_not_outlive_a_killed_launcher(tmp_path, cache_dir):
    out = tmp_path / "run"
    proc = subprocess.Popen([sys.executable, "-m", "fsdp_recipes.launch.launcher",
                             *launch_args(out, "--max_steps", "100000")], cwd=REPO,
                            env=pack_env(cache_dir, **fork_server.FRESH),  # the ranks' die_with_parent, not a fork's
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.time() + 300
    while not (out / "run_args.json").exists():  # training has started
        assert proc.poll() is None and time.time() < deadline
        time.sleep(0.2)
    ours = [p for p in tagged_processes() if p.pid != proc.pid]
    assert len(ours) >= 3, ours  # accelerate launch (torchrun) and 2 ranks
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    t = time.time()
    while (left := [p for p in ours if p.is_running() and p.status() != "zombie"]) and time.time() - t < 20:
        time.sleep(0.2)
    assert not left, [" ".join(p.cmdline())[:120] for p in left]
    print(f"all processes gone {time.time() - t:.1f} s after the launcher's SIGKILL")


@pytest.mark.parametrize("phase, step, code", [("setup", None, 2), ("training", 7, 1)])
def test_cuda_out_of_memory_is_one_line_with_the_budget_and_the_knobs(tmp_path, monkeypatch, phase, step, code):
    """The out-of-memory line, which no CPU run can trigger for real: torch's own OutOfMemoryError with a CUDA
    allocator message, written to the error file where torchrun would put it (train/failure_record.py), read back and
    described by the launcher's code (launch/explain_failure.py)."""
    import torch

    from fsdp_recipes.launch import explain_failure
    from fsdp_recipes.train import failure_record

    error_file = tmp_path / "torchrun" / "run_0" / "attempt_0" / "1" / "error.json"
    error_file.parent.mkdir(parents=True)
    monkeypatch.setenv(failure_record.ERROR_FILE_ENV, str(error_file))
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setitem(failure_record.STATE, "phase", phase)
    monkeypatch.setitem(failure_record.STATE, "step", step)
    cuda_says = ("CUDA out of memory. Tried to allocate 2.00 GiB. GPU 0 has a total capacity of 79.19 GiB of which "
                 "1.02 GiB is free.\nOf the allocated memory 75.10 GiB is allocated by PyTorch")
    try:
        raise torch.OutOfMemoryError(cuda_says)
    except torch.OutOfMemoryError as err:
        failure_record.record(err)
    records = explain_failure.read_records(tmp_path / "torchrun")
    line, exit_code = explain_failure.describe(records, 1, tmp_path / "logs", "mistral-7b-full", None)
    where = "while loading the model and setting up" if phase == "setup" else "during training (at step 7)"
    assert line == (f"rank 1 ran out of device memory {where}: CUDA out of memory. Tried to allocate 2.00 GiB. GPU 0 "
                    "has a total capacity of 79.19 GiB of which 1.02 GiB is free. Fix: check the budget with "
                    "`make plan RECIPE=mistral-7b-full`, then lower per_device_train_batch_size or max_length (raise "
                    "gradient_accumulation_steps to keep the batch), turn on activation_checkpointing, use LoRA or "
                    f"more GPUs. Full traceback: {tmp_path / 'logs'}/rank1.log")
    assert exit_code == code and "\n" not in line


# The launcher's main in a fresh process, then which of the heavy libraries it had imported by the time it answered.
ANSWERED_BEFORE_IMPORTS = """
import sys
from fsdp_recipes.launch import launcher
try:
    rc = launcher.main(sys.argv[1:])  # a UserError's one line, then SystemExit
finally:
    print("heavy imports:", sorted(m for m in ("torch", "transformers", "trl", "datasets") if m in sys.modules))
sys.exit(rc)
"""


@pytest.mark.parametrize("case", ["data", "lock"])
def test_data_and_lock_mistakes_are_answered_before_the_heavy_imports(case, tmp_path, cache_dir):
    """Issue 42: a mistyped local dataset path and an output_dir another run holds are one line before any rank
    starts and before the launcher imports torch, transformers, TRL or datasets (8-10 s on a 2-core VM): seconds."""
    from fsdp_recipes.checkpoint.output_lock import OutputLock

    out = tmp_path / "run"
    args = ["tiny-cpu-lora", "--output_dir", str(out), "--max_steps", "2"]
    held = None
    if case == "data":
        args += ["--dataset_name", "./no-such-data.jsonl"]
        fragment = "dataset not found: no-such-data.jsonl"
    else:
        held = OutputLock(out, "launch tiny-cpu-lora (the run already there)").acquire()
        fragment = f"{out} is in use by another run"
    try:
        res = subprocess.run([sys.executable, "-c", ANSWERED_BEFORE_IMPORTS, *args], cwd=REPO,
                             env=pack_env(cache_dir), capture_output=True, text=True, timeout=120)
    finally:
        if held is not None:
            held.release()
    errors = [line for line in res.stderr.splitlines() if line.startswith("error:")]
    assert res.returncode == 2 and len(errors) == 1 and fragment in errors[0], res.stdout[-2000:] + res.stderr[-2000:]
    assert "heavy imports: []" in res.stdout and "starting 2 process(es)" not in res.stdout


def test_data_the_checks_build_is_left_to_them(tmp_path, cache_dir):
    """DPO's demo writes its pairs where dataset_name says, from the SFT model's answers, during the checks: a folder
    that does not exist yet is no mistake before them (found by test_default_recipe's SFT -> DPO chain); the same
    folder for a recipe that builds nothing is."""
    from fsdp_recipes.config import recipes
    from fsdp_recipes.data import files
    from fsdp_recipes.errors import UserError

    def check(overrides):  # as the launcher asks before the ranks start
        early = recipes.load("smollm2-135m-dpo", overrides).early
        files.check_named_found(early.dataset_name, built_by_checks=early.addition_preferences)

    pairs = ["--dataset_name", str(tmp_path / "pairs")]
    check(pairs)  # builds them: no error
    with pytest.raises(UserError, match="dataset not found"):
        check([*pairs, "--addition_preferences", "false"])


def test_a_mistyped_key_or_value_is_answered_before_the_heavy_imports_once_a_launch_parsed_the_kind(tmp_path,
                                                                                                    monkeypatch):
    """Issue 42: YAML mistakes within seconds. The first parse in an empty cache (the launcher's checks, in process
    here) names the typo itself and remembers the kind's fields; the next launch names a mistyped YAML key or flag, a
    word where a number goes and a value out of range before it imports torch, transformers, TRL or datasets. Fields
    remembered under another fingerprint (another TRL, an edited kind module) are not used."""
    from fsdp_recipes.config import run_config, yaml_keys
    from fsdp_recipes.errors import UserError

    cache = tmp_path / "cache"
    monkeypatch.setenv("FSDP_RECIPES_CACHE", str(cache))
    recipe = tmp_path / "recipe"
    shutil.copytree(REPO / "recipes" / "tiny-cpu-lora", recipe)
    text = (recipe / "sft.yaml").read_text()
    assert "\nlearning_rate:" in text
    (recipe / "sft.yaml").write_text(text.replace("\nlearning_rate:", "\nlearnin_rate:"))
    with pytest.raises(UserError, match="unknown config key `learnin_rate`.*did you mean `learning_rate`"):
        run_config.parse_args(["--config", str(recipe / "sft.yaml")], world_size=2)
    assert yaml_keys.remembered_values("sft", {"learnin_rate": 1}, "x", [], tmp_path / "elsewhere") is None

    env = {**os.environ, "FSDP_RECIPES_CACHE": str(cache)}
    cases = [(text.replace("\nlearning_rate:", "\nlearnin_rate:"), [], "unknown config key `learnin_rate`"),
             (text, ["--lerning_rate", "1"], "`--lerning_rate`"),
             (text, ["--learning_rate", "abc"], "--learning_rate: invalid float value: 'abc'"),
             (text.replace("\nlearning_rate:", "\nlearning_rate: abc #"), [], "--learning_rate: invalid float value"),
             (text, ["--learning_rate", "-1"], "learning_rate is -1.0; it must be positive"),
             (text, ["--per_device_train_batch_size=0"], "per_device_train_batch_size is 0; it must be at least 1"),
             (text, ["--max_steps", "0"], "max_steps is 0: nothing would be trained"),
             (text, ["--bf16", "maybe"], "--bf16: invalid bool value: 'maybe'")]
    for yaml_text, args, fragment in cases:
        (recipe / "sft.yaml").write_text(yaml_text)
        res = subprocess.run([sys.executable, "-c", ANSWERED_BEFORE_IMPORTS, str(recipe), "--output_dir",
                              str(tmp_path / "run"), *args], cwd=REPO, env=env, capture_output=True, text=True,
                             timeout=120)
        errors = [line for line in res.stderr.splitlines() if line.startswith("error:")]
        assert res.returncode == 2 and len(errors) == 1 and fragment in errors[0], res.stdout + res.stderr
        assert "heavy imports: []" in res.stdout and "starting 2 process(es)" not in res.stdout

    import importlib.metadata

    real = importlib.metadata.version
    monkeypatch.setattr(importlib.metadata, "version", lambda p: "0.0.1" if p == "trl" else real(p))
    assert yaml_keys.remembered_values("sft", {"learnin_rate": 1}, "x", [], cache) is None  # another TRL


def test_the_launcher_writes_its_exit_code_where_the_exit_code_file_variable_says(tmp_path, monkeypatch):
    """`make finetune EXIT_CODE_FILE=<path>` (tests/test_make.py) hands the launcher FSDP_RECIPES_EXIT_CODE_FILE:
    however `launch` ends, returned, as a UserError's one line, or not caught at all, the file holds the code the
    process exits with (make itself exits 2 for every failure)."""
    from fsdp_recipes.errors import UserError
    from fsdp_recipes.launch import launcher

    def returns(code):
        return lambda argv, held: code

    def raises(err):
        def launch(argv, held):
            raise err
        return launch

    endings = [(returns(0), 0), (returns(3), 3), (returns(4), 4), (returns(75), 75), (returns(130), 130),
               (raises(UserError("a rank failed at step 7", exit_code=1)), 1), (raises(UserError("a mistake")), 2),
               (raises(RuntimeError("a bug")), 1), (raises(KeyboardInterrupt()), 130)]
    path = tmp_path / "exit_code"
    monkeypatch.setenv("FSDP_RECIPES_EXIT_CODE_FILE", str(path))
    for launch, expected in endings:
        path.unlink(missing_ok=True)
        monkeypatch.setattr(launcher, "launch", launch)
        try:
            code = launcher.main(["tiny-cpu-lora"])
        except SystemExit as stop:  # a UserError, through errors.cli
            code = stop.code
        except RuntimeError:  # what Python exits with: 1
            code = 1
        except KeyboardInterrupt:  # 130, as a shell reports it
            code = 130
        assert code == expected and path.read_text() == f"{expected}\n", (expected, code)


def test_an_exit_code_file_in_a_missing_folder_is_one_line_before_the_launch(tmp_path, monkeypatch, capsys):
    """launch.sh users (the Makefile checks the same): before, the whole run trained, then a warning."""
    from fsdp_recipes.launch import launcher

    ran = []
    monkeypatch.setattr(launcher, "launch", lambda argv, held: ran.append(argv) or 0)
    monkeypatch.setenv("FSDP_RECIPES_EXIT_CODE_FILE", str(tmp_path / "missing" / "rc"))
    with pytest.raises(SystemExit) as stop:
        launcher.main(["tiny-cpu-lora"])
    err = capsys.readouterr().err.strip().splitlines()
    assert stop.value.code == 2 and ran == [] and len(err) == 1, err
    assert err[0].startswith(f"error: FSDP_RECIPES_EXIT_CODE_FILE={tmp_path / 'missing' / 'rc'} is in a folder that "
                             "does not exist") and "Fix: create that folder first" in err[0]
    monkeypatch.setenv("FSDP_RECIPES_EXIT_CODE_FILE", str(tmp_path))  # a folder: the write would fail after the run
    with pytest.raises(SystemExit) as stop:
        launcher.main(["tiny-cpu-lora"])
    assert stop.value.code == 2 and ran == []
    assert capsys.readouterr().err.startswith(f"error: FSDP_RECIPES_EXIT_CODE_FILE={tmp_path} is a folder, where")


def test_a_summary_that_fails_after_a_completed_run_says_the_outputs_are_complete(tmp_path, monkeypatch):
    """Exit 2 says that nothing ran; a completed run whose summary raised (a bug, or a library's error) is exit 1
    with the way to make the summary again, its traceback in a file."""
    from fsdp_recipes.errors import UserError
    from fsdp_recipes.launch import ending

    def broken(argv, recipe=None):
        raise IndexError("list index out of range")

    monkeypatch.setattr(ending.summary, "main", broken)
    with pytest.raises(UserError) as caught:
        ending.summarise(None, str(tmp_path))
    line = str(caught.value)
    assert caught.value.exit_code == 1, line
    assert line.startswith("IndexError while summarising the finished run (training completed and "
                           f"{tmp_path / 'metrics.json'} says so; the outputs in {tmp_path} are complete)"), line
    assert f"Fix: once the cause is fixed, `python -m fsdp_recipes.launch.summary {tmp_path}` makes the summary" in line

    def moved(argv, recipe=None):  # the summary reads the data again: a file moved during the run
        raise UserError("dataset not found: x.jsonl. Fix: check dataset_name")

    monkeypatch.setattr(ending.summary, "main", moved)
    with pytest.raises(UserError) as caught:
        ending.summarise(None, str(tmp_path))
    assert caught.value.exit_code == 1 and str(caught.value).startswith(
        f"training completed and {tmp_path / 'metrics.json'} says so (the outputs in {tmp_path} are complete), but "
        "the summary stopped: dataset not found: x.jsonl."), str(caught.value)


def test_an_interrupted_run_names_what_the_same_command_resumes_from(tmp_path, monkeypatch):
    from fsdp_recipes.checkpoint import markers
    from fsdp_recipes.launch import ending

    assert ending.resumes_from(str(tmp_path)) == (f"no complete checkpoint in {tmp_path}: the same command starts "
                                                  "again at step 0")
    # checkpoint-25 is marked complete but lacks the Trainer's state (a copy that left it out): not resumable
    for step, complete, state in ((10, True, True), (20, True, True), (25, True, False), (30, False, True)):
        (tmp_path / f"checkpoint-{step}").mkdir()
        if state:
            (tmp_path / f"checkpoint-{step}" / "trainer_state.json").write_text("{}")
        if complete:
            (tmp_path / f"checkpoint-{step}" / markers.MARKER).write_text(str(step))
    assert ending.resumes_from(str(tmp_path)) == f"the same command resumes from {tmp_path / 'checkpoint-20'}"
    why = "trainer_state.json: missing, so the Trainer cannot resume from it (its step and the data to skip)"
    assert markers.usable(tmp_path)[1] == [(tmp_path / "checkpoint-25", why)]
    # what the command's own settings do instead (a requeued job runs the same command)
    from types import SimpleNamespace

    def cfg(overwrite=False, resume=None, auto=True):
        return SimpleNamespace(pack=SimpleNamespace(overwrite_output_dir=overwrite, auto_resume=auto),
                               training=SimpleNamespace(resume_from_checkpoint=resume))

    monkeypatch.delenv("SLURM_JOB_ID", raising=False)
    assert ending.resumes_from(str(tmp_path), cfg(overwrite=True)) == (
        f"the same command (--overwrite_output_dir true) would empty {tmp_path} again, checkpoints and all: leave that "
        f"flag out to resume from {tmp_path / 'checkpoint-20'}")
    monkeypatch.setenv("SLURM_JOB_ID", "4242")  # a requeue of the job keeps its run (output_dir.requeued)
    assert ending.resumes_from(str(tmp_path), cfg(overwrite=True)) == (
        f"the same command (--overwrite_output_dir true) would empty {tmp_path} again, checkpoints and all: leave that "
        f"flag out to resume from {tmp_path / 'checkpoint-20'}; a requeue of Slurm job 4242 keeps it: the requeued "
        f"job resumes from {tmp_path / 'checkpoint-20'}")
    assert ending.resumes_from(str(tmp_path), cfg(overwrite=True, auto=False)).endswith(
        "a requeue of Slurm job 4242 keeps it: the requeued job starts again at step 0 (--auto_resume false); "
        f"--auto_resume true resumes from {tmp_path / 'checkpoint-20'}")
    monkeypatch.delenv("SLURM_JOB_ID")
    assert ending.resumes_from(str(tmp_path), cfg(resume=str(tmp_path / "checkpoint-10"))) == (
        f"the same command resumes from {tmp_path / 'checkpoint-10'} again (its resume_from_checkpoint); leave that "
        f"out to resume from {tmp_path / 'checkpoint-20'}")
    assert ending.resumes_from(str(tmp_path), cfg(auto=False)) == (
        f"the same command starts again at step 0 (--auto_resume false); --auto_resume true resumes from "
        f"{tmp_path / 'checkpoint-20'}")


def test_a_flag_without_its_value_names_the_quoting_make_needs(cache_dir):
    """`make plan ARGS=--max_length 8192` (unquoted) hands the flag alone: the line said "expected one argument.
    Fix: correct that value in the recipe YAML", which no value in the YAML fixes."""
    from fsdp_recipes.config.run_config import parse_args
    from fsdp_recipes.errors import UserError

    with pytest.raises(UserError) as err:
        parse_args(["--config", str(REPO / "recipes/tiny-cpu-lora/sft.yaml"), "--max_length"])
    assert str(err.value) == ('--max_length is given no value. Fix: --max_length <value>; through make, quote the '
                              'flags and values together: ARGS="--max_length <value>".')


def test_a_failure_after_the_last_step_is_not_said_at_a_step_past_max_steps():
    """A 4-step run whose final save failed was said to fail "at step 5" (the step the record counted as in
    progress); it failed after its 4 steps. The record's trained_steps is set when the Trainer's loop ends."""
    from fsdp_recipes.launch.explain_failure import describe
    from fsdp_recipes.train import failure_record

    callback = failure_record.make_phase_callback()
    state = type("State", (), {"global_step": 4})()
    saved = dict(failure_record.STATE)
    try:
        callback.on_step_end(None, state, None)
        callback.on_train_end(None, state, None)
        rec = {"rank": 1, "type": "fsdp_recipes.checkpoint.save_check.IncompleteSave", "error": "final save failed",
               "phase": failure_record.STATE["phase"], "step": failure_record.STATE["step"],
               "trained_steps": failure_record.STATE["trained_steps"], "time": 0.0}
    finally:
        failure_record.STATE.update(saved)
    line, _ = describe([rec], 1, None, "tiny-cpu-lora", None)
    assert "after its 4 steps" in line and "at step 5" not in line, line


def test_a_field_of_another_trainer_kind_is_named_as_such(monkeypatch, capsys, cache_dir):
    """`ARGS="--beta 0.1"` on an SFT recipe said "remove it, or see `--help` for the valid keys": beta is DPO's."""
    from conftest import launcher_checks

    from fsdp_recipes.config.kind_registry import TRAINERS
    from fsdp_recipes.config.run_config import dataclass_types, kinds_with_field
    from fsdp_recipes.config.yaml_keys import known_fields

    has_beta = [k for k in TRAINERS if "beta" in known_fields(dataclass_types(k))]
    assert "sft" not in has_beta and len(has_beta) > 1  # the premise, from TRL's classes
    assert kinds_with_field("beta", but="sft") == has_beta
    for _ in range(2):  # the parse's check, then the early one (its fields remembered by the first launch)
        res = launcher_checks(["tiny-cpu-lora", "--beta", "0.1"], monkeypatch, capsys)
        named = ", ".join(has_beta[:-1]) + " and " + has_beta[-1]
        assert res.returncode == 2 and res.stderr.strip() == (
            f"error: unknown command-line flag `--beta`. Fix: `beta` is a field of the {named} trainers, not of "
            "this recipe's: remove it, or use a recipe of that trainer (fsdp-recipes recipes list names each one's)"), \
            res.stderr


def test_a_ranks_long_one_line_error_keeps_its_whole_fix():
    """A rank's UserError longer than 400 characters was cut mid-fix ("... to star.")."""
    from fsdp_recipes.launch.explain_failure import describe

    fix = "resume with the state dict type it was saved with, " * 8 + "or start over in a new output_dir"
    rec = {"rank": 0, "type": "fsdp_recipes.errors.UserError", "error": f"checkpoint-4 cannot be resumed. Fix: {fix}",
           "phase": "setup", "step": None, "time": 0.0}
    line, code = describe([rec], 2, None, "tiny-cpu-lora", None)
    assert line.startswith("checkpoint-4 cannot be resumed. Fix: ") and fix in line and code == 2, line


def test_a_local_models_foreign_tokenizer_is_refused_whatever_the_data(tmp_path, monkeypatch, capsys, cache_dir):
    """The tokenizer's vocabulary against the model's was checked only with local data (the launcher loads the
    tokenizer to measure its rows); with hub data a model folder holding another model's tokenizer reached the ranks."""
    import shutil

    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    from conftest import launcher_checks

    model = shutil.copytree(cache_dir / "tiny-mistral", tmp_path / "model")
    other = Tokenizer(models.BPE(unk_token="<unk>"))
    other.pre_tokenizer = pre_tokenizers.Whitespace()
    other.train_from_iterator(["a b c"], trainers.BpeTrainer(vocab_size=20, special_tokens=["<unk>"]))
    other.save(str(model / "tokenizer.json"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    res = launcher_checks(["tiny-cpu-lora", "--model_name_or_path", str(model), "--dataset_name", "trl-lib/Capybara"],
                          monkeypatch, capsys)
    lines = res.stderr.strip().splitlines()
    assert res.returncode == 2 and len(lines) == 1, res.stderr
    assert lines[0].startswith(f"error: the tokenizer of model_name_or_path {model} has ") and "vocab_size" in lines[0]
