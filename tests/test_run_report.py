"""The run-report callback: counters, atomic files, failure path, consistency, schema == docs/run-report.md."""

import json
import re
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from transformers import MistralConfig, MistralForCausalLM

from conftest import need_module
from fsdp_recipes.metrics import run_report, tokens
from fsdp_recipes.metrics.run_report import RunReportCallback
from fsdp_recipes.metrics.tokens import TokenCounter
from fsdp_recipes.records import write_json_atomic

# The metrics.json schema table moved out of the README into the run-report page.
SCHEMA_DOC = Path(__file__).resolve().parent.parent / "docs" / "run-report.md"


def test_token_counter_padded_batch():
    c = TokenCounter()
    c.add({"input_ids": torch.zeros(2, 5, dtype=torch.long),
           "attention_mask": torch.tensor([[1, 1, 1, 0, 0], [1, 1, 1, 1, 1]])})
    assert (c.non_padding, c.padded, c.sequences) == (8, 10, 2)
    assert c.squared_lengths == 3 ** 2 + 5 ** 2  # the real lengths, not the padded 5


def test_token_counter_padding_free_counts_sequences_from_position_ids():
    c = TokenCounter()
    c.add({"input_ids": torch.zeros(1, 7, dtype=torch.long), "position_ids": torch.tensor([[0, 1, 2, 0, 1, 0, 1]])})
    assert (c.non_padding, c.padded, c.sequences) == (7, 7, 3)
    assert c.squared_lengths == 3 ** 2 + 2 ** 2 + 2 ** 2  # sequences of 3, 2 and 2 tokens in one row


def test_token_counter_sampled_batches_count_prompt_and_completion_and_what_was_sampled():
    c = TokenCounter()
    # GRPO's batch: left-padded prompts of 2 and 3 tokens, completions of 3 and 1 tokens (right-padded)
    batch = {"prompt_ids": torch.zeros(2, 3, dtype=torch.long), "prompt_mask": torch.tensor([[0, 1, 1], [1, 1, 1]]),
             "completion_ids": torch.zeros(2, 3, dtype=torch.long),
             "completion_mask": torch.tensor([[1, 1, 1], [1, 0, 0]])}
    c.add_sampled(batch)
    assert (c.non_padding, c.padded, c.sequences, c.generated) == (2 + 3 + 3 + 1, 12, 2, 4)
    assert c.squared_lengths == 5 ** 2 + 4 ** 2
    c.add_sampled(batch, generated=False)  # trained on again (num_iterations 2), not sampled again
    assert (c.non_padding, c.sequences, c.generated) == (18, 4, 4)


def test_mfu_attention_length_is_token_weighted(tmp_path):
    # a row of 6 + 2 tokens: 6 of the 8 tokens attend over a 6-token sequence, so the per-token attention length
    # is (36 + 4) / 8 = 5, not the mean sequence length 4
    cb = RunReportCallback(str(tmp_path / "run"), {}, recipe="sim")
    cb.on_train_begin(None, SimpleNamespace(global_step=0, log_history=[]), None, model=tiny_model())
    cb.tokens.add({"input_ids": torch.zeros(1, 8, dtype=torch.long),
                   "position_ids": torch.tensor([[0, 1, 2, 3, 4, 5, 0, 1]])})
    counts = {k: getattr(cb.tokens, k) for k in tokens.COUNTS}
    fig = cb.mfu_figures(counts, 8.0, 1, {"type": "cuda", "name": "NVIDIA H100 80GB HBM3"})
    assert fig["flops_seq_len"] == pytest.approx(5.0)
    # 6 x 20,640 + 12 x 2 layers x 4 heads x 8 x 5 tokens = 123,840 + 3,840
    assert hand_flops_per_token(5.0) == 127_680
    assert fig["flops_per_token"] == pytest.approx(127_680)


@pytest.mark.parametrize("lora", [False, True])
def test_mfu_counts_each_extra_forward_on_its_weights(tmp_path, lora):
    """A kind's extra forwards (KTO with its KL term: 2 reference forwards and the policy's), 2N + attention's
    forward third each (4 x 2 layers x 4 heads x 8 x 5 tokens = 1,280): the reference on the whole model (full
    fine-tuning: its copy) or, with LoRA, on the frozen weights only (the adapter disabled); the policy's on all.
    LoRA stands in here as everything frozen but the LM head (2,048 weights)."""
    args = {"lora_config": {"r": 8}} if lora else {}
    cb = RunReportCallback(str(tmp_path / "run"), args, recipe="sim", extra_forwards={"reference": 2.0,
                                                                                       "kl_policy": 1.0})
    model = tiny_model()
    if lora:
        for name, p in model.named_parameters():
            p.requires_grad = name.startswith("lm_head")
    cb.on_train_begin(None, SimpleNamespace(global_step=0, log_history=[]), None, model=model)
    cb.tokens.add({"input_ids": torch.zeros(1, 8, dtype=torch.long),
                   "position_ids": torch.tensor([[0, 1, 2, 3, 4, 5, 0, 1]])})
    counts = {k: getattr(cb.tokens, k) for k in tokens.COUNTS}
    fig = cb.mfu_figures(counts, 8.0, 1, {"type": "cuda", "name": "NVIDIA H100 80GB HBM3"})
    trained = 64 * 32 if lora else TINY_NON_EMBEDDING
    frozen = TINY_NON_EMBEDDING - trained
    training = 6 * trained + 4 * frozen + 12 * 2 * 4 * 8 * 5
    reference = 2 * (2 * (frozen if lora else TINY_NON_EMBEDDING) + 1_280)
    assert fig["flops_per_token"] == pytest.approx(training + reference + 2 * TINY_NON_EMBEDDING + 1_280)


def test_resume_from_counters_without_squared_lengths_falls_back_to_the_mean_length(tmp_path):
    ckpt = tmp_path / "checkpoint-4"
    ckpt.mkdir()
    (ckpt / run_report.COUNTERS_FILE).write_text(json.dumps({"non_padding": 80, "padded": 100, "sequences": 10,
                                                             "train_time_s": 5.0}))
    cb = RunReportCallback(str(tmp_path / "run"), {}, recipe="sim", resume_from=ckpt)
    cb.on_train_begin(None, SimpleNamespace(global_step=4, log_history=[]), None, model=tiny_model())
    cb.tokens.add({"input_ids": torch.zeros(2, 5, dtype=torch.long), "attention_mask": torch.ones(2, 5)})
    totals = cb.counters_so_far(cb.train_start + 1.0)
    assert totals["squared_lengths"] is None and totals["sequences"] == 12
    fig = cb.mfu_figures(totals, 1.0, 1, {"type": "cpu", "name": "cpu"})
    assert fig["flops_seq_len"] == pytest.approx(110 / 12)


def test_atomic_write_replaces_and_leaves_no_temp(tmp_path):
    target = tmp_path / "metrics.json"
    write_json_atomic(target, {"a": 1})
    write_json_atomic(target, {"a": 2})
    assert json.loads(target.read_text()) == {"a": 2}
    assert [p.name for p in tmp_path.iterdir()] == ["metrics.json"]


def test_atomic_write_failure_keeps_the_old_file(tmp_path, monkeypatch):
    target = tmp_path / "metrics.json"
    write_json_atomic(target, {"a": 1})

    def broken_dump(*args, **kwargs):
        raise OSError("disk full")

    monkeypatch.setattr(run_report.json, "dump", broken_dump)
    with pytest.raises(OSError):
        write_json_atomic(target, {"a": 2})
    assert json.loads(target.read_text()) == {"a": 1}
    assert [p.name for p in tmp_path.iterdir()] == ["metrics.json"]


def test_failure_before_training_still_writes_both_files(tmp_path):
    cb = RunReportCallback(str(tmp_path), {"sft_config": {"learning_rate": 1e-4}}, recipe="r")
    m = cb.finalize("failed", error="ValueError: boom")
    assert m["status"] == "failed" and m["error"] == "ValueError: boom"
    assert json.loads((tmp_path / "metrics.json").read_text())["status"] == "failed"
    args = json.loads((tmp_path / "run_args.json").read_text())
    assert args["recipe"] == "r" and args["sft_config"] == {"learning_rate": 1e-4}
    assert args["versions"]["torch"] == torch.__version__
    assert cb.finalize("completed") is None  # written once


def tiny_model():
    return MistralForCausalLM(MistralConfig(vocab_size=64, hidden_size=32, intermediate_size=64,
                                            num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2))


# tiny_model()'s parameters counted by hand from its config (not by the code under test): hidden 32, 4 heads of
# head_dim 32 / 4 = 8, 2 key/value heads (kv width 2 x 8 = 16), intermediate 64, 2 layers, vocabulary 64, untied
# LM head (Mistral's default), no biases.
TINY_LAYERS, TINY_HEADS, TINY_HEAD_DIM = 2, 4, 8
TINY_PER_LAYER = (
    32 * 32 + 32 * 32    # q_proj and o_proj: 1,024 each
    + 32 * 16 + 32 * 16  # k_proj and v_proj: 512 each
    + 3 * 32 * 64        # gate, up and down projections: 6,144
    + 2 * 32             # input and post-attention RMSNorm weights: 64
)                        # = 9,280
TINY_NON_EMBEDDING = 2 * TINY_PER_LAYER + 32 + 64 * 32  # 2 layers + final norm + LM head = 18,560 + 32 + 2,048 = 20,640
TINY_TOTAL = TINY_NON_EMBEDDING + 64 * 32  # + the input embedding (a lookup, no FLOPs) = 22,688
assert (TINY_PER_LAYER, TINY_NON_EMBEDDING, TINY_TOTAL) == (9_280, 20_640, 22_688)  # the arithmetic above, summed


def hand_flops_per_token(seq_len: float) -> float:
    """Full fine-tuning FLOPs per token of tiny_model(), written out: 6N + 12 * L * H * d_head * T (PaLM paper,
    Chowdhery et al. 2022, appendix B; the same estimate as nanoGPT's estimate_mfu): 2N forward + 4N backward for
    the N non-embedding weights, plus the attention score and value matmuls over T positions."""
    return 6 * TINY_NON_EMBEDDING + 12 * TINY_LAYERS * TINY_HEADS * TINY_HEAD_DIM * seq_len


H100_SXM_PEAK = 989e12  # dense BF16 tensor-core FLOP/s of the H100 SXM5, NVIDIA's H100 datasheet (1,979 with sparsity)


CPU_PEAK = {"flops": 2e9, "measured_now": 1.5e9, "runs": 3, "products": 5, "size": 1024, "dtype": "float32",
            "threads": 1, "load_1min": 0.1, "key": "a CPU | float32 | 1 thread(s) per rank | 1 rank(s) | torch"}


def simulated_run(tmp_path, monkeypatch, device=None, cpu_peak=CPU_PEAK):
    """Drive the callback through the hooks the Trainer calls, with a real (tiny) model. On CPU the matmul rate
    the ranks would measure is `cpu_peak` (None: none measured)."""
    if device:
        monkeypatch.setattr(run_report, "device_info", lambda: device)
    monkeypatch.setattr(run_report.cpu_peak, "best_rate", lambda *a, **k: cpu_peak)
    monkeypatch.setattr(run_report.cpu_peak, "store", lambda *a, **k: None)  # the user's cache is not the test's
    cb = RunReportCallback(str(tmp_path), {}, recipe="sim")
    for point in ("imports_done", "through_gate", "configured", "data_loaded", "trainer_built"):  # as the entry point
        cb.mark(point)
    model = tiny_model()
    state = SimpleNamespace(global_step=0, log_history=[])
    cb.on_train_begin(None, state, None, model=model)
    for step in range(1, 4):
        cb.tokens.add({"input_ids": torch.zeros(4, 10, dtype=torch.long),
                       "attention_mask": torch.ones(4, 10, dtype=torch.long)})
        state.global_step = step
        cb.on_step_end(None, state, None)
        state.log_history.append({"loss": 3.0 / step, "step": step})
        cb.on_log(None, state, None)
    state.log_history.append({"eval_loss": 0.9, "step": 3})
    cb.on_train_end(None, state, None)
    return cb.finalize("completed"), model


def test_completed_run_metrics_are_consistent(tmp_path, monkeypatch):
    m, _ = simulated_run(tmp_path, monkeypatch)
    assert m["steps"] == 3 and m["samples"] == 12
    assert m["tokens"] == {"non_padding": 120, "padded": 120, "scope": "all_ranks"}
    assert m["tokens_per_second"] == pytest.approx(120 / m["train_time_s"])
    assert m["first_train_loss"] == 3.0 and m["final_train_loss"] == 1.0 and m["final_eval_loss"] == 0.9
    # counted by hand above; all trainable, and all active (a dense model: tests/test_moe.py has a mixture of experts)
    assert m["params"] == {"total": TINY_TOTAL, "trainable": TINY_TOTAL, "active": TINY_TOTAL}
    # CPU: MFU against the ranks' measured matmul rate (here 2 GFLOP/s, one rank), said in peak_flops_source
    assert m["peak_flops_per_device"] == 2e9 and m["peak_flops_source"].startswith(
        "against the best 1-rank float32 matmul rate measured on this machine, 2.0 GFLOP/s")
    assert m["mfu"] == pytest.approx(131_520 * m["tokens_per_second"] / 2e9)
    assert m["peak_memory"]["device_allocated_bytes"] is None and m["peak_memory"]["host_rss_bytes"] > 0
    # every sequence is 10 tokens (4 x 10, no padding): 6 x 20,640 + 12 x 2 x 4 x 8 x 10 = 123,840 + 7,680
    assert hand_flops_per_token(10) == 131_520
    assert m["flops_seq_len"] == 10 and m["flops_per_token"] == 131_520
    assert m["param_shards"]["dtensor_params"] == 0  # not sharded: single process


def test_mfu_on_a_known_gpu(tmp_path, monkeypatch):
    m, _ = simulated_run(tmp_path, monkeypatch, device={"type": "cuda", "name": "NVIDIA H100 80GB HBM3",
                                                         "count_per_node": 1})
    assert m["peak_flops_per_device"] == H100_SXM_PEAK
    # 120 tokens in the measured train time: tokens/s is a measurement, the FLOPs per token and the peak are not
    assert m["tokens_per_second"] == pytest.approx(120 / m["train_time_s"])
    assert m["mfu"] == pytest.approx(131_520 * m["tokens_per_second"] / H100_SXM_PEAK)  # 1 GPU
    assert m["mfu_note"] is None


def prom_samples(path: Path) -> dict:
    """{metric: value} of a one-run textfile, through prometheus_client's parser (it raises on bad syntax)."""
    parser = need_module("prometheus_client.parser")
    return {s.name: s.value for f in parser.text_string_to_metric_families(path.read_text()) for s in f.samples}


def test_gauges_are_rewritten_at_every_training_log_with_that_interval(tmp_path, monkeypatch):
    clock = [100.0]
    monkeypatch.setattr(run_report, "time", SimpleNamespace(time=lambda: clock[0]))
    monkeypatch.setattr(run_report, "device_info", lambda: {"type": "cuda", "name": "NVIDIA H100 80GB HBM3",
                                                            "count_per_node": 1})
    collector = tmp_path / "textfile"
    collector.mkdir()
    cb = RunReportCallback(str(tmp_path / "run-a"), {}, recipe="sim", prometheus_textfile=str(collector / "a.prom"))
    state = SimpleNamespace(global_step=0, log_history=[])
    cb.on_train_begin(None, state, None, model=tiny_model())

    def train(steps: int, seconds: float) -> None:
        for _ in range(steps):
            cb.tokens.add({"input_ids": torch.zeros(4, 10, dtype=torch.long),
                           "attention_mask": torch.ones(4, 10, dtype=torch.long)})  # 40 tokens a step
            state.global_step += 1
        clock[0] += seconds
        cb.on_log(None, state, None, logs={"loss": 1.0})

    train(2, 10.0)  # 80 tokens in 10 s
    first = prom_samples(tmp_path / "run-a" / "metrics.prom")
    assert first["training_tokens_per_second"] == pytest.approx(8.0) and first["training_step"] == 2
    train(3, 20.0)  # 120 tokens in 20 s: the gauge is this interval's, not the average since start (200 / 30)
    for path in (tmp_path / "run-a" / "metrics.prom", collector / "a.prom"):
        live = prom_samples(path)
        assert live["training_tokens_per_second"] == pytest.approx(6.0)
        assert live["training_step"] == 5 and live["training_running"] == 1
        assert live["training_last_update_timestamp_seconds"] == 130
        # 10-token sequences: hand_flops_per_token(10) = 131,520 FLOPs per token, at 6 tokens/s on one H100 SXM
        assert live["training_mfu"] == pytest.approx(131_520 * 6.0 / H100_SXM_PEAK)
    before = (collector / "a.prom").read_text()
    clock[0] += 5.0
    cb.on_log(None, state, None, logs={"eval_loss": 0.5})  # not a training log: nothing rewritten
    assert (collector / "a.prom").read_text() == before
    cb.on_train_end(None, state, None)
    m = cb.finalize("completed")
    final = prom_samples(collector / "a.prom")
    assert final["training_running"] == 0 and final["training_step"] == 5
    assert final["training_tokens_per_second"] == pytest.approx(m["tokens_per_second"]) == pytest.approx(200 / 35)


def test_an_unwritable_textfile_does_not_stop_training(tmp_path, monkeypatch, capsys):
    cb = RunReportCallback(str(tmp_path / "run"), {}, recipe="sim",
                           prometheus_textfile=str(tmp_path / "gone" / "a.prom"))
    monkeypatch.setattr(run_report, "write_textfile", lambda *a, **k: (_ for _ in ()).throw(PermissionError("ro")))
    state = SimpleNamespace(global_step=1, log_history=[])
    cb.on_train_begin(None, state, None, model=tiny_model())
    cb.tokens.add({"input_ids": torch.zeros(1, 4, dtype=torch.long)})
    cb.on_log(None, state, None, logs={"loss": 1.0})
    assert capsys.readouterr().err.count("could not write") == 2  # both files, one warning each, no exception


def documented_fields() -> set[str]:
    """Field names in docs/run-report.md's metrics.json table (first column, in backticks)."""
    text = SCHEMA_DOC.read_text()
    section = text.split("\n## metrics.json\n", 1)[1].split("\n#", 1)[0]
    return set(re.findall(r"^\| `([a-z_.]+)`", section, flags=re.M))


def flatten(d: dict, prefix: str = "") -> set[str]:
    keys = set()
    for k, v in d.items():
        keys.add(prefix + k)
        if isinstance(v, dict):
            keys |= flatten(v, prefix + k + ".")
    return keys


def test_metrics_schema_matches_the_docs(tmp_path, monkeypatch):
    m, _ = simulated_run(tmp_path, monkeypatch)
    assert flatten(m) == documented_fields()


@pytest.mark.parametrize("umask, mode", [(0o022, 0o644), (0o002, 0o664), (0o077, 0o600)])
def test_report_files_respect_the_umask(tmp_path, umask, mode):
    """Teammates read each other's run reports: the atomic write keeps the mode a plain open() would give."""
    import os

    old = os.umask(umask)
    try:
        write_json_atomic(tmp_path / "metrics.json", {"status": "completed"})
    finally:
        os.umask(old)
    assert (tmp_path / "metrics.json").stat().st_mode & 0o777 == mode


def test_metrics_json_has_one_owner_and_no_writer_drops_anothers_field(tmp_path):
    """Every writer amends metrics.json through metrics_file.amend: the summary's `eval` survives a later write of the
    same run's report, and a new run's report replaces an earlier run's fields."""
    from fsdp_recipes.metrics import metrics_file

    run = {"started_at": "2026-11-25T10:00:00+00:00", "status": "completed", "steps": 4}
    metrics_file.amend(tmp_path, lambda cur: {**metrics_file.same_run(cur, run["started_at"]), **run})
    metrics_file.amend(tmp_path, lambda m: {**m, "eval": {"prompts": 10}})  # the summary
    metrics_file.amend(tmp_path, lambda cur: {**metrics_file.same_run(cur, run["started_at"]), **run, "steps": 5})
    assert json.loads((tmp_path / "metrics.json").read_text()) == {**run, "steps": 5, "eval": {"prompts": 10}}
    later = {"started_at": "2026-11-25T11:00:00+00:00", "status": "completed", "steps": 2}
    metrics_file.amend(tmp_path, lambda cur: {**metrics_file.same_run(cur, later["started_at"]), **later})
    assert json.loads((tmp_path / "metrics.json").read_text()) == later  # the earlier run's eval is gone
    assert metrics_file.amend(tmp_path, lambda m: None) is None  # a change may decline: the file stays
    assert json.loads((tmp_path / "metrics.json").read_text()) == later



def test_a_cpu_run_without_a_measured_peak_has_no_mfu_and_says_why(tmp_path, monkeypatch):
    monkeypatch.setattr(run_report.RunReportCallback, "measure_cpu_peak", lambda self: None)
    m, _ = simulated_run(tmp_path, monkeypatch)
    assert m["mfu"] is None and "no matmul rate was measured" in m["mfu_note"] and m["peak_flops_source"] is None


def test_run_args_writes_sets_as_sorted_lists(tmp_path):
    """PEFT's target_modules is a set: written with json's default=str it was the set's printed form, whose order
    varies between processes, so `make report` listed it as a setting that differs between two runs of one recipe."""
    modules = {"v_proj", "down_proj", "q_proj", "gate_proj"}
    cb = RunReportCallback(str(tmp_path / "run"), {"lora_config": {"target_modules": modules, "r": 8}}, recipe="sim")
    write_json_atomic(tmp_path / "run_args.json", cb.run_args())
    written = json.loads((tmp_path / "run_args.json").read_text())["lora_config"]
    assert written == {"target_modules": ["down_proj", "gate_proj", "q_proj", "v_proj"], "r": 8}
