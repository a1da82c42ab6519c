"""The speed room (speed/): one module per option behind one interface, SpeedOption, and one registry (issue 56).

An option is added by its module and a line in config/option_registry.py; the launcher, the ranks, the planner and
the smoke run ask the registry. These tests add one and watch it go through the launcher's path, and grep the package
for an option's settings named outside its room.
"""

import ast
import dataclasses
import re
import types
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace

import pytest

from conftest import REPO, RanksWouldStart, launcher_until_ranks
from fsdp_recipes import speed
from fsdp_recipes.config import option_registry
from fsdp_recipes.errors import UserError


def test_every_registered_option_has_its_module():
    assert set(speed.names()) == set(option_registry.OPTIONS)
    assert speed.names() == ("four_bit", "attention", "experts", "ram_efficient_loading", "activation_checkpointing",
                             "checkpoint_offload", "chunked_loss", "yarn", "liger", "compile", "float8")
    for option in speed.OPTIONS.values():
        assert option.FIELDS and callable(option.enabled), option.name


def test_an_option_lacking_a_required_member_fails_at_registration():
    incomplete = types.ModuleType("my_option")
    incomplete.FIELDS = ("my_setting",)  # no enabled()
    with pytest.raises(TypeError, match=r"speed option mine \(my_option\) lacks enabled: every option provides "
                                        r"FIELDS, enabled"):
        speed.SpeedOption.from_module("mine", incomplete)
    incomplete.enabled = True  # not a function
    with pytest.raises(TypeError, match=r"speed option mine \(my_option\): enabled must be a function"):
        speed.SpeedOption.from_module("mine", incomplete)
    incomplete.enabled, incomplete.FIELDS = (lambda cfg: False), "my_setting"  # a string, not a tuple of names
    with pytest.raises(TypeError, match=r"FIELDS must be a tuple of setting names"):
        speed.SpeedOption.from_module("mine", incomplete)


@dataclass
class FusedNormArguments:
    """The made-up option's own setting."""

    fused_norms: bool = field(default=False, metadata={"help": "a made-up kernel, for this test"})


def fused_norms_module(calls: list, installed: bool) -> types.ModuleType:
    """A whole option module, as speed/<name>.py would be: its setting, its checks, what it does to the model."""
    m = types.ModuleType("fused_norms")
    m.FIELDS = ("fused_norms",)
    m.RESUME_SETTINGS = ("fused_norms",)

    def enabled(cfg):
        return cfg.option("fused_norms").fused_norms

    def check_config(cfg):
        calls.append("check_config")
        if enabled(cfg) and cfg.model.use_peft is False:
            raise UserError("fused_norms: true is for LoRA. Fix: use_peft: true, or fused_norms: false.")

    def check_installed(cfg):
        calls.append("check_installed")
        if enabled(cfg) and not installed:
            raise UserError("fused_norms: true needs the fused-norms package. Fix: pip install fused-norms.")

    def check_launch(cfg, acc, path):
        calls.append(("check_launch", Path(path).name))

    def model_init_kwargs(cfg):
        return {"fused_norm_kernel": "triton"} if enabled(cfg) else {}

    def prepare_trainer(trainer, cfg):
        trainer.model.fused = True
        return {"norms": 3}

    m.enabled, m.check_config, m.check_installed, m.check_launch = enabled, check_config, check_installed, check_launch
    m.model_init_kwargs, m.prepare_trainer = model_init_kwargs, prepare_trainer
    return m


@pytest.fixture
def fused_norms(monkeypatch):
    """The made-up option registered as a real one is: its line in config/option_registry.py, its module in speed/."""
    def register(installed: bool = True) -> list:
        calls = []
        monkeypatch.setitem(option_registry.OPTIONS, "fused_norms", FusedNormArguments)
        monkeypatch.setattr(speed, "OPTIONS", dict(speed.OPTIONS))  # the test's addition leaves with the test
        speed.register("fused_norms", fused_norms_module(calls, installed))
        return calls
    return register


def test_an_added_option_is_checked_by_the_launcher_before_any_rank_starts(fused_norms, cache_dir, monkeypatch,
                                                                           capsys):
    calls = fused_norms(installed=False)
    res = launcher_until_ranks(["tiny-cpu-lora", "--fused_norms", "true"], monkeypatch, capsys)
    assert res.returncode == 2
    assert res.stderr.strip().splitlines() == [
        "error: fused_norms: true needs the fused-norms package. Fix: pip install fused-norms."]
    assert "check_config" in calls and "check_installed" in calls


def test_an_added_option_reaches_the_ranks_command_and_its_launch_check(fused_norms, cache_dir, monkeypatch, capsys):
    calls = fused_norms(installed=True)
    with pytest.raises(RanksWouldStart) as started:
        launcher_until_ranks(["tiny-cpu-lora", "--fused_norms", "true"], monkeypatch, capsys)
    assert started.value.settings["fused_norms"] is True  # the ranks build their configuration from the launcher's
    assert ("check_launch", "accelerate.yaml") in calls


def test_an_added_option_is_parsed_applied_recorded_and_kept_on_resume(fused_norms, cache_dir):
    from fsdp_recipes.checkpoint import resume_settings
    from fsdp_recipes.config.run_config import parse_args

    fused_norms()
    cfg = parse_args(["--config", str(REPO / "recipes" / "tiny-cpu-lora" / "sft.yaml"), "--fused_norms", "true"])
    assert cfg.option("fused_norms").fused_norms is True
    assert cfg.resolved()["speed_args"]["fused_norms"] is True  # run_args.json
    assert speed.model_init_kwargs(cfg)["fused_norm_kernel"] == "triton"
    trainer = SimpleNamespace(model=SimpleNamespace(fused=False))
    assert speed.prepare_trainer(trainer, cfg)["fused_norms"] == {"norms": 3} and trainer.model.fused
    # its resume setting is fixed: a resume with the other value is refused, as for a 4-bit layout
    saved = resume_settings.current(cfg, 1, (), speed.resume_settings())
    cfg.option("fused_norms").fused_norms = False
    now = resume_settings.current(cfg, 1, (), speed.resume_settings())
    with pytest.raises(UserError, match=r"cannot resume from ckpt with fused_norms True -> False: the checkpoint's "
                                        r"optimizer state"):
        resume_settings.check("ckpt", 1, saved, now, override=True)


def test_options_off_leave_the_model_and_trainer_alone(cache_dir):
    from fsdp_recipes.config.run_config import parse_args

    cfg = parse_args(["--config", str(REPO / "recipes" / "tiny-cpu-lora" / "sft.yaml")])
    on = [option.name for option in speed.active(cfg)]
    assert "float8" not in on and "four_bit" not in on and "liger" not in on and "compile" not in on
    assert "quantization_config" not in speed.model_init_kwargs(cfg)


def test_liger_without_its_package_is_one_line_and_off_in_a_cpu_smoke_run(cache_dir, monkeypatch):
    import importlib.util

    from fsdp_recipes.config.run_config import parse_args

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "liger_kernel" else real(name, *a))
    cfg = parse_args(["--config", str(REPO / "recipes" / "tiny-cpu-lora" / "sft.yaml"), "--use_liger_kernel", "true"])
    with pytest.raises(UserError, match=r"use_liger_kernel: true needs the liger-kernel package, which is not "
                                        r"installed. Fix: pip install liger-kernel"):
        speed.check_config(cfg)
    speed.check_config(cfg, installed=False)  # `make plan` plans for the training machine: no package check here
    overrides, notes = speed.smoke(lambda name, default=None: {"use_liger_kernel": True}.get(name, default), gpus=0)
    assert overrides == ["--use_liger_kernel", "false"] and notes == [
        "liger: its Triton kernels need CUDA and liger-kernel -> off"]
    # the command line's "yes" (or a bare flag) is on, as the full parse reads it: off in the smoke run too
    from fsdp_recipes.config import recipes

    said = recipes.load(REPO / "recipes" / "tiny-cpu-lora", ["--use_liger_kernel", "yes"])
    assert speed.smoke(said.field, gpus=0)[0] == ["--use_liger_kernel", "false"]
    bare = recipes.load(REPO / "recipes" / "tiny-cpu-lora", ["--use_liger_kernel"])
    assert speed.smoke(bare.field, gpus=0)[0] == ["--use_liger_kernel", "false"]


SPEED = REPO / "src" / "fsdp_recipes" / "speed"
# The other places an option's setting may be named: the version patch that maps transformers' old training-field
# names to the new ones (activation_checkpointing was gradient_checkpointing before transformers 5.23), and the cp
# patch, which checks a library signature with a parameter named attn_implementation (AttentionInterface.get_interface)
ALLOWED = {REPO / "src" / "fsdp_recipes" / "patches" / "versions.py",
           REPO / "src" / "fsdp_recipes" / "patches" / "context_parallel.py"}


def named_settings(path: Path, settings: set[str], root: Path = REPO) -> list[str]:
    """Where `path`'s code (not its comments or docstrings) names one of `settings`: a string that is exactly the
    name or its flag (`"float8"`, `"--float8"`), an attribute (`cfg.pack.float8`), a keyword (`float8=...`) or a
    dataclass field."""
    tree = ast.parse(path.read_text())
    docstrings = {id(node.body[0].value) for node in ast.walk(tree)
                  if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef))
                  and node.body and isinstance(node.body[0], ast.Expr)
                  and isinstance(node.body[0].value, ast.Constant)}
    found = []
    for node in ast.walk(tree):
        name = None
        if isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in docstrings:
            name = node.value.removeprefix("--")
        elif isinstance(node, ast.Attribute):
            name = node.attr
        elif isinstance(node, ast.keyword):
            name = node.arg
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            name = node.target.id
        if name in settings:
            found.append(f"{path.relative_to(root)}:{node.lineno}: {name}")
    return found


def test_no_option_setting_is_named_outside_the_speed_room():
    """Every setting an option owns (its FIELDS) is read in speed/ and the registry only (issue 56: float8 was named
    in 8 files, attn_implementation handled in 6)."""
    settings = {name for option in speed.OPTIONS.values() for name in option.FIELDS}
    assert {"float8", "load_in_4bit", "attn_implementation", "use_liger_kernel", "torch_compile",
            "fsdp_cpu_ram_efficient_loading", "activation_checkpointing"} <= settings
    found = []
    for path in sorted((REPO / "src" / "fsdp_recipes").rglob("*.py")):
        if SPEED in path.parents or path.name == "option_registry.py" or path in ALLOWED:
            continue
        found += named_settings(path, settings)
    assert not found, "\n".join(found)


def test_the_grep_finds_a_setting_named_outside_the_room(tmp_path):
    """The check above can fail: the code this issue removed would be found."""
    stray = tmp_path / "stray.py"
    stray.write_text('"""cfg.pack.float8 in a docstring is prose"""\n'
                     'def f(cfg, raw):\n    # cfg.pack.float8 in a comment too\n'
                     '    return cfg.pack.float8 or raw.get("float8") or dict(use_liger_kernel=True)\n')
    assert sorted(named_settings(stray, {"float8", "use_liger_kernel"}, tmp_path)) == [
        "stray.py:4: float8", "stray.py:4: float8", "stray.py:4: use_liger_kernel"]


def test_each_option_module_documents_what_it_does():
    for option in speed.OPTIONS.values():
        assert option.module.__doc__ and len(option.module.__doc__.split()) > 15, option.name
        assert dataclasses.is_dataclass(option)


def test_an_options_accelerate_rule_holds_wherever_a_recipe_is_read(tmp_path, cache_dir, monkeypatch, capsys):
    """FSDP1 with fsdp_cpu_ram_efficient_loading and no fsdp_sync_module_states (speed/ram_efficient_loading.py's
    check_accelerate) is one line in the launcher, `make plan` and a cluster job alike: it was the YAML reader's
    rule before the option moved into the speed room, and each tool that reads a recipe asks the room now."""
    import shutil

    import yaml

    from fsdp_recipes.cluster import command
    from fsdp_recipes.planning import plan

    recipe = tmp_path / "fsdp1-no-sync"
    shutil.copytree(REPO / "recipes" / "mistral-small-lora", recipe)
    acc = yaml.safe_load((recipe / "accelerate.yaml").read_text())
    assert acc["fsdp_config"]["fsdp_version"] == 1 and acc["fsdp_config"]["fsdp_cpu_ram_efficient_loading"]
    acc["fsdp_config"]["fsdp_sync_module_states"] = False
    (recipe / "accelerate.yaml").write_text(yaml.safe_dump(acc))
    rule = r"accelerate.yaml: fsdp_cpu_ram_efficient_loading needs fsdp_sync_module_states: true"
    with pytest.raises(UserError, match=rule):
        plan.load_recipe(str(recipe))
    with pytest.raises(SystemExit) as stopped:  # fsdp-recipes job: its one line, exit 2
        command.main(["--launcher", "slurm", str(recipe), "--nodes", "1", "--gpus", "8", "--print"])
    assert stopped.value.code == 2 and re.search(rule, capsys.readouterr().err)
    res = launcher_until_ranks([str(recipe)], monkeypatch, capsys)
    assert res.returncode == 2 and res.stderr.strip().startswith(f"error: {recipe}/accelerate.yaml: ")


def test_trust_remote_code_is_read_where_the_recipe_sets_it(cache_dir):
    """trust_remote_code is a TrainingArguments field (TRL's ModelConfig has none): the checks read it from the model
    args, where it never is, and judged a remote-code model by transformers' own classes."""
    import dataclasses
    from types import SimpleNamespace

    from trl import ModelConfig, SFTConfig

    from fsdp_recipes.speed import attention

    assert "trust_remote_code" in {f.name for f in dataclasses.fields(SFTConfig)}
    assert "trust_remote_code" not in {f.name for f in dataclasses.fields(ModelConfig)}
    model = ModelConfig(model_name_or_path=str(cache_dir / "tiny-mistral"))
    assert attention.model_class(SimpleNamespace(model=model, training=SimpleNamespace(trust_remote_code=False)))
    cfg = SimpleNamespace(model=model, training=SimpleNamespace(trust_remote_code=True))
    assert attention.model_class(cfg) is None  # its own code builds it: not transformers' mapping
