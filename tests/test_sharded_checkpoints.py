"""Sharded (DCP) checkpoints: saved by 2 ranks, resumed by 1 and by 4, exported to an adapter on CPU.

Every run sees the same 32 samples per optimizer step (2 ranks x 16, 1 x 32, 4 x 8), so a resumed run must
continue the uninterrupted run's per-step losses and end with its weights.
"""

import json
import shutil
import subprocess
import sys

import pytest
import torch
import yaml
from safetensors.torch import load_file

from conftest import REPO, launch, pack_env
from fsdp_recipes.checkpoint import markers as checkpoints
from fsdp_recipes.checkpoint.save_check import LIVE_SHARDS

COMMON = ["--max_steps", "8", "--save_strategy", "steps", "--save_steps", "4", "--logging_steps", "1",
          "--eval_strategy", "no", "--save_merged_model", "false"]


def sharded_recipe(tmp_path, processes):
    dst = tmp_path / f"sharded-{processes}"
    if not dst.exists():
        shutil.copytree(REPO / "recipes" / "tiny-cpu-lora", dst)
        acc = yaml.safe_load((dst / "accelerate.yaml").read_text())
        acc["fsdp_config"]["fsdp_state_dict_type"] = "SHARDED_STATE_DICT"
        acc["num_processes"] = processes
        (dst / "accelerate.yaml").write_text(yaml.safe_dump(acc))
    return dst


def losses(run):
    history = json.loads((run / "log_history.json").read_text())["log_history"]
    return {h["step"]: h["loss"] for h in history if "loss" in h}


def export(args, cache_dir):
    return subprocess.run([sys.executable, "-m", "fsdp_recipes.checkpoint.export", *map(str, args)], cwd=REPO,
                          env=pack_env(cache_dir), capture_output=True, text=True, timeout=300)


@pytest.fixture(scope="module")
def saved(tmp_path_factory, cache_dir):
    tmp = tmp_path_factory.mktemp("sharded")
    out = tmp / "two-ranks"
    res = launch([str(sharded_recipe(tmp, 2)), *COMMON, "--output_dir", str(out)], cache_dir)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    return tmp, out


@pytest.mark.slow
def test_sharded_checkpoint_has_one_file_per_rank_and_a_verified_final_save(saved):
    _, out = saved
    ckpt = out / "checkpoint-4"
    assert checkpoints.is_complete(ckpt)
    assert sorted(p.name for p in (ckpt / "pytorch_model_fsdp_0").glob("*.distcp")) == ["__0_0.distcp", "__1_0.distcp"]
    m = json.loads((out / "metrics.json").read_text())
    assert m["status"] == "completed" and m["final_save_check"]["tensors"] == 57


@pytest.mark.slow
@pytest.mark.parametrize("processes", [1, 4])
def test_resume_with_another_world_size(saved, cache_dir, processes):
    tmp, out = saved
    resumed = tmp / f"resumed-{processes}"
    res = launch([str(sharded_recipe(tmp, processes)), *COMMON, "--per_device_train_batch_size", str(32 // processes),
                  "--resume_from_checkpoint", str(out / "checkpoint-4"), "--output_dir", str(resumed)], cache_dir)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    m = json.loads((resumed / "metrics.json").read_text())
    assert m["world_size"] == processes and m["steps"] == 8
    a, b = losses(out), losses(resumed)
    for step in range(5, 9):
        assert b[step] == pytest.approx(a[step], rel=1e-3), (step, a[step], b[step])
    wa, wb = load_file(out / "adapter_model.safetensors"), load_file(resumed / "adapter_model.safetensors")
    for key in wa:
        assert torch.allclose(wa[key], wb[key], rtol=1e-3, atol=1e-5), key


@pytest.mark.slow
def test_export_gives_the_final_adapter(saved, cache_dir):
    tmp, out = saved
    res = export([out / "checkpoint-8", tmp / "exported"], cache_dir)
    assert res.returncode == 0, res.stderr[-3000:]
    assert "57 tensors written and verified" in res.stdout
    final, exported = load_file(out / "adapter_model.safetensors"), load_file(tmp / "exported" / "adapter_model.safetensors")
    assert final.keys() == exported.keys() and all(torch.equal(final[k], exported[k]) for k in final)

    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(cache_dir / "tiny-mistral")
    PeftModel.from_pretrained(base, tmp / "exported")  # plain peft loads it


@pytest.mark.slow
def export_here(args, capsys) -> tuple[int, str]:
    """`make export`'s module in this process, for input it must refuse (the real process: export() above)."""
    from fsdp_recipes.checkpoint import export as export_module

    try:
        code = export_module.main([str(a) for a in args])
    except SystemExit as stop:
        code = stop.code
    return code, capsys.readouterr().err


def test_export_bad_input(saved, capsys):
    tmp, out = saved
    code, err = export_here([out, tmp / "x"], capsys)  # the run folder itself, not a sharded checkpoint
    assert code == 2 and "Traceback" not in err and "is not a sharded checkpoint" in err
    anonymous = tmp / "anonymous"
    shutil.copytree(out / "checkpoint-8", anonymous)
    (anonymous / checkpoints.IDENTITY).unlink()
    code, err = export_here([anonymous, tmp / "y"], capsys)
    assert code == 2 and "Traceback" not in err
    assert err.strip().splitlines()[-1].startswith("error: exporting") and "needs the model config" in err


@pytest.mark.slow
def test_full_finetune_sharded_checkpoint_exports_to_a_plain_model(tmp_path, cache_dir):
    from transformers import AutoModelForCausalLM

    out = tmp_path / "full"
    res = launch([str(sharded_recipe(tmp_path, 2)), "--use_peft", "false", "--learning_rate", "1e-3",
                  "--max_steps", "10", "--save_strategy", "steps", "--save_steps", "10", "--eval_strategy", "no",
                  "--output_dir", str(out)], cache_dir)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    # the final save was written by both ranks and consolidated, never gathered on one rank
    assert json.loads((out / "metrics.json").read_text())["final_save_check"] == {"tensors": 39, "lora_b_checked": 0,
                                                                                       "model_shapes_checked": 39,
                                                                                       "compared_with": LIVE_SHARDS}
    assert (out / "model.safetensors.index.json").is_file() and not (out / "sharded").exists()
    res = export([out / "checkpoint-10", tmp_path / "exported"], cache_dir)
    assert res.returncode == 0, res.stderr[-3000:]
    exported = AutoModelForCausalLM.from_pretrained(tmp_path / "exported")  # config from the recorded model
    final = AutoModelForCausalLM.from_pretrained(out)
    for (name, p), (_, q) in zip(exported.named_parameters(), final.named_parameters()):
        assert torch.equal(p, q), name


RESHARD_PROBE = """
import json, os, torch, torch.distributed as dist
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from fsdp_recipes.checkpoint.sharded_save import reshard_fsdp2
dist.init_process_group("gloo", init_method="tcp://127.0.0.1:" + os.environ["PORT"], rank=0, world_size=1)
model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 4))
mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16)
fully_shard(model[0], mp_policy=mp, reshard_after_forward=False)  # SHARD_GRAD_OP, as the default's YAML
fully_shard(model, mp_policy=mp)  # the root (LM head, embeddings): never resharded after its forward
seen = lambda pairs: sorted({f"{type(v).__name__} {str(v.dtype)[6:]}" for _, v in pairs})
with torch.no_grad():
    model(torch.randn(2, 8))  # an evaluation: a forward, no backward
out = {"parameters": seen(model.named_parameters()), "state_dict": seen(model.state_dict().items())}
out["modules"] = reshard_fsdp2(model)
out["resharded"] = seen(model.named_parameters())
print(json.dumps(out))
dist.destroy_process_group()
"""


def test_after_an_evaluation_the_parameters_are_bf16_copies_until_resharded(tmp_path):
    """Why the pack reshards after every evaluation and before the final save (sharded_save.reshard_fsdp2): with
    mixed precision, a forward without a backward leaves FSDP2's bf16 unsharded copies where named_parameters()
    reads (the LoRA save gathers from there); state_dict() still returns the float32 shards."""
    from fsdp_recipes.dist import free_port

    res = subprocess.run([sys.executable, "-c", RESHARD_PROBE], capture_output=True, text=True, timeout=120,
                         env=pack_env(tmp_path, PORT=str(free_port())))
    assert res.returncode == 0, res.stderr[-2000:]
    seen = json.loads(res.stdout.strip().splitlines()[-1])
    assert seen["parameters"] == ["Parameter bfloat16"] and seen["state_dict"] == ["DTensor float32"]
    assert seen["modules"] == 2 and seen["resharded"] == ["DTensor float32"]
