"""Attention that wastes nothing (issue 57, item 1): speed/attention.py (`auto`, the checks) and
speed/varlen_attention.py (`packed_varlen`: packed rows with no S x S mask).

In-process, on a tiny Llama built here (float32, 2 layers, grouped-query heads), seconds each. What is checked on
CPU is the mechanism: the rows' bounds reach the attention function, and each row attends to itself only, through
the reference path (SDPA row by row) that the CUDA kernel replaces. The CUDA kernel itself
(torch.nn.attention.varlen) is measured in the GPU plan (scripts/device_run.sh, bench/gpu.py), not here.
"""

import pytest
import torch

from conftest import REPO, launcher_until_ranks
from fsdp_recipes import speed
from fsdp_recipes.errors import UserError
from fsdp_recipes.speed import attention, varlen_attention

ROWS = (7, 12, 5)  # token counts of the packed rows: unequal, as packing makes them
# Eager attention on each row alone against packed_varlen on the packed batch, float32: the same arithmetic in
# another order (measured: losses equal to the last bit, gradients within 1.2e-7)
LOSS_TOL, GRAD_TOL = 1e-5, 1e-5


def tiny_llama(attn: str):
    from transformers import LlamaConfig, LlamaForCausalLM

    varlen_attention.register()
    torch.manual_seed(0)  # the same weights for every implementation
    config = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    model = LlamaForCausalLM(config)
    model.config._attn_implementation = attn
    return model


def rows_of_tokens(seed: int = 1) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 64, (n,), generator=g).tolist() for n in ROWS]


def packed_batch(rows, cu_seq_lens: bool = True) -> dict:
    """TRL's padding-free collator (what `padding_free: true` / bfd packing feeds the model): one flattened row,
    position_ids restarting per row, cu_seq_lens; without them, the position_ids alone (DataCollatorWithFlattening's
    default)."""
    from trl.trainer.sft_trainer import DataCollatorForLanguageModeling

    batch = DataCollatorForLanguageModeling(pad_token_id=0, padding_free=True)([{"input_ids": r} for r in rows])
    assert batch["input_ids"].shape == (1, sum(ROWS)) and "attention_mask" not in batch
    keep = ("input_ids", "position_ids", *(("cu_seq_lens_q", "cu_seq_lens_k", "max_length_q", "max_length_k")
                                           if cu_seq_lens else ()))
    return {k: batch[k] for k in keep}


def packed_row_losses(model, rows, cu_seq_lens: bool = True) -> torch.Tensor:
    """Each row's mean next-token loss, read from one forward over the packed batch."""
    batch = packed_batch(rows, cu_seq_lens)
    # use_cache=False as TRL's SFTTrainer.compute_loss passes: with a cache transformers looks for no packed rows
    logits, ids = model(**batch, use_cache=False).logits[0], batch["input_ids"][0]
    bounds = [0, *torch.tensor(ROWS).cumsum(0).tolist()]
    return torch.stack([torch.nn.functional.cross_entropy(logits[s:e - 1], ids[s + 1:e])
                        for s, e in zip(bounds[:-1], bounds[1:])])


def reference_row_losses(model, rows) -> torch.Tensor:
    """The reference: each row alone, unpacked, no padding."""
    return torch.stack([model(input_ids=torch.tensor([r]), labels=torch.tensor([r]), use_cache=False).loss
                        for r in rows])


@pytest.fixture
def sdpa_calls(monkeypatch):
    """Every call of torch's SDPA: (query length, key length, the mask it got, is_causal)."""
    calls, real = [], torch.nn.functional.scaled_dot_product_attention

    def spy(q, k, v, attn_mask=None, dropout_p=0.0, is_causal=False, **kw):
        calls.append((q.shape[-2], k.shape[-2], attn_mask, is_causal))
        return real(q, k, v, attn_mask=attn_mask, dropout_p=dropout_p, is_causal=is_causal, **kw)

    monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention", spy)
    return calls


@pytest.mark.parametrize("cu_seq_lens", [True, False], ids=["cu_seq_lens", "position_ids_only"])
def test_packed_varlen_gives_eager_per_row_losses_and_gradients_with_no_mask(cu_seq_lens, sdpa_calls):
    rows = rows_of_tokens()
    reference, packed = tiny_llama("eager"), tiny_llama(varlen_attention.NAME)
    want = reference_row_losses(reference, rows)
    assert not sdpa_calls  # eager computes its own softmax
    got = packed_row_losses(packed, rows, cu_seq_lens)
    assert torch.allclose(got, want, rtol=0, atol=LOSS_TOL), (got, want)
    want.sum().backward()
    got.sum().backward()
    for (name, a), b in zip(reference.named_parameters(), packed.parameters()):
        assert torch.allclose(a.grad, b.grad, rtol=0, atol=GRAD_TOL), name
    # no materialized mask: each layer attends row by row (CPU's reference path), is_causal, never over the packed
    # 24 tokens, never with a mask tensor
    assert len(sdpa_calls) == 2 * len(ROWS)  # 2 layers x 3 rows, forward (the backward runs SDPA's own grad)
    assert all(q == k and q in ROWS and mask is None and causal for q, k, mask, causal in sdpa_calls), sdpa_calls


def moved_losses_of_other_rows(model) -> tuple[float, float]:
    """Row 0's tokens changed (same length): how far rows 1.. and row 0 itself moved."""
    rows = rows_of_tokens()
    changed = [[(t + 1) % 64 for t in rows[0]], *rows[1:]]
    with torch.no_grad():
        before, after = packed_row_losses(model, rows), packed_row_losses(model, changed)
    return (after[1:] - before[1:]).abs().max().item(), (after[0] - before[0]).abs().item()


def test_in_a_packed_batch_no_row_attends_to_another(monkeypatch):
    others, itself = moved_losses_of_other_rows(tiny_llama(varlen_attention.NAME))
    assert itself > 1e-3  # the change reaches the model
    assert others == 0.0, others
    # The check can fail: with a deliberately wrong mask (the packed row's bounds ignored, causal attention over the
    # whole flattened row, as SDPA without transformers' block-diagonal mask would run), the rows after row 0 move
    monkeypatch.setattr(varlen_attention, "packed_bounds", lambda query, key, mask, kwargs: (
        torch.tensor([0, query.shape[2]], dtype=torch.int32), query.shape[2]))
    others, _ = moved_losses_of_other_rows(tiny_llama(varlen_attention.NAME))
    assert others > 1e-3


def test_full_rows_get_sdpa_is_causal_and_no_mask_tensor(sdpa_calls):
    """transformers' own sdpa path, which `auto` picks for full rows: a batch without padding (TRL's collator gives
    an all-ones attention_mask) reaches SDPA with no mask and is_causal=True, so SDPA may run its flash or cuDNN
    kernels (masking_utils.py _ignore_causal_mask_sdpa, `(q_length == 1 or kv_length == q_length) and (padding_mask
    is None or fast_all(padding_mask))`; sdpa_attention.py `is_causal = q_length > 1 and attention_mask is None and
    is_causal`). One padded row: a mask. packed_varlen on full rows is that same path."""
    ids = torch.randint(0, 64, (2, 9))
    for attn in ("sdpa", varlen_attention.NAME):
        sdpa_calls.clear()
        with torch.no_grad():
            tiny_llama(attn)(input_ids=ids, attention_mask=torch.ones_like(ids))
        assert len(sdpa_calls) == 2 and all(m is None and c and q == 9 for q, _, m, c in sdpa_calls), sdpa_calls
    sdpa_calls.clear()
    padded = torch.ones_like(ids)
    padded[0, -3:] = 0
    with torch.no_grad():
        tiny_llama("sdpa")(input_ids=ids, attention_mask=padded)
    assert all(isinstance(m, torch.Tensor) and not c for _, _, m, c in sdpa_calls)


def test_auto_picks_by_device_rows_and_what_is_installed():
    def has(*names):
        return lambda name: name in names

    everything = has("torch_varlen", "flash-attn-4", "flash-attn", "kernels")
    assert attention.choose(False, True, None, everything).name == "sdpa"  # CPU
    assert attention.choose(True, False, (9, 0), everything).name == "sdpa"  # full rows: SDPA is_causal
    assert attention.choose(True, True, (9, 0), everything).name == "packed_varlen"  # torch's own kernel first
    assert attention.choose(True, True, None, everything).name == "packed_varlen"  # capability unknown (launcher)
    assert attention.choose(True, True, (9, 0), has("flash-attn-4", "flash-attn")).name == "flash_attention_4"
    assert attention.choose(True, True, (8, 0), has("flash-attn-4", "flash-attn")).name == "flash_attention_2"
    assert attention.choose(True, True, (8, 0), has("kernels")).name == "flash_attention_2"
    assert attention.choose(True, True, (9, 0), has()).name == "sdpa"  # nothing installed: the mask, said so
    assert attention.choose(True, True, (7, 5), everything).name == "sdpa"  # no flash kernels before Ampere
    assert "block-diagonal" in attention.choose(True, True, (9, 0), has()).why


def test_auto_on_this_cpu_runs_sdpa_and_records_why(cache_dir):
    from types import SimpleNamespace

    from fsdp_recipes.config.run_config import parse_args

    cfg = parse_args(["--config", str(REPO / "recipes" / "tiny-cpu-lora" / "sft.yaml"),
                      "--attn_implementation", "auto", "--packing", "true"])
    assert attention.packed_rows(cfg.training)  # bfd packing, TRL's default strategy: padding-free
    speed.settle(cfg)
    assert cfg.model.attn_implementation == "sdpa"  # run_args.json's model_args record what runs
    assert speed.model_init_kwargs(cfg)["attn_implementation"] == "sdpa"
    trainer = SimpleNamespace(model=SimpleNamespace(config=SimpleNamespace(_attn_implementation="sdpa")))
    assert speed.prepare_trainer(trainer, cfg)["attention"] == {
        "requested": "auto", "ran": "sdpa", "why": attention.choose(False, True, None).why}
    assert attention.choose(False, True, None).why.startswith("no CUDA device")


def test_flex_attention_refused_on_cpu_in_one_line_before_any_rank_starts(cache_dir, monkeypatch, capsys):
    res = launcher_until_ranks(["tiny-cpu-lora", "--attn_implementation", "flex_attention"], monkeypatch, capsys)
    assert res.returncode == 2
    assert res.stderr.strip().splitlines() == [
        "error: attn_implementation: flex_attention cannot train on a CPU: torch 2.13's FlexAttention has no CPU "
        "backward (NotImplementedError in the first step). Fix: attn_implementation: auto or sdpa here; "
        "flex_attention on CUDA GPUs."]
    # `make smoke` on a machine without GPUs runs sdpa instead, and says so
    overrides, notes = speed.smoke(lambda name, default=None: {"attn_implementation": "flex_attention"}.get(
        name, default), gpus=0)
    assert overrides == ["--attn_implementation", "sdpa"] and notes == [
        "attention: flex_attention has no CPU backward -> sdpa"]


@pytest.mark.slow  # FlexAttention compiles its kernel on a CPU: 5-10 s
def test_flex_attentions_forward_on_cpu_is_sdpas():
    """What a CPU can check of FlexAttention (its backward has no CPU kernel, so training with it is refused above and
    is a GPU-plan step): the forward of the same weights gives SDPA's logits, a padded row included."""
    from transformers import LlamaConfig, LlamaForCausalLM

    ids = torch.randint(0, 64, (2, 12), generator=torch.Generator().manual_seed(0))
    mask = torch.ones_like(ids)
    mask[1, :3] = 0  # the second row left-padded by 3
    logits = {}
    for implementation in ("sdpa", "flex_attention"):
        config = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                             num_attention_heads=2, num_key_value_heads=1, attn_implementation=implementation)
        torch.manual_seed(0)
        model = LlamaForCausalLM(config).eval()
        assert model.config._attn_implementation == implementation
        with torch.no_grad():
            logits[implementation] = model(input_ids=ids, attention_mask=mask).logits
    kept = mask.bool()  # a padded position's output is nobody's answer
    torch.testing.assert_close(logits["flex_attention"][kept], logits["sdpa"][kept], rtol=1e-5, atol=1e-5)


def test_the_launch_line_says_what_auto_picks(cache_dir):
    from fsdp_recipes.config.run_config import parse_args

    cfg = parse_args(["--config", str(REPO / "recipes" / "tiny-cpu-lora" / "sft.yaml"),
                      "--attn_implementation", "auto"])
    lines = []
    attention.check_launch(cfg, {}, "accelerate.yaml", say=lines.append)
    assert lines == ["attention: auto -> sdpa (no CUDA device: torch's SDPA on CPU; packed rows get transformers' "
                     "block-diagonal mask)"]


def test_an_unknown_implementation_is_one_line(cache_dir):
    from fsdp_recipes.config.run_config import parse_args

    cfg = parse_args(["--config", str(REPO / "recipes" / "tiny-cpu-lora" / "sft.yaml"),
                      "--attn_implementation", "flash_attn_2"])
    with pytest.raises(UserError, match=r"attn_implementation 'flash_attn_2' is not an attention implementation\. "
                                        r"Fix: one of eager, sdpa, flex_attention, paged\|eager, auto, packed_varlen"):
        speed.check_config(cfg)


def test_the_gpu_check_of_the_kernel_runs_its_plumbing_on_cpu(tmp_path, capsys):
    """bench/varlen_check.py, the GPU plan's check of the CUDA kernel: on CPU it compares the reference with itself
    and times the two SDPA paths, so what runs on the GPU machine is this code with the kernel added."""
    import json

    from bench import varlen_check

    assert varlen_check.main(["--dry-run", "--out", str(tmp_path)]) == 0
    record = json.loads(next(tmp_path.glob("varlen-check-cpu-*.json")).read_text())
    assert record["ok"] and set(record["agreement"]) == {"out", "dq", "dk", "dv"}
    assert set(record["ms_forward_backward"]) == {"sdpa, block-diagonal mask", "sdpa is_causal, 2 full rows"}


def tiny_gemma2_folder(path):
    """A tiny Gemma2 config (the class transformers 5.23 gives no SDPA: `_supports_sdpa = False`, its softcapping)."""
    from transformers import Gemma2Config

    Gemma2Config(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
                 num_key_value_heads=1, head_dim=16, architectures=["Gemma2ForCausalLM"]).save_pretrained(path)
    return path


def test_an_implementation_the_models_class_lacks_is_one_line_and_auto_avoids_it(cache_dir, tmp_path):
    """A Gemma2 with the recipe's sdpa passed the launcher's checks and failed in every rank (`ValueError:
    Gemma2ForCausalLM does not support an attention implementation through
    torch.nn.functional.scaled_dot_product_attention yet`): refused by the class's own flag before any rank starts,
    naming eager; `auto` picks eager for it (on this CPU: sdpa otherwise), in the launch line and in the ranks."""
    from fsdp_recipes.config.run_config import parse_args

    folder = str(tiny_gemma2_folder(tmp_path / "gemma2"))
    recipe = ["--config", str(REPO / "recipes" / "tiny-cpu-lora" / "sft.yaml"), "--model_name_or_path", folder]
    cfg = parse_args([*recipe, "--attn_implementation", "sdpa"])
    with pytest.raises(UserError) as err:
        speed.check_config(cfg)
    assert str(err.value) == (
        "attn_implementation: sdpa is not supported by Gemma2ForCausalLM, the model's class (transformers' "
        "Gemma2ForCausalLM._supports_sdpa is False: from_pretrained would refuse it in every rank). Fix: "
        "--attn_implementation eager (or attn_implementation: eager in the recipe YAML; Gemma2ForCausalLM supports "
        "eager, flex_attention, flash_attention_2, flash_attention_3, flash_attention_4).")
    speed.check_config(parse_args([*recipe, "--attn_implementation", "eager"]))  # what it names passes
    cfg = parse_args([*recipe, "--attn_implementation", "auto"])
    speed.check_config(cfg)
    lines = []
    attention.check_launch(cfg, {}, "accelerate.yaml", say=lines.append)
    assert lines == ["attention: auto -> eager (sdpa would run here, but Gemma2ForCausalLM does not support it "
                     "(transformers' _supports_sdpa is False))"]
    speed.settle(cfg)
    assert cfg.model.attn_implementation == "eager"
