"""What a resume checks before any rank loads a weight, in one process: the checkpoint's FSDP state-dict type, the
base model's weights, the local data files (checkpoint/markers.py, resume_choice.py, resume_check.py)."""

import json
from types import SimpleNamespace

import pytest
import torch

from fsdp_recipes.checkpoint import markers
from fsdp_recipes.checkpoint.resume_choice import checkpoint_to_resume
from fsdp_recipes.errors import UserError

FSDP2_FULL = {"distributed_type": "FSDP", "fsdp_config": {"fsdp_version": 2, "fsdp_state_dict_type": "FULL_STATE_DICT"}}
FSDP2_SHARDED = {"distributed_type": "FSDP",
                 "fsdp_config": {"fsdp_version": 2, "fsdp_state_dict_type": "SHARDED_STATE_DICT"}}


def checkpoint(out, state_dict_type: str | None = "FULL_STATE_DICT", identity: dict | None = None, step: int = 2):
    """A complete checkpoint-N folder as the Trainer and the pack leave it, with the model's files of
    `state_dict_type` (accelerate's names: a torch.save file, or a DCP folder)."""
    ckpt = out / f"checkpoint-{step}"
    ckpt.mkdir(parents=True)
    (ckpt / "trainer_state.json").write_text(json.dumps({"global_step": step}))
    if state_dict_type == "FULL_STATE_DICT":
        torch.save({}, ckpt / "pytorch_model_fsdp.bin")
        torch.save({}, ckpt / "optimizer.bin")
    elif state_dict_type == "SHARDED_STATE_DICT":
        for name in ("pytorch_model_fsdp_0", "optimizer_0"):
            (ckpt / name).mkdir()
            (ckpt / name / "__0_0.distcp").write_bytes(b"\0")
    if identity is not None:
        (ckpt / markers.IDENTITY).write_text(json.dumps(identity))
    (ckpt / markers.MARKER).write_text(str(step))
    return ckpt


def run_cfg(out, model: str = "/nonexistent/model", resume: str | None = None, **script):
    from trl import ModelConfig

    return SimpleNamespace(
        training=SimpleNamespace(output_dir=str(out), resume_from_checkpoint=resume),
        model=ModelConfig(model_name_or_path=model), script=SimpleNamespace(dataset_name=None, **script),
        pack=SimpleNamespace(auto_resume=True, override_resumed_settings=False))


def test_the_state_dict_type_a_run_loads_with_is_accelerates():
    assert markers.run_state_dict_type(FSDP2_SHARDED) == "SHARDED_STATE_DICT"
    assert markers.run_state_dict_type(FSDP2_FULL) == "FULL_STATE_DICT"
    # unset: accelerate's default for the FSDP version (accelerate 1.15 FullyShardedDataParallelPlugin)
    assert markers.run_state_dict_type({"distributed_type": "FSDP", "fsdp_config": {"fsdp_version": 2}}) == \
        "SHARDED_STATE_DICT"
    assert markers.run_state_dict_type({"distributed_type": "FSDP", "fsdp_config": {}}) == "FULL_STATE_DICT"
    assert markers.run_state_dict_type({"distributed_type": "MULTI_CPU"}) is None


def test_the_ranks_read_it_from_accelerates_environment(monkeypatch):
    monkeypatch.delenv("ACCELERATE_USE_FSDP", raising=False)
    assert markers.run_state_dict_type() is None
    monkeypatch.setenv("ACCELERATE_USE_FSDP", "true")
    monkeypatch.setenv("FSDP_VERSION", "2")
    monkeypatch.delenv("FSDP_STATE_DICT_TYPE", raising=False)
    assert markers.run_state_dict_type() == "SHARDED_STATE_DICT"
    monkeypatch.setenv("FSDP_STATE_DICT_TYPE", "FULL_STATE_DICT")
    assert markers.run_state_dict_type() == "FULL_STATE_DICT"
    monkeypatch.setenv("FSDP_STATE_DICT_TYPE", "3")  # torch's enum value, which accelerate also takes
    assert markers.run_state_dict_type() == "SHARDED_STATE_DICT"


@pytest.mark.parametrize("saved, now", [("FULL_STATE_DICT", FSDP2_SHARDED), ("SHARDED_STATE_DICT", FSDP2_FULL)])
def test_a_resume_under_another_state_dict_type_is_one_line(tmp_path, saved, now):
    """A FULL_STATE_DICT checkpoint resumed by a copy of the recipe whose accelerate.yaml says SHARDED_STATE_DICT
    passed every check, then failed on every rank: 4 tracebacks (FileNotFoundError ... pytorch_model_fsdp_0/.metadata)
    and 'CheckpointException ranks:dict_keys([0, 1])', exit 2, no cause or fix named."""
    out = tmp_path / "run"
    ckpt = checkpoint(out, saved)
    assert markers.saved_state_dict_type(ckpt) == saved
    other = markers.run_state_dict_type(now)
    with pytest.raises(UserError) as err:
        checkpoint_to_resume(run_cfg(out), {}, accelerate=now)
    line = str(err.value)
    assert "\n" not in line and line == (
        f"cannot resume from {ckpt}: it was saved with fsdp_state_dict_type {saved} "
        f"({markers.STATE_DICT_FILES[saved]}); "
        f"this run's accelerate config says {other}, and accelerate loads only that type's files. Fix: set "
        f"fsdp_state_dict_type: {saved} in the recipe's accelerate.yaml to resume, or use a new output_dir to start "
        f"over with {other}.")
    with pytest.raises(UserError, match=rf"or point --resume_from_checkpoint at a {other} checkpoint\.$"):
        checkpoint_to_resume(run_cfg(out, resume=str(ckpt)), {}, accelerate=now)
    same = FSDP2_FULL if saved == "FULL_STATE_DICT" else FSDP2_SHARDED
    assert checkpoint_to_resume(run_cfg(out), {}, accelerate=same) == (str(ckpt), {})


def test_the_ranks_refuse_it_too(tmp_path, monkeypatch):
    """Every rank chooses the checkpoint again (train/entry.py), with accelerate's environment."""
    out = tmp_path / "run"
    checkpoint(out, "FULL_STATE_DICT")
    monkeypatch.setenv("ACCELERATE_USE_FSDP", "true")
    monkeypatch.setenv("FSDP_VERSION", "2")
    monkeypatch.setenv("FSDP_STATE_DICT_TYPE", "SHARDED_STATE_DICT")
    with pytest.raises(UserError, match="it was saved with fsdp_state_dict_type FULL_STATE_DICT"):
        checkpoint_to_resume(run_cfg(out), {})
    monkeypatch.setenv("FSDP_STATE_DICT_TYPE", "FULL_STATE_DICT")
    assert checkpoint_to_resume(run_cfg(out), {})[0] == str(out / "checkpoint-2")


def test_a_checkpoint_fsdp_did_not_write_is_not_judged(tmp_path):
    out = tmp_path / "run"
    checkpoint(out, None)  # DDP, tensor parallel (checkpoint/tensor_parallel_state.py), another tool's
    assert markers.saved_state_dict_type(out / "checkpoint-2") is None
    assert checkpoint_to_resume(run_cfg(out), {}, accelerate=FSDP2_SHARDED)[0] == str(out / "checkpoint-2")


def tiny_model(folder, seed: int = 0):
    """A random tiny Mistral saved into `folder` (save_pretrained: model.safetensors, config.json)."""
    from transformers import MistralConfig, MistralForCausalLM

    torch.manual_seed(seed)
    MistralForCausalLM(MistralConfig(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                     num_attention_heads=2, num_key_value_heads=1)).save_pretrained(folder)
    return str(folder)


def lora():
    from peft import LoraConfig

    return LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"])


def lora_cfg(out, model, resume=None):
    cfg = run_cfg(out, model, resume)
    cfg.model.use_peft, cfg.model.lora_r, cfg.model.lora_alpha = True, 4, 8
    cfg.model.lora_target_modules = ["q_proj", "v_proj"]
    return cfg


def test_a_resume_onto_other_weights_at_the_same_path_is_one_line(tmp_path):
    """New weights saved into the base model's folder between an interruption and its resume: the checkpoint's
    identity held the path and the architecture only, the resume said 'resumed adapter verified' and trained the old
    LoRA on the new base."""
    model = tiny_model(tmp_path / "model")
    out = tmp_path / "run"
    ckpt = checkpoint(out, identity=markers.identity(model, lora()))
    assert checkpoint_to_resume(lora_cfg(out, model), {})[0] == str(ckpt)  # the same weights
    tiny_model(tmp_path / "model", seed=1)  # the same architecture, other values
    with pytest.raises(UserError) as err:
        checkpoint_to_resume(lora_cfg(out, model), {})
    assert str(err.value) == (
        f"cannot resume from {ckpt}: the base model {model} holds other weights than the ones it was trained on "
        f"(model.safetensors changed). Fix: put the weights it was trained on back at {model}, or use a new "
        "output_dir to train on these weights.")
    with pytest.raises(UserError, match="or point --resume_from_checkpoint at a checkpoint of these weights"):
        checkpoint_to_resume(lora_cfg(out, model, resume=str(ckpt)), {})
    tiny_model(tmp_path / "model")  # the old weights back: resumes
    assert checkpoint_to_resume(lora_cfg(out, model), {})[0] == str(ckpt)
    assert set(markers.saved_identity(ckpt)["weights"]["files"]) == {"model.safetensors"}


def test_a_checkpoint_without_the_fingerprint_still_resumes(tmp_path):
    model = tiny_model(tmp_path / "model")
    out = tmp_path / "run"
    old = markers.identity(model, lora())
    del old["weights"]  # written before the fingerprint was recorded
    ckpt = checkpoint(out, identity=old)
    tiny_model(tmp_path / "model", seed=1)
    assert checkpoint_to_resume(lora_cfg(out, model), {})[0] == str(ckpt)


def test_the_weights_fingerprint_reads_little_and_ignores_copies(tmp_path):
    """A copy (another path, another mtime) has the fingerprint of its original; any tensor's new values change it;
    each tensor is read at its two ends only."""
    import os
    import shutil

    from fsdp_recipes.checkpoint import fingerprint

    model = tiny_model(tmp_path / "model")
    shutil.copytree(model, tmp_path / "copy")
    os.utime(tmp_path / "copy" / "model.safetensors", (1, 1))
    assert fingerprint.weights_fingerprint(model) == fingerprint.weights_fingerprint(str(tmp_path / "copy"))
    from safetensors.torch import load_file, save_file

    tensors = load_file(tmp_path / "copy" / "model.safetensors")
    name = sorted(tensors)[len(tensors) // 2]
    tensors[name] = tensors[name].clone()
    tensors[name].view(-1)[-1] += 1  # one value, at the end of one tensor in the middle of the file
    save_file(tensors, tmp_path / "copy" / "model.safetensors", metadata={"format": "pt"})
    assert fingerprint.weights_changed(fingerprint.weights_fingerprint(model),
                                       fingerprint.weights_fingerprint(str(tmp_path / "copy"))) == \
        "model.safetensors changed"


def test_a_hub_models_fingerprint_is_the_blobs_of_its_weight_files(tmp_path, monkeypatch):
    """Two commits whose weight files link to the same blobs (a README edited on the hub) are the same weights: the
    commit alone refused such a resume. Other blobs are other weights, and the fix pins the commit trained on."""
    import huggingface_hub.constants

    from fsdp_recipes.checkpoint import fingerprint

    repo = tmp_path / "hub" / "models--org--tiny"
    (repo / "blobs").mkdir(parents=True)
    for blob in ("w1", "w2"):
        (repo / "blobs" / blob).write_bytes(blob.encode())
    for sha, blob in (("a" * 40, "w1"), ("b" * 40, "w1"), ("c" * 40, "w2")):
        (repo / "snapshots" / sha).mkdir(parents=True)
        (repo / "snapshots" / sha / "config.json").write_text("{}")
        (repo / "snapshots" / sha / "model.safetensors").symlink_to(repo / "blobs" / blob)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text("a" * 40)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    assert fingerprint.weights_fingerprint("org/tiny") == {"blobs": {"model.safetensors": "w1"}, "commit": "a" * 40}
    assert fingerprint.weights_fingerprint("org/not-cached") is None
    saved = {"model": "org/tiny", "architecture": None, "weights": fingerprint.weights_fingerprint("org/tiny"),
             "peft": None}
    ckpt = tmp_path / "checkpoint-2"
    ckpt.mkdir()
    (ckpt / markers.IDENTITY).write_text(json.dumps(saved))
    (repo / "refs" / "main").write_text("b" * 40)  # a new commit, the same weights
    markers.check_compatible(ckpt, markers.identity("org/tiny", None))
    (repo / "refs" / "main").write_text("c" * 40)  # new weights
    with pytest.raises(UserError) as refused:
        markers.check_compatible(ckpt, markers.identity("org/tiny", None))
    assert (f"other weights than the ones it was trained on (commit {'a' * 40}'s weight files -> commit {'c' * 40}'s). "
            f"Fix: --model_revision {'a' * 40} (the commit it was trained on), or ") in str(refused.value)


def test_only_the_files_that_load_and_the_data_files_are_fingerprinted(tmp_path):
    """A model folder with model.safetensors and an unused pytorch_model.bin was refused once the .bin was deleted;
    a README edited in the data folder refused the resume as changed data."""
    from fsdp_recipes.checkpoint import fingerprint

    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text("{}")
    header = json.dumps({"w": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}}).encode()
    (model / "model.safetensors").write_bytes(len(header).to_bytes(8, "little") + header + bytes(8))
    (model / "pytorch_model.bin").write_bytes(b"old")
    before = fingerprint.weights_fingerprint(str(model))
    (model / "pytorch_model.bin").unlink()
    assert fingerprint.weights_fingerprint(str(model)) == before == {
        "files": {"model.safetensors": fingerprint.file_fingerprint(model / "model.safetensors")}}
    data = tmp_path / "data"
    data.mkdir()
    (data / "train.jsonl").write_text('{"text": "a"}\n')
    (data / "README.md").write_text("notes\n")
    was = fingerprint.data_fingerprint([str(data)])
    (data / "README.md").write_text("other notes\n")
    assert fingerprint.data_fingerprint([str(data)]) == was
    (data / "train.jsonl").write_text('{"text": "b"}\n{"text": "a"}\n')
    assert fingerprint.same_paths_changed(was, fingerprint.data_fingerprint([str(data)])) == [str(data)]
