"""Context parallel on CPU (speed/context_parallel.py): the split as torch's ring makes it, and one training step of a
tiny Llama over 2 gloo ranks with cp 2 against the same step in one process.

The two-rank step runs what a recipe's cp mesh runs on CPU: the buffers transformers' Trainer hands to the cp context
(input_ids, shift_labels, a padding attention_mask, global position_ids), accelerate's hooks that drop the mask for
is_causal, the all-to-all attention; then the Trainer's loss arithmetic under cp (transformers Trainer.
_get_num_items_in_batch and compute_loss, TRL SFTTrainer.compute_loss): the tokens counted on the whole batch on every
rank, summed over the world and divided by cp; each rank's loss its tokens' sum over that count, times the world size;
gradients averaged over the ranks, as FSDP's reduce-scatter over dp_shard x cp does.
"""

from __future__ import annotations

import json
import os
import time

import pytest
import torch

from fsdp_recipes.speed.context_parallel import shard, shard_indices

# float32 on a 2-layer model: the all-to-all form reorders no sum that SDPA does not already reorder between a
# 16-token and an 8-token query block, so the loss agrees to rounding
LOSS_TOL = 1e-5
GRAD_TOL = 1e-5  # the largest gradient difference over the largest gradient entry


def test_the_split_is_torchs_head_tail_load_balancing():
    # 8 tokens over 2 ranks, 4 chunks of 2: rank 0 holds the first and the last chunk, rank 1 the two middle ones
    assert shard_indices(8, 2).tolist() == [[0, 1, 6, 7], [2, 3, 4, 5]]
    assert shard_indices(12, 3).tolist() == [[0, 1, 10, 11], [2, 3, 8, 9], [4, 5, 6, 7]]
    # not a multiple of 2 x cp: torch's ring falls back to contiguous chunks, and so does the split
    assert shard_indices(6, 2).tolist() == [[0, 1, 2], [3, 4, 5]]
    row = torch.arange(16).reshape(2, 8) * 10  # [batch, seq]
    assert shard(row, 1, 1, 2).tolist() == [[20, 30, 40, 50], [100, 110, 120, 130]]
    with pytest.raises(ValueError, match="does not split"):
        shard_indices(7, 2)


def tiny_llama():
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=96, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                         attn_implementation="sdpa")
    return LlamaForCausalLM(config)


def batch():
    """Two rows of 16 tokens, the second right-padded after 11 (its labels -100 there), a prompt masked in the first."""
    g = torch.Generator().manual_seed(1)
    input_ids = torch.randint(3, 96, (2, 16), generator=g)
    attention_mask = torch.ones(2, 16, dtype=torch.long)
    attention_mask[1, 11:] = 0
    labels = input_ids.masked_fill(attention_mask == 0, -100)
    labels[0, :5] = -100
    return input_ids, attention_mask, labels


def one_process_step():
    model = tiny_llama()
    input_ids, attention_mask, labels = batch()
    loss = model(input_ids=input_ids, attention_mask=attention_mask, labels=labels).loss
    loss.backward()
    return float(loss.detach()), {n: p.grad.clone() for n, p in model.named_parameters()}


def cp_rank(rank: int, world: int, port: int, out: str) -> None:
    import torch.distributed as dist
    from accelerate.big_modeling import _attach_context_parallel_hooks
    from torch.distributed.device_mesh import init_device_mesh

    from fsdp_recipes.speed.context_parallel import all_to_all_context

    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("cp",))["cp"]
    ref_loss, ref_grads = one_process_step()

    model = tiny_llama()
    _attach_context_parallel_hooks(model)  # what accelerate's _prepare_cp puts on the model
    input_ids, attention_mask, labels = batch()
    # the Trainer's CP inputs: labels shifted before the split, the global positions
    shift_labels = torch.nn.functional.pad(labels, (0, 1), value=-100)[:, 1:].contiguous()
    position_ids = torch.arange(16).expand(2, -1).contiguous()
    tokens = (labels[:, 1:] != -100).sum()  # on the whole batch, on every rank
    dist.all_reduce(tokens)
    tokens = tokens / world  # _get_num_items_in_batch: summed over the world, divided by tp x cp (here cp = world)
    with all_to_all_context(mesh, buffers=[input_ids, attention_mask, shift_labels, position_ids],
                            buffer_seq_dims=[1, 1, 1, 1]):
        assert input_ids.shape == (2, 8) and position_ids[0].tolist() == shard_indices(16, world)[rank].tolist()
        logits = model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids).logits
        summed = torch.nn.functional.cross_entropy(logits.flatten(0, 1).float(), shift_labels.flatten(),
                                                   ignore_index=-100, reduction="sum")
        loss = summed / tokens * world  # compute_loss: times num_processes // tp
        loss.backward()  # inside, as Trainer.training_step does: the embedding's backward reads the split input_ids
    assert input_ids.shape == (2, 16)  # the buffers are whole again after the step
    logged = loss.detach().clone()
    dist.all_reduce(logged)
    logged /= world  # the Trainer's logged loss: the mean over ranks
    worst = 0.0
    for name, p in model.named_parameters():
        dist.all_reduce(p.grad)
        p.grad /= world  # FSDP: the average over dp_shard x cp
        worst = max(worst, float((p.grad - ref_grads[name]).abs().max() / ref_grads[name].abs().max()))
    if rank == 0:
        with open(out, "w") as f:
            json.dump({"ref_loss": ref_loss, "cp_loss": float(logged), "grad_rel": worst}, f)
    dist.destroy_process_group()


def test_two_ranks_cp2_train_a_step_as_one_process(tmp_path):
    """2 gloo ranks forked from this process, which has imported what they need (a spawn would import transformers
    twice more and leave multiprocessing's resource tracker behind)."""
    from transformers import LlamaForCausalLM  # noqa: F401  (imported before the fork: the ranks inherit it)

    from fsdp_recipes.dist import free_port

    out = tmp_path / "cp.json"
    started = time.time()
    torch.multiprocessing.start_processes(cp_rank, args=(2, free_port(), str(out)), nprocs=2, join=True,
                                          start_method="fork")
    got = json.loads(out.read_text())
    print(f"cp 2 over gloo: {time.time() - started:.1f} s, {got}")
    assert abs(got["cp_loss"] - got["ref_loss"]) <= LOSS_TOL * abs(got["ref_loss"]), got
    assert got["grad_rel"] <= GRAD_TOL, got


def test_install_puts_the_all_to_all_form_where_the_ring_cannot_run(monkeypatch):
    """The hook train/build.py calls on the built trainer: on a CPU with a cp mesh, accelerate's _prepare_cp (which
    `prepare` calls) sets the all-to-all context and accelerate's mask hooks; the token counter is left on every
    rank. Without a cp mesh it leaves the trainer alone."""
    from types import SimpleNamespace

    from fsdp_recipes.speed import context_parallel

    monkeypatch.setattr(context_parallel, "ring_available", lambda: False)
    hooked = []
    monkeypatch.setattr("accelerate.big_modeling._attach_context_parallel_hooks", lambda model: hooked.append(model))

    def trainer(cp_rank: int, cp_enabled: bool = True):
        mesh = {"cp": SimpleNamespace(get_local_rank=lambda: cp_rank)}
        accelerator = SimpleNamespace(parallelism_config=SimpleNamespace(cp_enabled=cp_enabled, cp_size=2),
                                      torch_device_mesh=mesh, _prepare_cp=None, _cp_context=None)
        return SimpleNamespace(accelerator=accelerator, token_counter=object())

    first, second, plain = trainer(0), trainer(1), trainer(0, cp_enabled=False)
    counter = second.token_counter
    assert context_parallel.install(first) == "all-to-all" and first.token_counter is not None
    # every rank keeps counting: the report divides the sum by tp x cp (the next test runs the two together)
    assert context_parallel.install(second) == "all-to-all" and second.token_counter is counter
    assert context_parallel.install(plain) is None and plain.accelerator._prepare_cp is None
    model = torch.nn.Linear(1, 1)
    assert first.accelerator._prepare_cp(model, "optimizer") == (model, "optimizer")
    assert hooked == [model]
    step = first.accelerator._cp_context(buffers=[], buffer_seq_dims=[])  # what maybe_context_parallel enters
    assert step.func is context_parallel.all_to_all_context.__wrapped__
    monkeypatch.setattr(context_parallel, "ring_available", lambda: True)
    assert context_parallel.install(trainer(0)) == "ring"  # CUDA: accelerate's own ring, left as it is


def test_a_cp_groups_ranks_count_a_batch_once_through_install_and_the_report(monkeypatch):
    """Both halves together, as a run has them: train/build.py's trainer class and install() on each rank of a
    dp_shard 1 x cp 2 group, then the run report's counters (tokens, tokens/s and MFU, a checkpoint's counters). Each
    rank counts the batch in training_step before the Trainer's cp context splits it (the fake base splits it in
    place, as torch's context_parallel does); the report divides the ranks' sum by tp x cp: a 1,000-token batch
    counts 1,000, its 2 rows 2."""
    from types import SimpleNamespace

    from accelerate.parallelism_config import ParallelismConfig

    from fsdp_recipes.metrics import environment, run_report
    from fsdp_recipes.metrics.tokens import COUNTS, TokenCounter
    from fsdp_recipes.speed import context_parallel
    from fsdp_recipes.train import build, kinds

    class SplittingTrainer:
        """transformers' Trainer.training_step under cp, reduced to what the count sees: the buffers cut in place."""

        def training_step(self, model, inputs, *args, **kwargs):
            for name, buffer in inputs.items():
                part = shard(buffer, 1, self.cp_rank, 2)
                buffer.resize_(part.shape)
                buffer.copy_(part)
            return torch.tensor(1.0)

    monkeypatch.setattr(kinds, "load", lambda kind: SimpleNamespace(trainer_class=lambda: SplittingTrainer,
                                                                    count_prepared=None))
    monkeypatch.setattr(context_parallel, "ring_available", lambda: False)
    monkeypatch.setattr("accelerate.big_modeling._attach_context_parallel_hooks", lambda model: None)
    pc = ParallelismConfig(dp_shard_size=1, cp_size=2)
    reports = []
    for cp_rank in (0, 1):
        trainer = build.make_trainer_class("sft").__new__(build.make_trainer_class("sft"))
        trainer.cp_rank = cp_rank
        trainer.accelerator = SimpleNamespace(
            parallelism_config=pc, torch_device_mesh={"cp": SimpleNamespace(get_local_rank=lambda r=cp_rank: r)})
        report = run_report.RunReportCallback.__new__(run_report.RunReportCallback)
        report.tokens, report.train_start = TokenCounter(), 0.0
        report.prior = {**dict.fromkeys(COUNTS, 0), "train_time_s": 0.0}
        trainer.token_counter = report.tokens  # as build_trainer sets it
        assert context_parallel.install(trainer) == "all-to-all"
        # the ranks of a cp group get the same batch: 2 rows of 512, 500 real tokens each
        attention_mask = torch.ones(2, 512, dtype=torch.long)
        attention_mask[:, 500:] = 0
        trainer.training_step(None, {"input_ids": torch.randint(3, 96, (2, 512)), "attention_mask": attention_mask})
        reports.append(report)

    ranks = [[r.tokens.counts()[k] for k in COUNTS] for r in reports]
    monkeypatch.setattr(run_report, "all_reduce", lambda values, op: [sum(v) for v in zip(*ranks)])
    monkeypatch.setattr(run_report, "mesh_info", lambda: environment.mesh_info(pc))
    totals = reports[0].counters_so_far(10.0)
    assert (totals["non_padding"], totals["padded"], totals["sequences"], totals["squared_lengths"]) == \
        (1000, 1024, 2, 2 * 500 * 500), totals


def test_a_cp_checkpoint_resumes_at_another_cp_with_the_same_rows_a_step_and_refuses_other_rows_in_one_line(
        monkeypatch):
    """checkpoint/resume_settings.py MESH under context parallel: a cp group's ranks share their rows, so the global
    batch a checkpoint records counts the data-parallel ranks, processes / (tp x cp) (config/mesh.py
    data_parallel_size). Another cp size, cp 1 included, resumes with the same rows a step (the state is FSDP's at
    any cp); another global batch beside another mesh is one line naming both meshes and the per-device batch that
    keeps it (a cp 2 x dp_shard 2 run relaunched as dp_shard 4 at the same per-device batch read 16 rows a step, not
    8, and compared equal); tp against a cp checkpoint is the tp rule's line. The rank records the mesh accelerate
    launch passed, cp included."""
    from types import SimpleNamespace

    from fsdp_recipes.checkpoint.resume_settings import check, current
    from fsdp_recipes.config.mesh import Mesh
    from fsdp_recipes.errors import UserError

    def run(per_device):
        training = SimpleNamespace(per_device_train_batch_size=per_device, gradient_accumulation_steps=1, max_steps=4)
        return SimpleNamespace(training=training, script=SimpleNamespace(dataset_name="d"), trainer="sft",
                               model=SimpleNamespace(dtype="float32"), pack=SimpleNamespace())

    ckpt = "out/checkpoint-2"
    saved = current(run(4), 4, mesh=Mesh(dp_shard=2, cp=2))
    # 2 cp groups of 4 rows each: 8 rows a step, not 4 x 4 processes
    assert saved["global_batch"] == 8 and saved["mesh"] == {"tp": 1, "dp_shard": 2, "cp": 2}
    dp_shard_4 = current(run(4), 4, mesh=Mesh(dp_shard=4))  # the same per-device batch on 4 data-parallel ranks
    assert dp_shard_4["global_batch"] == 16
    with pytest.raises(UserError, match=(
            rf"^cannot resume from {ckpt} with other settings \(global_batch 8 -> 16\): it was saved on the mesh "
            r"dp_shard 2 x cp 2, 8 rows a step, and a step on a mesh without tp or cp reads 16 "
            r"\(per_device_train_batch_size x gradient_accumulation_steps x the 4 data-parallel ranks, processes "
            r"/ \(tp x cp\)\), so the run would go on with other steps than it was saved with\. Fix: relaunch "
            r"with per_device_train_batch_size x gradient_accumulation_steps = 2 \(the same rows a step\), or a "
            r"new --output_dir, or --override_resumed_settings true to apply the new values from step 3\.$")):
        check(ckpt, 2, saved, dp_shard_4, override=False)
    # a finished cp run continued to a longer max_steps on that mesh: the same line's reason and fix
    from pathlib import Path

    from fsdp_recipes.checkpoint import previous_run

    finished = previous_run.Previous("completed", 2, "2026-11-29", saved, Path("out/checkpoint-2"), [])
    longer = {**dp_shard_4, "max_steps": 8}
    with pytest.raises(UserError, match=r"cannot continue to max_steps=8: this command also changes global_batch 8 -> "
                                        r"16: it was saved on the mesh dp_shard 2 x cp 2, 8 rows a step, .* Fix: "
                                        r"relaunch with per_device_train_batch_size x gradient_accumulation_steps = 2 "
                                        r"\(the same rows a step\), or a new --output_dir, or --overwrite_output_dir"):
        previous_run.decide("out", finished, longer)
    assert previous_run.decide("out", finished, {**current(run(2), 4, mesh=Mesh(dp_shard=4)), "max_steps": 8}) is None
    # the override applies the new global batch, and the report says so (never silent)
    assert check(ckpt, 2, saved, dp_shard_4, override=True)["changed"] == {"global_batch": [8, 16]}
    # 8 rows a step do not split over 3 data-parallel ranks: the fix says what mesh would keep them
    with pytest.raises(UserError, match=r"a step on the mesh dp_shard 3 x cp 2 reads 12 .* Fix: relaunch on a mesh "
                                        r"whose data-parallel ranks divide 8 \(no per-device batch keeps 8 rows a step "
                                        r"over 3\)"):
        check(ckpt, 2, saved, current(run(4), 6, mesh=Mesh(dp_shard=3, cp=2)), override=False)
    # the same 8 rows a step resume: cp 1 (dp_shard 4 at 2 a rank, 2 processes at 4, plain FSDP), cp 4, cp 2 at 4 x 2
    for world, mesh, per_device in ((4, Mesh(dp_shard=4), 2), (2, Mesh(dp_shard=2), 4), (2, None, 4),
                                    (8, Mesh(dp_shard=2, cp=4), 4), (8, Mesh(dp_shard=4, cp=2), 2)):
        assert check(ckpt, 2, saved, current(run(per_device), world, mesh=mesh), override=False) == {}
    # a plain FSDP checkpoint resumes on a cp mesh with the same rows a step, and names both meshes otherwise
    fsdp = current(run(2), 4)
    assert fsdp["mesh"] is None and fsdp["global_batch"] == 8
    assert check(ckpt, 2, fsdp, saved, override=False) == {}
    with pytest.raises(UserError, match=r"it was saved on a mesh without tp or cp, 8 rows a step, and a step on the "
                                        r"mesh dp_shard 2 x cp 2 reads 4 "):
        check(ckpt, 2, fsdp, current(run(2), 4, mesh=Mesh(dp_shard=2, cp=2)), override=False)
    # a cp checkpoint saved before its mesh was recorded (mesh null, every rank counted): refused without naming one
    unrecorded = {k: v for k, v in saved.items() if k != "data_parallel_ranks"} | {"mesh": None, "global_batch": 16}
    with pytest.raises(UserError, match=r"with other settings \(global_batch 16 -> 8\): the checkpoint holds the old"):
        check(ckpt, 2, unrecorded, saved, override=False)
    # tp against a cp checkpoint: the tp rule's line (the FSDP path's state), even under the override
    with pytest.raises(UserError, match=rf"^cannot resume from {ckpt} on the mesh tp 2 x dp_shard 2: it was saved on "
                                        r"the mesh dp_shard 2 x cp 2, and its state is the FSDP path's, .* Fix: "
                                        r"relaunch with no parallelism_config_tp_size, as it was saved"):
        check(ckpt, 2, saved, current(run(4), 4, mesh=Mesh(dp_shard=2, tp=2)), override=True)
    # what a rank records (train/entry.py): the mesh accelerate launch passed, cp included
    from fsdp_recipes.config.mesh import launched_mesh

    for name, size in (("USE_PARALLELISM_CONFIG", "true"), ("DP_SHARD_SIZE", "2"), ("CP_SIZE", "2")):
        monkeypatch.setenv(("ACCELERATE_" if name.startswith("USE") else "PARALLELISM_CONFIG_") + name, size)
    assert launched_mesh() == Mesh(dp_shard=2, cp=2)
    assert current(run(4), 4, mesh=launched_mesh()) == saved
