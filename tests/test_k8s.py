"""make k8s (`fsdp-recipes job --launcher k8s`): the generated manifests validate offline, carry the preemption/resume settings, and bad input is one line.

Validators: kubernetes-validate --strict for core kinds (the PyTorchJob pod template is checked as a PodTemplate),
the CRD OpenAPI schemas in ../shared/k8s-crds for PyTorchJob and TrainJob (skipped, with a message, without them),
k8s/schemas/runai-trainingworkload.schema.json for Run:ai, yamllint for style. Each validator is also shown a
broken manifest, so a validator that accepts everything fails here.
"""

from __future__ import annotations

import copy
import functools
import json
import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import jsonschema
import pytest
import yaml

from conftest import skip_or_fail
from fsdp_recipes.cluster import command, k8s
from fsdp_recipes.config.preemption import SHUTDOWN_MARGIN_S

REPO = Path(__file__).resolve().parent.parent
BIN = Path(sys.executable).parent
CRDS = Path(os.environ.get("FSDP_K8S_CRDS", REPO.parent / "shared" / "k8s-crds"))  # env: another copy
RUNAI_SCHEMA = REPO / "k8s" / "schemas" / "runai-trainingworkload.schema.json"

HSDP_ACCELERATE = """\
distributed_type: FSDP
num_machines: 2
num_processes: 16
fsdp_config:
  fsdp_version: 2
parallelism_config:
  parallelism_config_dp_replicate_size: 2
  parallelism_config_dp_shard_size: 8
"""


def make_recipe(root: Path, name: str, accelerate: str, sft: str = "min_gpus: 0\n") -> Path:
    """A synthetic recipe folder: only the two YAML files the generator reads."""
    folder = root / name
    folder.mkdir(parents=True)
    (folder / "accelerate.yaml").write_text(accelerate)
    (folder / "sft.yaml").write_text(f"recipe_name: {name}\n{sft}")
    return folder


def generate(recipe: str | Path, out: Path, *args: str) -> dict[str, Path]:
    assert command.main(["--launcher", "k8s", str(recipe), "--out", str(out), *args]) == 0
    return {p.name: p for p in out.iterdir()}


def load(path: Path) -> dict:
    return yaml.safe_load(path.read_text())


@pytest.fixture(scope="module")
def outputs(tmp_path_factory) -> dict[str, dict[str, Path]]:
    """Manifests for the shipped recipes and for synthetic HSDP / long-grace recipes."""
    root = tmp_path_factory.mktemp("k8s")
    hsdp = make_recipe(root / "recipes", "hsdp-demo", HSDP_ACCELERATE, "min_gpus: 16\npreemption_grace_s: 300\n")
    made = {
        "mistral-2x8": generate("mistral-small-lora", root / "m", "--nodes", "2", "--gpus", "8"),
        "tiny-1x2": generate("tiny-cpu-lora", root / "t", "--nodes", "1", "--gpus", "2"),
        "hsdp-4x8": generate(hsdp, root / "h", "--nodes", "4", "--gpus", "8", "--env", "NCCL_SOCKET_IFNAME=eth0"),
    }
    # Every shipped recipe at the size its accelerate.yaml was written for, so a new recipe is validated too.
    for folder in sorted(p for p in (REPO / "recipes").iterdir() if (p / "accelerate.yaml").is_file()):
        acc = load(folder / "accelerate.yaml")
        nodes = int(acc.get("num_machines", 1))
        gpus = max(1, int(acc.get("num_processes", 1)) // nodes)
        made[f"recipe:{folder.name}"] = generate(folder, root / folder.name, "--nodes", str(nodes), "--gpus", str(gpus))
    return made


def all_files(outputs, suffix: str) -> list[Path]:
    return [p for files in outputs.values() for name, p in files.items() if name.endswith(suffix)]


# ------------------------------------------------------------------ what the manifests say


def test_pytorchjob_nodes_resume_and_restart(outputs):
    job = load(outputs["mistral-2x8"]["pytorchjob.yaml"])
    specs = job["spec"]["pytorchReplicaSpecs"]
    assert specs["Master"]["replicas"] == 1 and specs["Worker"]["replicas"] == 1
    for replica in specs.values():
        assert replica["restartPolicy"] == "ExitCode"
        pod = replica["template"]["spec"]
        (container,) = pod["containers"]
        assert container["name"] == "pytorch"  # the operator injects MASTER_ADDR/RANK into this container only
        assert container["resources"]["limits"]["nvidia.com/gpu"] == 8
        # output_dir is on the checkpoint claim: a recreated pod finds the checkpoints and auto_resume continues.
        cmd = container["command"]
        assert cmd[:3] == ["bash", "k8s/entrypoint.sh", "mistral-small-lora"]
        assert cmd[cmd.index("--output_dir") + 1] == "/checkpoints/mistral-small-lora"
        mounts = {m["name"]: m["mountPath"] for m in container["volumeMounts"]}
        claims = {v["name"]: v.get("persistentVolumeClaim", {}).get("claimName") for v in pod["volumes"]}
        assert mounts["checkpoints"] == "/checkpoints" and claims["checkpoints"] == "fsdp-checkpoints"
        assert mounts["data"] == "/data" and claims["data"] == "fsdp-data"
        assert mounts["dshm"] == "/dev/shm"
        assert pod["terminationGracePeriodSeconds"] == 120 + SHUTDOWN_MARGIN_S  # sft.yaml default grace
        assert pod["priorityClassName"] == "fsdp-finetune-low"
        env = {e["name"]: e["value"] for e in container["env"]}
        assert env["FSDP_NNODES"] == "2" and env["FSDP_GPUS_PER_NODE"] == "8"
        assert env["TORCH_NCCL_ASYNC_ERROR_HANDLING"] == "1"


def test_a_cpu_recipe_as_a_gpu_job_says_so(tmp_path, capsys):
    """`make k8s RECIPE=tiny-cpu-lora` made 8-GPU manifests for a CPU-only recipe without a word: one line says it is
    a CPU recipe, what the manifests ask for and what the run uses of it; a GPU recipe gets no such line."""
    generate("tiny-cpu-lora", tmp_path / "t", "--nodes", "1", "--gpus", "8")
    out = capsys.readouterr().out
    assert "[job] note: tiny-cpu-lora is a CPU recipe (min_gpus 0, 2 process(es) in its accelerate.yaml); these " \
           "files ask for 1 node(s) x 8 GPU(s) (nvidia.com/gpu: 8 per pod), and the launcher runs one process per " \
           "GPU there, up to 2: GPUS=2 asks for what it uses\n" in out
    assert command.main(["--launcher", "slurm", "tiny-cpu-lora", "--nodes", "1", "--gpus", "2", "--print"]) == 0
    err = capsys.readouterr().err  # --print: the files on stdout, the note beside them
    assert err.count("\n") == 1 and "(--gpus-per-node=2)" in err and "GPUS=2 asks" not in err
    generate("mistral-small-lora", tmp_path / "m", "--nodes", "1", "--gpus", "8")
    assert "CPU recipe" not in capsys.readouterr().out


def test_single_node_has_no_workers(outputs):
    job = load(outputs["tiny-1x2"]["pytorchjob.yaml"])
    assert list(job["spec"]["pytorchReplicaSpecs"]) == ["Master"]
    assert load(outputs["tiny-1x2"]["runai.yaml"])["kind"] == "TrainingWorkload"


def test_hsdp_replicas_follow_the_node_count_and_grace_follows_the_recipe(outputs):
    job = load(outputs["hsdp-4x8"]["pytorchjob.yaml"])
    assert job["spec"]["pytorchReplicaSpecs"]["Worker"]["replicas"] == 3
    pod = job["spec"]["pytorchReplicaSpecs"]["Master"]["template"]["spec"]
    env = {e["name"]: e["value"] for e in pod["containers"][0]["env"]}
    # 4 nodes x 8 GPUs with shard groups of 8: 4 replicas, not the 2 the recipe was written for.
    assert env["FSDP_K8S_LAUNCH_EXTRA"] == "--parallelism_config_dp_replicate_size 4"
    assert env["NCCL_SOCKET_IFNAME"] == "eth0"
    assert pod["terminationGracePeriodSeconds"] == 300 + SHUTDOWN_MARGIN_S
    # min_gpus 16 is the recipe's total; each pod checks its own 8.
    cmd = pod["containers"][0]["command"]
    assert cmd[cmd.index("--min_gpus") + 1] == "8"


def test_trainjob_and_runai_use_the_same_command_and_claims(outputs):
    files = outputs["hsdp-4x8"]
    pod = load(files["pytorchjob.yaml"])["spec"]["pytorchReplicaSpecs"]["Master"]["template"]["spec"]
    command = pod["containers"][0]["command"]
    tj = load(files["trainjob.yaml"])["spec"]
    assert tj["trainer"]["command"] == command and tj["trainer"]["numNodes"] == 4
    assert tj["trainer"]["numProcPerNode"] == 8
    assert tj["podSpecOverrides"][0]["volumes"] == pod["volumes"]
    ra = load(files["runai.yaml"])
    assert ra["kind"] == "DistributedWorkload" and ra["spec"]["workers"]["value"] == 3  # + 1 master pod
    assert [ra["spec"]["command"]["value"], *ra["spec"]["arguments"]["value"].split()] == command
    claims = {i["value"]["path"]: i["value"]["claimName"] for i in ra["spec"]["pvcs"]["items"].values()}
    assert claims == {"/data": "fsdp-data", "/checkpoints": "fsdp-checkpoints"}


def test_runai_submit_script_passes_workers_gpus_and_claims(outputs, tmp_path):
    fake = tmp_path / "runai"
    fake.write_text('#!/usr/bin/env bash\nprintf "%s\\n" "$@"\n')
    fake.chmod(0o755)
    env = dict(os.environ, RUNAI=str(fake), RUNAI_PROJECT="team-a")
    out = subprocess.run(["bash", str(outputs["hsdp-4x8"]["runai-submit.sh"])], env=env, capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    argv = out.stdout.splitlines()
    assert argv[:4] == ["training", "pytorch", "submit", "ft-hsdp-demo"]
    assert argv[argv.index("-p") + 1] == "team-a"
    assert argv[argv.index("--workers") + 1] == "3" and argv[argv.index("-g") + 1] == "8"
    assert "claimname=fsdp-checkpoints,path=/checkpoints" in argv and "claimname=fsdp-data,path=/data" in argv
    assert argv[argv.index("--priority") + 1] == "train"
    assert argv[argv.index("--termination-grace-period") + 1] == f"{300 + SHUTDOWN_MARGIN_S}s"
    assert "FSDP_K8S_LAUNCH_EXTRA=--parallelism_config_dp_replicate_size 4" in argv
    assert argv[argv.index("--command") + 2 :][:3] == ["bash", "k8s/entrypoint.sh", "hsdp-demo"]
    single = subprocess.run(
        ["bash", str(outputs["tiny-1x2"]["runai-submit.sh"])], env=env, capture_output=True, text=True
    )
    assert single.stdout.splitlines()[:2] == ["training", "submit"] and "--workers" not in single.stdout
    no_project = subprocess.run(
        ["bash", str(outputs["tiny-1x2"]["runai-submit.sh"])], env=dict(env, RUNAI_PROJECT=""), capture_output=True
    )
    assert no_project.returncode != 0


# ------------------------------------------------------------------ validators, each also shown a broken manifest


def kubernetes_validate(paths: list[Path]) -> subprocess.CompletedProcess:
    exe = shutil.which("kubernetes-validate", path=f"{BIN}{os.pathsep}{os.environ.get('PATH', '')}")
    assert exe, "kubernetes-validate is missing: pip install -e .[test]"
    return subprocess.run([exe, "--strict", *map(str, paths)], capture_output=True, text=True)


def as_pod_template(job: dict, replica: str = "Master") -> dict:
    """The PyTorchJob's pod template as a core PodTemplate, so the real Kubernetes schema checks it strictly."""
    template = job["spec"]["pytorchReplicaSpecs"][replica]["template"]
    name = job["metadata"]["name"]
    return {"apiVersion": "v1", "kind": "PodTemplate", "metadata": {"name": name}, "template": template}


def test_core_kinds_pass_kubernetes_validate_strict(outputs, tmp_path):
    paths = all_files(outputs, "pvc-checkpoints.yaml") + all_files(outputs, "priorityclass.yaml")
    for i, path in enumerate(all_files(outputs, "pytorchjob.yaml")):
        paths.append(tmp_path / f"podtemplate-{i}.yaml")
        paths[-1].write_text(yaml.safe_dump(as_pod_template(load(path))))
    out = kubernetes_validate(paths)
    assert out.returncode == 0, out.stdout + out.stderr

    broken = as_pod_template(load(outputs["mistral-2x8"]["pytorchjob.yaml"]))
    broken["template"]["spec"]["terminationGracePeriod"] = 30  # misspelt: --strict must reject it
    bad = tmp_path / "broken.yaml"
    bad.write_text(yaml.safe_dump(broken))
    out = kubernetes_validate([bad])
    assert out.returncode != 0 and "terminationGracePeriod" in out.stdout + out.stderr


def crd_schema(filename: str) -> dict:
    if not CRDS.is_dir():  # the issue's rule: these schemas are optional, so say what was not checked
        skip_or_fail(f"CRD schemas not found at {CRDS} (../shared/k8s-crds): PyTorchJob/TrainJob not validated")
    return _crd_schema(filename)


@functools.cache
def _crd_schema(filename: str) -> dict:
    crd = yaml.safe_load((CRDS / filename).read_text())
    (version,) = [v for v in crd["spec"]["versions"] if v.get("storage")]
    return openapi_to_jsonschema(version["schema"]["openAPIV3Schema"])


def openapi_to_jsonschema(node):
    """Map Kubernetes' OpenAPI v3 dialect onto JSON Schema.

    int-or-string and nullable become JSON Schema types; other x-kubernetes-* keys are dropped. An object with
    declared properties gets additionalProperties: false unless it preserves unknown fields, which is what
    kubectl's strict field validation does: a misspelt field is an error, not silently pruned.
    """
    if isinstance(node, list):
        return [openapi_to_jsonschema(n) for n in node]
    if not isinstance(node, dict):
        return node
    out = {
        k: openapi_to_jsonschema(v) for k, v in node.items() if not k.startswith("x-kubernetes-") and k != "nullable"
    }
    if node.get("x-kubernetes-int-or-string"):
        out.pop("type", None)
        out["anyOf"] = [{"type": "integer"}, {"type": "string"}]
    if node.get("nullable") and "type" in out:
        out["type"] = [out["type"], "null"]
    preserve = node.get("x-kubernetes-preserve-unknown-fields")
    if "properties" in out and "additionalProperties" not in out and not preserve:
        out["additionalProperties"] = False
    return out


def errors(schema: dict, doc: dict) -> list[str]:
    found = jsonschema.Draft7Validator(schema).iter_errors(doc)
    return [f"{'/'.join(map(str, e.absolute_path))}: {e.message}" for e in found]


@pytest.mark.parametrize(
    "crd, filename, break_it",
    [
        ("kubeflow.org_pytorchjobs.yaml", "pytorchjob.yaml",
         lambda d: d["spec"]["pytorchReplicaSpecs"]["Master"].update(replica=1)),  # misspelt
        ("kubeflow.org_pytorchjobs.yaml", "pytorchjob.yaml",
         lambda d: d["spec"]["runPolicy"].update(backoffLimit="three")),
        ("trainer.kubeflow.org_trainjobs.yaml", "trainjob.yaml", lambda d: d["spec"]["trainer"].update(numNodes="4")),
        ("trainer.kubeflow.org_trainjobs.yaml", "trainjob.yaml", lambda d: d["spec"].pop("runtimeRef")),
    ],
)
def test_custom_kinds_match_their_crd(outputs, crd, filename, break_it):
    schema = crd_schema(crd)
    for files in outputs.values():
        doc = load(files[filename])
        assert errors(schema, doc) == [], files[filename]
    broken = copy.deepcopy(load(outputs["hsdp-4x8"][filename]))
    break_it(broken)
    assert errors(schema, broken), f"the {crd} schema accepted a broken {filename}"


def test_runai_manifests_match_our_schema(outputs):
    schema = json.loads(RUNAI_SCHEMA.read_text())
    jsonschema.Draft202012Validator.check_schema(schema)
    validator = jsonschema.Draft202012Validator(schema)
    for path in all_files(outputs, "runai.yaml"):
        assert list(validator.iter_errors(load(path))) == [], path
    single, multi = load(outputs["tiny-1x2"]["runai.yaml"]), load(outputs["hsdp-4x8"]["runai.yaml"])
    for broken in (
        {**single, "spec": {**single["spec"], "gpus": {"value": "2"}}},  # misspelt field
        {**single, "spec": {**single["spec"], "gpu": {"value": 2}}},  # Run:ai wants a string
        {**single, "spec": {**single["spec"], "workers": {"value": 1}}},  # workers on a single-node kind
        {**multi, "spec": {k: v for k, v in multi["spec"].items() if k != "workers"}},
    ):
        assert list(validator.iter_errors(broken)), broken["spec"].keys()


def yamllint(*paths: Path | str, strict: bool = False) -> subprocess.CompletedProcess:
    cmd = [str(BIN / "yamllint"), "-c", str(REPO / ".yamllint"), "-f", "parsable", *(["--strict"] if strict else [])]
    return subprocess.run([*cmd, *map(str, paths)], cwd=REPO, capture_output=True, text=True)


def test_yaml_style(outputs, tmp_path):
    # Generated manifests: not even a warning. The repository's YAML: no errors (long lines are warnings).
    out = yamllint(*all_files(outputs, ".yaml"), strict=True)
    assert out.returncode == 0, out.stdout
    repo_yaml = ["accelerate_configs", *sorted(str(p.relative_to(REPO)) for p in REPO.glob("recipes/*/*.yaml"))]
    out = yamllint(*repo_yaml)
    assert out.returncode == 0, out.stdout
    bad = tmp_path / "bad.yaml"
    bad.write_text("a: 1\na: 2\nb: yes  \n")  # duplicate key, YAML-1.1 boolean, trailing spaces
    out = yamllint(bad)
    assert out.returncode != 0 and "key-duplicates" in out.stdout and "truthy" in out.stdout


# ------------------------------------------------------------------ bad input: one line, non-zero, no traceback


@pytest.fixture(scope="module")
def odd_recipes(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("odd")
    make_recipe(root, "hsdp-demo", HSDP_ACCELERATE)
    make_recipe(root, "hybrid-fsdp1", "distributed_type: FSDP\nfsdp_config:\n  fsdp_sharding_strategy: HYBRID_SHARD\n")
    make_recipe(root, "single-gpu", "distributed_type: 'NO'\nnum_processes: 1\n")
    return root


@pytest.mark.parametrize(
    "args, message",
    [
        (["no-such-recipe"], "unknown recipe 'no-such-recipe'"),
        (["mistral-small-lora", "--nodes", "1", "--gpus", "4"], "needs at least 8 GPUs"),
        (["{odd}/hsdp-demo", "--nodes", "1", "--gpus", "8"], "needs NODES >= 2"),
        (["{odd}/hybrid-fsdp1", "--nodes", "1", "--gpus", "8"], "needs NODES >= 2"),
        (["{odd}/hsdp-demo", "--nodes", "2", "--gpus", "4"], "must fit whole inside a node of 4 GPUs"),
        (["{odd}/single-gpu", "--nodes", "1", "--gpus", "2"], "cannot use 1 node(s) x 2 GPU(s)"),
        (["tiny-cpu-lora", "--pvc-checkpoints", ""], "output volume (checkpoint claim) is missing"),
        (["tiny-cpu-lora", "--pvc-checkpoints", "Checkpoints_1"], "not a valid Kubernetes name"),
        (["tiny-cpu-lora", "--nodes", "two"], "invalid int value"),
        (["tiny-cpu-lora", "--gpus", "0"], "must be at least 1"),
    ],
)
def test_bad_input_is_one_error_line(odd_recipes, tmp_path, args, message):
    args = [a.format(odd=odd_recipes) for a in args]
    out = subprocess.run(
        [sys.executable, "-m", "fsdp_recipes.cli", "job", "--launcher", "k8s", *args, "--out", str(tmp_path / "out")],
        cwd=REPO, capture_output=True, text=True,
    )
    assert out.returncode == 2
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and "Fix:" in lines[0], out.stderr
    assert message in lines[0]
    assert not (tmp_path / "out").exists()  # nothing half-written


def test_fsdp1_hybrid_on_two_nodes_is_fine(odd_recipes, tmp_path):
    files = generate(odd_recipes / "hybrid-fsdp1", tmp_path, "--nodes", "2", "--gpus", "8")
    env = {e["name"] for e in load(files["pytorchjob.yaml"])["spec"]["pytorchReplicaSpecs"]["Worker"]["template"]
           ["spec"]["containers"][0]["env"]}
    assert "FSDP_K8S_LAUNCH_EXTRA" not in env  # FSDP1 makes each node a shard group by itself


# ------------------------------------------------------------------ the container entrypoint


@pytest.fixture()
def fake_repo(tmp_path) -> Path:
    """A working directory like the image's: k8s/entrypoint.sh and a recipe whose launch.sh reports what it got."""
    (tmp_path / "k8s").mkdir()
    shutil.copy(REPO / "k8s" / "entrypoint.sh", tmp_path / "k8s" / "entrypoint.sh")
    recipe = tmp_path / "recipes" / "demo"
    recipe.mkdir(parents=True)
    (recipe / "launch.sh").write_text(textwrap.dedent("""\
        #!/usr/bin/env bash
        echo "ARGS=$*"
        echo "LAUNCH=$FSDP_RECIPES_LAUNCH_ARGS"
        exit "${FAKE_RC:-0}"
        """))
    return tmp_path


def entrypoint(repo: Path, **env) -> subprocess.CompletedProcess:
    clean = {k: v for k, v in os.environ.items() if k not in ("RANK", "MASTER_ADDR", "MASTER_PORT", "WORLD_SIZE")}
    return subprocess.run(
        ["bash", "k8s/entrypoint.sh", "demo", "--output_dir", "/checkpoints/demo"],
        cwd=repo, env={**clean, **env}, capture_output=True, text=True, timeout=60,
    )


def test_entrypoint_pytorchjob_env(fake_repo):
    out = entrypoint(
        fake_repo, FSDP_NNODES="2", FSDP_GPUS_PER_NODE="8", RANK="1", MASTER_ADDR="job-master-0", MASTER_PORT="23456",
        WORLD_SIZE="2", FSDP_K8S_LAUNCH_EXTRA="--parallelism_config_dp_replicate_size 2",
    )
    assert out.returncode == 0, out.stderr
    assert "ARGS=--output_dir /checkpoints/demo" in out.stdout
    assert ("LAUNCH=--num_machines 2 --machine_rank 1 --main_process_ip job-master-0 --main_process_port 23456 "
            "--num_processes 16 --rdzv_backend c10d --parallelism_config_dp_replicate_size 2") in out.stdout


def test_entrypoint_trainjob_env(fake_repo):
    out = entrypoint(fake_repo, FSDP_NNODES="3", FSDP_GPUS_PER_NODE="4", PET_NODE_RANK="2",
                     PET_MASTER_ADDR="tj-node-0-0.tj", PET_MASTER_PORT="29400", PET_NNODES="3")
    assert out.returncode == 0, out.stderr
    assert ("LAUNCH=--num_machines 3 --machine_rank 2 --main_process_ip tj-node-0-0.tj --main_process_port 29400 "
            "--num_processes 12 --rdzv_backend c10d") in out.stdout


def test_entrypoint_single_node_and_exit_codes(fake_repo):
    out = entrypoint(fake_repo, FSDP_GPUS_PER_NODE="8")
    assert out.returncode == 0 and "LAUNCH=--num_processes 8" in out.stdout
    assert entrypoint(fake_repo, FSDP_GPUS_PER_NODE="8", FAKE_RC="75").returncode == k8s.RETRYABLE_EXIT
    assert entrypoint(fake_repo, FSDP_GPUS_PER_NODE="8", FAKE_RC="2").returncode == 2  # permanent stays permanent
    wrong = entrypoint(fake_repo, FSDP_NNODES="2", FSDP_GPUS_PER_NODE="8", RANK="2")
    assert wrong.returncode == 2 and wrong.stderr.startswith("error: node rank 2")


def test_entrypoint_forwards_sigterm(fake_repo):
    """PID 1 in the pod gets the kubelet's SIGTERM: the launcher must get it too, and its exit 75 becomes 138."""
    (fake_repo / "recipes" / "demo" / "launch.sh").write_text(textwrap.dedent("""\
        #!/usr/bin/env bash
        trap 'echo saved; exit 75' TERM
        echo ready
        while true; do sleep 0.1; done
        """))
    env = {**os.environ, "FSDP_GPUS_PER_NODE": "1"}
    cmd = ["bash", "k8s/entrypoint.sh", "demo"]
    proc = subprocess.Popen(cmd, cwd=fake_repo, env=env, stdout=subprocess.PIPE, text=True)
    for line in proc.stdout:
        if line.strip() == "ready":
            break
    proc.terminate()
    assert proc.wait(timeout=30) == k8s.RETRYABLE_EXIT
    assert "saved" in proc.stdout.read()
