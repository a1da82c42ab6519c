"""The evaluation room (evaluation/): each stage's scores from one load of a real model, the log-probabilities they
are built from, the rows they are scored on, and the metrics registry: a metric added in a test is scored and
printed through the path the pack's own take, and a metric missing a member fails when it is registered."""

import json
import math
from types import ModuleType

import pytest

from fsdp_recipes.evaluation import answer_loss, eval_rows, generation, scores, scoring
from fsdp_recipes.launch import summary


def test_preference_margins_are_the_answers_log_probabilities(cache_dir):
    """scoring.preference_margins against each sequence scored on its own, unpadded: log p(chosen) - log p(rejected),
    summed over the answer's tokens (those after the rendered prompt), on the tiny model."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from fsdp_recipes.assets.tiny_assets import ensure_assets

    model_dir = str(ensure_assets(quiet=True)["model"])
    tok, model = AutoTokenizer.from_pretrained(model_dir), AutoModelForCausalLM.from_pretrained(model_dir).eval()
    pairs = [([{"role": "user", "content": "What is 2 + 3?"}], "5", "16"),
             ([{"role": "user", "content": "What is 9 + 9?"}], "18", "7")]

    def alone(prompt, answer):
        head = tok.apply_chat_template(prompt, tokenize=False, add_generation_prompt=True)
        full = tok.apply_chat_template(prompt + [{"role": "assistant", "content": answer}], tokenize=False)
        assert full.startswith(head)
        ids = tok(full, add_special_tokens=False, return_tensors="pt")["input_ids"]
        n_head = len(tok(head, add_special_tokens=False)["input_ids"])
        with torch.no_grad():
            logp = torch.log_softmax(model(input_ids=ids).logits[0, :-1].float(), -1)
        return sum(float(logp[t - 1, ids[0, t]]) for t in range(n_head, ids.shape[1]))

    expected = [alone(p, c) - alone(p, r) for p, c, r in pairs]
    assert scoring.preference_margins(model_dir, pairs) == pytest.approx(expected, abs=1e-4)


def test_held_out_loss_is_the_mean_log_likelihood_of_the_tokens_sft_trains_on(cache_dir):
    """evaluation/answer_loss.held_out_loss against each row scored on its own, unpadded, on the tiny model: a chat
    prompt's answer tokens (after the rendered prompt: the answer and the template's EOS), a text prompt's completion
    with the EOS TRL appends, and a text row's every token after the first; the loss is their mean negative
    log-likelihood per token, the perplexity its exponential. Batched in a few tokens or many, the same."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from fsdp_recipes.assets.tiny_assets import ensure_assets

    model_dir = str(ensure_assets(quiet=True)["model"])
    tok, model = AutoTokenizer.from_pretrained(model_dir), AutoModelForCausalLM.from_pretrained(model_dir).eval()
    chat = [{"role": "user", "content": "What is 2 + 3?"}]
    items = [(chat, "5"), ("What is 9 + 9?", " 18"), (None, "What is 1 + 1? 2")]

    def alone(ids: list[int], start: int):  # (summed log p of tokens start.. of the row, how many)
        with torch.no_grad():
            logp = torch.log_softmax(model(input_ids=torch.tensor([ids])).logits[0, :-1].float(), -1)
        return sum(float(logp[t - 1, ids[t]]) for t in range(start, len(ids))), len(ids) - start

    eos = tok.eos_token
    head = tok.apply_chat_template(chat, tokenize=False, add_generation_prompt=True)
    full = tok.apply_chat_template(chat + [{"role": "assistant", "content": "5"}], tokenize=False)
    assert full.startswith(head) and full.endswith(eos)
    ids = lambda text, special=True: tok(text, add_special_tokens=special)["input_ids"]  # noqa: E731
    parts = [alone(ids(full, False), len(ids(head, False))),  # the template writes its own BOS
             alone(ids("What is 9 + 9? 18" + eos), len(ids("What is 9 + 9?"))),  # special tokens as TRL adds them
             alone(ids("What is 1 + 1? 2" + eos), 1)]
    total, tokens = sum(s for s, _ in parts), sum(n for _, n in parts)
    got = answer_loss.held_out_loss(model, tok, items)
    assert got["tokens"] == tokens and (got["rows"], got["rows_cut"]) == (3, 0)
    assert got["loss"] == pytest.approx(-total / tokens, abs=1e-4)
    assert got["perplexity"] == pytest.approx(math.exp(-total / tokens), rel=1e-4)
    rows = [answer_loss.sequence(tok, p, a) for p, a in items]
    one_by_one = answer_loss.token_logps(model, tok, rows, batch_tokens=1)  # a batch per row
    together = answer_loss.token_logps(model, tok, rows)
    assert [n for _, n, _ in one_by_one] == [n for _, n, _ in together] == [n for _, n in parts]
    assert [s for s, _, _ in one_by_one] == pytest.approx([s for s, _, _ in together], abs=1e-4)
    short = answer_loss.token_logps(model, tok, rows[:1], max_tokens=len(rows[0][0]) - 1)
    assert short[0][1] == parts[0][1] - 1 and short[0][2] is True  # cut on the right: its last token not scored


def test_a_stage_is_scored_with_one_load_of_a_real_model(cache_dir, monkeypatch):
    """scoring.score_stage on the tiny model: the loss of the references, greedy answers to every prompt where every
    reference is short, and the preference margins, from one load; a reference over 16 tokens turns the exact match
    off and leaves SAMPLE_ROWS prompts answered (up to SAMPLE_TOKENS tokens), to read."""
    from fsdp_recipes.assets.tiny_assets import ensure_assets
    from fsdp_recipes.evaluation.answer_loss import held_out_loss

    model_dir = str(ensure_assets(quiet=True)["model"])
    loads = []
    monkeypatch.setattr(generation, "load", lambda d, t=None, real=generation.load: loads.append(d) or real(d, t))
    items = [([{"role": "user", "content": f"What is {i} + 2?"}], str(i + 2)) for i in range(3)]
    pairs = [(p, a, "16") for p, a in items]
    got = scoring.score_stage(model_dir, items, pairs)
    assert loads == [model_dir]
    assert got["loss"] == held_out_loss(*generation.load(model_dir), items)
    assert len(got["answers"]) == 3 and got["long_answers"] == 0
    assert got["margins"] == pytest.approx(scoring.preference_margins(model_dir, pairs), abs=1e-5)
    monkeypatch.setattr(eval_rows, "SAMPLE_ROWS", 2)
    monkeypatch.setattr(eval_rows, "SAMPLE_TOKENS", 3)  # a random model's 64 tokens are seconds, and prove nothing more
    long = scoring.score_stage(model_dir, items + [(items[0][0], " ".join(["7 + 8 is 15"] * 8))], [])
    assert long["long_answers"] == 1 and len(long["answers"]) == 2 and "margins" not in long


def test_labelled_answers_are_expected_only_where_labelled_desirable():
    """KTO's unpaired rows hold wrong answers too: the summary's exact match must not expect one of those."""
    from datasets import Dataset

    from fsdp_recipes.evaluation.eval_rows import prompts_of

    q = [{"role": "user", "content": "What is 2 + 3?"}]
    rows = Dataset.from_list([{"prompt": q, "completion": [{"role": "assistant", "content": "5"}], "label": True},
                              {"prompt": q, "completion": [{"role": "assistant", "content": "6"}], "label": False}])
    assert prompts_of(rows) == [(q, "5")]


def answer_length_metric() -> ModuleType:
    """A metric the pack does not have, written as a user would: each stage's mean answer length in characters
    against the references', from the stages' generations."""
    from fsdp_recipes.evaluation.stages import names

    metric = ModuleType("answer_length")
    metric.NEEDS = ("generations",)
    metric.INTERVAL = "none: a mean length, read beside the references'"
    metric.applies = lambda data: bool(data.refs)

    def score(check, scored):
        for stage, raw in zip(check["stages"], scored.raw):
            stage["mean_answer_chars"] = sum(map(len, raw["answers"])) / len(raw["answers"])
        check["answer_length"] = {"reference": sum(map(len, scored.data.expected)) / len(scored.data.expected)}

    def lines(check):
        if "answer_length" not in check:
            return []
        per_stage = " -> ".join(f"{name} {s['mean_answer_chars']:.2f}" for name, s in zip(names(check),
                                                                                           check["stages"]))
        return [f"answer length (characters): {per_stage}; references {check['answer_length']['reference']:.2f}"]

    metric.score, metric.lines = score, lines
    return metric


def test_a_registered_metric_is_scored_and_printed_as_the_packs_own_are(tmp_path, monkeypatch, capsys):
    """Registered in the test, the answer-length metric goes the way exact match does: the stages' answers (a stand-in
    for the models: the base model answers `no`, the trained one the sum), its score in the check, its line in the
    summary after the pack's metrics on the answers, its per-stage figure in metrics.json's `eval`."""
    from datasets import Dataset
    from test_splits import stand_in
    from test_summary import fake_run

    monkeypatch.setattr(scores, "METRICS", dict(scores.METRICS))
    scores.register("answer_length", answer_length_metric())
    assert list(scores.METRICS) == ["held_out_loss", "exact_match", "four_bit", "preference", "answer_length"]
    run = fake_run(tmp_path)
    (run / "run_args.json").write_text(json.dumps({"model_args": {"model_name_or_path": "base-model"},
                                                   "pack_args": {"trainer": "sft"}}))
    rows = Dataset.from_list([{"prompt": [{"role": "user", "content": f"What is {i} + 1?"}],
                               "completion": [{"role": "assistant", "content": str(i + 1)}]} for i in range(4)])
    monkeypatch.setattr(eval_rows, "scored_rows", lambda run_args, n, cfg=None: (rows, "the `test` split", 0, "text"))
    monkeypatch.setattr(scoring, "score_stage", stand_in([]))
    monkeypatch.setenv(summary.FORCE_ENV, "1")
    assert summary.main([str(run)]) == 0
    out = capsys.readouterr().out.splitlines()
    first = out.index(next(line for line in out if line.startswith("held-out loss")))
    # base `no` x4: 2 characters; trained 1, 2, 3, 4: 1 each; references the same sums
    assert out[first:first + 4] == [
        "held-out loss on 4 eval rows (12 answer tokens): base model 2.000 (perplexity 7.39) -> trained 0.500 "
        "(perplexity 1.65)",
        "exact match on 4 eval prompts: base model 0/4 (0.0-49.0%) -> trained 4/4 (51.0-100.0%): no change "
        "(p=0.12; 0 right only before, 4 only after)",
        "            95% Wilson intervals; a change: exact McNemar test on the prompts only one side got right "
        "(p < 0.05)",
        "answer length (characters): base model 2.00 -> trained 1.00; references 1.00"]
    ev = json.loads((run / "metrics.json").read_text())["eval"]
    assert [s["mean_answer_chars"] for s in ev["stages"]] == [2.0, 1.0]
    assert list(ev["intervals"]) == ["held_out_loss", "exact_match", "answer_length"]  # those that applied
    assert ev["intervals"]["answer_length"] == "none: a mean length, read beside the references'"
    assert json.loads((run / "sample_generations.json").read_text())["answer_length"] == {"reference": 1.0}


def test_a_metric_asks_each_stage_only_for_what_it_needs(monkeypatch):
    """score_stage computes a need (here the preference rows' margins) only where a metric that applies names it."""
    asked = []
    for need in scores.NEEDS_KINDS:
        monkeypatch.setitem(scoring.NEEDED, need, lambda model, tok, data, need=need: asked.append(need) or {})
    items = [([{"role": "user", "content": "What is 1 + 1?"}], "2")]
    scoring.score_stage("unused", items, [], loaded=(None, None))
    assert asked == ["log-probs", "generations"]  # no pairs: the preference metric does not apply
    monkeypatch.setattr(scores, "METRICS", dict(scores.METRICS))
    wants_pairs = answer_length_metric()
    wants_pairs.NEEDS = ("preference rows",)
    scores.register("pairs_anyway", wants_pairs)
    asked.clear()
    scoring.score_stage("unused", items, [], loaded=(None, None))
    assert asked == ["log-probs", "generations", "preference rows"]


@pytest.mark.parametrize("member", ["NEEDS", "applies", "score", "INTERVAL", "lines"])
def test_a_metric_missing_a_member_fails_when_it_is_registered(monkeypatch, member):
    monkeypatch.setattr(scores, "METRICS", dict(scores.METRICS))
    half = answer_length_metric()
    delattr(half, member)
    with pytest.raises(TypeError, match=f"evaluation metric answer_length \\(answer_length\\) lacks {member}: "
                                        "every metric provides NEEDS, applies, score, INTERVAL, lines"):
        scores.register("answer_length", half)
    assert "answer_length" not in scores.METRICS


def test_a_metric_needing_what_no_stage_computes_fails_when_it_is_registered(monkeypatch):
    monkeypatch.setattr(scores, "METRICS", dict(scores.METRICS))
    odd = answer_length_metric()
    odd.NEEDS = ("attention maps",)
    with pytest.raises(TypeError, match=r"NEEDS \('attention maps',\): a tuple of log-probs, generations, "
                                        "preference rows"):
        scores.register("odd", odd)


def test_every_registered_metric_provides_the_interface():
    assert list(scores.METRICS) == list(scores.NAMES)
    for name, metric in scores.METRICS.items():
        assert metric.name == name and metric.module.__name__ == f"fsdp_recipes.evaluation.scores.{name}"
        assert set(metric.NEEDS) <= set(scores.NEEDS_KINDS) and set(scoring.NEEDED) == set(scores.NEEDS_KINDS)
        assert all(callable(f) for f in (metric.applies, metric.score, metric.lines))
        assert isinstance(metric.INTERVAL, str) and metric.INTERVAL


def test_a_run_over_its_own_models_folder_is_one_stage_not_a_loop(tmp_path):
    """An older launcher let output_dir be the model's folder: its run_args.json then names itself as the model, and
    the summary printed `base -> sft -> sft -> ...` nine times."""
    import json

    from fsdp_recipes.evaluation.stages import stages

    run = tmp_path / "model"
    run.mkdir()
    args = {"pack_args": {"trainer": "sft"}, "model_args": {"model_name_or_path": str(run)}}
    (run / "run_args.json").write_text(json.dumps(args))
    assert stages(run, args, run) == [("base", str(run)), ("sft", str(run))]
    sft = tmp_path / "sft"  # a real chain still reads every stage: base -> sft -> dpo
    sft.mkdir()
    (sft / "run_args.json").write_text(json.dumps({"pack_args": {"trainer": "sft"},
                                                   "model_args": {"model_name_or_path": "base-model"}}))
    dpo = {"pack_args": {"trainer": "dpo"}, "model_args": {"model_name_or_path": str(sft / "merged")}}
    assert stages(tmp_path / "dpo", dpo, tmp_path / "dpo") == [
        ("base", "base-model"), ("sft", str(sft / "merged")), ("dpo", str(tmp_path / "dpo"))]
