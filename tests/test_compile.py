"""The compile option on a CPU (issue 57's CPU checks): the model compiled as the Trainer compiles it
(`torch_compile`: torch.compile of the whole model) and as the ladder's compile rung does (accelerate's regional
compile, each decoder layer in place) gives the eager model's loss and gradients on the same batch. The backend is
aot_eager: dynamo's graph capture and AOTAutograd's joint graph, what both forms change, without inductor's C++ build
(the GPU ladder measures inductor's speed)."""

import pytest
import torch

LOSS_RTOL, GRAD_ATOL = 1e-6, 1e-5  # float32, the same operations regrouped


def tiny_llama():
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    return LlamaForCausalLM(LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                        num_attention_heads=4, num_key_value_heads=2, attn_implementation="sdpa"))


def loss_and_grads(model):
    ids = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(1))
    loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    return loss.item(), {n: p.grad.clone() for n, p in model.named_parameters()}


@pytest.mark.slow  # dynamo traces the model: a few seconds
@pytest.mark.parametrize("form", ["whole model (torch_compile)", "regional (the ladder's rung)"])
def test_compiled_training_step_matches_eager(form):
    from accelerate.utils import compile_regions

    torch._dynamo.reset()
    reference_loss, reference_grads = loss_and_grads(tiny_llama())
    model = tiny_llama()
    compiled = torch.compile(model, backend="aot_eager") if form.startswith("whole") else compile_regions(
        model, backend="aot_eager")
    loss, grads = loss_and_grads(compiled)
    grads = {name.replace("_orig_mod.", ""): grad for name, grad in grads.items()}  # the compiled wrappers' names
    assert loss == pytest.approx(reference_loss, rel=LOSS_RTOL) and grads.keys() == reference_grads.keys()
    for name, grad in grads.items():
        torch.testing.assert_close(grad, reference_grads[name], rtol=0, atol=GRAD_ATOL)
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] > 0  # it really compiled
