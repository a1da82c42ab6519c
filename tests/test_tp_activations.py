"""The memory budget under tensor parallel with fp32 weights under bf16 autocast (config/mesh.py's full fine-tune):
the residual stream stays fp32, so the norms' saved tensors, the checkpointed layers' inputs and FSDP's gathered
weights are priced at 4 B, and autocast's bf16 casts of each norm's output are counted (planning/memory_budget.py's
docstring). Worked by hand on a made-up model, and held against what autograd saves in one layer of the tiny
Mistral, in this process."""

from dataclasses import replace

from fsdp_recipes.planning import memory_budget

# a made-up model: 2 layers of 3,000 parameters, hidden 16, q 16, kv 8, intermediate 32, vocab 64
SHAPE = memory_budget.ModelShape(
    params=8000, trainable=8000, layers=2, hidden=16, q_dim=16, kv_dim=8, intermediate=32, vocab=64,
    layer_params=3000, layer_trainable=3000, root_params=2000, lora_dropout_width=0, lora_rank_width=0)
# tp 2 x dp_shard 2, fp32 weights under bf16, 1,024 tokens a GPU
TP_FP32 = memory_budget.Setup(shard=2, world=4, strategy="FSDP", load_bytes=4, compute_bytes=2, mixed_precision=True,
                              tokens=1024, checkpointed=False, optimizer_bytes=8, runtime_bytes=0, tp=2)


def test_a_layer_under_tp_with_fp32_weights_keeps_fp32_norm_tensors_and_five_bf16_casts():
    # 2 norms x (fp32 input + fp32 normalized) x 16 = 256, 5 bf16 casts x 16 = 160, and the split part as before:
    # 2 x (2 x 16 + 2 x 8 + 4 x 32) / tp 2 = 176; 592 B a token
    assert memory_budget.activations_per_token_per_layer(SHAPE, TP_FP32) == 256 + 160 + 176 == 592
    # a bf16 load (LoRA's base under tp): the norms' 2 x 16 x (4 + 2) = 192, unchanged
    assert memory_budget.activations_per_token_per_layer(SHAPE, replace(TP_FP32, load_bytes=2)) == 192 + 176
    # without tp (FSDP's mixed-precision policy casts the weights, so the residual stream is bf16): as before
    assert memory_budget.activations_per_token_per_layer(SHAPE, replace(TP_FP32, tp=1, shard=4)) == 192 + 352


def test_tp_with_fp32_weights_checkpoints_fp32_inputs_and_gathers_fp32_weights():
    every_1 = replace(TP_FP32, checkpointed=True)
    # each of the 2 checkpointed layers keeps its fp32 input: 2 x 16 x 4 B a token (bf16 load: 2 B)
    assert memory_budget.checkpoint_inputs(SHAPE, every_1) == 128
    assert memory_budget.checkpoint_inputs(SHAPE, replace(every_1, load_bytes=2)) == 64
    parts = memory_budget.budget(SHAPE, TP_FP32)
    # FSDP gathers 2 layers and the root at 4 B, plus a layer's fp32 gradients: (8,000 x 4 + 3,000 x 4) / tp 2
    assert parts["communication_buffers"] == (8000 * 4 + 3000 * 4) // 2 == 22_000
    # 1,024 tokens x (2 layers x 592 + the final norm's 2 x 4 x 16 and the LM head's bf16 cast 2 x 16), the chunked
    # head's fp32 tile 1,024 x 64 x 4, its fp32 gradients: hidden states' 1,024 x 16 x 4, the head's 64 x 16 x 4 / 2
    assert parts["activations"] == 1024 * (2 * 592 + 160) + 1024 * 64 * 4 + 1024 * 16 * 4 + 2048 == 1_705_984


def test_one_layer_of_the_tiny_mistral_saves_what_the_formula_counts(cache_dir):
    """One process, fp32 weights under bf16 autocast, 3 rows of 11 tokens (no activation shaped like a weight):
    the saved storages of layer 1 (of 4), autocast's bf16 weight copies apart (tp_autocast_weight_copies). The tiny
    Mistral: hidden 256, q 256, kv 128, intermediate 688, 4 heads. One process holds whole what tp splits: the
    formula at tp 2 is 2 x 256 x 2 x 4 + 5 x 2 x 256 = 6,656 plus 2 x (512 + 256 + 2,752) / 2 = 3,520; the process
    holds 3,520 more, and 24 B of per-row scalars the formula leaves out (2 norms' fp32 rsqrt, 4 heads' fp32
    log-sum-exp): 13,720 B a token. bench/tp_cpu_collectives.py measures the tp 2 x dp_shard 2 layer: 10,192."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(cache_dir / "tiny-mistral"),
                                             dtype=torch.float32)
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    weight_shapes = {s for p in model.parameters() for s in (tuple(p.shape), tuple(reversed(p.shape)))}
    rows, length = 3, 11
    ids = torch.randint(4, 268, (rows, length), generator=torch.Generator().manual_seed(0))
    inside, saved = [False], {}
    layer = model.model.layers[1]
    layer.register_forward_pre_hook(lambda *a: inside.__setitem__(0, True))
    layer.register_forward_hook(lambda *a: inside.__setitem__(0, False))

    def pack(t):
        weight_copy = t.dtype == torch.bfloat16 and tuple(t.shape) in weight_shapes
        if t.untyped_storage().data_ptr() not in params and not weight_copy:  # where it is first saved: the
            # rotary cos and sin every layer saves are layer 0's
            saved.setdefault(t.untyped_storage().data_ptr(), (inside[0], t.untyped_storage().nbytes()))
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), torch.autocast("cpu", dtype=torch.bfloat16):
        model(input_ids=ids, labels=ids)
    measured = sum(n for in_layer_1, n in saved.values() if in_layer_1) / (rows * length)
    shape = memory_budget.ModelShape(
        params=0, trainable=0, layers=4, hidden=256, q_dim=256, kv_dim=128, intermediate=688, vocab=268,
        layer_params=0, layer_trainable=0, root_params=0, lora_dropout_width=0, lora_rank_width=0)
    assert memory_budget.activations_per_token_per_layer(shape, TP_FP32) == 6656 + 3520
    assert measured == 6656 + 3520 + 3520 + 24 == 13_720
