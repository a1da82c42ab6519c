"""Per-GPU memory budget of a recipe on a given topology: weights, gradients, optimizer states, activations,
communication buffers. Plain arithmetic on the model's shapes; `make plan` prints it, tests compare it with
what the tiny CPU runs really hold (fsdp_recipes.metrics.memory_probe).

Bytes per parameter (ZeRO paper, Rajbhandari et al. 2020, section 3, adapted to what accelerate 1.15 does):
with mixed precision, accelerate upcasts *trainable* parameters to fp32 under FSDP1 and FSDP2 (the
"FSDP upcast of low precision parameters" warning); frozen ones stay in the load dtype. Gradients have the
parameter's dtype; AdamW keeps two fp32 moments. Sharding divides all three by the shard-group size
(FULL_SHARD: the world; HSDP: the GPUs of one shard group; DDP: 1).

Activations, bytes per token per decoder layer, counted from what autograd saves in transformers' Llama /
Mistral / Qwen3 layers with SDPA (no materialised attention matrix; Korthikanti et al. 2022 do the same
count for GPT) and checked tensor by tensor with saved_tensors_hooks on the tiny model: each RMSNorm keeps an fp32
copy of its input and its output (h * (4 + c)), trained (full fine-tuning) its normalized input too (c * h); SDPA
keeps q, k, v (GQA's k and v unrepeated: torch's enable_gqa) and its output, which o_proj reuses (c * (2q + 2kv));
the MLP keeps gate, up, SiLU(gate) and their product (4cI); each LoRA-targeted linear keeps its r-wide A output, and
with dropout its dropped-out input and mask. c is the compute width (2 bytes with bf16 mixed precision, 4 in fp32):

    per_layer = 2h(4 + c [+ c]) + c(2q + 2kv + 4I + r * targets) [+ (c + 1) * in_features per target, with dropout]
                [+ (4 [+ c])(q + kv) + 4(heads + kv_heads): Qwen3's q_norm and k_norm, below]

The norms' [+ c], op by op (transformers' RMSNorm, `weight * hidden.to(input_dtype)` last): the fp32 input (4h) is
kept, the weight's multiply keeps the normalized tensor (ch) only when the weight trains, the next linears its output
(ch). Measured (2026-11-29, tests/test_norm_activations.py: tiny Mistral, bf16 weights as FSDP2's bf16 policy gathers
them, under autocast; alike without, a one-off probe): layer 1 keeps 11,160 B a token with trained norms, 10,136
frozen; the formula 11,136, 10,112 (24 B of per-row scalars apart). The final norm alike, the chunked head keeping
its own copy of the labelled rows' hidden states (ch): 4h + 2ch trained (8h at c = 2), 4h + ch frozen.

A mixture of experts (Qwen3-MoE, Mixtral) holds every expert's weights, gradients and optimizer states (sharded like
any other parameter, all experts of a layer gathered at once: no expert parallelism), but a token's activations are
those of the top_k experts it is routed to: each route keeps the gathered input, gate, up, SiLU(gate), their product,
the output and its routing weight (c * top_k * (4 I_expert + 2h + 1)); the block keeps its input for the router
(c * h), the router its fp32 probabilities (4E), and the routes' int64 indices come to 32 bytes each (32 top_k).
Counted tensor by tensor in transformers 5's eager expert loop (Mixtral on CPU: tests/test_moe.py); the grouped
kernels a GPU uses (experts_implementation) may keep other tensors.

LoRA on parameters (PEFT's target_parameters: a mixture's fused 3-D experts) has no r-wide activation per token:
PEFT 0.21's ParamWrapper puts a parametrization on each targeted tensor for the layer's forward, which computes the
merged weight W + scaling * B @ A (_LoraFactorsProxy's baddbmm, in W's dtype: the gathered copy's, the compute
width) as a new tensor the size of W, every expert of the layer. The experts' matmuls save it for their backward, so
a layer keeps one merged copy of its targeted tensors from its forward to its backward unless it is checkpointed
(then it is computed again in the recompute), and that layer's backward adds the merged weight's gradient, the same
size, before baddbmm's backward reduces it to A's and B's (`lora_merged_copies`, each merged_copy x c bytes): without
checkpointing layers + 1 (every layer's copy, and the gradient of the first in the backward); with it, the layers
not checkpointed + 2 (a checkpointed layer's recomputed copy and its gradient), as layer_activations bounds them. Qwen3-30B-A3B with LoRA on both expert tensors: 128 x (1536 x 2048 + 2048 x 768) = 604M
elements, 1.125 GiB per copy in bf16.

Qwen3's q_norm and k_norm (head_norms_per_layer; any layer whose attention has both, found by shape_of): an RMSNorm
over each query and key head's head_dim before RoPE keeps, like the others, its fp32 input and its per-row rsqrt
(4(q + kv) + 4 x the heads), and trained its c-wide normalized input; its output is not kept (RoPE's multiplies keep
cos and sin, SDPA the roped q and k already counted): (4 [+ c])(q + kv) + 4(heads + kv_heads). Measured 2026-11-29,
tests/test_head_norm_activations.py (a tiny Qwen3, 4 + 2 heads of 64, as the norms' test): 2,328 B trained, 1,560
frozen, exactly; Qwen3-8B's full fine-tune 6 x 5,120 + 160 = 30,880 B a layer-token. Under tp they are split with
the heads (1/tp each; not measured under tp).

Activation checkpointing (speed/activation_checkpointing.py's policies), per token:
    none        layers x per_layer
    full        layers x c*h (each layer's input) + per_layer (one layer's set, alive during its recompute)
    every_<k>   ceil(layers / k) checkpointed layers x c*h + the other layers x per_layer + per_layer (the
                recompute of a checkpointed one); transformers checkpoints layers 0, k, 2k, ...
    ops         full's, plus the attention output each layer saves (c*q) under TRL's selective policy
Checked against the H100 runs of 2026-11-26 (bench/README.md, "Second GPU run"; docs/planner.md "Against the
GPU"): with full checkpointing the 8B LoRA rungs' max_memory_allocated less their probed weights, gradients and
optimizer states grows by 608,898 B per token between the packed rung (8,192 tokens) and the padded one (8 x 4,096),
against this term's 612,576 (-0.6%); the policies without checkpointing wait for the GPU ladder's first rung.
TRL 1.16's SFTTrainer computes the loss through a fused, chunked LM head, so full logits are never
materialised; one tile of at most 4096 tokens x 32768 vocabulary entries is (trl/kernels/chunked_logprob.py), and
is counted, as is what its backward accumulates in fp32: the hidden states' gradient, and in full fine-tuning the
head weight's gradient (vocab x hidden x 4 bytes: 2 GiB for a 131k vocabulary at hidden 4096). Worst case: every
sequence max_length long.

Communication buffers (also at world size 1, where FSDP2 still casts each layer to a compute-width copy): FSDP
all-gathers one decoder layer's parameters at the compute width while
prefetching the next (2 layers), plus that layer's gradients for the reduce-scatter; the root unit
(embeddings, final norm, LM head) stays gathered for the whole step. Without resharding after the forward
(FSDP2's reshard_after_forward false, FSDP1's SHARD_GRAD_OP: ZeRO-2) every layer's gathered compute-width copy is
kept from its forward to its backward, so the whole model's is counted. Measured on an H100, 2026-11-26 (the
default, world size 1, bench/README.md "First GPU run"): the two-layer count left 289 MB of torch's
max_memory_allocated unexplained; the whole model's bf16 copy is 279 MB of it. DDP keeps a gradient bucket copy of
every trainable parameter (gradient_as_bucket_view is off by default).

DPO (train/kinds/dpo.py): a micro-batch of B pairs is 2B sequences (chosen and rejected), so the tokens double. The
reference model is its own component: with LoRA none (the base with the adapter disabled, no copy), with full
fine-tuning a second copy of the weights in the load dtype, sharded like the policy, with no gradients or optimizer
state, plus its own all-gather of one layer and its prefetch at the compute width and its root unit; its forward
runs under no_grad, so it keeps no activations.

GRPO (train/kinds/grpo.py): a micro-batch of B completions is B sequences of prompt + completion. Sampling them adds
either the KV cache of the completions one GPU samples at once (the policy's own generate: per sequence, prompt +
completion tokens x layers x 2 (K and V) x kv_dim x the compute width, plus one step's fp32 logits), or in vLLM's
colocate mode the engine's share of the GPU (vllm_gpu_memory_utilization x the GPU's memory: its bf16 weights and
its KV cache). Both are counted on top of the training peak, an upper bound: sampling ends before the training
forward starts, and vLLM's sleep mode releases its share while the policy trains.

QLoRA (`load_in_4bit`, speed/four_bit.py): every linear layer of the decoder is stored as NF4, two values per
byte (0.5 bytes per parameter), in a tensor FSDP shards like any other; its scales are not part of that tensor and
stay whole on every rank: one fp32 absmax per 64-value block (4/64 = 0.0625 bytes per parameter), or with nested
quantization one uint8 per block plus one fp32 per 256 blocks (1/64 + 4/16384). Embeddings, norms and the LM head stay
in the load dtype (transformers' bitsandbytes quantizer keeps the output layer). FSDP gathers a layer's packed bytes
(0.5 per parameter, not the compute width), and bitsandbytes dequantises one linear at a time to the compute dtype
for its matmul: the largest linear of a layer, once, is the working copy (QLoRA paper, Dettmers et al. 2023, section 3;
bitsandbytes' Linear4bit).

Other families (decoder.py): the decoder layers wherever the family keeps them (gpt_neox.layers,
transformer.h, model.decoder.layers), its widths by its own config names; each layer counted, the per-layer terms
taken from the largest (Jamba's Mamba and attention layers differ). The activation count above is Llama's layer's on
those widths: for a GELU MLP (GPT-NeoX, GPT-2) or parallel attention and MLP an estimate, not measured.

Tensor parallel: planning/tp_terms.py (autocast's copies under tp, its fp32 residual stream, LoRA's
adapters under tp), measured on CPU.

Runtime: CUDA context, NCCL and allocator slack, 2 GiB per GPU (a typical figure for H100 nodes, not
measured by this pack); 0 on CPU.
"""

from __future__ import annotations

import dataclasses
import math

from fsdp_recipes import decoder
from fsdp_recipes.metrics import flops
from fsdp_recipes.planning.tp_terms import (lora_adapters_under_autocast, lora_under_tp_per_layer, residual_bytes,
                                             wide_weights_under_autocast)

GIB = 1024**3
OPTIMIZER_BYTES = {"adamw": 8, "adam": 8, "sgd": 0, "adafactor": 4}  # per trainable parameter, fp32 states
LM_HEAD_TILE = 32768  # TRL's chunked log-prob tile: TOKEN_CHUNK_SIZE (4096) tokens x _CHUNKED_LOGPROB_CHUNK_SIZE


@dataclasses.dataclass
class ModelShape:
    params: int  # all parameters, LoRA adapters and modules_to_save copies included
    trainable: int
    layers: int
    hidden: int
    q_dim: int  # num_attention_heads * head_dim
    kv_dim: int  # num_key_value_heads * head_dim
    intermediate: int
    vocab: int
    layer_params: int  # one decoder layer, adapters included
    layer_trainable: int
    root_params: int  # outside the decoder layers: embeddings, final norm, LM head
    lora_dropout_width: int  # sum of in_features over LoRA-targeted linears of one layer, when dropout > 0
    lora_rank_width: int  # LoRA r x the number of targeted linears in one layer (the A outputs B keeps)
    embedding: int = 0  # the input embedding (a lookup, no matmul FLOPs)
    tied: bool = False  # the LM head shares the embedding's weight (still a matmul)
    quantized: int = 0  # QLoRA: base weights stored in 4 bits (every linear of the decoder layers)
    layer_quantized: int = 0  # of one layer
    largest_quantized: int = 0  # the largest such linear: the dequantised working copy
    experts: int = 0  # a mixture of experts: routed experts per layer (0: dense); intermediate is one expert's
    top_k: int = 0  # experts each token is routed to
    expert_params: int = 0  # all routed experts' weights, every layer: held in full, top_k / experts of them active
    merged_copy: int = 0  # elements of one layer's LoRA-targeted parameters: ParamWrapper's merged copy per forward
    lora_input_width: int = 0  # sum of in_features over LoRA-targeted linears of one layer, dropout or not
    lora_split_input_width: int = 0  # of those, the linears tp splits on their input (the tp plan's rowwise: o, down)
    lora_split_params: int = 0  # adapter elements of one layer tp splits: a column-wise linear's B, a row-wise one's A
    norms_trained: bool = False  # full fine-tuning: each norm's weight multiply keeps its normalized input
    head_norm_rows: int = 0  # Qwen3's q_norm and k_norm: rows they normalize per token (query + key heads); 0: none

    @property
    def active(self) -> int:
        """Parameters one token passes through (metrics/flops.py): all of them, less the experts it is not routed to."""
        return self.params - round(self.expert_params * (1 - self.top_k / self.experts)) if self.experts else self.params


@dataclasses.dataclass
class Setup:
    shard: int  # size of the group parameters are sharded over (1: DDP or a single GPU)
    world: int
    strategy: str  # "FSDP" | "HSDP" | "DDP" | "single"
    load_bytes: int  # bytes per parameter as loaded (dtype)
    compute_bytes: int  # bytes per activation element (2 with bf16 mixed precision)
    mixed_precision: bool
    tokens: int  # tokens per micro-batch per GPU (worst case)
    checkpointed: bool  # activation checkpointing (speed/activation_checkpointing.py)
    optimizer_bytes: int
    runtime_bytes: int
    checkpoint_every: int = 1  # every k-th layer is checkpointed (1: all of them)
    checkpoint_ops: bool = False  # selective: each checkpointed layer also saves its attention output
    reference: str = "none"  # DPO's reference model: "none" (SFT), "adapter" (LoRA: no copy), "copy" (full FT)
    generation: str = "none"  # GRPO's sampling: "none" (SFT, DPO), "generate" (the policy's), "vllm" (colocate)
    generated_sequences: int = 0  # completions one GPU samples at once (generate)
    generation_tokens: int = 0  # prompt + completion tokens of each (generate)
    vllm_bytes: float = 0  # the vLLM engine's share of the GPU (vllm)
    reshard_after_forward: bool = True  # False: FSDP2 reshard_after_forward false / FSDP1 SHARD_GRAD_OP
    quant_bytes: float = 0  # QLoRA: bytes per 4-bit parameter of the sharded storage (0.5), 0 without
    scale_bytes: float = 0  # its scales per parameter, whole on every rank
    checkpoint_offload: bool = False  # the checkpointed layers' inputs in host memory (speed/checkpoint_offload.py)
    full_logits: bool = False  # the loss from the full logits, not the chunked head's tiles (speed/chunked_loss.py)
    cp: int = 1  # context parallel: each row's tokens split over cp ranks (config/mesh.py)
    tp: int = 1  # tensor parallel: each layer's weights and heads split over tp ranks

    @property
    def local_tokens(self) -> float:
        """Tokens of the micro-batch one GPU holds: its cp share of the rows."""
        return self.tokens / self.cp


def shape_of(model, model_args, **decided) -> ModelShape:
    """Parameter counts and widths of `model` (a meta-device copy), with the recipe's LoRA applied on paper.
    `decided`: the fields the speed options decide (speed.planner_shape: the 4-bit weights)."""
    import torch

    cfg = model.config
    hd = decoder.head_dim(cfg)
    prefix, layers = decoder.layers(model)  # "model.layers" (Llama), "gpt_neox.layers", "transformer.h", ...

    def layer_of(name: str) -> tuple[int | None, str]:
        """(the decoder layer `name` is in, or None outside them; its name inside the layer)."""
        if not name.startswith(prefix + "."):
            return None, name
        index, _, rest = name[len(prefix) + 1:].partition(".")
        return int(index), rest

    n = len(layers)
    base = [sum(p.numel() for p in layer.parameters()) for layer in layers]
    total = sum(p.numel() for p in model.parameters())
    # per layer: LoRA's parameters and the widths its activations take (dropout's inputs, r per target, the inputs,
    # those of the linears tp splits on their input, the adapter elements tp splits), the merged copy's elements
    lora, dropout_width, rank_width, input_width, split_input_width, split_params, merged = (
        [0] * n for _ in range(7))
    lora_other, saved = 0, 0
    # transformers' tp plan of the model ("layers.*.self_attn.o_proj": "rowwise"): a rowwise linear's input is split;
    # its keys are named from the base model (model.model, model.gpt_neox): the layers' list as it names it
    tp_plan = getattr(cfg, "base_model_tp_plan", None) or {}
    tp_prefix = prefix.removeprefix(getattr(model, "base_model_prefix", "") + ".") + ".*."
    if model_args.use_peft:
        from transformers.pytorch_utils import Conv1D

        targets = model_args.lora_target_modules
        head = model.get_output_embeddings()  # PEFT's all-linear leaves it out, whatever its name
        for name, module in model.named_modules():
            leaf = name.rsplit(".", 1)[-1]
            # PEFT's linear layers: torch's Linear, GPT-2's Conv1D (its weight stored (in, out))
            hit = isinstance(module, (torch.nn.Linear, Conv1D)) and (
                targets == "all-linear" and module is not head or isinstance(targets, list) and leaf in targets)
            if hit:
                fan_in, fan_out = (module.weight.shape if isinstance(module, Conv1D) else
                                   (module.in_features, module.out_features))
                adapter = model_args.lora_r * (fan_in + fan_out)
                i, inner = layer_of(name)
                if i is not None:
                    lora[i] += adapter
                    dropout_width[i] += fan_in if model_args.lora_dropout else 0
                    rank_width[i] += model_args.lora_r
                    input_width[i] += fan_in
                    planned = tp_plan.get(tp_prefix + inner, "")
                    split_input_width[i] += fan_in if "rowwise" in planned else 0
                    split_params[i] += model_args.lora_r * (fan_in if "rowwise" in planned else
                                                            fan_out if "colwise" in planned else 0)
                else:
                    lora_other += adapter
            if leaf in (model_args.lora_modules_to_save or []):
                saved += sum(p.numel() for p in module.parameters())
        # LoRA on parameters (PEFT's target_parameters, TRL's lora_target_parameters: a mixture's fused 3-D experts):
        # PEFT's ParamWrapper reads a (experts, in, out) tensor, or (out, in), and keeps A (r x experts, in) and
        # B (out, r x experts). It adds the merged weight to the forward instead of an r-wide activation per token:
        # that copy, the targeted tensors of a layer, is budget()'s lora_merged_copies.
        wanted = list(getattr(model_args, "lora_target_parameters", None) or [])
        for name, param in model.named_parameters() if wanted else ():
            if any(name == t or name.endswith("." + t) for t in wanted):
                experts, fan_in, fan_out = param.shape if param.dim() == 3 else (1, param.shape[1], param.shape[0])
                adapter = model_args.lora_r * experts * (fan_in + fan_out)
                i, _ = layer_of(name)
                if i is not None:
                    lora[i] += adapter
                    merged[i] += param.numel()
                else:
                    lora_other += adapter
        trainable = sum(lora) + lora_other + saved
    else:
        trainable = total
    params = total + (trainable if model_args.use_peft else 0)
    # the layer budget() counts for each: the largest (every layer alike in Llama; Jamba's attention or Mamba ones)
    at = max(range(n), key=lambda i: base[i] + lora[i])
    layer_params = base[at] + lora[at]
    if merged[at]:
        decided["merged_copy"] = decided.get("merged_copy", 0) + merged[at]
    # Qwen3's q_norm / k_norm (each query and key head normalized over head_dim): rows a token has, by their widths
    attention = getattr(layers[at], "self_attn", None)
    q_norm, k_norm = (getattr(attention, name, None) for name in ("q_norm", "k_norm"))
    if q_norm is not None and k_norm is not None:
        decided["head_norm_rows"] = (decoder.heads(cfg) * hd // q_norm.weight.numel()
                                     + decoder.kv_heads(cfg) * hd // k_norm.weight.numel())
    moe = flops.experts_of(cfg)  # (top_k, experts): the experts' weights are named mlp.experts.* (flops.is_expert_param)
    if moe:
        decided.update(top_k=moe[0], experts=moe[1], expert_params=sum(
            p.numel() for name, p in model.named_parameters() if flops.is_expert_param(name)))
    # one expert's width: Qwen3-MoE's intermediate_size is its dense MLP's (unused where every layer is sparse)
    intermediate = getattr(cfg, "moe_intermediate_size", None) if moe else None
    return ModelShape(
        params=params, trainable=trainable, layers=n, hidden=cfg.hidden_size,
        q_dim=decoder.heads(cfg) * hd, kv_dim=decoder.kv_heads(cfg) * hd,
        intermediate=intermediate or decoder.intermediate(cfg), vocab=cfg.vocab_size, layer_params=layer_params,
        layer_trainable=lora[at] if model_args.use_peft else base[at],
        root_params=params - sum(base) - sum(lora), lora_dropout_width=dropout_width[at],
        lora_rank_width=rank_width[at], lora_input_width=input_width[at],
        lora_split_input_width=split_input_width[at], lora_split_params=split_params[at],
        norms_trained=not model_args.use_peft,
        embedding=model.get_input_embeddings().weight.numel(), tied=bool(getattr(cfg, "tie_word_embeddings", False)),
        **decided,
    )


def head_norms_per_layer(m: ModelShape, s: Setup) -> float:
    """Qwen3's q_norm and k_norm (docstring, measured): each keeps its fp32 input and per-row rsqrt, and trained its
    c-wide normalized input, over the q and kv heads: split by tp with them."""
    if not m.head_norm_rows:
        return 0
    trained = s.compute_bytes if m.norms_trained else 0
    return ((4 + trained) * (m.q_dim + m.kv_dim) + 4 * m.head_norm_rows) / s.tp


def activations_per_token_per_layer(m: ModelShape, s: Setup) -> float:
    """Bytes one token leaves in one layer; under tp the head- and MLP-wide tensors are split over the tp ranks
    (transformers' tp_plan: q, k, v, gate, up column-wise), the norms' hidden-wide ones are not."""
    if lora_adapters_under_autocast(m, s):
        return lora_under_tp_per_layer(m, s) + head_norms_per_layer(m, s)
    c = s.compute_bytes
    norms = 2 * m.hidden * (4 + c + (c if m.norms_trained else 0))  # + a trained weight's normalized input
    if wide_weights_under_autocast(s):  # the fp32 residual stream (docstring): each norm keeps its fp32 input and
        # its fp32 normalized tensor (the trained weight's multiply), and autocast casts its output to c once for each
        # projection that reads it (q, k, v; gate, up): 5 h-wide copies, none split by tp (a dense layer's count)
        norms = 2 * m.hidden * 2 * residual_bytes(s) + 5 * c * m.hidden
    # dense: gate, up, SiLU(gate), product; a mixture of experts: those, the routed input and output and the routing
    # weight per route, the block's input (the router's), the router's fp32 probabilities and the routes' int64 indices
    mlp, routing = 4 * m.intermediate, 0
    if m.experts:
        mlp = m.top_k * (4 * m.intermediate + 2 * m.hidden + 1) + m.hidden
        routing = 4 * m.experts + 32 * m.top_k
    saved = c * (2 * m.q_dim + 2 * m.kv_dim + mlp + m.lora_rank_width) / s.tp
    return norms + saved + routing + (c + 1) * m.lora_dropout_width + head_norms_per_layer(m, s)


def checkpoint_inputs(m: ModelShape, s: Setup) -> float:
    """Bytes per token the checkpointed layers save (each one's input, and its attention output under ops)."""
    if not s.checkpointed:
        return 0
    kept = m.layers // s.checkpoint_every + (1 if m.layers % s.checkpoint_every else 0)  # layers 0, k, 2k, ...
    return kept * (m.hidden * residual_bytes(s) + (m.q_dim * s.compute_bytes / s.tp if s.checkpoint_ops else 0))


def layer_activations(m: ModelShape, s: Setup, per_layer: float) -> float:
    """Bytes per token the decoder layers hold on the GPU at the backward's start, under the checkpointing policy;
    offloaded, the checkpointed layers' inputs are in host memory instead (host_bytes), but for the one being
    recomputed, brought back (its input, inside per_layer's count)."""
    if not s.checkpointed:
        return m.layers * per_layer
    kept = m.layers // s.checkpoint_every + (1 if m.layers % s.checkpoint_every else 0)
    saved = 0 if s.checkpoint_offload else checkpoint_inputs(m, s)
    return saved + (m.layers - kept) * per_layer + per_layer


def host_bytes(m: ModelShape, s: Setup) -> int:
    """Pinned host memory per GPU's process: the offloaded checkpoint inputs of its tokens."""
    return int(math.ceil(s.local_tokens * checkpoint_inputs(m, s))) if s.checkpoint_offload else 0


def logits(m: ModelShape, s: Setup) -> float:
    """The loss's logits on one GPU: the chunked head's one fp32 tile (at most 4,096 tokens x 32,768 entries), or
    the full logits at the compute width plus the fp32 log-softmax the label smoother keeps and its gradient."""
    if s.full_logits:
        return s.local_tokens * m.vocab * (s.compute_bytes + 4 + 4)
    return min(s.local_tokens, 4096) * min(m.vocab, LM_HEAD_TILE) * 4


def budget(m: ModelShape, s: Setup) -> dict[str, int]:
    """Bytes per GPU, by component."""
    # trainable parameters' storage dtype: fp32 under mixed precision (accelerate upcasts them), except a 4-bit
    # model's adapters, which TRL keeps in bf16 (QLoRA paper; trl SFTTrainer) and accelerate then leaves alone
    # (accelerate 1.15 utils/fsdp_utils.py skips the upcast for a quantized model); AdamW's moments follow them
    # a mesh: FSDP shards over dp_shard x cp (accelerate's dp_shard_cp), tp splits every layer's weights further
    shard = s.shard * s.tp
    master = 2 if s.quant_bytes else (4 if s.mixed_precision else s.load_bytes)
    frozen = m.params - m.trainable
    packed = m.quantized * s.quant_bytes if s.quant_bytes else 0  # QLoRA: the 4-bit base, sharded
    full = m.quantized if s.quant_bytes else 0
    weights = ((frozen - full) * s.load_bytes + packed + m.trainable * master) / shard + full * s.scale_bytes
    gradients = m.trainable * master / shard
    optimizer = m.trainable * s.optimizer_bytes * (master / 4 if s.quant_bytes else 1) / shard
    per_layer = activations_per_token_per_layer(m, s)
    tokens = s.local_tokens  # context parallel: a GPU holds its share of each row's tokens
    activations = tokens * layer_activations(m, s, per_layer)
    # the fused head's backward accumulates in fp32: the hidden states' gradient, and the head's when it trains
    head_grads = tokens * m.hidden * 4 + (m.vocab * m.hidden * 4 / s.tp if m.trainable == m.params else 0)
    # + the final norm's (docstring: 4h + 2ch trained, 4h + ch frozen; tp with fp32 weights: fp32 ones, a cast)
    final_norm = m.hidden * (4 * 2 + s.compute_bytes if wide_weights_under_autocast(s) else
                             4 + (2 if m.norms_trained else 1) * s.compute_bytes)
    activations += tokens * final_norm + logits(m, s) + head_grads
    # FSDP gathers at the compute width, but under tp at the weights' own (no mixed-precision policy: docstring)
    gather = s.load_bytes if wide_weights_under_autocast(s) else s.compute_bytes
    if s.strategy in ("FSDP", "HSDP"):
        gathered = (2 * m.layer_params + m.root_params) if s.reshard_after_forward else m.params
        four_bit = (2 * m.layer_quantized if s.reshard_after_forward else m.quantized) if s.quant_bytes else 0
        comm = ((gathered - four_bit) * gather + four_bit * s.quant_bytes + m.layer_trainable * master) / s.tp
    elif s.strategy == "DDP":
        comm = m.trainable * master
    else:
        comm = 0
    parts = {
        "weights": weights, "gradients": gradients, "optimizer_states": optimizer,
        "activations": activations, "communication_buffers": comm, "runtime": s.runtime_bytes,
    }
    if s.reference != "none":
        reference = 0
        if s.reference == "copy":
            reference = m.params * s.load_bytes / shard
            if s.strategy in ("FSDP", "HSDP"):
                reference += (2 * m.layer_params + m.root_params) * gather / s.tp
        parts["reference_model"] = reference
    if m.merged_copy:  # PEFT's ParamWrapper: each layer's merged copy of its LoRA-targeted tensors (docstring)
        copies = m.layers + 1
        if s.checkpointed:  # layers 0, k, 2k, ... (layer_activations)
            copies = m.layers - (m.layers // s.checkpoint_every + bool(m.layers % s.checkpoint_every)) + 2
        parts["lora_merged_copies"] = copies * m.merged_copy * s.compute_bytes
    if s.quant_bytes:  # bitsandbytes dequantises one linear at a time for its matmul
        parts["dequantised_working_copy"] = m.largest_quantized * s.compute_bytes
    if s.generation == "generate":  # the KV cache of every completion sampled at once, and one step's fp32 logits
        parts["generation_kv_cache"] = (s.generated_sequences * (s.generation_tokens * m.layers * 2 * m.kv_dim
                                                                 * s.compute_bytes + m.vocab * 4))
    elif s.generation == "vllm":  # the engine's weights and KV cache, in the GPU share it is given
        parts["vllm_engine"] = s.vllm_bytes
    copies = m.layers  # autocast's cache holds every layer's cast to the forward's end, checkpointed too (docstring)
    if wide_weights_under_autocast(s):  # autocast's kept copies of the weights (docstring)
        parts["tp_autocast_weight_copies"] = ((copies * (m.layer_params - 2 * m.hidden) + m.vocab * m.hidden)
                                              * s.compute_bytes / s.tp)
    elif lora_adapters_under_autocast(m, s):  # of the fp32 adapters alone, on one tp rank (docstring)
        adapters = m.layer_trainable - m.lora_split_params * (1 - 1 / s.tp)
        parts["tp_autocast_weight_copies"] = copies * adapters * s.compute_bytes
    if s.cp > 1:  # ring attention: a layer's K and V chunks, the one computed on and the one arriving
        parts["cp_ring_buffers"] = 2 * 2 * tokens * m.kv_dim / s.tp * s.compute_bytes
    parts = {k: int(math.ceil(v)) for k, v in parts.items()}
    parts["total"] = sum(parts.values())
    return parts
