"""What a rank shows on the console and what it keeps for its log only (train/console.py). The launch itself, its
console and rank logs: tests/test_default_recipe.py."""

import os
import subprocess
import sys
import textwrap

import pytest

from fsdp_recipes.train import console
from fsdp_recipes.train.failure_record import DETAILS_FILE, ERROR_FILE_ENV

PEFT_WARNING = ("`is_gradient_checkpointing` is deprecated and will be removed in v6. Use "
                "`is_activation_checkpointing` instead.")  # as transformers 5.23 words it


def test_a_training_log_is_one_line():
    logs = {"loss": 2.2171, "grad_norm": 2.579, "learning_rate": 0.001, "tokens_per_second": 1461.4, "epoch": 0.016}
    assert console.progress_line(logs, 4, 48) == "[train] step  4/48  loss 2.217  lr 1.00e-03  1,461 tokens/s"
    assert console.progress_line({"loss": 0.05888}, 48, 48) == "[train] step 48/48  loss 0.05888"
    grpo = {"loss": -0.002552, "learning_rate": 2e-05, "reward": 0.84375, "tokens_per_second": 133.2}
    assert console.progress_line(grpo, 4, 40) == "[train] step  4/40  loss -0.002552  lr 2.00e-05  reward 0.844  133 tokens/s"


def test_an_eval_log_is_one_line_and_the_end_of_training_totals_none():
    assert console.progress_line({"eval_loss": 2.30102, "eval_runtime": 0.08}, 8, 8) == \
        "[train] eval at step 8/8: loss 2.301"
    assert console.progress_line({"train_runtime": 30.7, "train_loss": 1.45}, 8, 8) is None


def test_only_the_listed_upstream_warning_is_kept_off_the_console(tmp_path):
    """In a process of its own, as a rank: pytest records warnings itself, which would hide what reaches stderr."""
    script = textwrap.dedent(f"""
        import warnings
        from fsdp_recipes.train import console
        console.keep_upstream_warnings_in_log()
        warnings.simplefilter("always")
        warnings.warn({PEFT_WARNING!r}, FutureWarning)
        warnings.warn({PEFT_WARNING!r}, UserWarning)  # the same words, another category: not ours to hide
        warnings.warn("another deprecation", FutureWarning)
    """)
    env = dict(os.environ, **{ERROR_FILE_ENV: str(tmp_path / "error.json")})  # as under torchrun
    res = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr
    kept = (tmp_path / DETAILS_FILE).read_text()
    assert f"FutureWarning: {PEFT_WARNING}" in kept and "UserWarning" not in kept and "another" not in kept
    assert f"UserWarning: {PEFT_WARNING}" in res.stderr and "FutureWarning: another deprecation" in res.stderr
    assert f"FutureWarning: {PEFT_WARNING}" not in res.stderr


def test_upstream_warnings_no_recipe_can_act_on_stay_in_the_log():
    """As torch 2.13 (an FSDP1 recipe's every save: 6 on the console of a 3-step `make smoke
    RECIPE=mistral-small-lora`) and peft 0.21 (LoRA on GPT-2's Conv1D layers) word them."""
    fsdp1 = ("FSDP.state_dict_type() and FSDP.set_state_dict_type() are being deprecated. Please use APIs, "
             "get_state_dict() and set_state_dict(), which can support different parallelisms, FSDP1, FSDP2, DDP.")
    assert console.log_only(FutureWarning, fsdp1) and not console.log_only(UserWarning, fsdp1)
    assert console.log_only(UserWarning, "fan_in_fan_out is set to False but the target module is `Conv1D`. Setting "
                                         "fan_in_fan_out to True.")


@pytest.mark.parametrize("under_launcher", [True, False])
def test_details_go_to_the_rank_log_file_or_stderr(tmp_path, monkeypatch, capsys, under_launcher):
    if under_launcher:
        monkeypatch.setenv(ERROR_FILE_ENV, str(tmp_path / "error.json"))
    else:
        monkeypatch.delenv(ERROR_FILE_ENV, raising=False)
    console.details("[train] step 4: {}")
    err = capsys.readouterr().err
    if under_launcher:
        assert (tmp_path / DETAILS_FILE).read_text() == "[train] step 4: {}\n" and err == ""
    else:
        assert err == "[train] step 4: {}\n" and not (tmp_path / DETAILS_FILE).exists()


# bitsandbytes.functional.has_avx512bf16() answers True, as on a Zen 4 or a Sapphire Rapids CPU, whatever this one is
AVX512_BF16_CPU = """
import importlib.abc, importlib.util, sys

class AVX512BF16(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name != "bitsandbytes.functional":
            return None
        sys.meta_path.remove(self)
        spec = importlib.util.find_spec(name)
        run = spec.loader.exec_module

        def exec_module(module):
            run(module)
            module.has_avx512bf16 = lambda: True

        spec.loader.exec_module = exec_module
        return spec

sys.meta_path.insert(0, AVX512BF16())
"""
KERNEL_RECORD = "Failed to load CPU gemm_4bit_forward from kernels-community"  # bitsandbytes 0.50.2's words


@pytest.mark.parametrize("process", ["none", "rank", "launcher"])
def test_bitsandbytes_kernel_record_stays_off_the_console(process, tmp_path):
    """peft imports bitsandbytes whenever it is installed; on a CPU with AVX-512 BF16 its CPU backend logs, at import,
    that it could not fetch a hub kernel (library_logs.py). A rank keeps that in its log, the launcher drops it, and
    without either the console shows it (the control: the faked CPU does reach that record here). The rank and the
    launcher as they start: each stops at its first mistake (no such config or recipe), peft imported after."""
    from conftest import qlora_site

    start = {"none": "",
             "rank": "from fsdp_recipes.train import entry\ntry:\n    entry.train_once(['--config', 'missing.yaml'])\n"
                     "except BaseException:\n    pass\n",
             "launcher": "from fsdp_recipes.launch import launcher\ntry:\n    launcher.main(['no-such-recipe'])\n"
                         "except BaseException:\n    pass\n"}
    script = AVX512_BF16_CPU + start[process] + "import peft\nprint('imported')\n"
    env = dict(os.environ, PYTHONPATH=qlora_site(), **{ERROR_FILE_ENV: str(tmp_path / "error.json")})
    res = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=120,
                         cwd=tmp_path)
    assert res.returncode == 0 and res.stdout.endswith("imported\n"), res.stderr[-2000:]
    details = tmp_path / DETAILS_FILE
    assert (KERNEL_RECORD in res.stderr) == (process == "none"), res.stderr[-2000:]
    assert (details.exists() and KERNEL_RECORD in details.read_text()) == (process == "rank")
    if process == "rank":
        assert f"WARNING bitsandbytes.backends.cpu.ops: {KERNEL_RECORD}" in details.read_text()


def test_a_diverted_record_whose_sink_fails_still_reaches_the_console(caplog):
    """logging does not guard filters: a sink that raises (a full disk under details) must not break the import
    that logs, so the record then goes on as logging would send it."""
    import logging

    from fsdp_recipes.library_logs import Diverted

    def full_disk(text):
        raise OSError(28, "No space left on device")

    logger = logging.getLogger("test_console.diverted")
    logger.addFilter(Diverted("^Failed to load", full_disk))
    with caplog.at_level(logging.WARNING, logger=logger.name):
        logger.warning("Failed to load %s", "a kernel")
    assert [r.getMessage() for r in caplog.records] == ["Failed to load a kernel"]


def test_a_fast_runs_checkpoint_ordering_note_stays_in_the_log():
    """transformers 5.23 orders checkpoints saved under a second apart (every smoke run's) by their number and says
    "mtime may not be reliable on this filesystem": on the console of `make smoke`, about a file system that is fine."""
    import logging

    from fsdp_recipes.library_logs import LOG_ONLY_RECORDS, Diverted

    kept = []
    logger = logging.getLogger("test_console.mtime")
    for name, pattern in LOG_ONLY_RECORDS:
        if name == "transformers.trainer_utils":
            logger.addFilter(Diverted(pattern, kept.append))
    logger.warning("mtime may not be reliable on this filesystem, falling back to numerical ordering")
    assert kept == ["WARNING test_console.mtime: mtime may not be reliable on this filesystem, falling back to "
                    "numerical ordering"]
