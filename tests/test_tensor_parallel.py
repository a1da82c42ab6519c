"""Tensor parallel beside FSDP2 (train/tensor_parallel.py, patches/tensor_parallel.py) on CPU over gloo: the tiny
Mistral on a tp 2 x dp_shard 2 mesh of 4 processes against one process: loss and every gradient, full fine-tuning
and LoRA; the final save gathered from the DTensors; a distributed checkpoint saved at that mesh and loaded at
another (dp_shard 4); a preempted Trainer run resumed exactly from the pack's checkpoint (4 steps straight against
2 + 2), one resumed at its last step (no step past max_steps), and one saved on tp 2 x dp_shard 1 (2 forked ranks
first) resumed at dp_shard 2. The ranks are forks of this process (nothing to import again): one test, 19-25 s on 2
cores (measured 13.7 s before the last two resumes and 20.6 s with them, the same quiet hour).
The pack's launch of the same mesh (its recipe, Trainer and final save) was checked by hand (docs/training.md)."""

from __future__ import annotations

import json
import os
import types

import pytest
import torch

from fsdp_recipes.config.mesh import Mesh
from fsdp_recipes.errors import UserError
from fsdp_recipes.train import tensor_parallel

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning", "ignore::FutureWarning")

TP, DP = 2, 2
BATCH, LENGTH = 4, 24
LOSS_TOL, GRAD_TOL = 1e-5, 1e-5  # float32; measured 2026-11-29: loss 1e-6, gradients 3.3e-7 at most
RESUME_STEPS, RESUME_TOL = 4, 1e-6  # the same ranks, shards and reduction order: measured equal to the last bit
RESHARD_TOL = 1e-5  # resumed at another dp_shard: other shards, another reduction order


def rows() -> torch.Tensor:
    return torch.randint(4, 268, (BATCH, LENGTH), generator=torch.Generator().manual_seed(0))


def lora(model):
    """LoRA on every projection with A and B random (init_lora_weights False: every adapter tensor gets a gradient)."""
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(1)
    return get_peft_model(model, LoraConfig(r=4, lora_alpha=8, target_modules="all-linear", init_lora_weights=False))


def reference(model_dir) -> dict:
    """One process, the whole batch: losses, gradients and the adapter's initial weights (the ranks copy them in)."""
    from transformers import AutoModelForCausalLM

    out = {}
    for kind in ("full", "lora"):
        model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
        model = lora(model) if kind == "lora" else model
        ids = rows()
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        grads = {n: p.grad for n, p in model.named_parameters() if p.grad is not None}
        out[kind] = {"loss": loss.item(), "grads": grads,
                     "weights": {n: p.detach().clone() for n, p in model.named_parameters() if p.requires_grad}}
    return out


def full(t):
    from torch.distributed.tensor import DTensor

    return t.full_tensor() if isinstance(t, DTensor) else t


def step(model, rank: int):
    """This rank's share of the batch (its dp coordinate: tp is the mesh's fastest dimension); the loss averaged over
    the dp ranks, as the Trainer logs it."""
    import torch.distributed as dist

    share = BATCH // DP
    ids = rows()[rank // TP * share:(rank // TP + 1) * share]
    loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    mean = full(loss.detach()).clone()
    dist.all_reduce(mean)
    return mean.item() / dist.get_world_size()


def worst(model, grads: dict) -> float:
    gathered = {n: full(p.grad) for n, p in model.named_parameters() if p.grad is not None}  # every rank: collectives
    assert set(gathered) == set(grads), sorted(set(gathered) ^ set(grads))[:3]
    return max((gathered[n] - grads[n]).abs().max().item() for n in grads)


def join(rank: int, world: int, port: int) -> None:
    """This fork as rank `rank` of a tp 2 x dp_shard world/2 mesh, as `accelerate launch` starts one."""
    import torch.distributed as dist

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world),
                      LOCAL_RANK=str(rank), ACCELERATE_USE_PARALLELISM_CONFIG="true",
                      PARALLELISM_CONFIG_TP_SIZE=str(TP), PARALLELISM_CONFIG_DP_SHARD_SIZE=str(world // TP))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)


def save_on_one_tp_group(rank: int, world: int, port: int, out_dir: str) -> None:
    """tp 2 x dp_shard 1 (2 ranks): the resume test's first 2 steps with the same 4 rows a step (4 a rank), then a
    checkpoint and a stop, which the 4 ranks resume at dp_shard 2 (`resume`)."""
    import torch.distributed as dist

    join(rank, world, port)
    tensor_parallel.set_up_process()
    trainer(f"{out_dir}/one-group", save_steps=RESUME_STEPS // 2, callbacks=[preempted()], batch=4).train()
    dist.destroy_process_group()


def preempted():
    """Stops the run once it saved a checkpoint, as a preemption does."""
    from transformers import TrainerCallback

    class Preempted(TrainerCallback):
        def on_save(self, args, state, control, **kwargs):
            control.should_training_stop = True

    return Preempted()


def rank_main(rank: int, world: int, port: int, model_dir: str, out_dir: str, ref: dict) -> None:
    import torch.distributed as dist
    from torch.distributed.tensor import DTensor, distribute_tensor
    from transformers import AutoModelForCausalLM, Trainer

    join(rank, world, port)
    result = {}
    mesh = tensor_parallel.set_up_process()  # as a rank of `accelerate launch` does: the patches
    config = tensor_parallel.distributed_config(mesh)

    def load(path=model_dir, distributed=config):
        return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, distributed_config=distributed)

    model = load()
    result["full_loss"] = step(model, rank)
    result["full_grad"] = worst(model, ref["full"]["grads"])
    with torch.no_grad():  # an SGD step, so that the saves below hold trained weights, not the file's
        for p in model.parameters():
            p -= 0.1 * p.grad
    main = rank == 0
    trainer = types.SimpleNamespace(model=model, accelerator=types.SimpleNamespace(is_main_process=main),
                                    save_model=lambda out: model.save_pretrained(out, is_main_process=main))
    result["final_save"] = tensor_parallel.save_and_check(trainer, f"{out_dir}/final", peft=False)
    model.save_pretrained(f"{out_dir}/dcp", distributed_checkpoint=True)
    dist.barrier()
    other = load(f"{out_dir}/dcp", {"fsdp_size": world})  # another mesh: the 4 ranks one shard group
    live = {n: full(t) for n, t in model.state_dict().items()}
    result["resharded"] = max((full(t) - live[n]).abs().max().item() for n, t in other.state_dict().items())
    result["resharded_mesh"] = list(other._device_mesh.mesh_dim_names)

    adapted = lora(load())
    with torch.no_grad():  # the reference's adapter, each rank its shard of it
        for n, p in adapted.named_parameters():
            if n in ref["lora"]["weights"]:
                w = ref["lora"]["weights"][n]
                target = p.to_local() if isinstance(p, DTensor) else p
                target.copy_(distribute_tensor(w, p.device_mesh, p.placements).to_local() if isinstance(p, DTensor)
                             else w)
    hooks = types.SimpleNamespace(model=adapted, accelerator=types.SimpleNamespace(sync_gradients=True))
    tensor_parallel.sync_adapter_over_dp(hooks)  # prepare_trainer's: the tp-sharded adapter tensors averaged over dp
    Trainer._sync_replicated_trainable_parameters(hooks, adapted)  # the Trainer's own, for the plain ones
    result["lora_loss"] = step(adapted, rank)
    result["lora_grad"] = worst(adapted, ref["lora"]["grads"])
    result["lora_sharded"] = sum(isinstance(p, DTensor) for p in adapted.parameters() if p.requires_grad)
    result.update(resume(out_dir, rank))
    dist.barrier()
    if main:
        with open(f"{out_dir}/result.json", "w") as f:
            json.dump(result, f)
    dist.destroy_process_group()


def trainer(out_dir: str, save_steps: int | None, callbacks=(), batch: int = 2):
    """The Trainer of a tp run on 24 rows (2 a rank, 6 steps an epoch: the run's 4 steps end mid-epoch, as most runs
    do) with AdamW and a decaying schedule, so that a resume that lost the optimizer's moments, the schedule or the
    data position trains other losses."""
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, Trainer, TrainingArguments

    from fsdp_recipes.checkpoint.markers import CompletionMarkerCallback
    from fsdp_recipes.patches.resume_at_end import no_step_past_max_steps

    ids = torch.randint(4, 268, (24, LENGTH), generator=torch.Generator().manual_seed(2)).tolist()
    model = AutoModelForCausalLM.from_pretrained(
        os.environ["TP_TEST_MODEL"], dtype=torch.float32,
        distributed_config=tensor_parallel.distributed_config(tensor_parallel.mesh_from_env()))
    args = TrainingArguments(output_dir=out_dir, max_steps=RESUME_STEPS, per_device_train_batch_size=batch,
                             learning_rate=1e-2, lr_scheduler_type="linear", logging_steps=1,
                             save_strategy="steps" if save_steps else "no", save_steps=save_steps or 500,
                             save_only_model=True, report_to=[], use_cpu=True, seed=0, disable_tqdm=True)
    built = Trainer(model=model, args=args, train_dataset=Dataset.from_dict({"input_ids": ids, "labels": ids}),
                    callbacks=[CompletionMarkerCallback(), *callbacks])  # the pack's order (train/build.py)
    tensor_parallel.prepare_trainer(built)
    no_step_past_max_steps(built)  # as every trainer of the pack's (train/build.py make_trainer_class)
    return built


def resume(out_dir: str, rank: int) -> dict:
    """4 steps straight; 2 steps, a checkpoint and a stop (a preemption); a fresh trainer resumed for the last 2. Then
    the relaunch of a run preempted at its last step: a fresh trainer resumed from the straight run's checkpoint-4
    (the Trainer saves one at max_steps, as a preemption seen at the last step does) trains no step. And the
    checkpoint of 2 steps on one tp group (tp 2 x dp_shard 1, `save_on_one_tp_group`) resumed here at dp_shard 2
    with the same rows a step: DCP reshards the weights and AdamW's state, the Trainer skips the trained rows. (The
    tiny model draws no random numbers in training, so its RNG files do not matter here: resume_settings.py MESH.)"""
    from fsdp_recipes.checkpoint import markers
    from fsdp_recipes.checkpoint.resume_check import ResumeCheckCallback

    def losses(done):
        return [h["loss"] for h in done.state.log_history if "loss" in h]

    straight = trainer(f"{out_dir}/straight", save_steps=100)
    straight.train()
    cut = trainer(f"{out_dir}/cut", save_steps=RESUME_STEPS // 2, callbacks=[preempted()])
    cut.train()
    ckpt = markers.latest_complete(f"{out_dir}/cut")  # the marker is written after the pack's part (markers.py)
    order = [type(c).__name__ for c in cut.callback_handler.callbacks]
    # the pack's resume check verifies every AdamW state's step count after the load (resume_check.py)
    resumed = trainer(f"{out_dir}/cut", save_steps=None, callbacks=[ResumeCheckCallback(str(ckpt), peft=False)])
    resumed.train(resume_from_checkpoint=str(ckpt))
    at_end = trainer(f"{out_dir}/straight", save_steps=100)
    at_end.train(resume_from_checkpoint=f"{out_dir}/straight/checkpoint-{RESUME_STEPS}")
    grown = trainer(f"{out_dir}/one-group", save_steps=None)
    grown.train(resume_from_checkpoint=f"{out_dir}/one-group/checkpoint-{RESUME_STEPS // 2}")
    live = dict(straight.model.named_parameters())
    at_end_weights = max((full(p) - full(live[n])).abs().max().item() for n, p in at_end.model.named_parameters())
    return {"straight": losses(straight), "resumed": losses(resumed), "checkpoint": ckpt.name,
            "grown": losses(grown),
            "at_end": [at_end.state.global_step, losses(at_end), at_end_weights, sorted(
                p.name for p in markers.checkpoint_dirs(f"{out_dir}/straight"))],
            "readable": markers.unreadable(ckpt), "files": sorted(p.name for p in ckpt.iterdir()),
            "pack_first": order.index("TensorParallelCheckpoints") < order.index("CompletionMarkerCallback")}


def test_tp_beside_fsdp2_trains_saves_and_reshards_as_one_process(cache_dir, tmp_path, monkeypatch):
    import torch.multiprocessing as mp

    from fsdp_recipes.dist import free_port

    model_dir = str(cache_dir / "tiny-mistral")
    monkeypatch.setenv("TP_TEST_MODEL", model_dir)
    ref = reference(model_dir)
    # forks: the ranks share this process's imports (spawn would import torch and transformers 4 more times)
    mp.start_processes(save_on_one_tp_group, args=(TP, free_port(), str(tmp_path)), nprocs=TP, start_method="fork")
    mp.start_processes(rank_main, args=(TP * DP, free_port(), model_dir, str(tmp_path), ref), nprocs=TP * DP,
                       start_method="fork")
    got = json.loads((tmp_path / "result.json").read_text())
    assert abs(got["full_loss"] - ref["full"]["loss"]) < LOSS_TOL
    assert got["full_grad"] < GRAD_TOL
    assert got["final_save"]["tensors"] == len(ref["full"]["weights"])  # every weight, gathered and compared
    assert got["resharded"] == 0.0 and got["resharded_mesh"] == ["pp", "fsdp", "tp"]
    assert abs(got["lora_loss"] - ref["lora"]["loss"]) < LOSS_TOL
    assert got["lora_grad"] < GRAD_TOL
    assert got["lora_sharded"] == 28  # per layer: lora_B of 5 colwise projections, lora_A of 2 rowwise; 4 layers
    # a preempted tp run resumes exactly: the resumed trainer's log holds the checkpoint's 2 losses and its own 2
    assert got["checkpoint"] == "checkpoint-2" and got["readable"] is None and got["pack_first"]
    assert {"tp_state", "scheduler.pt", "rng_state_3.pth", "trainer_state.json", "checkpoint_complete"} <= \
        set(got["files"])
    assert len(got["straight"]) == len(got["resumed"]) == RESUME_STEPS
    assert max(abs(a - b) for a, b in zip(got["straight"], got["resumed"])) <= RESUME_TOL
    # resumed at its last step (a preemption seen there), a run trains no step past max_steps: its log is the
    # checkpoint's, its weights the straight run's, and no checkpoint-5 (patches/resume_at_end.py)
    step, logged, weights, checkpoints = got["at_end"]
    assert step == RESUME_STEPS and logged == got["straight"] and weights == 0.0
    assert checkpoints == [f"checkpoint-{RESUME_STEPS}"]
    # saved on one tp group (tp 2 x dp_shard 1), resumed on two (tp 2 x dp_shard 2) with the same rows a step: the
    # 4 losses of the run that never stopped (measured 1.4e-6 apart at most)
    grown = got["grown"]
    assert len(grown) == RESUME_STEPS and max(abs(a - b) for a, b in zip(got["straight"], grown)) <= RESHARD_TOL


def cfg(use_peft=True, modules_to_save=None, save_strategy="steps", save_only_model=False):
    training = types.SimpleNamespace(output_dir="runs/x", save_strategy=save_strategy, save_only_model=save_only_model)
    model = types.SimpleNamespace(use_peft=use_peft, lora_modules_to_save=modules_to_save)
    return types.SimpleNamespace(training=training, model=model)


def tp_env(monkeypatch, tp=2, dp_shard=2):
    monkeypatch.setenv("ACCELERATE_USE_PARALLELISM_CONFIG", "true")
    monkeypatch.setenv("PARALLELISM_CONFIG_TP_SIZE", str(tp))
    monkeypatch.setenv("PARALLELISM_CONFIG_DP_SHARD_SIZE", str(dp_shard))


def test_the_rank_reads_the_mesh_accelerate_launch_passed(monkeypatch):
    assert tensor_parallel.mesh_from_env() is None  # no parallelism_config in the YAML
    tp_env(monkeypatch, tp=1)
    assert tensor_parallel.mesh_from_env() is None  # a data-parallel mesh: accelerate's FSDP as before
    tp_env(monkeypatch)
    assert tensor_parallel.mesh_from_env() == Mesh(dp_shard=2, tp=2)
    run = cfg()
    assert tensor_parallel.model_init_kwargs(run, resume=None) == {
        "distributed_config": {"tp_size": 2, "fsdp_size": 2}, "device_map": None}
    assert run.training.save_only_model  # transformers checkpoints no optimizer state for such a model


def test_what_a_tp_run_cannot_do_is_one_line(monkeypatch, tmp_path):
    tp_env(monkeypatch)
    # a checkpoint without the pack's part (saved before it, or by transformers alone): no optimizer state to resume
    with pytest.raises(UserError, match=r"^runs/x has a checkpoint to resume \(runs/x/checkpoint-4\), but it holds "
                                        r"no optimizer state \(tp_state/ missing: .* transformers 5.23 .* Fix: "):
        tensor_parallel.model_init_kwargs(cfg(), resume="runs/x/checkpoint-4")
    ckpt = tmp_path / "checkpoint-4"
    (ckpt / "tp_state").mkdir(parents=True)
    (ckpt / "tp_state" / ".metadata").write_bytes(b"")
    (ckpt / "trainer_state.json").write_text("{}")  # a Trainer's save: the part of it that is not the pack's
    assert tensor_parallel.model_init_kwargs(cfg(), resume=str(ckpt))["distributed_config"]  # one it resumes from
    from fsdp_recipes.checkpoint.markers import unreadable  # the launcher's check: that empty index cannot be read

    assert unreadable(ckpt).startswith("tp_state/.metadata: ")
    with pytest.raises(UserError, match=r"^lora_modules_to_save \['lm_head'\] with a tensor-parallel mesh .* FSDP2 "
                                        r"refuses to copy .* Fix: "):  # also the launcher's (tests/test_mesh.py)
        tensor_parallel.model_init_kwargs(cfg(modules_to_save=["lm_head"]), resume=None)


def test_the_patches_apply_to_the_installed_libraries(monkeypatch):
    """Each patch finds its target with the signature it was written for; accelerate then validates a CPU job's
    tp x dp_shard mesh, which it refused (MULTI_CPU is no multi-device state to accelerate 1.15)."""
    from accelerate.parallelism_config import ParallelismConfig
    from accelerate.utils import DistributedType
    from peft.tuners.lora.layer import LoraLayer

    from fsdp_recipes.patches import guard
    from fsdp_recipes.patches import tensor_parallel as patches

    for owner, name in ((LoraLayer, "_get_in_out_features"), (ParallelismConfig, "_validate_accelerator")):
        monkeypatch.setattr(owner, name, getattr(owner, name))  # restored after the test
    monkeypatch.setattr(guard, "APPLIED", [])
    monkeypatch.setattr(patches, "_PATCHED", set())
    cpu_job = types.SimpleNamespace(distributed_type=DistributedType.MULTI_CPU, num_processes=4, is_fsdp2=False,
                                    multi_device=False, is_main_process=True)
    with pytest.raises(ValueError, match="only compatible"):
        ParallelismConfig(tp_size=2, dp_shard_size=2)._validate_accelerator(cpu_job)
    patches.lora_widths_of_tensor_parallel_linears()
    patches.parallelism_config_on_cpu()
    ParallelismConfig(tp_size=2, dp_shard_size=2)._validate_accelerator(cpu_job)
    assert [p["patch"] for p in guard.APPLIED] == ["tensor_parallel.lora_widths_of_tensor_parallel_linears",
                                                   "tensor_parallel.parallelism_config_on_cpu"]


def test_a_tp_trainers_resume_hands_its_checkpoint_to_the_pack(monkeypatch):
    """Point 3 of the patches: the Trainer's own load (which fails on DTensors) hands the path on, on that trainer
    only; a changed signature refuses in one line."""
    from transformers import Trainer

    from fsdp_recipes.patches import guard
    from fsdp_recipes.patches import tensor_parallel as patches

    monkeypatch.setattr(guard, "APPLIED", [])
    trainer, other, seen = Trainer.__new__(Trainer), Trainer.__new__(Trainer), []
    patches.resume_through(trainer, seen.append)
    trainer._load_from_checkpoint("out/checkpoint-2")
    assert seen == ["out/checkpoint-2"] and "_load_from_checkpoint" not in vars(other)
    assert [p["patch"] for p in guard.APPLIED] == ["tensor_parallel.resume_through_the_packs_state"]

    class Changed(Trainer):
        def _load_from_checkpoint(self, resume_from_checkpoint, model=None, strict=True):
            pass

    with pytest.raises(guard.PatchTargetChanged, match="_load_from_checkpoint now takes"):
        patches.resume_through(Changed.__new__(Changed), seen.append)


def test_a_tp_checkpoint_resumes_at_another_dp_shard_and_refuses_another_tp_in_one_line(monkeypatch):
    """checkpoint/resume_settings.py MESH: another dp_shard resumes (the forked test above resumes tp 2 x dp_shard 1 at
    dp_shard 2) when the rows of a step stay the same, which the global batch counts over the data-parallel ranks
    (world / tp); another tp size, or tp resumed from a checkpoint without it (or the reverse), is one line naming
    both meshes and the fix, even under override_resumed_settings. The rank records the mesh accelerate launch
    passed."""
    from fsdp_recipes.checkpoint.resume_settings import check, current

    def run(per_device):
        training = types.SimpleNamespace(per_device_train_batch_size=per_device, gradient_accumulation_steps=1,
                                         max_steps=4)
        return types.SimpleNamespace(training=training, script=types.SimpleNamespace(dataset_name="d"), trainer="sft",
                                     model=types.SimpleNamespace(dtype="float32"), pack=types.SimpleNamespace())

    tp_env(monkeypatch, tp=2, dp_shard=1)
    saved = current(run(4), 2, mesh=tensor_parallel.mesh_from_env())  # as the rank records it (train/entry.py)
    assert saved["mesh"] == {"tp": 2, "dp_shard": 1} and saved["global_batch"] == 4  # one group: 4 rows a step
    assert check("out/checkpoint-2", 2, saved, current(run(2), 4, mesh=Mesh(dp_shard=2, tp=2)), False) == {}
    with pytest.raises(UserError, match=r"with other settings \(global_batch 4 -> 8\)"):  # 2 groups of 4 rows
        check("out/checkpoint-2", 2, saved, current(run(4), 4, mesh=Mesh(dp_shard=2, tp=2)), override=False)
    for world, now, named in ((4, Mesh(dp_shard=1, tp=4), "the mesh tp 4 x dp_shard 1"),
                              (2, Mesh(dp_shard=2), "a mesh without tensor parallel")):
        for override in (False, True):
            with pytest.raises(UserError, match=rf"^cannot resume from out/checkpoint-2 on {named}: it was saved on "
                                                rf"the mesh tp 2 x dp_shard 1, and .*\. Fix: relaunch with "
                                                r"parallelism_config_tp_size 2 \(dp_shard may change, with a "
                                                r"per_device_train_batch_size that keeps the global batch\), or a new "
                                                r"--output_dir to start over\.$"):
                check("out/checkpoint-2", 2, saved, current(run(4), world, mesh=now), override)
    fsdp = current(run(2), 2, mesh=Mesh(dp_shard=2))  # a mesh that splits no layers records none
    assert fsdp["mesh"] is None and fsdp["global_batch"] == 4
    with pytest.raises(UserError, match=r"^cannot resume from out/checkpoint-2 on the mesh tp 2 x dp_shard 1: it was "
                                        r"saved on a mesh without tensor parallel, and its state is the FSDP path's, "
                                        r".* Fix: relaunch with no parallelism_config_tp_size, as it was saved, or a "
                                        r"new --output_dir"):
        check("out/checkpoint-2", 2, fsdp, saved, override=False)
