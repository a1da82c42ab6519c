"""`fsdp-recipes <command>` (src/fsdp_recipes/cli/): a mistyped command or a missing argument is one line with the
fix, a command runs its module's main, and the Makefile's targets go through it."""

from __future__ import annotations

import importlib
import re
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import REPO
from fsdp_recipes.cli.commands import COMMANDS, Command
from fsdp_recipes.config.kind_registry import TRAINERS


def cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "fsdp_recipes.cli", *args], cwd=REPO, capture_output=True,
                          text=True, timeout=120)


@pytest.mark.parametrize("args, line", [
    (["finetun", "tiny-cpu-lora"], "error: no command 'finetun'. Fix: fsdp-recipes finetune (`fsdp-recipes --help` "
                                   "lists them)."),
    (["serve_check"], "error: no command 'serve_check'. Fix: fsdp-recipes serve-check (`fsdp-recipes --help` lists "
                      "them)."),
    (["export"], "error: the following arguments are required: checkpoint, out. Fix: see `fsdp-recipes export "
                 "--help`."),
    (["plan"], "error: the following arguments are required: recipe. Fix: see `fsdp-recipes plan --help`."),
    (["report", "runs/a", "--outt", "x"], "error: unrecognized arguments: --outt x. Fix: did you mean --out? see "
                                          "`fsdp-recipes report --help`."),
    (["plan", "mistral-7b-full", "--gpus", "abc"], "error: --gpus takes a whole number, not 'abc'. Fix: --gpus <n> "
                                                   "(make: GPUS=<n>)."),  # make plan GPUS=abc
    (["recipes", "check", "no-such-recipe"], None),  # the recipes module's own one line
])
def test_a_mistake_is_one_line_and_exit_2(args, line):
    out = cli(*args)
    assert out.returncode == 2, out.stderr
    lines = out.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and "Fix:" in lines[0], out.stderr
    if line:
        assert lines == [line]


def test_a_command_runs_its_modules_main():
    listed = cli("recipes", "list")
    assert listed.returncode == 0, listed.stderr
    assert re.search(r"^  tiny-cpu-lora +sft +\S", listed.stdout, re.M), listed.stdout
    assert cli("recipes", "check", "tiny-cpu-lora").returncode == 0


def test_help_lists_every_command():
    out = cli("--help")
    assert out.returncode == 0
    for command in COMMANDS:
        assert re.search(rf"^  {re.escape(command.name)} +\S", out.stdout, re.M), command.name


def test_every_command_names_a_main_that_exists():
    for command in COMMANDS:
        module, function = command.target.split(":")
        assert callable(getattr(importlib.import_module(module), function)), command.target


def test_a_row_with_a_bad_target_fails_when_written():
    with pytest.raises(TypeError, match=r"command nope: target 'fsdp_recipes.nope' is not"):
        Command("nope", "fsdp_recipes.nope", "nothing")


def test_the_makefile_calls_the_cli():
    """`make <target>` runs `python -m fsdp_recipes.cli <command>`, never a module of the pack directly."""
    text = (REPO / "Makefile").read_text()
    direct = re.findall(r"-m fsdp_recipes\.(?!cli\b)[\w.]+", text)
    assert not direct, direct
    res = subprocess.run(["make", "-n", "--no-print-directory", f"VENV={Path(sys.prefix)}", "-o",
                          str(Path(sys.prefix) / ".installed"), "job", "LAUNCHER=slurm", "RECIPE=tiny-cpu-lora"],
                         cwd=REPO, capture_output=True, text=True, timeout=60)
    assert res.returncode == 0, res.stderr
    assert "-m fsdp_recipes.cli job --launcher slurm tiny-cpu-lora --nodes 1 --gpus 8" in res.stdout


@pytest.mark.parametrize("target, fix", [
    ("finetune", "Fix: CUDA_VISIBLE_DEVICES=0,1 make finetune RECIPE=tiny-cpu-lora (those GPUs, the same global batch), "
                 "or FSDP_RECIPES_LAUNCH_ARGS=\"--num_processes 2\""),
    ("smoke", "Fix: drop GPUS; make finetune RECIPE=tiny-cpu-lora runs it"),
])
def test_gpus_given_to_a_target_that_runs_here_is_refused_not_ignored(target, fix, tmp_path):
    """GPUS is make plan's, job's and k8s's: `make finetune GPUS=2` silently ran on what placement chose. Refused in
    one line, exit 2 (also in EXIT_CODE_FILE) before the recipe is looked at; without it the target runs as before."""
    make = ["make", "--no-print-directory", f"VENV={Path(sys.prefix)}", "-o", str(Path(sys.prefix) / ".installed"),
            target, "RECIPE=tiny-cpu-lora"]
    res = subprocess.run([*make, "GPUS=2", f"EXIT_CODE_FILE={tmp_path / 'rc'}"], cwd=REPO, capture_output=True,
                         text=True, timeout=60)
    errors = [line for line in res.stderr.splitlines() if line.startswith("error:")]
    assert res.returncode == 2 and len(errors) == 1 and fix in errors[0], res.stderr
    assert errors[0].startswith(f"error: GPUS=2 ") and (tmp_path / "rc").read_text().strip() == "2"
    assert "recipes check" not in res.stdout + res.stderr
    plain = subprocess.run(["make", "-n", *make[1:]], cwd=REPO, capture_output=True, text=True, timeout=60)
    assert plain.returncode == 0 and "GPUS" not in plain.stdout and "launch.sh" in plain.stdout, plain.stderr
    if target == "finetune":  # GPUS=0 names no process count of 0, and the way to run without GPUs
        zero = subprocess.run([*make, "GPUS=0"], cwd=REPO, capture_output=True, text=True, timeout=60)
        assert zero.returncode == 2 and "--num_processes 0" not in zero.stderr, zero.stderr
        assert '--num_processes <n>"' in zero.stderr and "make smoke RECIPE=tiny-cpu-lora" in zero.stderr


def test_recipes_list_describes_a_recipe_by_its_whole_first_paragraph(tmp_path):
    """A README paragraph wrapped over lines was cut at its first line ("... 12.9B active per token:"), and a link
    was listed as markdown."""
    from fsdp_recipes.config.recipes import describe

    (tmp_path / "README.md").write_text("# moe\n\nLoRA on a mixture of experts (46.7B parameters, 12.9B active per "
                                        "token:\n2 of 8 experts), as [the default](../d/README.md).\n\n- **Hardware**: "
                                        "8 GPUs\n")
    assert describe(tmp_path) == ("LoRA on a mixture of experts (46.7B parameters, 12.9B active per token: 2 of 8 "
                                  "experts), as the default.")


def test_a_mistyped_recipe_names_the_nearest_one():
    from fsdp_recipes.config.recipes import resolve
    from fsdp_recipes.errors import UserError

    with pytest.raises(UserError, match=r"^unknown recipe 'tiny-cpu-lorra'\. Fix: did you mean RECIPE=tiny-cpu-lora\?"):
        resolve("tiny-cpu-lorra")
    # a family's prefix: every recipe of it, not the one closest spelling
    with pytest.raises(UserError, match=r"did you mean RECIPE=mistral-7b-full or RECIPE=mistral-large-hsdp or "
                                        r"RECIPE=mistral-large-qlora-4xh100 or RECIPE=mistral-small-lora or "
                                        r"RECIPE=mistral-small-lora-2xh200\?"):
        resolve("mistral")
    with pytest.raises(UserError, match=r"^unknown recipe 'nope'\. Available: ddp-baseline, "):
        resolve("nope")


def test_a_recipe_named_outside_the_project_says_where_names_are_looked_up(tmp_path, monkeypatch):
    """It said "Available: none found under ./recipes. Fix: RECIPE=<one of those> (see `make help`)": no recipe to
    choose, and make's words for a user of the installed command."""
    from fsdp_recipes.config.recipes import resolve
    from fsdp_recipes.errors import UserError

    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("FSDP_RECIPES_DIR", raising=False)
    with pytest.raises(UserError) as err:
        resolve("tiny-cpu-lora")
    assert str(err.value) == (f"unknown recipe 'tiny-cpu-lora': no recipe folders in {tmp_path.resolve() / 'recipes'}, "
                              "where names are looked up. Fix: give the recipe's folder (path/to/recipes/tiny-cpu-lora),"
                              " run from the project that holds recipes/, or set FSDP_RECIPES_DIR to that recipes/ "
                              "folder.")
    monkeypatch.setenv("FSDP_RECIPES_DIR", str(REPO / "recipes"))  # the way it names
    assert resolve("tiny-cpu-lora") == REPO / "recipes" / "tiny-cpu-lora"


def test_a_reader_that_closes_the_pipe_is_no_traceback():
    """`make plan ... | head -2` printed a 15-line BrokenPipeError traceback."""
    script = ("from fsdp_recipes.errors import cli\n"
              "main = cli(lambda: [print('a line of a long report') for _ in range(200_000)])\n"
              "main()\n")
    proc = subprocess.Popen([sys.executable, "-c", script], cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True)
    assert proc.stdout.readline() == "a line of a long report\n"
    proc.stdout.close()  # as head does after its lines
    err = proc.stderr.read()
    assert proc.wait(timeout=60) == 141 and err == "", err
    # another pipe or socket that breaks is a failure, not a reader gone: its traceback stays (stdout still read)
    script = ("import socket\nfrom fsdp_recipes.errors import cli\n"
              "def main():\n    a, b = socket.socketpair()\n    b.close()\n    print('step 1')\n"
              "    for _ in range(3):\n        a.send(b'x' * 65536)\n"
              "cli(main)()\n")
    done = subprocess.run([sys.executable, "-c", script], cwd=REPO, capture_output=True, text=True, timeout=60)
    assert done.returncode == 1 and "BrokenPipeError" in done.stderr and done.stdout == "step 1\n", done


def test_a_folder_that_is_not_a_recipe_names_what_it_lacks_and_the_fix(tmp_path):
    from fsdp_recipes.config.recipes import resolve
    from fsdp_recipes.errors import UserError

    (tmp_path / "sft.yaml").write_text("max_steps: 2\n")
    with pytest.raises(UserError, match=r"is not a recipe folder: missing accelerate\.yaml\. Fix: copy the missing "):
        resolve(str(tmp_path))


def test_an_exit_code_file_in_a_missing_folder_is_refused_before_the_run(tmp_path):
    """make finetune EXIT_CODE_FILE=<missing folder>/rc trained the whole run, then warned that the code could not be
    written: a job script waiting on that file never saw it."""
    missing = tmp_path / "no-such-folder" / "rc"
    res = subprocess.run(["make", "--no-print-directory", f"VENV={Path(sys.prefix)}", "-o",
                          str(Path(sys.prefix) / ".installed"), "finetune", "RECIPE=tiny-cpu-lora",
                          f"EXIT_CODE_FILE={missing}"], cwd=REPO, capture_output=True, text=True, timeout=60)
    errors = [line for line in res.stderr.splitlines() if line.startswith("error:")]
    assert res.returncode == 2 and len(errors) == 1, res.stdout + res.stderr
    assert errors[0].startswith(f"error: EXIT_CODE_FILE={missing} is in a folder that does not exist") and \
        "Fix: create that folder first" in errors[0]
    assert "[launch]" not in res.stdout


def test_ctrl_c_that_no_step_handles_is_one_line_and_exit_130(capsys):
    """A Ctrl-C pressed again after the launcher's own handling (or during `make plan`) was a traceback."""
    from fsdp_recipes.errors import EXIT_INTERRUPTED, cli

    @cli
    def main():
        raise KeyboardInterrupt

    with pytest.raises(SystemExit) as stop:
        main()
    assert stop.value.code == EXIT_INTERRUPTED == 130
    assert capsys.readouterr().err == "interrupted\n"


def test_finetune_help_is_its_usage_or_the_recipes_fields():
    """`fsdp-recipes finetune --help` was an error naming `python -m fsdp_recipes.launch.launcher`, and
    `finetune RECIPE --help` started the ranks, then failed on a `%` in a help text (argparse formats them)."""
    usage = cli("finetune", "--help")
    assert usage.returncode == 0 and usage.stdout.startswith(
        "usage: fsdp-recipes finetune <recipe name or folder> [--field value ...]\n"), usage.stdout + usage.stderr
    fields = cli("finetune", "tiny-cpu-lora", "--help")
    assert fields.returncode == 0 and fields.stderr == "", fields.stderr
    assert fields.stdout.startswith("usage: fsdp-recipes finetune tiny-cpu-lora [--field value ...]")
    assert "starting" not in fields.stdout  # nothing was started
    # each field's default is the recipe YAML's where it sets one (recipes/tiny-cpu-lora/sft.yaml)
    assert re.search(r"--lora_r LORA_R.*?\n\s+LoRA R value\. \(default: 32\)", fields.stdout, re.S), fields.stdout
    assert re.search(r"--max_steps MAX_STEPS.*?\(default: 300\)", fields.stdout, re.S)


@pytest.mark.parametrize("trainer", sorted(TRAINERS))
def test_every_trainer_kinds_fields_help_renders(trainer):
    from fsdp_recipes.config.run_config import fields_help

    text = fields_help(trainer, "prog", {}, "x.yaml")
    assert "--output_dir" in text and "--mfu_min" in text


@pytest.mark.parametrize("command", [c.name for c in COMMANDS])
def test_every_commands_help_is_its_usage_and_exit_0(command, capsys):
    """`fsdp-recipes data --help` and `recipes --help` were `error:` lines, exit 2; `finetune --help` named
    `python -m fsdp_recipes.launch.launcher`."""
    from fsdp_recipes.cli.main import main

    try:
        code = main([command, "--help"])
    except SystemExit as stop:  # argparse's own --help
        code = stop.code
    out, err = capsys.readouterr()
    assert code == 0 and err == "", err
    assert out.startswith(f"usage: fsdp-recipes {command} "), out


def test_a_recipe_given_as_dot_has_its_folders_name(monkeypatch):
    """`cd recipes/tiny-cpu-lora && fsdp-recipes smoke .` printed `recipe  (.)` and wrote its run straight into
    runs/smoke/, the folder of every smoke run, and its accelerate copy as `.accelerate.yaml`."""
    from fsdp_recipes.config import recipes
    from fsdp_recipes.launch import smoke

    monkeypatch.chdir(REPO / "recipes" / "tiny-cpu-lora")
    assert recipes.load(".").name == "tiny-cpu-lora"
    assert smoke.model_dir(Path(".")).name == "tiny-cpu-lora"


def test_make_data_checks_the_speed_options_fields_as_the_launcher_does(cache_dir, capsys, monkeypatch):
    """`make data ARGS="--attn_implementation foo"` passed; the launcher refuses it in one line."""
    from fsdp_recipes.launch import data_preview

    monkeypatch.chdir(REPO)
    try:
        code = data_preview.main(["tiny-cpu-lora", "--attn_implementation", "foo"])
    except SystemExit as stop:
        code = stop.code
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1, err
    assert err[0].startswith("error: attn_implementation 'foo' is not an attention implementation. Fix: ")
