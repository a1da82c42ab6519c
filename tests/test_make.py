"""The Makefile's set-up steps as a person sees them: `make venv`'s few lines and its log, and what `make test` says
when it cannot install Slurm."""

import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

from conftest import REPO


def test_a_failing_make_venv_step_names_its_log(tmp_path):
    venv, missing = tmp_path / "venv", tmp_path / "torch-0-py3-none-any.whl"
    # as from a shell: not as a sub-make of `make test` (make[1]: ..., its MAKEFLAGS)
    env = {k: v for k, v in os.environ.items() if k not in ("MAKELEVEL", "MAKEFLAGS", "MFLAGS")}
    res = subprocess.run(["make", "--no-print-directory", "venv", f"VENV={venv}", f"PYTHON={sys.executable}",
                          f"TORCH_SPEC={missing}", "CONSTRAINTS="], cwd=REPO, capture_output=True, text=True,
                         timeout=300, env=env)
    log = venv / "install.log"
    assert res.returncode != 0
    assert res.stdout.splitlines() == [
        f"[venv] creating {venv} with Python {sys.version.split()[0]}; pip's output goes to {log}",
        f"[venv] installing {missing}"]
    err = res.stderr.splitlines()  # pip's last lines, this line, then make's own "make: *** [...] Error 1"
    assert err[-2] == f"[venv] failed; pip's whole output: {log}" and err[-1].startswith("make: ***") and len(err) <= 7
    assert str(missing) in log.read_text()  # pip's own error, kept whole in the log
    assert not (venv / ".installed").exists()  # the next `make venv` tries again


def test_make_test_says_which_tests_skip_where_it_cannot_install_slurm(tmp_path):
    """A machine without Slurm or apt-get (a PATH with only what the script itself needs)."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for tool in ("bash", "id"):
        (bin_dir / tool).symlink_to(shutil.which(tool))
    res = subprocess.run([str(bin_dir / "bash"), "scripts/install_slurm.sh", "--if-possible"], cwd=REPO,
                         capture_output=True, text=True, timeout=60, env={"PATH": str(bin_dir)})
    assert res.returncode == 0 and res.stderr == "", res.stderr
    assert res.stdout.splitlines() == [
        "[test] no Slurm here (missing slurmctld slurmd sbatch munged): the tests of tests/test_slurm.py will skip. "
        "To run them: sudo scripts/install_slurm.sh"]


# ---- make serve-check: the run's own problems before the environments are built, and the user's engine pythons

def make_serve_check(tmp_path, *args, **env):
    """`make serve-check` as from a shell, with the venv this suite runs in (-o: never remade here), the asset cache
    in tmp_path, and a `python3` on PATH that records being called: serve-env's `python3 -m venv`, the first step of
    building an engine's environment."""
    bin_dir, calls = tmp_path / "bin", tmp_path / "python3-calls"
    bin_dir.mkdir(exist_ok=True)
    (bin_dir / "python3").write_text(f'#!/bin/sh\necho "$@" >> {calls}\nexit 1\n')
    (bin_dir / "python3").chmod(0o755)
    venv = Path(sys.executable).parent.parent
    clean = {k: v for k, v in os.environ.items() if k not in ("MAKELEVEL", "MAKEFLAGS", "MFLAGS")}
    res = subprocess.run(["make", "--no-print-directory", "-o", f"{venv}/.installed", "serve-check", f"VENV={venv}",
                          *args], cwd=REPO, capture_output=True, text=True, timeout=120,
                         env={**clean, "PATH": f"{bin_dir}:{clean['PATH']}", "FSDP_RECIPES_CACHE": str(tmp_path / "cache"),
                              **env})
    return res, calls


def test_serve_check_names_a_run_without_a_merged_model_before_building_anything(tmp_path):
    run = tmp_path / "run"
    run.mkdir()
    (run / "run_args.json").write_text("{}")
    (run / "adapter_config.json").write_text("{}")  # a LoRA run saved without its merged model
    started = time.time()
    res, calls = make_serve_check(tmp_path, f"RUN={run}")
    seconds = time.time() - started
    errors = [line for line in res.stderr.splitlines() if not line.startswith("make: ***")]
    assert res.returncode != 0 and errors == [
        f"error: {run} holds a LoRA adapter but no merged model. Fix: run it with --save_merged_model true, or merge "
        f"it (peft's merge_and_unload) into a folder and export that folder."], res.stdout + res.stderr
    assert not calls.exists() and not (tmp_path / "cache" / "serve-env").exists(), "serve-env started a build"
    assert seconds < 60, seconds


def test_serve_check_uses_the_engine_pythons_the_user_names(tmp_path):
    """docs/serving.md's GPU route: FSDP_RECIPES_VLLM_PYTHON names the GPU node's vLLM. The Makefile used to set both
    variables to its own environments over the user's, and built them first. Here the CLI is a stand-in that records
    its arguments and the two variables; llama.cpp's python comes from make's command line, vLLM's from the
    environment."""
    log = tmp_path / "cli-calls"
    cli = tmp_path / "cli"
    cli.write_text(f'#!/bin/sh\necho "$* | $FSDP_RECIPES_LLAMACPP_PYTHON | $FSDP_RECIPES_VLLM_PYTHON" >> {log}\n')
    cli.chmod(0o755)
    run = tmp_path / "run"
    res, calls = make_serve_check(tmp_path, f"RUN={run}", f"CLI={cli}", "FSDP_RECIPES_LLAMACPP_PYTHON=/opt/llama/python",
                                  FSDP_RECIPES_VLLM_PYTHON="/gpu/vllm/bin/python")
    assert res.returncode == 0, res.stdout + res.stderr
    assert not calls.exists() and not (tmp_path / "cache" / "serve-env").exists(), "serve-env started a build"
    assert res.stdout.splitlines() == [
        "[serve-env] llama.cpp: FSDP_RECIPES_LLAMACPP_PYTHON names /opt/llama/python; nothing to build",
        "[serve-env] vLLM: FSDP_RECIPES_VLLM_PYTHON names /gpu/vllm/bin/python; nothing to build"]
    first, second = log.read_text().splitlines()
    assert first.startswith(f"serve-check {run} --engine all --run-only")  # the run's own problems first
    assert second == f"serve-check {run} --engine all | /opt/llama/python | /gpu/vllm/bin/python"


# ---- make finetune's exit code for scripts: EXIT_CODE_FILE (docs/training.md#exit-codes)

PROBES = REPO / "tests" / "probes"
# the launcher's exit codes (errors.py, launch/explain_failure.py) and what a CI script does with each
ENDINGS = {1: "failed during training", 2: "a mistake, found before training", 3: "a failed gate",
           4: "diverged", 75: "preempted: requeue", 130: "interrupted"}


def make_target(tmp_path, target: str, *args, **env) -> subprocess.Popen:
    venv = Path(sys.executable).parent.parent
    clean = {k: v for k, v in os.environ.items() if k not in ("MAKELEVEL", "MAKEFLAGS", "MFLAGS")}
    return subprocess.Popen(["make", "--no-print-directory", "-o", f"{venv}/.installed", target, f"VENV={venv}",
                             *args], cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env={**clean, "FSDP_RECIPES_CACHE": str(tmp_path / "cache"), **env})


def test_make_finetune_writes_the_launchers_own_exit_code_where_exit_code_file_says(tmp_path):
    """make exits 2 for every failure; EXIT_CODE_FILE gets the launcher's own code, whatever it is. The launcher
    ends at once here with each code (tests/probes: FAKE_LAUNCH_EXIT), after make's `recipes check` passed; its
    in-process recording of each way it ends: tests/test_mistakes.py. An earlier run's file is removed when make
    starts, and a step before the launcher (an unknown recipe) writes its own failure."""
    probes = f"{PROBES}:{os.environ.get('PYTHONPATH', '')}"
    files = {code: tmp_path / f"code-{code}" for code in ENDINGS}
    for file in files.values():
        file.write_text("0\n")  # a completed earlier run's: never what a script reads after this one
    runs = {code: make_target(tmp_path, "finetune", "RECIPE=tiny-cpu-lora", f"EXIT_CODE_FILE={files[code]}",
                              PYTHONPATH=probes, FAKE_LAUNCH_EXIT=str(code)) for code in ENDINGS}
    for code, proc in runs.items():
        out, err = proc.communicate(timeout=300)  # 6 makes at once, each a launcher process: seconds, on 2 cores
        assert proc.returncode == 2, (code, out, err)  # make's contract: non-zero, whatever failed
        assert f"error: the launch ended with exit code {code}" in err, err
        assert files[code].read_text() == f"{code}\n", (code, ENDINGS[code], err)
    unknown = make_target(tmp_path, "finetune", "RECIPE=nope", f"EXIT_CODE_FILE={files[3]}")
    _, err = unknown.communicate(timeout=120)
    assert unknown.returncode == 2 and "unknown recipe 'nope'" in err and files[3].read_text() == "2\n", err


def test_make_finetune_and_smoke_take_a_recipe_folder_by_its_path_as_make_plan_does(tmp_path):
    """`recipes check` passed a copied folder's path, then bash looked for recipes//tmp/.../launch.sh (exit 127)."""
    folder = shutil.copytree(REPO / "recipes" / "tiny-cpu-lora", tmp_path / "my-recipe")
    venv = Path(sys.executable).parent.parent
    clean = {k: v for k, v in os.environ.items() if k not in ("MAKELEVEL", "MAKEFLAGS", "MFLAGS")}
    for target, recipe, runs in [("finetune", str(folder), folder / "launch.sh"),
                                 ("smoke", str(folder), folder / "launch.sh"),
                                 ("finetune", "tiny-cpu-lora", "recipes/tiny-cpu-lora/launch.sh")]:
        res = subprocess.run(["make", "--no-print-directory", "-n", "-o", f"{venv}/.installed", target,
                              f"VENV={venv}", f"RECIPE={recipe}"], cwd=REPO, capture_output=True, text=True,
                             timeout=60, env=clean)
        assert res.returncode == 0, res.stderr
        assert res.stdout.splitlines()[-1].endswith(f" bash {runs} "), res.stdout
