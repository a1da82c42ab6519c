"""GRPO, the third trainer kind: its reward functions are data of the recipe (import paths), checked before any rank
starts, one line each; the shipped rewards score what they say; `make plan` counts the sampling's memory. The runs
themselves: tests/test_default_recipe.py (the real model, after SFT) and tests/test_preemption.py (exact resume)."""

import json
import os
import shutil
import sys
from types import SimpleNamespace

import pytest
import yaml

from conftest import REPO, launcher_until_ranks, RanksWouldStart
from recipe_variant import recipe_variant
from test_bad_input import assert_one_line_error

from fsdp_recipes.rewards import exact_answer, number_only


@pytest.fixture(autouse=True)
def checks_before_ranks(monkeypatch):
    monkeypatch.setenv("FSDP_RECIPES_OVERLAP_CHECKS", "0")


def grpo_recipe(tmp_path, **fields) -> "Path":  # noqa: F821
    """tiny-cpu-lora as a GRPO recipe (grpo.yaml, trainer: grpo) on its prompt-completion data."""
    fields = {"reward_funcs": ["fsdp_recipes.rewards.exact_answer"], "num_generations": 4, "max_completion_length": 4,
              "eval_strategy": "no", "output_dir": str(tmp_path / "run"), **fields}
    kind = fields.pop("trainer", "grpo")
    # max_length and per_device_eval_batch_size: GRPOConfig lacks the first, the second would have to divide by
    # num_generations
    return recipe_variant(tmp_path, "tiny-grpo", trainer=kind, drop=("max_length", "per_device_eval_batch_size"),
                          **fields)


def write_module(tmp_path, monkeypatch, source: str) -> str:
    (tmp_path / "my_rewards.py").write_text(source)
    monkeypatch.syspath_prepend(str(tmp_path))
    sys.modules.pop("my_rewards", None)
    return "my_rewards.score"


def test_a_good_grpo_recipe_reaches_the_ranks_with_its_own_yaml(tmp_path, cache_dir, monkeypatch, capsys):
    folder = grpo_recipe(tmp_path)
    with pytest.raises(RanksWouldStart) as started:
        launcher_until_ranks([str(folder)], monkeypatch, capsys)
    written = yaml.safe_load((folder / "grpo.yaml").read_text())  # what the ranks are handed is that YAML's
    assert {k: started.value.settings[k] for k in written if k != "output_dir"} == {
        k: v for k, v in written.items() if k != "output_dir"}
    assert "trainer grpo" in capsys.readouterr().out


@pytest.mark.parametrize("source, fragment", [
    ("def score(completions, answer):\n    return [0.0]\n", "does not take **kwargs"),
    ("def score(completions, ground_truth, **kwargs):\n    return [0.0]\n",
     "needs ground_truth, which is neither a dataset column"),
    ("score = 3\n", "has no function score"),
    ("def score(completions, **kwargs)\n    return []\n", "module my_rewards cannot be imported (SyntaxError"),
], ids=["no-kwargs", "missing-column", "not-callable", "syntax-error"])
def test_a_reward_function_that_cannot_work_is_one_line(tmp_path, cache_dir, checks, monkeypatch, source, fragment):
    path = write_module(tmp_path, monkeypatch, source)
    assert_one_line_error(checks([grpo_recipe(tmp_path, reward_funcs=[path])]), fragment)


def test_a_reward_function_naming_a_column_the_data_has_passes(tmp_path, cache_dir, monkeypatch, capsys):
    # `answer` is the prompt-completion data's completion, renamed by the kind; `prompts` is passed by TRL
    path = write_module(tmp_path, monkeypatch, "def score(prompts, completions, answer, **kwargs):\n    return []\n")
    with pytest.raises(RanksWouldStart):
        launcher_until_ranks([str(grpo_recipe(tmp_path, reward_funcs=[path]))], monkeypatch, capsys)


@pytest.mark.parametrize("fields, fragment", [
    ({"reward_funcs": []}, "a GRPO recipe needs reward_funcs"),
    ({"reward_funcs": ["no_such_module_xyz.score"]}, "module no_such_module_xyz cannot be imported"),
    ({"reward_funcs": ["exact_answer"]}, "is not an import path"),
    ({"reward_weights": [1.0, 0.5]}, "reward_weights has 2 values for 1 reward_funcs"),
    ({"generation_backend": "sglang"}, "generation_backend 'sglang' is not one of auto, vllm, transformers"),
    ({"generation_backend": "vllm"}, "generation_backend vllm, but"),
], ids=["none", "no-module", "bare-name", "weights", "backend", "vllm-here"])
def test_grpo_setting_mistakes(tmp_path, cache_dir, checks, monkeypatch, fields, fragment):
    from fsdp_recipes.train.kinds import sampling

    monkeypatch.setattr(sampling, "vllm_installed", lambda: False)  # the same answer on a GPU machine with vLLM
    assert_one_line_error(checks([grpo_recipe(tmp_path, **fields)]), fragment)


def test_another_kinds_length_field_points_at_this_kinds_length_field(tmp_path, cache_dir, checks):
    """SFT's max_length in a GRPO recipe was told `did you mean vllm_max_model_length?`, vLLM's context, not what
    GRPO trains on: the suggestion is the kind's own length field, as YAML key and as flag."""
    res = checks([grpo_recipe(tmp_path, max_length=64)])
    assert_one_line_error(res, "Fix: did you mean `max_completion_length`? (the length setting of this trainer kind: "
                               "`max_completion_length`)")
    res = checks([grpo_recipe(tmp_path / "flag"), "--max_seq_length", "64"])
    assert_one_line_error(res, "unknown command-line flag `--max_seq_length`. Fix: did you mean "
                               "`max_completion_length`?")
    assert "vllm" not in res.stderr


def test_a_reward_function_whose_package_is_missing_is_one_line_before_any_rank(tmp_path, cache_dir, checks,
                                                                                monkeypatch):
    # as trl.rewards.accuracy_reward without math-verify: importable, failing only when called
    path = write_module(tmp_path, monkeypatch, "def score(completions, answer, **kwargs):\n"
                                               "    raise ImportError('Please install the `math_verify` package')\n")
    res = checks([grpo_recipe(tmp_path, reward_funcs=[path])])
    assert_one_line_error(res, "reward function my_rewards.score cannot run here: Please install the `math_verify`")


def test_a_reward_function_cannot_read_the_prompt_column(tmp_path, cache_dir, checks, monkeypatch):
    # TRL passes every column but `prompt` and `completion` (it passes `prompts`)
    path = write_module(tmp_path, monkeypatch, "def score(completions, prompt, **kwargs):\n    return []\n")
    assert_one_line_error(checks([grpo_recipe(tmp_path, reward_funcs=[path])]), "needs prompt, which is neither")


def test_data_without_prompts(tmp_path, cache_dir, checks):
    data = tmp_path / "data"
    data.mkdir()
    (data / "train.jsonl").write_text('{"question": "What is 2 + 3?", "answer": "5"}\n')
    res = checks([grpo_recipe(tmp_path, dataset_name=str(data), dataset_test_split="train")])
    assert_one_line_error(res, "GRPO and RLOO need `prompt`")


@pytest.mark.parametrize("kind", ["grpo", "rloo"])
def test_labelled_answers_with_false_labels_are_refused_not_rewarded(tmp_path, cache_dir, checks, kind):
    """KTO's labelled rows under a sampling kind: `completion` became `answer` and `label` was dropped, so the
    exact-answer reward scored the answers labelled false (wrong) as right, and the run trained towards them."""
    data = tmp_path / "labelled"
    data.mkdir()
    rows = [{"prompt": f"What is {i} + 1?", "completion": f"{i + 1 if i % 2 else i + 2}", "label": bool(i % 2)}
            for i in range(4)]
    (data / "train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    res = checks([grpo_recipe(tmp_path, trainer=kind, dataset_name=str(data), dataset_test_split="none")])
    assert_one_line_error(res, f"2 of its 4 rows labelled undesirable (false), and {kind.upper()} would take their "
                               "completions as the right answers")
    assert "keep only the rows labelled true" in res.stderr and "KTO recipe" in res.stderr


def test_the_grpo_demo_without_its_sft_run_names_the_command(tmp_path, cache_dir, checks):
    res = checks(["smollm2-135m-grpo", "--model_name_or_path", tmp_path / "missing" / "merged"])
    assert_one_line_error(res, "run `make finetune RECIPE=smollm2-135m-lora` first")


def test_exact_answer_and_number_only_score_what_they_say():
    chat = lambda text: [{"role": "assistant", "content": text}]  # noqa: E731
    assert exact_answer([chat("57"), chat(" 57\n"), chat("56"), chat("57 is it")], [chat("57")] * 4) == [1, 1, 0, 0]
    assert exact_answer(["123"], ["123"]) == [1.0]  # plain-text prompts give plain completions
    # digits among the non-space characters: 2 of 2, 2 of 6 ("57isit"), 0 of 3, nothing at all
    assert number_only([chat("57"), chat("57 is it"), chat("abc"), chat("  ")]) == [1.0, 2 / 6, 0.0, 0.0]


def test_the_planner_counts_generation_and_says_which_backend_it_assumed():
    from fsdp_recipes.planning import plan

    gib = 1024 ** 3
    vllm = plan.prepare("llama-3.1-8b-lora-grpo", 8, 1, "H100", REPO / "recipes")
    budget = vllm.budgets[vllm.own]
    # the engine's share: vllm_gpu_memory_utilization 0.3 of the H100's memory as the planner reads it
    assert budget["vllm_engine"] == pytest.approx(0.3 * vllm.capacity * gib, rel=1e-6)
    text = plan.report(vllm)
    assert "assumed vLLM in colocate mode, 30% of each GPU" in text
    hf = plan.prepare("llama-3.1-8b-lora-grpo", 8, 1, "H100", REPO / "recipes",
                      ["--generation_backend", "transformers"])
    kv = hf.budgets[hf.own]["generation_kv_cache"]
    # Llama 3.1 8B: 32 layers, 8 KV heads of 128; 8 completions x 4 micro-batches sampled at once per GPU, each a
    # 512-token prompt (the planner's assumption) + 1024 completion tokens, bf16 K and V; plus fp32 logits
    expected = 32 * (512 + 1024) * 32 * 2 * (8 * 128) * 2 + 32 * 128256 * 4
    assert kv == expected
    assert "the policy's generate: a KV cache of 32 completions x 1,536 tokens" in plan.report(hf)
    assert "vllm_engine" not in hf.budgets[hf.own]
    server = plan.prepare("llama-3.1-8b-lora-grpo", 8, 1, "H100", REPO / "recipes", ["--vllm_mode", "server"])
    assert not {"vllm_engine", "generation_kv_cache"} & set(server.budgets[server.own])
    assert "vLLM in server mode, on GPUs of its own" in plan.report(server)


def test_mfu_counts_each_forward_grpo_runs_per_sampled_batch():
    from types import SimpleNamespace

    from fsdp_recipes.train.kinds import grpo

    args = dict(beta=0.0, num_iterations=1, steps_per_generation=4, gradient_accumulation_steps=4, use_vllm=False,
                vllm_importance_sampling_correction=True)
    assert grpo.extra_forwards(SimpleNamespace(**args)) == {"generation": 1.0}
    # vLLM's importance-sampling correction recomputes the sampled tokens' log-probabilities; so does a sampled batch
    # that outlives an optimizer step (accumulation 2, a batch every 4 micro-batches)
    assert grpo.extra_forwards(SimpleNamespace(**{**args, "use_vllm": True})) == {"generation": 1.0, "old_policy": 1.0}
    assert grpo.extra_forwards(SimpleNamespace(**{**args, "gradient_accumulation_steps": 2}))["old_policy"] == 1.0
    # a batch trained on twice was sampled (and its reference computed) once: half a forward per trained token
    assert grpo.extra_forwards(SimpleNamespace(**{**args, "beta": 0.1, "num_iterations": 2,
                                                  "gradient_accumulation_steps": 8})) == {"generation": 0.5,
                                                                                          "reference": 0.5}


def test_a_run_whose_rewards_never_varied_is_one_line_before_its_final_save(tmp_path):
    from trl import GRPOConfig

    from fsdp_recipes.errors import UserError
    from fsdp_recipes.train import kinds

    grpo = kinds.load("grpo")  # its check_learned is sampling.py's, which RLOO shares
    training = GRPOConfig(output_dir=str(tmp_path), num_generations=8, per_device_train_batch_size=8, use_cpu=True)

    flat = [{"step": 1, "reward": 0.0, "frac_reward_zero_std": 1.0}, {"step": 2, "reward": 0.0, "frac_reward_zero_std": 1.0}]
    with pytest.raises(UserError, match=r"GRPO learned nothing: .* each group of 8 completions scored alike \(mean "
                                        r"reward 0.000\)"):
        grpo.check_learned(flat, training)
    varied = [*flat, {"step": 3, "reward": 0.25, "frac_reward_zero_std": 0.5}]
    grpo.check_learned(varied, training)  # one step varied


def test_a_run_whose_completions_were_all_cut_says_so_instead_of_raising_the_temperature(tmp_path):
    from trl import GRPOConfig, RLOOConfig

    from fsdp_recipes.errors import UserError
    from fsdp_recipes.train import kinds

    # tiny-grpo's logs at max_completion_length 4: every completion was cut, every reward 0 (a measured launch)
    cut = [{"step": s, "reward": 0.0, "frac_reward_zero_std": 1.0, "completions/clipped_ratio": 1.0,
            "completions/mean_terminated_length": 0.0} for s in (1, 2)]
    for kind, config in (("grpo", GRPOConfig), ("rloo", RLOOConfig)):
        training = config(output_dir=str(tmp_path), num_generations=8, max_completion_length=4,
                          per_device_train_batch_size=8, use_cpu=True)
        with pytest.raises(UserError, match=rf"{kind.upper()} learned nothing: every completion was cut at "
                                            r"max_completion_length \(4 tokens; completions/clipped_ratio 1.0 at "
                                            r"every logged step\).* Fix: raise max_completion_length") as err:
            kinds.load(kind).check_learned(cut, training)
        assert "temperature" not in str(err.value)
    half = [{**cut[0], "completions/clipped_ratio": 0.5}, cut[1]]  # some ended: the rewards are the cause
    with pytest.raises(UserError, match="raise temperature or num_generations"):
        kinds.load("grpo").check_learned(half, training)


@pytest.mark.parametrize("fields, fragment", [
    ({"reward_weights": [0.0]}, "reward_weights [0.0] are all 0"),
    ({"reward_funcs": ["fsdp_recipes.rewards.exact_answer", "fsdp_recipes.rewards.number_only"],
      "reward_weights": [0.0, 0.0]}, "reward_weights [0.0, 0.0] are all 0"),
    ({"temperature": 0.0}, "temperature is 0: GRPO samples each prompt's 4 completions, and without randomness"),
], ids=["weight-0", "weights-0", "temperature-0"])
def test_sampling_settings_that_train_nothing_are_one_line(tmp_path, cache_dir, checks, fields, fragment):
    assert_one_line_error(checks([grpo_recipe(tmp_path, **fields)]), fragment)


# ---- RLOO, the second sampling kind: the same checks from sampling.py, its own forwards

def test_an_rloo_recipe_gets_the_sampling_checks(tmp_path, cache_dir, checks, monkeypatch):
    assert_one_line_error(checks([grpo_recipe(tmp_path, trainer="rloo", reward_funcs=[])]),
                          "a RLOO recipe needs reward_funcs")


def test_mfu_counts_each_forward_rloo_runs_per_sampled_batch():
    from fsdp_recipes.train.kinds import rloo

    args = dict(beta=0.0, num_iterations=1)
    # RLOOTrainer recomputes the sampled tokens' log-probabilities for every batch (trl 1.16)
    assert rloo.extra_forwards(SimpleNamespace(**args)) == {"generation": 1.0, "old_policy": 1.0}
    assert rloo.extra_forwards(SimpleNamespace(beta=0.05, num_iterations=2)) == {
        "generation": 0.5, "old_policy": 0.5, "reference": 0.5}


# ---- issue 44: the launcher's checks of the trainer config see the layout the ranks will see

@pytest.mark.parametrize("trainer", ["grpo", "rloo"])
def test_fewer_completions_per_process_than_num_generations_reaches_the_ranks(tmp_path, cache_dir, monkeypatch,
                                                                              capsys, trainer):
    # 2 processes x 4 completions = one group of 8 per step: TRL accepts it under torchrun (its world size is 2); the
    # launcher, one process, used to validate GRPOConfig with world size 1 and refuse it (generation batch 4)
    folder = grpo_recipe(tmp_path, trainer=trainer, num_generations=8, per_device_train_batch_size=4)
    with pytest.raises(RanksWouldStart):
        launcher_until_ranks([str(folder)], monkeypatch, capsys)


@pytest.mark.parametrize("fields", [
    {"num_generations": 8, "per_device_train_batch_size": 3},  # 2 x 3 = 6 completions: no whole group of 8
    {"num_generations": 8, "per_device_train_batch_size": 2, "steps_per_generation": 3},  # 2 x 2 x 3 = 12
], ids=["per-step", "per-generation"])
def test_a_generation_batch_without_whole_groups_is_still_refused(tmp_path, cache_dir, checks, fields):
    res = checks([grpo_recipe(tmp_path, **fields)])
    assert_one_line_error(res, f"must be divisible by num_generations (8) (as the ranks see it: 2 process(es)")


def test_the_planner_validates_the_layout_of_the_planned_job():
    from fsdp_recipes.errors import UserError
    from fsdp_recipes.planning import plan

    # the shipped recipe: 8 completions per GPU, one group of 8 on any number of GPUs; 4 per GPU needs 2 or more
    plan.load_recipe("llama-3.1-8b-lora-grpo", REPO / "recipes", ["--per_device_train_batch_size", "4"], world_size=2)
    with pytest.raises(UserError, match=r"divisible by num_generations \(8\) \(as the ranks see it: 1 process"):
        plan.load_recipe("llama-3.1-8b-lora-grpo", REPO / "recipes", ["--per_device_train_batch_size", "4",
                                                                      "--steps_per_generation", "1"], world_size=1)


# ---- issue 44: a reward function that misbehaves is one line naming it, at the step where it happens

def checked(source: str, tmp_path, monkeypatch, funcs: tuple[str, ...] = ()):
    """The kind's reward functions as the ranks give them to TRL: my_rewards.score after `funcs`."""
    from fsdp_recipes.train.kinds import sampling

    return sampling.checked_reward_funcs([*funcs, write_module(tmp_path, monkeypatch, source)])


def call(funcs, n: int = 4, step: int = 0) -> list:
    """TRL 1.16's _calculate_rewards: each function in turn, keyword arguments only."""
    kwargs = dict(prompts=["q"] * n, completions=[f"{i}" for i in range(n)], completion_ids=[[1]] * n,
                  answer=["1"] * n, trainer_state=SimpleNamespace(global_step=step), log_extra=None, log_metric=None)
    return [f(**kwargs) for f in funcs]


@pytest.mark.parametrize("body, fragment", [
    ("x = 1", "returned None (NoneType) instead of a list of 4 rewards (at step 1). Fix: return a list with one "
              "number (or None) per completion: a function that ends without `return` returns None"),
    ("return [None] * len(completions)", "the reward function returned None for all 4 completions of 3 batches in a "
                                         "row (at step 1; the last: my_rewards.score): no completion could be scored"),
    ("return [float('nan')] + [1.0] * (len(completions) - 1)", "returned nan for 1 of 4 completions (at step 1)"),
    ("return [1.0] * (len(completions) + 1)", "returned 5 rewards for 4 completions (at step 1)"),
    ("return ['1.0'] * len(completions)", "returned '1.0' (str), not a number, for 4 of 4 completions"),
    ("return 1.0", "returned 1.0 (float) instead of a list of 4 rewards"),
    ("return {c: 1.0 for c in completions}", "(dict) instead of a list of 4 rewards"),
    ("raise KeyError('solution')", "raised KeyError: 'solution' (at step 1, on 4 completions)"),
], ids=["no-return", "all-none", "nan", "wrong-length", "strings", "one-float", "dict", "raises"])
def test_a_misbehaving_reward_function_is_one_line_naming_it(tmp_path, monkeypatch, body, fragment):
    from fsdp_recipes.errors import UserError

    funcs = checked(f"def score(completions, **kwargs):\n    {body}\n", tmp_path, monkeypatch)
    if "None] *" in body:  # one batch with nothing scored can be right (a reward for some prompts only): 3 in a row
        call(funcs), call(funcs)
    with pytest.raises(UserError) as err:
        call(funcs)
    line = str(err.value)
    assert "\n" not in line and fragment in line and "Fix:" in line, line
    if "last:" not in fragment:
        assert line.startswith("reward function my_rewards.score ")


def test_what_trl_accepts_from_a_reward_function_passes_unchanged(tmp_path, monkeypatch, capsys):
    import numpy as np
    import torch

    # a tensor, numpy scalars, bools, ints: numbers as torch.tensor takes them; TRL's own name for its logs
    funcs = checked("import torch\ndef score(completions, **kwargs):\n"
                    "    return torch.tensor([0.5] * len(completions))\n", tmp_path, monkeypatch)
    assert call(funcs) == [[0.5] * 4] and funcs[0].__name__ == "score"
    from fsdp_recipes.train.kinds import sampling

    mixed = sampling.CheckedReward(lambda **kw: [np.float32(1), True, 2, None], "m.mixed", 0, sampling.RewardBatch(1))
    assert call([mixed]) == [[1.0, True, 2, None]]
    assert "returned None for 1 of 4 completions (at step 1; the last: m.mixed): TRL gives those no advantage" in \
        capsys.readouterr().out
    # two functions, one of which applies to no completion of this batch: the other scores them all, no line
    funcs = checked("def score(completions, **kwargs):\n    return [None] * len(completions)\n", tmp_path, monkeypatch,
                    ("fsdp_recipes.rewards.number_only",))
    assert call(funcs, step=3) == [[1.0] * 4, [None] * 4] and capsys.readouterr().out == ""
    assert torch.tensor([v if v is not None else float("nan") for v in call(funcs)[0]]).isfinite().all()


def test_a_nan_reward_in_the_logs_reaches_the_console_and_summary_as_text():
    from fsdp_recipes.train.console import progress_line
    from fsdp_recipes.train.kinds import sampling

    # TRL logs nanmean: NaN when every completion of the interval was unscored
    assert "reward nan" in progress_line({"loss": 0.0, "reward": float("nan")}, 1, 4)
    line = sampling.summary_lines({"trainer": "grpo", "generated_tokens": 10, "generated_tokens_per_second": None,
                                   "grpo": {"reward": {"first": None, "last": float("nan")}}})
    assert line == ["sampled     10 completion tokens (0.0/s); reward n/a -> nan (mean over the first and last "
                    "logged steps)"]


@pytest.mark.slow
def test_the_once_refused_layout_trains_and_unscored_completions_are_said_once(tmp_path, cache_dir):
    """Issue 44's refused-valid layout, launched: 2 processes x 4 completions, groups of 8 (the launcher refused it
    before it checked the config with the job's world size), with a reward that leaves some completions unscored
    (None: TRL gives them no advantage). The run trains to the end and the unscored completions are one warning."""
    from conftest import launch

    (tmp_path / "my_rewards.py").write_text(
        "from fsdp_recipes.rewards import number_only\n"
        "def score(completions, **kwargs):\n"
        "    return [None] + number_only(completions[1:])\n")
    folder = grpo_recipe(tmp_path, num_generations=8, per_device_train_batch_size=4, max_steps=2, logging_steps=1,
                         warmup_steps=0, save_strategy="no", save_merged_model=False, reward_funcs=["my_rewards.score"])
    res = launch([str(folder)], cache_dir, PYTHONPATH=f"{tmp_path}:{os.environ['PYTHONPATH']}")  # the reward's folder
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    assert "[train] step 2/2" in res.stdout and "completed" in res.stdout
    said = [line for line in res.stdout.splitlines() if "returned None for 1 of 4 completions (at step 1" in line]
    assert 1 <= len(said) <= 2 and "TRL gives those no advantage" in said[0], res.stdout  # once per rank at most
