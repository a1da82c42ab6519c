"""Cluster launchers behind one interface (src/fsdp_recipes/cluster/registry.py): a launcher added here renders a
job through the same path as local, Slurm and Kubernetes; one lacking a member fails when it is registered; and the
real ones render what their schedulers need (the recipe's world size, the preemption signal, the grace period).
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import types
from pathlib import Path

import pytest
import yaml

from conftest import REPO
from fsdp_recipes.cluster import command, registry

GRACE_300 = "min_gpus: 16\npreemption_grace_s: 300\n"


def skypilot_module(**drop_or_change) -> types.ModuleType:
    """A made-up launcher as a site would add it: SkyPilot's task YAML (sky launch), with its own --cloud flag."""
    module = types.ModuleType("sites_own.skypilot")
    module.DESCRIPTION = "SkyPilot: a task YAML for `sky launch`"
    module.SIGNAL = signal.SIGTERM
    module.OUTPUT_DIR = "sky/generated"
    module.grace_seconds = lambda grace_s: grace_s + 30

    def add_arguments(parser):
        parser.add_argument("--cloud", default="aws")

    def render(job):
        task = {
            "name": f"ft-{job.name}",
            "num_nodes": job.nodes,
            "resources": {"accelerators": f"H100:{job.gpus}", "cloud": job.options.cloud},
            "envs": {"FSDP_RECIPES_LAUNCH_ARGS": job.launch_args("$SKYPILOT_NODE_RANK", "$HEAD_IP"),
                     "PREEMPTION_SIGNAL": job.signal.name, "GRACE_S": job.grace_s},
            "run": f"bash {job.folder}/launch.sh",
        }
        return {"task.yaml": yaml.safe_dump(task, sort_keys=False)}

    module.add_arguments = add_arguments
    module.render = render
    module.submit_command = lambda job, out: ["sky", "launch", str(out / "task.yaml")]
    for name, value in drop_or_change.items():
        if value is None:
            delattr(module, name)
        else:
            setattr(module, name, value)
    return module


@pytest.fixture
def skypilot():
    launcher = registry.register("skypilot", skypilot_module())
    yield launcher
    registry.LAUNCHERS.pop("skypilot")


def recipe_with(root: Path, name: str, sft: str) -> Path:
    folder = root / name
    folder.mkdir(parents=True)
    (folder / "accelerate.yaml").write_text("distributed_type: FSDP\nnum_processes: 8\n"
                                            "fsdp_config:\n  fsdp_version: 2\n")
    (folder / "sft.yaml").write_text(f"recipe_name: {name}\n{sft}")
    return folder


def test_an_added_launcher_renders_a_job_through_the_same_path(skypilot, tmp_path, capsys):
    recipe = recipe_with(tmp_path / "recipes", "long-save", GRACE_300)
    out = tmp_path / "out"
    assert command.main(["--launcher", "skypilot", str(recipe), "--nodes", "2", "--gpus", "8", "--cloud", "gcp",
                         "--out", str(out)]) == 0
    task = yaml.safe_load((out / "task.yaml").read_text())
    assert task["num_nodes"] == 2 and task["resources"] == {"accelerators": "H100:8", "cloud": "gcp"}
    assert task["envs"] == {
        "FSDP_RECIPES_LAUNCH_ARGS": "--num_machines 2 --machine_rank $SKYPILOT_NODE_RANK --main_process_ip $HEAD_IP "
                                    "--main_process_port 29500 --num_processes 16 --rdzv_backend c10d",
        "PREEMPTION_SIGNAL": "SIGTERM", "GRACE_S": 330}  # the recipe's 300 s save + the launcher's own 30
    printed = capsys.readouterr().out.splitlines()
    assert printed[0] == (f"[job] long-save on skypilot: 2 node(s) x 8 GPU(s) = 16, preempted by SIGTERM with 330 s "
                          f"to save -> {out}/")
    assert printed[-1] == f"[job] submit: sky launch {out}/task.yaml"
    # The shared checks run before the launcher's render: a count the recipe cannot use writes nothing.
    with pytest.raises(SystemExit) as stop:
        command.main(["--launcher", "skypilot", str(recipe), "--nodes", "1", "--gpus", "4",
                      "--out", str(tmp_path / "x")])
    assert stop.value.code == 2 and not (tmp_path / "x").exists()


@pytest.mark.parametrize("member", ["render", "SIGNAL", "grace_seconds", "submit_command", "OUTPUT_DIR", "DESCRIPTION"])
def test_a_launcher_lacking_a_member_fails_at_registration_naming_it(member):
    with pytest.raises(TypeError, match=rf"cluster launcher skypilot \(sites_own.skypilot\) lacks {member}:"):
        registry.register("skypilot", skypilot_module(**{member: None}))
    assert "skypilot" not in registry.LAUNCHERS


def test_a_launcher_whose_signal_the_ranks_ignore_fails_at_registration():
    with pytest.raises(TypeError, match=r"preempts with <Signals.SIGHUP: 1>, which the ranks do not save on: use one "
                                        r"of SIGTERM, SIGUSR1"):
        registry.register("skypilot", skypilot_module(SIGNAL=signal.SIGHUP))
    with pytest.raises(TypeError, match=r"render must be a function"):
        registry.register("skypilot", skypilot_module(render="task.yaml"))


def test_every_shipped_launcher_is_registered_with_its_signal():
    assert {name: registry.load(name).SIGNAL for name in registry.names()} == {
        "local": signal.SIGTERM, "slurm": signal.SIGUSR1, "k8s": signal.SIGTERM}


def rendered(argv: list[str], capsys) -> str:
    assert command.main([*argv, "--print"]) == 0
    return capsys.readouterr().out


def test_slurm_job_is_the_shipped_script_with_the_jobs_header(tmp_path, capsys):
    recipe = recipe_with(tmp_path / "recipes", "long-save", GRACE_300)
    text = rendered(["--launcher", "slurm", str(recipe), "--nodes", "4", "--gpus", "4"], capsys)
    lines = text.splitlines()
    assert lines[0] == "# ==> job.sbatch <=="
    assert "#SBATCH --nodes=4" in lines and "#SBATCH --gpus-per-node=4" in lines
    assert "#SBATCH --signal=USR1@360" in lines  # 300 s to save + 60 s for torchrun's shutdown and the summary
    assert "#SBATCH --job-name=ft-long-save" in lines
    assert f'RECIPE="${{RECIPE:-{recipe}}}"  # the environment\'s RECIPE (and ARGS) still win' in lines
    shipped = (REPO / "slurm" / "fsdp_multinode.sbatch").read_text().splitlines()
    changed = {"#SBATCH --nodes=2", "#SBATCH --gpus-per-node=8", "#SBATCH --signal=USR1@300",
               "#SBATCH --job-name=fsdp-multinode"}
    usage = next(line for line in shipped if line.startswith("#   RECIPE="))  # the template's, by hand
    assert '#   ARGS="--max_steps 500" sbatch slurm/generated/long-save/job.sbatch   # ARGS (optional) overrides ' \
           "fields" in lines  # this job's own usage line, in place of the template's
    assert [line for line in shipped if line not in changed | {usage}] == [
        line for line in lines[1:] if not line.startswith(("#SBATCH --", "# Generated by", "RECIPE=", "#   ARGS="))
        or line in shipped]
    one_node = rendered(["--launcher", "slurm", "tiny-cpu-lora", "--nodes", "1", "--gpus", "2"], capsys)
    assert "srun --nodes=1 --ntasks=1" in one_node and "#SBATCH --signal=USR1@180" in one_node  # default 120 s


def test_slurm_jobs_comments_say_its_own_signal_lead_and_usage(capsys, tmp_path):
    """The generated 1-node script's comment said "`--signal=USR1@300` ... five minutes" above its `USR1@180`
    directive, and its usage example named mistral-small-lora and the template's path."""
    text = rendered(["--launcher", "slurm", "tiny-cpu-lora", "--nodes", "1", "--gpus", "2", "--out",
                     str(tmp_path / "job")], capsys)
    assert "#SBATCH --signal=USR1@180" in text.splitlines()
    comments = [line for line in text.splitlines() if line.startswith("# ") or line.startswith("#   ")]
    said = " ".join(comments)
    assert "`--signal=USR1@180` asks the launcher to save and exit 75 180 s before the time limit" in \
        " ".join(line.lstrip("# ") for line in comments)
    assert "USR1@300" not in text and "five minutes" not in text and "minutes before" not in said
    assert "mistral-small-lora" not in said and "slurm/fsdp_1node.sbatch\n" not in text
    assert f'#   ARGS="--max_steps 500" sbatch {tmp_path / "job" / "job.sbatch"}' in said
    # a template whose usage comment the user edited away keeps its words (it raised "a bug in the repository")
    from types import SimpleNamespace

    from fsdp_recipes.cluster import slurm

    job = SimpleNamespace(options=SimpleNamespace(out=None), name="tiny-cpu-lora", grace_s=180)
    assert slurm.job_comments("#!/bin/bash\n# my own notes\n", job) == "#!/bin/bash\n# my own notes\n"


def test_local_job_runs_the_launcher_with_its_gpu_count(tmp_path, capsys):
    """What launch.sh runs, not launch.sh: a recipe folder copied without it got `exec bash <folder>/launch.sh`, which
    does not exist, where the launcher runs the folder fine."""
    import importlib.util

    from fsdp_recipes.cluster import local

    text = rendered(["--launcher", "local", "tiny-cpu-lora", "--gpus", "2"], capsys)
    assert 'export FSDP_RECIPES_LAUNCH_ARGS="--num_processes 2"' in text
    assert 'exec "$py" -m fsdp_recipes.launch.launcher recipes/tiny-cpu-lora "$@"' in text
    assert "within 120 s" in text  # no scheduler kills after torchrun's own grace: the recipe's
    copied = tmp_path / "copied"
    shutil.copytree(REPO / "recipes" / "tiny-cpu-lora", copied, ignore=shutil.ignore_patterns("launch.sh"))
    text = rendered(["--launcher", "local", str(copied), "--nodes", "1", "--gpus", "2"], capsys)
    assert f'exec "$py" -m fsdp_recipes.launch.launcher {copied} "$@"' in text
    assert "bash " not in text.replace("#!/usr/bin/env bash", "")  # nothing runs a launch.sh
    spec = importlib.util.spec_from_file_location("sync_recipes", REPO / "scripts" / "sync_recipes.py")
    sync = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(sync)
    assert local.NOT_INSTALLED == sync.NOT_INSTALLED  # launch.sh's line, word for word
    assert 'py=$(command -v python || command -v python3 || true)' in sync.LAUNCH_SH


@pytest.mark.parametrize("args, message", [
    (["--launcher", "sllurm", "tiny-cpu-lora"], "error: no cluster launcher named 'sllurm'. Fix: --launcher slurm."),
    (["tiny-cpu-lora"], "error: the following arguments are required: --launcher. Fix: see `fsdp-recipes job "
                        "--launcher <name> --help`."),
    (["--launcher", "local", "tiny-cpu-lora", "--nodes", "2"], "error: the local launcher runs one node and got "
                                                               "--nodes 2. Fix: --nodes 1, or --launcher slurm or k8s "
                                                               "for 2 nodes."),
])
def test_job_mistakes_are_one_line(args, message, tmp_path):
    out = subprocess.run([sys.executable, "-m", "fsdp_recipes.cli", "job", *args, "--out", str(tmp_path / "o")],
                         cwd=REPO, capture_output=True, text=True, timeout=120)
    assert out.returncode == 2 and out.stderr.splitlines() == [message], out.stderr
    assert not (tmp_path / "o").exists()


def test_an_hsdp_job_tells_each_node_the_replicas_for_its_node_count(tmp_path, skypilot):
    recipe = recipe_with(tmp_path / "recipes", "hsdp", "min_gpus: 0\n")
    (recipe / "accelerate.yaml").write_text("distributed_type: FSDP\nnum_machines: 2\nnum_processes: 16\nfsdp_config:\n"
                                            "  fsdp_version: 2\nparallelism_config:\n"
                                            "  parallelism_config_dp_replicate_size: 2\n"
                                            "  parallelism_config_dp_shard_size: 8\n")
    job = command.build(registry.load("skypilot"), str(recipe), 4, 8, command.parser(None).parse_args(
        ["--launcher", "skypilot", str(recipe)]))
    assert job.world_size == 32 and job.grace_s == 150  # preemption_grace_s's default 120 + 30
    assert job.launch_args("3", "head") == ("--num_machines 4 --machine_rank 3 --main_process_ip head "
                                            "--main_process_port 29500 --num_processes 32 --rdzv_backend c10d "
                                            "--parallelism_config_dp_replicate_size 4")


def test_submit_runs_the_launchers_command(tmp_path):
    """--submit: the files written, then the scheduler's own command on them (a stand-in sbatch here)."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "sbatch").write_text('#!/usr/bin/env bash\necho "sbatch got $*"\n')
    (bin_dir / "sbatch").chmod(0o755)
    out = tmp_path / "job"
    env = {**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}"}
    res = subprocess.run([sys.executable, "-m", "fsdp_recipes.cli", "job", "--launcher", "slurm", "tiny-cpu-lora",
                          "--gpus", "2", "--out", str(out), "--submit"], cwd=REPO, env=env, capture_output=True,
                         text=True, timeout=120)
    assert res.returncode == 0, res.stderr
    assert res.stdout.splitlines()[-1] == f"sbatch got {out}/job.sbatch"
    assert "#SBATCH --gpus-per-node=2" in (out / "job.sbatch").read_text()


def test_slurm_outside_the_repository_is_one_line(tmp_path):
    res = subprocess.run([sys.executable, "-m", "fsdp_recipes.cli", "job", "--launcher", "slurm",
                          str(REPO / "recipes" / "tiny-cpu-lora"), "--gpus", "1", "--print"], cwd=tmp_path,
                         capture_output=True, text=True, timeout=120)
    assert res.returncode == 2
    assert res.stderr.splitlines() == [
        "error: slurm/fsdp_1node.sbatch not found: a Slurm job is made from the repository's slurm/ scripts. Fix: run "
        "from the fsdp-recipes repository root, or set FSDP_RECIPES_HOME=<repo>."]
