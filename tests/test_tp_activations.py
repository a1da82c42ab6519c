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


# ------------------------------------------------------------------ LoRA under tp: the fp32 adapters' input copies
# The tiny Mistral (tests/conftest.py's tiny assets): hidden 256, 4 heads of 64 (q 256), 2 key/value heads (kv 128),
# intermediate 688; LoRA r 4 on its 7 linears. Under tp 2 q, k, v, gate, up are column-wise (their input whole, 256
# each), o and down row-wise (their input split: 256 / 2 and 688 / 2).
TINY_LORA = memory_budget.ModelShape(
    params=0, trainable=0, layers=4, hidden=256, q_dim=256, kv_dim=128, intermediate=688, vocab=268,
    layer_params=0, layer_trainable=0, root_params=0, lora_dropout_width=0, lora_rank_width=7 * 4,
    lora_input_width=5 * 256 + 256 + 688, lora_split_input_width=256 + 688)
LORA_TP = replace(TP_FP32, load_bytes=2)  # a bf16 base under bf16 autocast, tp 2


def test_a_lora_layer_under_tp_keeps_each_targeted_linears_own_input_copy():
    """What bench/tp_cpu_collectives.py measured in layer 1 of 4 on a tp 2 x dp_shard 2 rank (2026-11-29), tensor by
    tensor: 8,456 B a token; the planner counted 6,620 before (the norms' bf16 outputs and the MLP's product, which
    nothing keeps here, and the A outputs at 1/tp, which are whole)."""
    norms = 2 * 256 * 4  # each norm's fp32 input; the frozen weight's multiply keeps no normalized tensor: 2,048
    split = 2 * (2 * 256 + 2 * 128 + 3 * 688) // 2  # q, k, v, attention output; gate, up, SiLU(gate) at 1/tp: 2,832
    inputs = 5 * 256 + 256 // 2 + 688 // 2  # each targeted linear's input on one rank: 1,752 elements, at 2 B
    a_outputs = 2 * 7 * 4  # 7 r-wide A outputs, whole on each rank: 56
    assert memory_budget.activations_per_token_per_layer(TINY_LORA, LORA_TP) == norms + split + 2 * inputs + a_outputs
    assert norms + split + 2 * inputs + a_outputs == 8440  # the bench's 8,456 less 16 B of per-row scalars (-0.2%)
    # with dropout a GPU keeps its bool mask too: 1 B an input element
    dropout = replace(TINY_LORA, lora_dropout_width=TINY_LORA.lora_input_width)
    assert memory_budget.activations_per_token_per_layer(dropout, LORA_TP) == 8440 + 1752
    # an fp32 base (the residual stream fp32) keeps the same: 8,456 measured alike on 2 tp ranks (a one-off probe of
    # 2026-11-29, the bench's hooks; autocast's base weight copies apart, which tp_autocast_weight_copies counts)
    assert memory_budget.activations_per_token_per_layer(TINY_LORA, TP_FP32) == 8440
    # without tp the count is the one before: FSDP's mixed-precision policy gives the adapters bf16, no copy to make
    no_tp = replace(LORA_TP, tp=1, shard=4)
    assert memory_budget.activations_per_token_per_layer(TINY_LORA, no_tp) == (
        2 * 256 * (4 + 2) + 2 * (2 * 256 + 2 * 128 + 4 * 688 + 28))


def test_lora_under_tp_counts_autocasts_bf16_copies_of_the_adapters(cache_dir):
    """The tiny model's adapters on one tp 2 rank: a column-wise linear's A whole (4 x 256) and B halved (out / 2 x 4),
    a row-wise one's A halved and B whole: q 1,024 + 512, k and v 1,024 + 256, o 512 + 1,024, gate and up 1,024 +
    1,376, down 1,376 + 1,024 = 12,832 elements, 2 B each, in 4 layers: 102,656 B (the bench: 96,512, layer 0's q, k,
    v A copies of 2,048 B not kept, its input needing no gradient)."""
    import types

    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(cache_dir / "tiny-mistral"))
    lora = types.SimpleNamespace(use_peft=True, lora_target_modules="all-linear", lora_r=4, lora_dropout=0.0,
                                 lora_modules_to_save=None, lora_target_parameters=None)
    shape = memory_budget.shape_of(model, lora)
    assert (shape.lora_input_width, shape.lora_split_input_width) == (2224, 944)
    # the split adapter elements: column-wise B's 4 x (256 + 128 + 128 + 688 + 688), row-wise A's 4 x (256 + 688)
    assert shape.lora_split_params == 4 * 1888 + 4 * 944 == 11_328
    assert memory_budget.budget(shape, replace(LORA_TP, tokens=33))["tp_autocast_weight_copies"] == 102_656


def test_one_lora_layer_of_the_tiny_mistral_saves_what_the_formula_counts(cache_dir):
    """One process, a bf16 base with PEFT's fp32 adapters (r 4, every linear) under bf16 autocast, no FSDP (as under
    tp: nothing casts the adapters), 3 rows of 11 tokens: layer 1's saved storages, the adapters' bf16 copies apart.
    One process holds whole what tp 2 splits: 8,440 + 2,832 (attention, MLP) + 2 x (128 + 344) (o's and down's
    input copies) = 12,216, and 24 B of per-row scalars (2 rsqrt, 4 heads' log-sum-exp): 12,240."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoConfig, AutoModelForCausalLM

    torch.manual_seed(0)
    base = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(cache_dir / "tiny-mistral"),
                                            dtype=torch.bfloat16)
    model = get_peft_model(base, LoraConfig(r=4, lora_alpha=8, target_modules="all-linear"))
    assert model.base_model.model.model.layers[1].self_attn.q_proj.lora_A["default"].weight.dtype == torch.float32
    params = {p.untyped_storage()._cdata for p in model.parameters()}
    weight_shapes = {s for p in model.parameters() for s in (tuple(p.shape), tuple(reversed(p.shape)))}
    rows, length = 3, 11
    ids = torch.randint(4, 268, (rows, length), generator=torch.Generator().manual_seed(0))
    inside, saved = [False], {}
    layer = model.base_model.model.model.layers[1]
    layer.register_forward_pre_hook(lambda *a: inside.__setitem__(0, True))
    layer.register_forward_hook(lambda *a: inside.__setitem__(0, False))

    def pack(t):
        storage = t.untyped_storage()
        weight_copy = t.dtype == torch.bfloat16 and tuple(t.shape) in weight_shapes
        if storage._cdata not in params and not weight_copy:
            saved.setdefault(storage._cdata, (inside[0], storage.nbytes(), t))  # t: its storage stays its own
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), torch.autocast("cpu", dtype=torch.bfloat16):
        model(input_ids=ids, labels=ids)
    measured = sum(n for in_layer_1, n, _ in saved.values() if in_layer_1) / (rows * length)
    assert memory_budget.activations_per_token_per_layer(TINY_LORA, LORA_TP) == 8440
    assert measured == 8440 + 2832 + 2 * (128 + 344) + 24 == 12_240


def test_a_lora_recipe_planned_on_a_tp_mesh_counts_the_lora_tp_layer(tmp_path):
    """No recipe trains LoRA under tp: llama-3.1-8b-lora with a tp 2 x dp_shard 4 mesh in its accelerate YAML, on 8
    H100. Llama 3.1 8B: hidden 4096, q 4096, kv 1024, intermediate 14336, 32 layers, vocab 128256; LoRA r 16 on the
    7 linears, dropout 0.05; 1 row of 4,096 tokens. A layer a token: 8 x 4,096 = 32,768 (norms) + 2 x (2 x 4,096 +
    2 x 1,024 + 3 x 14,336) / 2 = 53,248 + (2 + 1) x (5 x 4,096 + 4,096 / 2 + 14,336 / 2) = 89,088 (input copies and
    masks) + 2 x 16 x 7 = 224: 175,328 B (the count before: 233,584). No checkpointing fits (pick none): 4,096 x 32 x
    175,328 + the final norm's 4,096 x 4,096 x 8, the head's tile 4,096 x 32,768 x 4 and the hidden states' fp32
    gradient 4,096 x 4,096 x 4 = 23,718,789,120 B = 22.1 GiB (29.2 before)."""
    import contextlib
    import io
    import shutil

    from conftest import REPO
    from fsdp_recipes.planning import plan

    recipe = tmp_path / "lora-tp"
    shutil.copytree(REPO / "recipes" / "llama-3.1-8b-lora", recipe)
    with (recipe / "accelerate.yaml").open("a") as f:
        f.write("parallelism_config:\n  parallelism_config_dp_shard_size: 4\n  parallelism_config_tp_size: 2\n")
    out = io.StringIO()
    with contextlib.chdir(REPO), contextlib.redirect_stdout(out), contextlib.redirect_stderr(io.StringIO()):
        assert plan.main([str(recipe), "--gpus", "8", "--gpu", "H100"]) == 0
    per_layer = 8 * 4096 + 2 * (2 * 4096 + 2 * 1024 + 3 * 14336) // 2 + 3 * (5 * 4096 + 4096 // 2 + 14336 // 2) + 224
    activations = 4096 * 32 * per_layer + 4096 * 4096 * 8 + 4096 * 32768 * 4 + 4096 * 4096 * 4
    assert per_layer == 175_328 and activations == 23_718_789_120
    rows = [x for x in out.getvalue().splitlines() if x.startswith("| activations |")]
    assert rows and rows[0].startswith(f"| activations | {activations / 2**30:.1f} |"), rows
    assert "-> pick none" in out.getvalue()
