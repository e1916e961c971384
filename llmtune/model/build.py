"""Build the model in one order: meta device -> the features' build (model.quantize's 4-bit base among them) -> frozen
weights to bf16/fp16 (under either; the quantized ones keep their form) -> activation checkpointing -> (compile) ->
fully_shard per decoder layer, then the root -> materialise -> load the weights, each rank reading only its own
shard (of a quantized weight: the whole, one at a time) -> the features' weights_ready (the values of what they
added).

No rank ever holds the full pretrained model. A model trained from a config is the exception: its
random initialisation is done whole on every rank (with the same seed) and then sharded, so that
the initial weights do not depend on the number of ranks.
"""

import copy
import dataclasses
import hashlib
import json
import logging
from contextlib import contextmanager
from pathlib import Path

import torch
from accelerate import init_empty_weights
from torch import Tensor, nn
from torch.utils import _pytree as pytree
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard, register_fsdp_forward_method
from transformers import (AutoConfig, AutoModelForCausalLM, AutoModelForImageTextToText,
                          AutoModelForSequenceClassification, GenerationConfig, PreTrainedModel)

from llmtune.errors import UserError
from llmtune.model.attention import backend_problems, resolve_backend
from llmtune.model.checkpointing import enable_checkpointing
from llmtune.model.expert_parallel import split_experts
from llmtune.model.loss import IGNORE_INDEX, LossOptions, cross_entropy_sum, token_logps
from llmtune.model import multimodal
from llmtune.model.multimodal import text_attention
from llmtune.tasks.registry import LM_HEAD, SCORE_HEAD
from llmtune.model.pretrained import checkpoint_index, load_weights, weight_sources
from llmtune.model.quantize import is_quantized
from llmtune.model.state import saved_tensors
from llmtune.model.tensor_parallel import whole_tokens

log = logging.getLogger(__name__)
# The compute dtypes below fp32 (TrainConfig.half_precision): FSDP2 gathers the weights in them for compute.
HALF_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}


# The score head of transformers' sequence classifiers (every family's ...ForSequenceClassification names it so).
SCORE = "score"


class CausalLMForTraining(nn.Module):
    """The FSDP root around an unmodified HF causal LM, or its family's sequence classifier (rm: sequence_scores).

    Its forward runs the decoder and then the loss from the last hidden states and the lm_head
    weight, plus the features' loss terms. Being the root, FSDP has unsharded the embeddings and
    lm_head exactly where the loss needs them, and the HF model class is never edited. sequence_logps
    (preference training) is a second forward method: build_model registers it with FSDP.

    `features`: the run's Features (features/base.py), passed in rather than imported: the features are the layer
    above the model, they build on it.
    """

    attention: str | None = None  # the attention backend the model resolved, set by build_model

    def __init__(self, hf_model: PreTrainedModel, loss_options: LossOptions, features):
        super().__init__()
        self.hf_model = hf_model
        self.loss_options = loss_options
        self.features = features

    def forward(self, input_ids, attention_mask=None, position_ids=None, shift_labels=None, labelled=None,
                **model_kwargs):
        """Summed loss over the labelled tokens (the lm_head never runs on the whole sequence), or the
        logits, as the HF model gives them, when no labels are given. labelled: the labelled tokens' flat indices
        (loss.labelled_positions), None: found here. model_kwargs reach the decoder and, through it, the attention
        function of every layer (context parallelism's full_position_ids)."""
        outputs = self._decode(input_ids, attention_mask, position_ids, model_kwargs)
        head = self.hf_model.get_output_embeddings()
        if shift_labels is None:
            logits = head(outputs.last_hidden_state)
            cap = self.loss_options.logit_softcap
            return cap * torch.tanh(logits / cap) if cap else logits
        loss = cross_entropy_sum(outputs.last_hidden_state, head.weight, head.bias, shift_labels, self.loss_options,
                                 labelled)
        inputs = dict(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                      shift_labels=shift_labels, **model_kwargs)
        return sum(self.features.loss_terms(outputs, inputs), loss)

    def sequence_logps(self, input_ids, attention_mask=None, position_ids=None, shift_labels=None, labelled=None,
                       sequence_ids=None, sequences: int = 0, **model_kwargs) -> tuple[Tensor, Tensor, Tensor]:
        """For the sequences packed in the micro-batch's rows: (the sum of each one's labelled tokens'
        log-probabilities, fp32 [sequences]; the count of its labelled tokens, fp32 [sequences]; the features' loss
        terms summed, a scalar, 0 when none), from the same decoder and LossOptions as forward, never the whole
        [tokens, vocab] logits.

        sequence_ids [b, S]: the index in the micro-batch of each token's sequence, -1 for padding (it never reaches
        the decoder); None: each row is one sequence. sequences: how many there are, 0: as many as the ids name (which
        reads them on the host)."""
        logps, _, terms = self._labelled_logps(input_ids, attention_mask, position_ids, shift_labels, labelled,
                                               sequence_ids, self.loss_options, False, model_kwargs)
        if sequence_ids is None:
            sequence_ids = torch.arange(len(input_ids), device=input_ids.device)[:, None].expand(input_ids.shape)
        sequences = sequences or int(sequence_ids.max()) + 1
        # Every token added to its sequence, the uncounted ones as 0 (padding to sequence 0): selecting the counted
        # ones would make a tensor sized by the values, which the host would wait for.
        counted = ((shift_labels != IGNORE_INDEX) & (sequence_ids >= 0)).flatten()
        owners = sequence_ids.flatten().clamp(min=0)
        sums = logps.new_zeros(sequences).index_add(0, owners, logps.flatten().where(counted, 0.0))
        counts = logps.new_zeros(sequences).index_add(0, owners, counted.to(logps.dtype))
        return sums, counts, terms

    def token_logps(self, input_ids, attention_mask=None, position_ids=None, shift_labels=None, labelled=None,
                    sequence_ids=None, temperature: float = 1.0, with_entropy: bool = False,
                    **model_kwargs) -> tuple[Tensor, Tensor | None, Tensor]:
        """(each labelled token's log-probability at `temperature` (its logits divided by it), fp32 [b, S], 0.0
        elsewhere; with_entropy: its distribution's entropy there, without gradient, else None; the features' loss
        terms summed), from the same decoder and LossOptions as forward (grpo's per-token ratios). A third forward
        method, registered with FSDP."""
        options = dataclasses.replace(self.loss_options, temperature=temperature)
        logps, entropy, terms = self._labelled_logps(input_ids, attention_mask, position_ids, shift_labels, labelled,
                                                     sequence_ids, options, with_entropy, model_kwargs)
        # Cloned (a [b, S] copy): the values are a view of the flat per-token ones, and FSDP warns of a view returned
        # by a forward method, on which an in-place op would skip its pre-backward hook.
        return logps.clone(), entropy, terms

    def _labelled_logps(self, input_ids, attention_mask, position_ids, shift_labels, labelled, sequence_ids,
                        options: LossOptions, with_entropy: bool, model_kwargs: dict):
        """The one decoder call of sequence_logps and token_logps: (per-token log-probabilities, entropies or None,
        the features' loss terms)."""
        outputs = self._decode(input_ids, attention_mask, position_ids, model_kwargs)
        head = self.hf_model.get_output_embeddings()
        found = token_logps(outputs.last_hidden_state, head.weight, head.bias, shift_labels, options, labelled,
                            with_entropy)
        logps, entropy = found if with_entropy else (found, None)
        inputs = dict(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                      shift_labels=shift_labels, sequence_ids=sequence_ids, **model_kwargs)
        return logps, entropy, sum(self.features.loss_terms(outputs, inputs), logps.new_zeros(()))

    def sequence_scores(self, input_ids, attention_mask=None, position_ids=None, shift_labels=None, labelled=None,
                        sequence_ids=None, scored=None, sequences: int = 0, **model_kwargs) -> tuple[Tensor, Tensor]:
        """A sequence classifier's (one label) scores of the sequences packed in the micro-batch's rows: (each one's
        score, the score head on the hidden state of its token marked 1 in `scored` [b, S] (collate.score_marks: its
        last that is not the pad id, as the classifier's own forward reads it), fp32 [sequences], 0 for a sequence
        whose mark another cp peer holds; the features' loss terms summed, a scalar). The head runs on every token
        ([b, S, 1], a dot product each) and the marked ones are summed by sequence: no index sized by the values,
        which the host would wait for. A fourth forward method, registered with FSDP."""
        outputs = self._decode(input_ids, attention_mask, position_ids, model_kwargs)
        token_scores = self.hf_model.get_submodule(SCORE)(whole_tokens(outputs.last_hidden_state)).float().squeeze(-1)
        marks = scored.to(token_scores.dtype) * (sequence_ids >= 0)
        # A filler micro-batch (MicroBatch.emptied) has no sequence: one slot, dropped, takes its zeros. Cloned: FSDP
        # warns of a view returned by a forward method.
        sums = token_scores.new_zeros(max(sequences, 1)).index_add(
            0, sequence_ids.flatten().clamp(min=0), (token_scores * marks).flatten())[:sequences].clone()
        inputs = dict(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                      shift_labels=shift_labels, sequence_ids=sequence_ids, **model_kwargs)
        return sums, sum(self.features.loss_terms(outputs, inputs), token_scores.new_zeros(()))

    def generate(self, **kwargs) -> Tensor:
        """transformers' generate of the HF model, a forward method of the FSDP root (registered in build_model), so
        that the root's own weights (embeddings, lm_head) are gathered around it (generation/engine.py)."""
        return self.hf_model.generate(**kwargs)

    def prefill(self, **kwargs) -> None:
        """The decoder over prompts, filling the KV cache in kwargs (generation/engine.py's prefill shared by a
        prompt's samples): a forward method of the FSDP root, like generate."""
        self.hf_model.get_decoder()(**kwargs)

    def _decode(self, input_ids, attention_mask, position_ids, model_kwargs: dict):
        """The decoder's outputs, the one call of it for forward and sequence_logps (a vision-language model's: its
        images encoded first, model/multimodal.py)."""
        if multimodal.is_multimodal(self.hf_model.config):
            return multimodal.decode(self.hf_model, input_ids, attention_mask, position_ids, model_kwargs)
        return self.hf_model.get_decoder()(
            input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids, use_cache=False,
            **model_kwargs
        )


def load_model_config(model_cfg, head: str = LM_HEAD, pad_id: int | None = None):
    """The HF config of the model the run trains, for a task whose model ends in `head` (tasks/registry.py): a causal
    LM's, or for SCORE_HEAD its family's sequence classifier's with one label (num_labels 1, its class named in
    architectures: what the run builds and exports). pad_id: the tokenizer's pad token, which a classifier's
    forward reads to find each sequence's last token (TRL's RewardTrainer sets it so), where known."""
    name = model_cfg.name_or_path or model_cfg.config
    config = AutoConfig.from_pretrained(name, trust_remote_code=model_cfg.trust_remote_code)
    if head == LM_HEAD:
        if is_classifier(config):
            raise UserError(f"model.name_or_path: {name} is a sequence classifier ({config.architectures[0]}), "
                            "which scores sequences and generates no text; name a causal LM's folder")
        return config
    classifier = AutoModelForSequenceClassification._model_mapping.get(type(config), None)
    if classifier is None:
        raise UserError(f"model: transformers has no sequence classifier for {type(config).__name__} "
                        f"(model_type {config.model_type}), so it cannot be trained as a reward model; use a model of "
                        "a family that has one (docs/models.md)")
    if is_classifier(config) and config.num_labels != 1:
        raise UserError(f"model.name_or_path: {name} is a classifier of {config.num_labels} labels; a reward model "
                        "has one (its score): start from a causal LM or a reward model's folder")
    config.num_labels, config.architectures = 1, [classifier.__name__]
    if pad_id is not None:
        config.pad_token_id = pad_id
    return config


def is_classifier(model_config) -> bool:
    """Whether the config is a sequence classifier's (its architectures name ...ForSequenceClassification)."""
    return any(name.endswith("ForSequenceClassification") for name in model_config.architectures or ())


def auto_class(model_config):
    """transformers' auto class of the config's model: its sequence classifier, a vision-language model's
    image-text-to-text class (the whole model: its export is the model the user brought), or its causal LM."""
    if is_classifier(model_config):
        return AutoModelForSequenceClassification
    return AutoModelForImageTextToText if multimodal.is_multimodal(model_config) else AutoModelForCausalLM


def generation_defaults(hf_model: PreTrainedModel) -> GenerationConfig | None:
    """The model's sampling defaults (generation_config.json), None for a sequence classifier, which generates
    nothing."""
    return getattr(hf_model, "generation_config", None)


def output_head(hf_model: PreTrainedModel) -> nn.Module:
    """The layer the model ends in: a causal LM's lm_head, a sequence classifier's score head."""
    return hf_model.get_submodule(SCORE) if is_classifier(hf_model.config) else hf_model.get_output_embeddings()


def new_head(hf_model: PreTrainedModel, tensors: dict) -> set[str]:
    """The score head's tensors of a sequence classifier started from a causal LM's folder, whose checkpoint has
    none: they take transformers' initialisation (pretrained.fresh_value, seeded by name: the same for any number of
    ranks). Empty for a causal LM. `tensors`: the model's, as pretrained.load_weights takes them."""
    if not is_classifier(hf_model.config):
        return set()
    return {name for name in tensors if name.startswith(SCORE + ".")}


def meta_model(model_config, model_cfg, **kwargs) -> PreTrainedModel:
    """The model of `model_config` with its parameters on the meta device (no memory): for checks of its shapes and
    names before anything is built."""
    with torch.device("meta"):
        return auto_class(model_config).from_config(model_config, trust_remote_code=model_cfg.trust_remote_code,
                                                    **kwargs)


def check_model(model_cfg, train_cfg, model_config) -> None:
    """The model is built once on the meta device (no memory), before any process starts, so that what would
    otherwise stop every rank with a traceback stops the CLI with one line: a config with no causal LM class, a
    backend the recipe names that this machine or the class cannot run (a CUDA-only backend on CPU, a missing
    package; what transformers judges for the class), a class with no decoder
    layer to shard; and, for a pretrained folder, weights it lacks or stores in a layout llmtune cannot convert
    rank by rank (their headers are read, not their data), or quantized weights."""
    quantization = getattr(model_config, "quantization_config", None)
    if model_cfg.name_or_path and quantization:
        method = quantization.get("quant_method") if isinstance(quantization, dict) else quantization
        raise UserError(f"model.name_or_path: {model_cfg.name_or_path} holds quantized weights ({method}); llmtune "
                        "trains from bf16 or fp32 weights: use a dequantized copy of the checkpoint (e.g. loaded with "
                        "from_pretrained and saved with save_pretrained)")
    cuda = torch.cuda.is_available()
    problems = backend_problems(model_cfg.attn_implementation, cuda, train_cfg.half_precision() is not None)
    if problems:
        raise UserError("\n".join(problems))
    backend = resolve_backend(model_cfg.attn_implementation, model_config, cuda, train_cfg.half_precision() is not None)
    try:
        hf_model = meta_model(model_config, model_cfg, attn_implementation=backend)
    except (ValueError, ImportError) as err:
        reason = str(err).split(". ")[0].strip().rstrip(".")
        if backend is None:
            raise UserError(f"model: transformers cannot build a causal LM from this config ({reason})") from None
        raise UserError(f"model.attn_implementation: {backend} cannot run this model ({reason}); set "
                        "model.attn_implementation to auto, which picks a backend the model supports") from None
    decoder_layers(hf_model)
    if model_cfg.name_or_path:
        tensors = saved_tensors(hf_model)
        weight_sources(hf_model, Path(model_cfg.name_or_path), tensors, model_cfg.strict_load,
                       new_head(hf_model, tensors))


def check_vocab(config, tokenizer) -> None:
    vocab_size = config.get_text_config().vocab_size
    if len(tokenizer) > vocab_size:
        raise UserError(f"model.tokenizer: the model's vocabulary ({vocab_size}) is smaller than the "
                        f"tokenizer's ({len(tokenizer)}); use a matching model config or tokenizer")


def decoder_layers(hf_model: PreTrainedModel) -> list[nn.Module]:
    names = set(hf_model._no_split_modules or ())
    # Sharded, a layer's class is FSDP's subclass of its own.
    layers = [m for m in hf_model.modules() if any(cls.__name__ in names for cls in type(m).__mro__)]
    if not layers:
        raise UserError(f"model: {type(hf_model).__name__} declares no decoder layer class "
                        "(_no_split_modules), so it cannot be sharded layer by layer")
    return layers


def build_model(model_config, model_cfg, train_cfg, state, features) -> CausalLMForTraining:
    """`model_config`: the HF config (load_model_config); `features`: the run's Features, which change the model before
    it is sharded."""
    config = copy.deepcopy(model_config)  # the model keeps and changes its config (its attention implementation)
    half = train_cfg.half_precision()
    backend = resolve_backend(model_cfg.attn_implementation, config, state.device.type == "cuda", half is not None)
    kwargs = dict(attn_implementation=backend, trust_remote_code=model_cfg.trust_remote_code, dtype=torch.float32)
    pretrained = model_cfg.name_or_path is not None
    if pretrained:
        # Parameters on the meta device; buffers (e.g. RoPE frequencies) computed for real, they are small.
        with init_empty_weights(include_buffers=False):
            hf_model = auto_class(config).from_config(config, **kwargs)
        # from_config leaves meta parameters untied: tie them, so a tied lm_head is the embedding itself.
        hf_model.tie_weights()
        # The folder's sampling defaults (generation/engine.py's, and the export's generation_config.json), where
        # from_config made them from config.json alone.
        if (Path(model_cfg.name_or_path) / "generation_config.json").is_file() and not is_classifier(config):
            hf_model.generation_config = GenerationConfig.from_pretrained(model_cfg.name_or_path)
    else:
        torch.manual_seed(train_cfg.seed)
        hf_model = auto_class(config).from_config(config, **kwargs)
    # transformers' pick where the recipe says auto, before a feature wraps it in its own (the start banner's).
    attention = text_attention(hf_model)
    features.build(hf_model, state)
    if half:
        # Frozen weights (an adapter run's base) are never updated, so they need no fp32 master copy: stored in the
        # compute dtype they compute exactly as their fp32 copy cast to it would, in half the memory.
        for param in hf_model.parameters():
            if not param.requires_grad and not is_quantized(param):
                param.data = param.data.to(HALF_DTYPES[half])
    if train_cfg.checkpointing() != "none":
        enable_checkpointing(hf_model, train_cfg.checkpointing())
    layers = decoder_layers(hf_model)
    if train_cfg.compile:
        for layer in layers:
            compile_layer(layer)
    module = CausalLMForTraining(hf_model, LossOptions.of_run(train_cfg, config), features)
    module.attention = attention
    policy = MixedPrecisionPolicy(param_dtype=HALF_DTYPES[half], reduce_dtype=torch.float32) if half \
        else MixedPrecisionPolicy()
    # Where a copy is sharded over one rank, FSDP2 skips the all-gather and copies only the first tensor a tensor
    # subclass gathers (pytorch/pytorch#197999), where NF4 gathers three: quantized weights stay outside FSDP2 there,
    # which would have nothing to shard anyway.
    alone = {p for p in hf_model.parameters() if is_quantized(p)} if state.shard_size == 1 else None
    options = {**state.shard_options(), "ignored_params": alone}
    # The last layer keeps its weights gathered after its forward, as torchtitan's default policy has it: its
    # backward comes next and would gather them again at once.
    last, kept = set(layers[-1].modules()), {"reshard_after_forward": False}
    for experts in split_experts(hf_model):
        # Experts split over ep ranks (parallel.expert_parallel) are sharded over the data-parallel ranks left
        # (efsdp), before their layer takes the rest of it over every rank.
        fully_shard(experts, mp_policy=policy,
                    **{**options, **state.shard_options(experts=True), **(kept if experts in last else {})})
        # An expert's gradient holds the tokens the ep ranks sent it, those of every data-parallel rank: averaged
        # over all of them (not over tp peers, whose tokens are parts of one micro-batch), as a dense weight's is,
        # not over its efsdp ranks alone. Where a reduce-scatter runs,
        # summed and then divided, since gloo lacks the premultiplied sum another factor would use; over one efsdp
        # rank FSDP2 divides its copy of the gradient by the factor, and would divide it again after a summed
        # reduction.
        experts.set_gradient_divide_factor(state.fsdp_group_size)
        experts.set_force_sum_reduction_for_comms(state.expert_mesh["efsdp"].size() > 1)
    for layer in layers:
        fully_shard(layer, mp_policy=policy, **{**options, **(kept if layer is layers[-1] else {})})
    # The root (embeddings, lm_head) keeps FSDP2's own choice: gathered from forward to backward, which needs it first.
    fully_shard(module, mp_policy=policy, **{**options, "reshard_after_forward": None})
    prefetch(layers, state.parallel.prefetch_layers)
    # FSDP unshards the root's own parameters (embeddings, lm_head) around `forward` alone.
    register_fsdp_forward_method(module, "sequence_logps")
    register_fsdp_forward_method(module, "token_logps")
    register_fsdp_forward_method(module, "sequence_scores")
    register_fsdp_forward_method(module, "generate")
    register_fsdp_forward_method(module, "prefill")
    if pretrained:
        buffers = {name: buffer.clone() for name, buffer in module.named_buffers()}
        module.to_empty(device=state.parameter_device)
        for name, buffer in module.named_buffers():
            buffer.copy_(buffers[name])
        tensors = features.pretrained_tensors(hf_model)
        left_out = load_weights(hf_model, Path(model_cfg.name_or_path), tensors, model_cfg.strict_load,
                                train_cfg.seed, new_head(hf_model, tensors))
        if left_out and state.is_main:
            log.warning("model.strict_load false: the load of %s left out %s; the model's tensors among them keep "
                        "their fresh initialisation, the others are ignored", model_cfg.name_or_path, left_out)
    else:
        module.to(state.parameter_device)
    features.weights_ready(hf_model)
    return module


def compile_layer(layer: nn.Module) -> None:
    """torch.compile the decoder layer (Module.compile, as torchtitan compiles each block) with the batch and
    sequence sizes of its inputs symbolic from the first compile: packed rows change length from one micro-batch to
    the next, and a second length would compile every layer again before torch.compile made the size dynamic
    itself. Only those two: every other size (heads, head dim, hidden) stays a number, which inductor needs to
    vectorise; with all sizes symbolic (dynamic=True) the layers' transposes in backward ran 4-20x slower on CPU."""
    layer.compile()
    layer.register_forward_pre_hook(_rows_dynamic, with_kwargs=True)


@torch.compiler.disable
def _rows_dynamic(module, args, kwargs) -> None:
    """Mark the first two sizes of every tensor a layer takes dynamic. A forward pre-hook: Module.compile's
    __call__ runs the hooks as frames of their own, outside the layer's graph, and this one is left uncompiled
    (marks are made before tracing). It runs after FSDP2's own pre-hook (prepended), which passes the inputs that
    need gradients through an autograd function: new tensors, which marks made before it would miss."""
    for tensor in pytree.tree_leaves((args, kwargs)):
        if isinstance(tensor, Tensor):
            for dim in range(min(tensor.ndim, 2)):
                torch._dynamo.maybe_mark_dynamic(tensor, dim)


def prefetch(layers: list[nn.Module], depth: int) -> None:
    """parallel.prefetch_layers: each sharded decoder layer gathers the weights of the `depth` layers that run after
    it, in forward and in backward. 1 is FSDP2's own overlap, left implicit."""
    if depth == 1:
        return
    for i, layer in enumerate(layers):
        layer.set_modules_to_forward_prefetch(layers[i + 1:i + 1 + depth])
        layer.set_modules_to_backward_prefetch(layers[max(i - depth, 0):i][::-1])


def reshard(module: nn.Module) -> None:
    """Free the gathered weights of every sharded module of `module` after a forward with no backward (evaluation, a
    reference model): those the root, or parallel.reshard_after_forward, keep for a backward would stay gathered."""
    for sub in module.modules():
        if isinstance(sub, FSDPModule):
            sub.reshard()


@contextmanager
def gathered(module: nn.Module):
    """Every sharded module of `module` gathered for the whole block, then freed: a generation phase gathers each
    layer once, not once per token. Inside, the modules below the root run without FSDP2's forward hooks: with
    their weights gathered the hooks would only keep FSDP's books, at every layer of every token (measured: 4-11%
    of a CPU generation's time). The root keeps its hooks, around each call of its registered `generate`.

    FSDP2's own switch, set_reshard_after_forward, takes only true or false and could not give back
    parallel.reshard_after_forward n's layout: each parameter group's layout after a forward (post_forward_mesh_info)
    is kept and restored as it was, and so are the modules' hook tables, in their order."""
    units = [sub for sub in module.modules() if isinstance(sub, FSDPModule)]
    groups = [group for sub in units for group in sub._get_fsdp_state()._fsdp_param_groups]
    layouts = [group.post_forward_mesh_info for group in groups]
    below = [sub for sub in units if sub is not module]
    tables = [getattr(sub, name) for sub in below for name in _FORWARD_HOOK_TABLES]
    kept = [dict(table) for table in tables]
    for group in groups:
        group.post_forward_mesh_info = None
    try:
        for sub in units:
            sub.unshard()
        for sub in below:
            fsdp = sub._get_fsdp_state()
            fsdp._pre_forward_hook_handle.remove()
            fsdp._post_forward_hook_handle.remove()
        yield
    finally:
        for table, entries in zip(tables, kept):
            table.clear()
            table.update(entries)
        for group, layout in zip(groups, layouts):
            group.post_forward_mesh_info = layout
        reshard(module)


# The tables of nn.Module's forward hooks, where FSDP2's handles of a module are (gathered).
_FORWARD_HOOK_TABLES = ("_forward_pre_hooks", "_forward_pre_hooks_with_kwargs", "_forward_hooks",
                        "_forward_hooks_with_kwargs", "_forward_hooks_always_called")


def base_record(config, model_cfg, model_config) -> dict:
    """The base a checkpoint of the trained parameters alone needs (checkpoint.validate.check_base): the recipe's
    model and the fingerprint of its weights. `model_cfg`: config.model as the run reads it (Hub ids fetched)."""
    return {"name_or_path": config.model.name_or_path or config.model.config,
            "fingerprint": base_fingerprint(model_cfg, model_config, config.train.seed)}


def base_fingerprint(model_cfg, model_config, seed: int) -> str:
    """What identifies the weights a run starts from, for checkpoints that hold only the parameters it trains: the
    pretrained checkpoint's index (every tensor's file, name, dtype, shape and offsets) and, since fine-tunes of one
    model share their index, 64 KiB of data from the start, middle and end of each file; for a model trained from
    model.config, that config and the seed that initialises it. Under model.quantize, also the quantization: the
    weights the run computes with are the quantized ones (a checkpoint of its adapters, or a reference's precomputed
    log-probabilities, belongs to them); without it the fingerprint is what it was before model.quantize existed."""
    digest = hashlib.sha256()
    if model_cfg.quantize != "none":
        digest.update(f"quantize={model_cfg.quantize}".encode())
    if not model_cfg.name_or_path:
        digest.update(f"{model_config.to_json_string(use_diff=False)} seed={seed}".encode())
        return digest.hexdigest()[:16]
    index = checkpoint_index(Path(model_cfg.name_or_path))
    digest.update(json.dumps(sorted([tensor.path.name, name, tensor.entry] for name, tensor in index.items())).encode())
    sample = 2**16
    for path in sorted({tensor.path for tensor in index.values()}):
        size = path.stat().st_size
        with open(path, "rb") as f:
            for at in (0, size // 2, max(0, size - sample)):
                f.seek(at)
                digest.update(f.read(sample))
    return digest.hexdigest()[:16]
