"""What the sampling kinds share (GRPO, RLOO: TRL trainers that sample completions from the policy being trained and
score them with reward functions): their reward functions, generation backend, data, sampled-token counting, the
sampling's memory in `make plan`, the summary line and the "learned nothing" check. A sampling kind's module
imports these as its interface members and adds what is its own (its forwards, its resume settings).

Reward functions are named by import path in the recipe (`reward_funcs: [fsdp_recipes.rewards.exact_answer]`, the
kind's own SamplingArguments in config/kind_registry.py). TRL calls each with keyword arguments: the prompts, the
completions and every dataset column.

Generation:
- `generation_backend: auto` (the default) generates with vLLM in the trainer's processes (`vllm_mode: colocate`)
  where vLLM is installed and the run is on GPUs, else with the policy's own `generate`. `vllm` insists on vLLM
  (one line when it cannot), `transformers` never uses it. The run's first lines say which was chosen.
- With `generate` under FSDP2 every forward gathers the layer it runs, as in training (TRL's path; transformers
  sets `synced_gpus` for an FSDP module, so a rank whose completions ended keeps stepping with the others).

Data: `prompt` plus the columns the reward functions read. Prompt-completion data (the SFT recipes' own) works as it
is: its `completion` becomes the `answer` column, which TRL would otherwise not pass to a reward function.

An exact resume, with the policy's `generate`: the Trainer saves each rank's random generators into every checkpoint
(rng_state_<rank>.pth) and restores them on resume, and where the accumulation is a multiple of steps_per_generation x
num_iterations no sampled batch outlives an optimizer step, so a preempted and resumed run samples the same
completions as an uninterrupted one (tests/test_preemption.py). With vLLM it is not exact: the engine's sampler is
seeded per process and its state is in no checkpoint.
"""

from __future__ import annotations

import importlib
import inspect

from fsdp_recipes.data import loading, row_checks
from fsdp_recipes.errors import UserError
from fsdp_recipes.metrics.figures import figure

# the trainers' own logs (averaged over the logging interval) kept in metrics.json's `<kind>` section (trl 1.16:
# GRPOTrainer and RLOOTrainer log these under the same names)
REPORTED_LOGS = ("reward", "reward_std", "frac_reward_zero_std", "completions/mean_length",
                 "completions/clipped_ratio", "kl", "entropy")
# what a resume compares (checkpoint/resume_settings.py), besides a kind's own
RESUME_SETTINGS = ("reward_funcs", "reward_weights", "num_generations", "max_completion_length", "temperature",
                   "beta", "epsilon")
SEQUENCES_PER_ROW = 1  # per_device_train_batch_size counts completions: each is one prompt + completion sequence
ROWS = "completions (num_generations per prompt)"
SMOKE_DATA = "data"  # tiny_assets' prompt-completion chat data: its completion is the answer the reward checks
# make smoke: the recipe's own reward may read columns the synthetic data lacks (trl.rewards.accuracy_reward: a
# `solution`); the exact answer runs on it, with number_only beside it so that a tiny random model's completions
# still differ in reward (fsdp_recipes/rewards.py); a few short completions keep the steps quick
SMOKE_SETTINGS = {"reward_funcs": ["fsdp_recipes.rewards.exact_answer", "fsdp_recipes.rewards.number_only"],
                  "max_completion_length": 4, "num_generations": 2, "vllm_enable_sleep_mode": False}
describe_tokens = ("non-padding tokens of the trained sequences (prompt + sampled completion), one forward and "
                   "backward each; sampling them is one more forward per token, counted in MFU (2N FLOPs), and "
                   "metrics.json's `generated_tokens` counts the completion tokens sampled")
# Keyword arguments TRL passes to every reward function besides the dataset's columns (trl 1.16 _calculate_rewards)
PASSED = {"prompts", "completions", "completion_ids", "trainer_state", "log_extra", "log_metric", "environments"}
BACKENDS = ("auto", "vllm", "transformers")
PROMPT_TOKENS = 512  # make plan's assumption for a prompt: neither GRPOConfig nor RLOOConfig truncates prompts
GIB = 1024 ** 3


def trainer_kwargs(cfg) -> dict:
    return {"reward_funcs": checked_reward_funcs(cfg.kind_args.reward_funcs)}


def checked_reward_funcs(paths: list[str]) -> list:
    """The recipe's reward functions, each wrapped so that what it returns is checked at every call (CheckedReward);
    an async function or a reward model (a torch module) goes to TRL as it is (TRL awaits the first in a loop of its
    own and calls the second's forward itself)."""
    import torch
    from trl.trainer.utils import is_async_callable

    batch = RewardBatch(len(paths))
    funcs = [load_reward_func(path) for path in paths]
    return [f if is_async_callable(f) or isinstance(f, torch.nn.Module) else CheckedReward(f, path, i, batch)
            for i, (f, path) in enumerate(zip(funcs, paths))]


class RewardBatch:
    """Which completions of the batch now being scored each reward function left unscored (None): TRL calls the
    functions one after another on the same batch, so the last one can tell whether any function scored each."""

    def __init__(self, functions: int) -> None:
        self.functions = functions
        self.unscored: dict[int, list[bool]] = {}
        self.warned = False
        self.unscored_batches = 0  # batches in a row of this rank in which no completion was scored


# A batch of this rank with no completion scored can be right (a reward for some prompts only, a group split across
# ranks); ALL_UNSCORED_BATCHES in a row is a function that never applies (a wrong column, a wrong completion form).
ALL_UNSCORED_BATCHES = 3


def describe(value) -> str:
    text = repr(value)
    return text if len(text) <= 40 else text[:37] + "..."


class CheckedReward:
    """A reward function as TRL calls it, with what it returns checked, at every call, against what TRL needs: one
    number or None (does not apply: TRL gives that completion no advantage) per completion. Anything else stops the
    run in one line that names the function, what it returned and for how many of the rank's completions, at the
    step where it happens (the first, for a function that is always wrong): where TRL would raise from inside its
    reward code (a list of the wrong length, a string), go on with NaN (a non-number that torch converts), or train
    on nothing (every completion None, ALL_UNSCORED_BATCHES batches in a row). A completion that no function scores
    is one warning line, once.

    A callable object, not a closure: picklable as the function is, and named as it is (TRL's reward_func_names, its
    logs' `rewards/<name>/mean`)."""

    def __init__(self, func, path: str, index: int, batch: RewardBatch) -> None:
        self.func, self.path, self.index, self.batch = func, path, index, batch
        self.__name__ = getattr(func, "__name__", type(func).__name__)
        self.__doc__ = getattr(func, "__doc__", None)

    def __call__(self, *args, **kwargs):
        completions = kwargs.get("completions")
        n = len(completions) if completions is not None else None
        state = kwargs.get("trainer_state")
        at = f"at step {state.global_step + 1}" if state is not None else "when called"
        try:
            out = self.func(*args, **kwargs)
        except UserError:
            raise
        except Exception as err:  # noqa: BLE001  (the user's code: named with the function, one line)
            first = (str(err).strip().splitlines() or [""])[0]
            raise UserError(f"reward function {self.path} raised {type(err).__name__}: {first} ({at}, on {n} "
                            "completions). Fix: make it return a number (or None) for every completion; try it on a "
                            "few of the data's rows and this model's answers.") from err
        values = self.check(out, n, at)
        self.count_unscored(values, at)
        return values

    def fail(self, what: str, at: str, fix: str = "return one number per completion, or None where the reward does "
                                                   "not apply") -> None:
        raise UserError(f"reward function {self.path} returned {what} ({at}). Fix: {fix}.")

    def check(self, out, n: int | None, at: str) -> list:
        if hasattr(out, "tolist") and not isinstance(out, (str, bytes)):  # a tensor or numpy array
            out = out.tolist()
        if out is None or isinstance(out, (str, bytes, dict)) or not hasattr(out, "__len__") \
                or not hasattr(out, "__iter__"):
            self.fail(f"{describe(out)} ({type(out).__name__}) instead of a list of {n} rewards", at,
                      "return a list with one number (or None) per completion" + (
                          ": a function that ends without `return` returns None" if out is None else ""))
        out = list(out)
        if n is not None and len(out) != n:
            self.fail(f"{len(out)} rewards for {n} completions", at, "return exactly one reward per completion "
                      "(None where it does not apply), in the order of `completions`")
        values, bad, not_finite = [], [], []
        for value in out:
            if value is None:
                values.append(None)
                continue
            if hasattr(value, "item") and getattr(value, "ndim", 0) == 0:  # a numpy or torch scalar
                value = value.item()
            if not isinstance(value, (int, float)):  # bool is an int: True is 1.0, as torch.tensor takes it
                bad.append(value)
                continue
            value = float(value)
            if value != value or value in (float("inf"), float("-inf")):
                not_finite.append(value)
            values.append(value)
        if bad:
            self.fail(f"{describe(bad[0])} ({type(bad[0]).__name__}), not a number, for {len(bad)} of {len(out)} "
                      "completions", at)
        if not_finite:
            self.fail(f"{not_finite[0]} for {len(not_finite)} of {len(out)} completions", at,
                      "return a finite number per completion (None where the reward does not apply: TRL gives that "
                      "completion no advantage; NaN or inf would reach the advantages)")
        return values

    def count_unscored(self, values: list, at: str) -> None:
        """The last function of a batch: completions that no function scored (None from every one)."""
        batch = self.batch
        batch.unscored[self.index] = [v is None for v in values]
        if self.index != batch.functions - 1 or len(batch.unscored) != batch.functions:
            return
        masks, batch.unscored = list(batch.unscored.values()), {}
        unscored = sum(all(column) for column in zip(*masks))
        if not unscored:
            return
        alone = "the reward function" if batch.functions == 1 else f"every one of the {batch.functions} reward " \
                                                                     "functions"
        batch.unscored_batches = batch.unscored_batches + 1 if unscored == len(values) else 0
        if batch.unscored_batches >= ALL_UNSCORED_BATCHES:
            raise UserError(f"{alone} returned None for all {unscored} completions of {ALL_UNSCORED_BATCHES} batches "
                            f"in a row ({at}; the last: {self.path}): no completion could be scored, so nothing "
                            "would be learned. Fix: return a number for the completions a function applies to (check "
                            "the columns it reads, e.g. `answer`, and the form of `completions`: chat turns for "
                            "conversational prompts).")
        if not batch.warned:
            batch.warned = True
            print(f"[train] warning: {alone} returned None for {unscored} of {len(values)} completions ({at}; the "
                  f"last: {self.path}): TRL gives those no advantage, so they teach nothing (said once)", flush=True)


def sequence_length(training) -> int:
    """make plan's worst case for a trained sequence: a prompt of PROMPT_TOKENS and the longest completion."""
    return PROMPT_TOKENS + training.max_completion_length


def load_reward_func(path: str):
    """`package.module.function` (or `package.module:function`) -> the function; one line when it is not there."""
    module_name, _, name = path.replace(":", ".").rpartition(".")
    fix = "Fix: name a function by its import path, e.g. fsdp_recipes.rewards.exact_answer."
    if not module_name:
        raise UserError(f"reward_funcs entry {path!r} is not an import path. {fix}")
    try:
        module = importlib.import_module(module_name)
    except (ImportError, SyntaxError) as err:  # a user's own module may not even parse
        raise UserError(f"reward_funcs entry {path!r}: module {module_name} cannot be imported "
                        f"({type(err).__name__}: {err}). {fix}") from None
    func = getattr(module, name, None)
    if not callable(func):
        raise UserError(f"reward_funcs entry {path!r}: {module_name} has no function {name}. {fix}")
    return func


def check_reward_func(path: str, columns: set[str] | None = None) -> None:
    """TRL calls a reward function with keyword arguments only (PASSED and the dataset's columns): it must take
    **kwargs (TRL passes more than any one function reads) and need no argument TRL does not give."""
    func = load_reward_func(path)
    params = inspect.signature(func).parameters.values()
    if not any(p.kind is p.VAR_KEYWORD for p in params):
        raise UserError(f"reward function {path} does not take **kwargs, but TRL passes it every dataset column and "
                        f"{', '.join(sorted(PASSED - {'environments'}))}. Fix: add **kwargs to its signature.")
    needed = [p.name for p in params if p.default is p.empty and p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)]
    try:  # a function whose package is missing says so only when called (trl.rewards.accuracy_reward: math-verify)
        func(**{name: [] for name in needed})
    except ImportError as err:
        raise UserError(f"reward function {path} cannot run here: {err}. Fix: install what it needs (TRL's math "
                        "rewards: pip install 'fsdp-recipes[grpo]') in every node's environment.") from None
    except Exception:  # noqa: BLE001  (called with no completions, a function may fail in its own ways: not ours to judge)
        pass
    if columns is not None:
        missing = [n for n in needed if n not in PASSED | columns]
        if missing:
            raise UserError(f"reward function {path} needs {', '.join(missing)}, which is neither a dataset column "
                            f"(the data has {loading.names_shown(columns)}) nor passed by TRL. Fix: add that column "
                            "to the data, or give the argument a default.")


def check_config(cfg) -> None:
    """Settings, before any data or weight is loaded (in the launcher and every rank)."""
    funcs, weights = cfg.kind_args.reward_funcs, cfg.training.reward_weights
    if not funcs:
        raise UserError(f"a {cfg.trainer.upper()} recipe needs reward_funcs, the import paths of its reward "
                        f"functions. Fix: add e.g. `reward_funcs: [fsdp_recipes.rewards.exact_answer]` to "
                        f"{cfg.trainer}.yaml.")
    for path in funcs:
        check_reward_func(path)
    if weights is not None and len(weights) != len(funcs):
        raise UserError(f"reward_weights has {len(weights)} values for {len(funcs)} reward_funcs. Fix: give one weight "
                        "per function, or leave reward_weights out (all 1.0).")
    if weights is not None and not any(weights):
        raise UserError(f"reward_weights {list(weights)} are all 0: every completion's reward is 0, so no completion "
                        "has an advantage and nothing would be trained. Fix: give a reward function a weight other "
                        "than 0, or leave reward_weights out (all 1.0).")
    if cfg.training.temperature <= 0:
        raise UserError(f"temperature is {cfg.training.temperature:g}: {cfg.trainer.upper()} samples each prompt's "
                        f"{cfg.training.num_generations} completions, and without randomness they are alike, score "
                        "alike and teach nothing (transformers refuses it for sampling). Fix: set temperature above "
                        "0 (1.0 samples the policy as it is).")
    check_backend(cfg.kind_args.generation_backend)


def settle_generation(cfg) -> None:
    """Where the completions are sampled on the machine that runs the recipe (the launcher's and each rank's):
    apart from check_config, so that `make data` on a laptop checks a vLLM recipe's settings without asking for the
    GPUs it will run on."""
    cfg.training.use_vllm = use_vllm(cfg.kind_args.generation_backend, cfg.training.use_cpu)


def check_backend(backend: str) -> None:
    if backend not in BACKENDS:
        raise UserError(f"generation_backend {backend!r} is not one of {', '.join(BACKENDS)}. Fix: use auto (vLLM "
                        "where installed, else the model's generate), vllm or transformers.")


def vllm_installed() -> bool:
    import importlib.util

    return importlib.util.find_spec("vllm") is not None


def use_vllm(backend: str, use_cpu: bool) -> bool:
    """generation_backend -> the TRL config's use_vllm: vLLM where asked for (and there), or where `auto` finds it on
    GPUs. Decided in the launcher and again in every rank from the same facts; nodes with different installs would
    decide differently, so install vLLM on every node or on none (or say vllm / transformers)."""
    check_backend(backend)
    import torch

    have = vllm_installed()
    gpus = torch.cuda.is_available() and not use_cpu
    if backend == "vllm" and not (have and gpus):
        why = "vLLM is not installed" if not have else "the run has no GPU"
        raise UserError(f"generation_backend vllm, but {why}. Fix: pip install 'fsdp-recipes[vllm]' on the GPU "
                        "machines, or set generation_backend auto (the model's generate where vLLM cannot run).")
    return backend == "vllm" or (backend == "auto" and have and gpus)


def generation_setup(cfg, capacity_gib: float) -> dict:
    """The sampling as planning/memory_budget.Setup fields: which backend `make plan` assumes, and its size. `auto`
    counts vLLM (installed on the GPU machines the recipe is for); the plan also gives the generate figure."""
    training, backend = cfg.training, cfg.kind_args.generation_backend
    check_backend(backend)
    if backend != "transformers" and training.vllm_mode == "server":
        return dict(generation="none")  # vLLM on GPUs of its own (trl vllm-serve): nothing on the training GPUs
    mode = "generate" if backend == "transformers" else "vllm"
    return dict(generation=mode, generated_sequences=training.per_device_train_batch_size
                * (training.steps_per_generation or 1), generation_tokens=sequence_length(training),
                vllm_bytes=training.vllm_gpu_memory_utilization * capacity_gib * GIB)


def describe_generation(training) -> str:
    """The run's first lines say how completions are sampled."""
    share = (f"{training.vllm_gpu_memory_utilization:.0%} of each GPU" if training.vllm_mode == "colocate" else
             f"at {training.vllm_server_base_url or f'{training.vllm_server_host}:{training.vllm_server_port}'}")
    how = (f"vLLM ({training.vllm_mode}, {share})" if training.use_vllm
           else "the policy's own generate (vLLM not used)")
    return (f"{training.num_generations} completions of at most {training.max_completion_length} tokens per prompt, "
            f"temperature {training.temperature}, sampled with {how}")


def count_prepared(trainer, prepared, counter) -> None:
    """The batch trained on exists only after _prepare_inputs, sampled from the prompts training_step was given. A
    sampled batch is trained on num_iterations times, its tokens sampled once: the first pass is the first
    steps_per_generation micro-batches of each cycle (trl 1.16 GRPOTrainer and RLOOTrainer _prepare_inputs;
    training_step advances _step only after this returns)."""
    if "completion_ids" not in prepared:
        return
    per_batch = trainer.args.steps_per_generation
    first_pass = trainer._step % (per_batch * trainer.num_iterations) < per_batch
    counter.add_sampled(prepared, generated=first_pass)


def summary_lines(m: dict) -> list[str]:
    """The end-of-run summary: what was sampled, and what it scored."""
    if m.get("generated_tokens") is None:
        return []
    reward = (m.get(m.get("trainer") or "") or {}).get("reward") or {}
    # None (never logged) or NaN (TRL's nanmean of an interval no function scored): metrics/figures.py
    rewards = (f"; reward {figure(reward.get('first'), '.3f')} -> {figure(reward.get('last'), '.3f')} (mean over "
               "the first and last logged steps)" if reward.get("last") is not None else "")
    return [f"sampled     {figure(m['generated_tokens'], ',')} completion tokens "
            f"({figure(m.get('generated_tokens_per_second') or 0, ',.1f')}/s){rewards}"]


def check_learned(log_history: list[dict], training) -> None:
    """After training, before the final save: a run in which no group's rewards ever varied had no advantage to learn
    from (GRPO's group mean, RLOO's leave-one-out baseline), so its weights are those it started with (a LoRA adapter
    still zero, which the final-save check would call an incomplete save). Almost always a reward that cannot vary
    on this model's completions: said as such."""
    logged = [h for h in log_history if "frac_reward_zero_std" in h]
    if logged and all(h["frac_reward_zero_std"] == 1.0 for h in logged):
        mean = sum(h.get("reward") or 0.0 for h in logged) / len(logged)
        kind = type(training).__name__.removesuffix("Config")  # GRPOConfig -> GRPO
        clipped = [h.get("completions/clipped_ratio") for h in logged]
        if all(c is not None and c >= 1.0 for c in clipped):  # TRL: the share cut at max_completion_length
            raise UserError(f"{kind} learned nothing: every completion was cut at max_completion_length "
                            f"({training.max_completion_length} tokens; completions/clipped_ratio 1.0 at every "
                            f"logged step), so none ended with an answer and each group of "
                            f"{training.num_generations} scored alike (mean reward {mean:.3f}). Fix: raise "
                            "max_completion_length to the longest answer in tokens plus the end-of-turn token, or "
                            "start from a model that answers briefly (an SFT run on the same task).")
        raise UserError(f"{kind} learned nothing: at every logged step each group of {training.num_generations} "
                        "completions "
                        f"scored alike (mean reward {mean:.3f}), so no completion had an advantage and the weights "
                        "did not change. Fix: try the reward functions on a few of this model's completions (one "
                        "that is always 0 or always 1 teaches nothing), start from a model that is sometimes right "
                        "(an SFT run), or raise temperature or num_generations.")


def load_datasets(cfg, want_eval: bool | None = None):
    """(train, eval or None): prompts and the columns the rewards read; a `completion` column becomes `answer`."""
    want_eval = cfg.training.eval_strategy != "no" if want_eval is None else want_eval
    splits = loading.load_for(cfg, want_eval, check_columns)
    for ds in splits:  # `label` is not read: a false row's completion would become an answer the rewards score right
        if ds is not None:
            loading.check_no_undesirable_answers(
                ds, cfg.script.dataset_name or "mixture", cfg.trainer.upper(),
                f"{cfg.trainer.upper()} would take their completions as the right answers (`answer`) its rewards "
                "compare with, and train towards them")
    return tuple(None if ds is None else with_answer(ds) for ds in splits)


def with_answer(ds):
    """A `completion` column becomes `answer`, as text: a chat completion (Alpaca's, converted) gives its last turn's
    content, what a reward function compares with."""
    if "completion" in ds.column_names and "answer" not in ds.column_names:
        ds = ds.rename_column("completion", "answer")
        if len(ds) and isinstance(ds[0]["answer"], list):
            ds = ds.map(lambda r: {"answer": r["answer"][-1]["content"] if r["answer"] else ""})
    return ds


def check_columns(ds, where: str) -> None:
    if "prompt" not in set(ds.column_names or []):
        raise UserError(f"dataset {where} has columns {loading.names_shown(ds.column_names or [])}, but GRPO and "
                        "RLOO need `prompt` (and the columns its reward functions read, e.g. `answer`). Fix: rename "
                        "the prompt column, or use prompt-completion data (its completion becomes `answer`).")


def check_data(cfg, splits, tokenizer) -> list[str]:
    """Prompts present; every reward function's named arguments are columns of the data (or passed by TRL)."""
    where = cfg.script.dataset_name
    for split, ds in zip((cfg.script.dataset_train_split, cfg.script.dataset_test_split), splits):
        if ds is None:
            continue
        check_columns(ds, where)
        if len(ds) == 0:
            raise UserError(f"the `{split}` split of the dataset {where} has no prompts. Fix: point dataset_name at "
                            "data with rows.")
        # TRL passes every column to the rewards but these (trl 1.16 _calculate_rewards)
        columns = set(with_answer(ds).column_names) - {"prompt", "completion", "completion_ids"}
        for path in cfg.kind_args.reward_funcs:
            check_reward_func(path, columns)
        if tokenizer is not None and row_checks.conversational(ds):
            row_checks.check_chat_template(tokenizer, cfg.model.model_name_or_path, where)
    return []
