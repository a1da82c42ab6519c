"""`make plan --comms/--time` for kinds that run forwards besides the trained sequence's own forward and backward
(train/kinds' extra_forwards: DPO's and KTO's reference model, KTO's KL term): their FLOPs, as the run report counts
them, and their all-gathers under FSDP. Every expected figure is derived by hand below from the recipes'
model_config.json and settings, never with the planner's or metrics/flops.py's functions."""

import pytest

from conftest import REPO
from fsdp_recipes.planning import answers, comms, fabric, plan

H100 = 989e12 * 0.4  # dense bf16 peak x the assumed 40% MFU
NVLINK4 = 450e9  # bytes/s per GPU per direction

# ---- Qwen3-8B (recipes/qwen3-8b-full-dpo): hidden 4096, 36 layers, 32 heads x 128 (q width 4096), 8 kv heads
# (kv width 1024), intermediate 12288, vocab 151936, LM head untied; q_norm and k_norm 128 each.
QWEN_LAYER = 2 * 4096 * 4096 + 2 * 4096 * 1024 + 3 * 4096 * 12288 + 2 * 4096 + 2 * 128  # 192,946,432
QWEN_ROOT = 4096 + 2 * 151936 * 4096  # final norm + embedding + LM head: 1,244,663,808
QWEN_PARAMS = 36 * QWEN_LAYER + QWEN_ROOT  # 8,190,735,360
QWEN_MATMUL = QWEN_PARAMS - 151936 * 4096  # all but the input embedding (a lookup): 7,568,405,504
QWEN_PINS = ["--per_device_train_batch_size", "2", "--gradient_accumulation_steps", "8", "--max_length", "2048"]

# ---- Llama-3.1-8B + LoRA r 16 on the 7 linears (recipes/llama-3.1-8b-lora-dpo): hidden 4096, 32 layers, q width
# 4096, kv 1024, intermediate 14336, vocab 128256, untied.
LLAMA_BASE_LAYER = 2 * 4096 * 4096 + 2 * 4096 * 1024 + 3 * 4096 * 14336 + 2 * 4096  # 218,112,000
LLAMA_LORA_LAYER = 16 * (2 * (4096 + 4096) + 2 * (4096 + 1024) + 3 * (4096 + 14336))  # 1,310,720
LLAMA_TRAINABLE = 32 * LLAMA_LORA_LAYER  # 41,943,040
LLAMA_FROZEN = 32 * LLAMA_BASE_LAYER + 4096 + 128256 * 4096  # base layers, final norm, LM head: 7,504,924,672
LLAMA_PINS = ["--per_device_train_batch_size", "4", "--gradient_accumulation_steps", "4", "--max_length", "2048"]

# ---- SmolLM2-135M + LoRA r 16 on the 7 linears (recipes/smollm2-135m-kto): hidden 576, 30 layers, 9 heads x 64
# (q width 576), 3 kv heads (192), intermediate 1536, vocab 49152, LM head tied to the embedding (still a matmul).
SMOL_BASE_LAYER = 2 * 576 * 576 + 2 * 576 * 192 + 3 * 576 * 1536 + 2 * 576  # 3,540,096
SMOL_LORA_LAYER = 16 * (2 * (576 + 576) + 2 * (576 + 192) + 3 * (576 + 1536))  # 162,816
SMOL_TRAINABLE = 30 * SMOL_LORA_LAYER  # 4,884,480
SMOL_FROZEN = 30 * SMOL_BASE_LAYER + 576 + 49152 * 576  # base layers, final norm, the tied embedding: 134,515,008


def attention(layers: int, q_width: int, length: float, passes: int) -> float:
    """Attention's score and value matmuls, 4 x layers x q width x length FLOPs a pass (forward 1, backward 2)."""
    return 4 * passes * layers * q_width * length


def test_hand_counts():
    assert (QWEN_LAYER, QWEN_PARAMS, QWEN_MATMUL) == (192_946_432, 8_190_735_360, 7_568_405_504)
    assert (LLAMA_TRAINABLE, LLAMA_FROZEN) == (41_943_040, 7_504_924_672)
    assert (SMOL_BASE_LAYER, SMOL_LORA_LAYER, SMOL_TRAINABLE, SMOL_FROZEN) == (3_540_096, 162_816, 4_884_480,
                                                                               134_515_008)


def run(capsys, *argv):
    try:
        code = plan.main(list(argv))
    except SystemExit as stop:
        code = stop.code
    out = capsys.readouterr()
    assert not code, out.err
    return out.out


@pytest.fixture(autouse=True)
def in_repo(monkeypatch):
    monkeypatch.chdir(REPO)


def test_dpo_full_fine_tuning_counts_the_reference_copy(capsys):
    """8 micro-batches of 2 pairs (4 sequences) x 2,048 tokens = 65,536 tokens per GPU per step. Training: 6N +
    attention's 3 passes; the reference (a copy of the whole model): 2N + attention's forward pass. Its all-gathers:
    every layer of the copy once per micro-batch, bf16, 7/8 of it sent over NVLink. --time: 60,000 pairs of 1,500
    tokens, 469 steps of 2 x 8 x 8, attention at 750 tokens a sequence."""
    per_token = 8 * QWEN_MATMUL + attention(36, 4096, 2048, 3 + 1)  # 65,379,082,240
    compute = 65_536 * per_token / H100  # 10.83 s (6N alone: 8.12 s)
    reference = 8 * 36 * QWEN_LAYER * 2  # 111,137,144,832 B
    gathered = 8 * (2 * 36 * QWEN_LAYER + QWEN_ROOT) * 2
    comm = (round(7 / 8 * gathered) + round(7 / 8 * reference) + round(7 / 8 * QWEN_PARAMS * 2)) / NVLINK4
    per_token_750 = 8 * QWEN_MATMUL + attention(36, 4096, 750, 4)
    seconds = 90_000_000 * per_token_750 / (8 * H100)
    out = run(capsys, "qwen3-8b-full-dpo", "--gpus", "8", "--gpu", "H100", *QWEN_PINS, "--comms", "--time",
              "--rows", "60000", "--tokens-per-row", "1500")
    assert (f"| all-gather (reference) | 8 | {reference / 1e9:,.2f} | {round(7 / 8 * reference) / 1e9:,.2f} | "
            f"NVLink 4 | 450 | {round(7 / 8 * reference) / NVLINK4:.3f} |") in out
    assert (f"compute: 65,536 tokens x {per_token / 1e9:,.2f} GFLOP/token (incl. the reference forward) = "
            f"{65_536 * per_token / 1e15:,.4g} PFLOP") in out and f"TFLOP/s = {compute:,.2f} s" in out
    assert f"verdict: compute-bound (communication {comm:,.2f} s vs compute {compute:,.2f} s" in out
    assert (f"{per_token_750 / 1e9:,.2f} GFLOP/token (incl. the reference forward; attention at 750 tokens)"
            in out)
    assert f"time: {seconds / 60:,.1f} min = 469 steps x {seconds / 469:,.3g} s" in out


def test_dpo_lora_reference_is_the_base_and_its_gathers_the_policys_layers():
    """LoRA: the reference is the policy with the adapter disabled: 2 x the frozen weights a token, and the policy's
    own layers (adapters included) gathered once more per micro-batch (4 of them), bf16."""
    p = plan.prepare("llama-3.1-8b-lora-dpo", 8, 1, "H100", REPO / "recipes", LLAMA_PINS)
    e = comms.estimate(p.shape, answers.topology(p), answers.work(p, 0.4), fabric.fabric("H100"))
    training = 6 * LLAMA_TRAINABLE + 4 * LLAMA_FROZEN + attention(32, 4096, 2048, 3)
    assert e.flops_per_token == pytest.approx(training + 2 * LLAMA_FROZEN + attention(32, 4096, 2048, 1), rel=1e-12)
    reference = [c for c in e.collectives if c.op == "all-gather (reference)"]
    assert len(reference) == 1
    assert reference[0].payload == 4 * 32 * (LLAMA_BASE_LAYER + LLAMA_LORA_LAYER) * 2
    assert reference[0].sent == round(7 / 8 * reference[0].payload)


def test_dpo_with_precomputed_reference_log_probs_adds_nothing():
    """precompute_ref_log_probs: the reference runs before training, so a step is the policy's 6N and its gathers
    only; the default differs by the reference's 2N + attention's forward pass."""
    f = fabric.fabric("H100")
    estimates = {}
    for precompute in ("true", "false"):
        p = plan.prepare("qwen3-8b-full-dpo", 8, 1, "H100", REPO / "recipes",
                         [*QWEN_PINS, "--precompute_ref_log_probs", precompute])
        estimates[precompute] = comms.estimate(p.shape, answers.topology(p), answers.work(p, 0.4), f)
    alone = 6 * QWEN_MATMUL + attention(36, 4096, 2048, 3)
    assert estimates["true"].flops_per_token == pytest.approx(alone, rel=1e-12)
    assert [c.op for c in estimates["true"].collectives] == ["all-gather", "reduce-scatter"]
    assert estimates["false"].flops_per_token - estimates["true"].flops_per_token == pytest.approx(
        2 * QWEN_MATMUL + attention(36, 4096, 2048, 1), rel=1e-9)


def test_kto_with_its_kl_term_counts_two_reference_forwards_and_the_policys():
    """loss_type kto (its KL term), LoRA: per trained token the reference (the base) runs over the answer and over
    the mismatched KL answer (2 x 2F), the policy over the KL answer without gradients (2 (F + T)). One micro-batch
    of 8 answers x 64 tokens, fp32 weights gathered (mixed_precision no), each forward gathering every layer once."""
    p = plan.prepare("smollm2-135m-kto", 8, 1, "H100", REPO / "recipes",
                     ["--per_device_train_batch_size", "8", "--gradient_accumulation_steps", "1", "--max_length", "64"])
    e = comms.estimate(p.shape, answers.topology(p), answers.work(p, 0.4), fabric.fabric("H100"))
    training = 6 * SMOL_TRAINABLE + 4 * SMOL_FROZEN + attention(30, 576, 64, 3)
    reference = 2 * (2 * SMOL_FROZEN + attention(30, 576, 64, 1))
    kl_policy = 2 * (SMOL_FROZEN + SMOL_TRAINABLE) + attention(30, 576, 64, 1)
    assert e.flops_per_token == pytest.approx(training + reference + kl_policy, rel=1e-12)
    rows = {c.op: c.payload for c in e.collectives if c.op.startswith("all-gather (")}
    layer = SMOL_BASE_LAYER + SMOL_LORA_LAYER
    assert rows == {"all-gather (reference)": 2 * 30 * layer * 4, "all-gather (kl_policy)": 30 * layer * 4}
