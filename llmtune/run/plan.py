"""`llmtune plan`: what one training step will hold in each rank's memory, computed from the recipe and the model's
config before any weight is read or any process started.

Sizes of parameters, gradients and AdamW's moments come from the model built on the meta device, sharded the way
FSDP2 shards it (dim 0 split over every rank, padded). Activations are not estimated by a formula per model family:
the decoder's forward runs on meta tensors for one micro-batch and every tensor autograd saves for backward is
counted (but the weights, which FSDP2 frees after forward), the way benchmarks/context_parallel.py counts a real
step. Two things make that trace the run's own:
attention calls the kernel a real CPU run calls (torch picks its math fallback for meta tensors, which would save
the [sequence, sequence] weights a flash kernel never holds), and the model's data-dependent checks (is this row
packed? is the mask all ones?) are answered with the plain case, as no data exists. A vision-language model's
tower runs the same way on its image processor's tensors of the images a micro-batch is taken to hold (Vision).
The step's peak is then the sum of what is alive at its fullest moment, the start of backward (see Plan.peak).
"""

import math
from collections import defaultdict
from contextlib import ExitStack
from dataclasses import dataclass, replace
from functools import partial

import psutil
import torch
import torch.nn.functional as F
from torch.multiprocessing.reductions import StorageWeakRef
from torch.overrides import TorchFunctionMode
from torch.utils import _pytree as pytree
from torch.utils._python_dispatch import TorchDispatchMode

from llmtune.config import AUTO, CHECKPOINTING, ParallelConfig
from llmtune.errors import UserError
from llmtune.tasks.registry import PROMPTS, TASKS

GIB = 2**30
# The share of a GPU's memory a plan may fill: the CUDA context and the caching allocator's fragmentation take
# the rest (max_memory_allocated, what the plan predicts, stays below memory_reserved).
USABLE_FRACTION = 0.9


@dataclass(frozen=True)
class Layout:
    world_size: int
    cp: int
    micro_batch: int
    accumulation: int
    seq_len: int
    replicate: int = 1  # parallel.dp_replicate: HSDP's groups, each holding a whole sharded copy
    ep: int = 1  # parallel.expert_parallel: the ranks each MoE layer's experts are split over
    tp: int = 1  # parallel.tp_size: the ranks each layer's weights, heads and the vocabulary are split over

    @property
    def dp(self) -> int:
        return self.world_size // (self.cp * self.tp)

    @property
    def shard(self) -> int:
        """The ranks FSDP2 shards each parameter (a tp rank's share of it) over."""
        return self.world_size // (self.replicate * self.tp)

    @property
    def efsdp(self) -> int:
        """The ranks each expert-parallel rank's share of the experts is sharded over."""
        return self.shard // self.ep

    @property
    def tokens_per_step(self) -> int:
        """Tokens of one optimizer step over all ranks (rows of max_seq_len: packed, or padded to it at most)."""
        return self.micro_batch * self.dp * self.accumulation * self.seq_len


@dataclass(frozen=True)
class Vision:
    """A vision-language model's vision side of a plan, which reads no data: each image a square of
    data.image_max_pixels (the largest an image reaches its processor at, data/images.load_image), and a
    micro-batch's rows filled with them, as many as a row's tokens hold, at least one a row (the tokens a template
    writes around an image are left out: a row is taken to hold a few more than it can)."""
    parts: tuple[tuple[str, int, int], ...]  # (part, parameters, trained) of the vision tower and the projector
    images: int  # a micro-batch's
    side: int  # pixels of each image's width and height
    tokens: int  # image tokens of one image (the features the tower gives the language model)
    activations: tuple[int, int]  # what the tower holds of a micro-batch's images, checkpointing (off, on)


@dataclass(frozen=True)
class Plan:
    """Bytes per rank."""
    layout: Layout
    params: int
    grads: int
    optimizer: int
    largest_layer: int  # a decoder layer all-gathered in the compute dtype
    all_layers: int  # every decoder layer all-gathered at once, in the compute dtype
    root: int  # embeddings, lm_head and final norm, gathered from forward to the end of backward
    activations: int  # per micro-batch, with the recipe's checkpointing
    activations_by_mode: dict  # per micro-batch, under each of train.gradient_checkpointing's modes
    loss: int  # the loss's buffers at its peak (chunked or full logits)
    trainable: int  # parameters that train, whole model
    total_params: int
    averages: int = 0  # train.ema_decay's moving averages: an fp32 copy of the trained parameters per decay
    reference: int = 0  # a preference task's frozen reference copy (dpo.reference: model), in the compute dtype
    offload: bool = False  # parallel.cpu_offload: the sharded state (parameters, gradients, optimizer, copies) on the CPU
    whole_grads: int = 0  # the trained parameters' fp32 gradients, unsharded (of the rank's own experts under ep)
    reshard_after_forward: bool | int = True  # parallel.reshard_after_forward
    prefetch: int = 1  # parallel.prefetch_layers
    reshard_between: bool = True  # parallel.reshard_between_micro_batches
    quantized: int = 0  # model.quantize: parameters held in nf4, whole model
    dequantized: int = 0  # model.quantize: the transient dequantization of the largest quantized weight
    experts: int = 0  # experts of a mixture-of-experts layer (the most of any layer; 0: none)
    routed: int = 0  # the largest layer's (token, expert) pairs' hidden states, [T x k, hidden] in the compute dtype
    kv_cache: int = 0  # the keys and values of a batch of completions, every layer (0: no generation)
    generation: str = ""  # what generates (eval_generation, grpo's rounds) and in batches of how many completions
    sharded_modules: int = 0  # the modules fully_shard wraps (layers, split experts, the root): all-gathers of a phase
    vision: Vision | None = None  # a vision-language model's vision tower and images (its activations in activations)

    @property
    def kept_whole(self) -> bool:
        """Whether every layer stays gathered, with whole gradients, between the micro-batches of a step."""
        return self.layout.accumulation > 1 and not self.reshard_between

    @property
    def gathered(self) -> int:
        """The decoder layers' weights gathered at the start of backward, with the unsharded gradient of the layer in
        backward: the layer in backward and the `prefetch` ones after it, on top of what each other layer keeps
        after its forward (nothing, 1/n of it under reshard_after_forward n, or all of it), never more layers than the
        model has; every layer when they stay gathered between micro-batches. The layer in backward is the last one,
        which keeps all of its weights after its forward (build_model), counted as the largest."""
        after = self.reshard_after_forward
        if after is False or self.kept_whole:
            return self.all_layers + self.largest_layer
        kept = 0 if after is True else (self.all_layers - self.largest_layer) // after
        return kept + min((1 + self.prefetch) * self.largest_layer, self.all_layers) + self.largest_layer

    @property
    def dispatch(self) -> int:
        """parallel.expert_parallel's all-to-all buffers of the MoE layer in flight, with balanced routing (each rank
        receives as many pairs as it sends): the pairs sorted by expert to be sent, those received and the experts'
        outputs sent back, each `routed`. What the split forward saves for backward is in the activations."""
        return 3 * self.routed if self.layout.ep > 1 else 0

    @property
    def dispatch_worst(self) -> int:
        """The dispatch buffers of a rank whose experts receive every pair of its ep group: ep times the pairs."""
        return (1 + 2 * self.layout.ep) * self.routed if self.layout.ep > 1 else 0

    @property
    def peak(self) -> int:
        """At the start of backward every activation is still held, the loss has made its gradients, the root and
        the `gathered` layers are gathered, and a quantized layer dequantizes one weight; from the second micro-batch
        on (accumulation) the gradients exist: the sharded ones (with the sharded state, on the CPU under
        cpu_offload), or whole on the device while they stay unreduced between micro-batches; under expert
        parallelism the last layer's backward holds its dispatch buffers."""
        grads = self.grads if self.layout.accumulation > 1 and not self.kept_whole else 0
        state = 0 if self.offload else self.sharded_state(grads)
        return state + (self.whole_grads if self.kept_whole else 0) + self.root + self.gathered + self.dequantized \
            + self.dispatch + self.activations + self.loss

    @property
    def generation_peak(self) -> int:
        """A generation phase (eval_generation, generation/engine.py): the sharded state (the gradients freed), every
        layer and the root gathered once for the whole phase, a batch's KV cache."""
        return self.sharded_state(0) + self.all_layers + self.root + self.kv_cache

    def sharded_state(self, grads: int) -> int:
        """The sharded parameters, optimizer state, moving averages, reference copy and `grads` of gradients: on the
        device, or with parallel.cpu_offload in the CPU's memory."""
        return self.params + self.optimizer + self.averages + self.reference + grads


class _MetaAsOnDevice(TorchFunctionMode):
    """Attention on meta tensors through the flash kernel a CPU (or CUDA) run uses, not the math fallback."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is F.scaled_dot_product_attention and args[0].is_meta:
            query, key, value = args[:3]
            out, _ = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
                query, key, value, kwargs.get("dropout_p", 0.0), kwargs.get("is_causal", False),
                attn_mask=kwargs.get("attn_mask"), scale=kwargs.get("scale"))
            return out
        return func(*args, **kwargs)


class _PlainData(TorchDispatchMode):
    """A meta tensor read as a Python number (the model's checks of its inputs) reads as true / 1: no packing,
    no padding. Grouped expert matmuls in fp32, which the CPU kernel runs but whose meta shape function refuses,
    are shaped in bf16 and given the fp32 result's size."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is torch.ops.aten._local_scalar_dense.default and args[0].is_meta:
            return True if args[0].dtype == torch.bool else 1
        if func is torch.ops.aten._grouped_mm.default and args[0].is_meta and args[0].dtype == torch.float32:
            low = [a.to(torch.bfloat16) if isinstance(a, torch.Tensor) and a.is_floating_point() else a for a in args]
            return func(*low, **kwargs).to(torch.float32)
        return func(*args, **kwargs)


class _OnMeta(TorchDispatchMode):
    """An op given meta and real tensors runs on meta: an image's real tensors, whose values a vision tower reads to
    lay out its patches (Qwen's grid, LLaVA-NeXT's image sizes, Idefics3's padding crops), meet its meta weights."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        tensors = [leaf for leaf in pytree.tree_leaves((args, kwargs)) if isinstance(leaf, torch.Tensor)]
        if any(t.is_meta for t in tensors) and not all(t.is_meta for t in tensors):
            args, kwargs = pytree.tree_map_only(torch.Tensor, lambda t: t.to("meta"), (args, kwargs))
        return func(*args, **kwargs)


class _Saves(TorchFunctionMode):
    """What a forward on the meta device leaves its graph holding for backward once the step keeps only what it reads
    of the forward's output (what backward will run): the tensors autograd saves, and the leaves the forward makes
    require grad (marked with requires_grad_, as transformers' enable_input_require_grads marks embeddings), which
    the graph holds for their gradients; by storage, alive or freed with a graph the output does not reach: the module of
    `modules` running when it was first held (None: outside them) and its bytes. And the storages of each module's
    tensor inputs, what activation checkpointing keeps of it. Left out: the weights autograd saves (a matmul keeps
    its weight for the input's gradient): under FSDP2 they are the gathered weights, whose storage is freed after
    the layer's forward and gathered again for its backward, which Plan.gathered counts; and the tensors of
    `left_out`."""

    def __init__(self, hf_model, modules, left_out=()):
        super().__init__()
        self.modules = modules
        self.weights = {t.untyped_storage()._cdata for t in [*hf_model.parameters(), *left_out]}
        self.held, self.current, self.inputs = {}, None, [{} for _ in modules]

    def run(self, forward, read, *modes) -> tuple:
        """(`read` of forward()'s output, what the step keeps of it, the rest dropped; {storage: (module, bytes)} of
        what the graph holds), forward() run under the plan's meta modes and `modes`."""
        hooks = [module.register_forward_pre_hook(partial(self._enter, i), with_kwargs=True)
                 for i, module in enumerate(self.modules)]
        hooks += [module.register_forward_hook(self._leave) for module in self.modules]
        try:
            with ExitStack() as stack:
                for mode in (_MetaAsOnDevice(), _PlainData(), *modes, self,
                             torch.autograd.graph.saved_tensors_hooks(self._keep, lambda tensor: tensor)):
                    stack.enter_context(mode)
                kept = read(forward())
        finally:
            for hook in hooks:
                hook.remove()
        return kept, {cdata: (module, nbytes) for cdata, (module, nbytes, ref) in self.held.items()
                      if not ref.expired()}

    def by_module(self, held: dict) -> tuple[int, list[int]]:
        """(bytes of `held` outside the modules, bytes of each module's)."""
        per_module = [0] * len(self.modules)
        outside = 0
        for module, nbytes in held.values():
            if module is None:
                outside += nbytes
            else:
                per_module[module] += nbytes
        return outside, per_module

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if func is torch.Tensor.requires_grad_:
            self._hold(args[0])
        return func(*args, **(kwargs or {}))

    def _enter(self, i, module, args, kwargs):
        self.current = i
        self.inputs[i] = {leaf.untyped_storage()._cdata: leaf.untyped_storage().nbytes()
                          for leaf in pytree.tree_leaves((args, kwargs)) if isinstance(leaf, torch.Tensor)}

    def _leave(self, module, args, out):
        self.current = None

    def _keep(self, tensor):
        self._hold(tensor)
        # Detached, the same storage: an op's output saved as itself would make a reference cycle with the node that
        # saved it (its grad_fn), which would outlive its graph.
        return tensor.detach()

    def _hold(self, tensor) -> None:
        storage = tensor.untyped_storage()
        known = self.held.get(storage._cdata)
        if storage._cdata not in self.weights and (known is None or known[2].expired()):  # new, or a freed one's address
            self.held[storage._cdata] = (self.current, storage.nbytes(), StorageWeakRef(storage))


class _SelectiveKept(TorchDispatchMode):
    """The bytes selective checkpointing keeps of each of `saves`' modules in a forward: the outputs of the ops its
    policy keeps (model/checkpointing.kept), counted in each module's call as the policy counts them."""

    def __init__(self, saves):
        from llmtune.model.checkpointing import kept

        super().__init__()
        self.saves, self.keeps = saves, kept
        self.kept = [0] * len(saves.modules)
        self.counts = [defaultdict(int) for _ in saves.modules]

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        module = self.saves.current
        if module is not None and self.keeps(self.counts[module], func):
            self.kept[module] += sum(t.numel() * t.element_size() for t in pytree.tree_leaves(out)
                                     if isinstance(t, torch.Tensor))
        return out


def saved_activations(hf_model, layers, rows: int, tokens: int) -> tuple[int, list[int], list[int], list[int]]:
    """(bytes autograd saves outside the decoder layers, bytes each layer saves, bytes of each layer's experts'
    pairs, bytes selective checkpointing keeps of each layer) in the decoder's forward of `rows` x `tokens` on the
    meta device, each storage counted once, the weights left out (_Saves). The pairs: the hidden states of the
    (token, expert) pairs an experts module computes, [T x k, hidden] in their dtype, what expert parallelism sends
    to the experts' ranks (0 in a layer without experts)."""
    from llmtune.model.expert_parallel import experts_modules

    saves = _Saves(hf_model, layers)
    selective = _SelectiveKept(saves)
    pairs = [0] * len(layers)

    def routed(module, args):
        # Every family calls its experts with (hidden_states [T, H], top_k_index [T, k], top_k_weights).
        hidden_states, top_k_index = args[:2]
        pairs[saves.current] += top_k_index.numel() * hidden_states.shape[-1] * hidden_states.element_size()
    hooks = [module.register_forward_pre_hook(routed) for module in experts_modules(hf_model)]

    ids = torch.zeros((rows, tokens), dtype=torch.long, device="meta")
    try:
        _, held = saves.run(lambda: hf_model.get_decoder()(input_ids=ids, use_cache=False), lambda outputs: outputs,
                            selective)
    finally:
        for hook in hooks:
            hook.remove()
    return *saves.by_module(held), pairs, selective.kept


def language_layers(hf_model, layers) -> list:
    """The decoder layers of the language model: a vision-language model's text decoder's (its vision blocks are
    FSDP units too), a text model's every one."""
    from llmtune.model.multimodal import is_multimodal

    if not is_multimodal(hf_model.config):
        return layers
    language = set(hf_model.get_decoder().modules())
    return [layer for layer in layers if layer in language]


def vision_saved(hf_model, image: dict, checkpointing: bool) -> tuple[int, int]:
    """(bytes a vision-language model's vision tower holds for backward for one image, `image` its processor's
    tensors; the image tokens it gives the language model), from the run's call of the tower (model/multimodal.decode)
    on the meta device. A tower's images are encoded each on its own (Qwen's patches attend within their image,
    CLIP's images are a batch), so a micro-batch's images hold as many times this. Held: what the language model
    reads of the encoding reaches (its pooler_output, Qwen3-VL's deepstack features too); the rest is freed with the
    encoding before backward (LLaVA's last CLIP layer, whose output its features skip).
    With checkpointing, each checkpointed block that holds anything keeps its inputs instead (its recomputation is
    the tower's backward, at the end of the step's, not at the start the plan's peak is). A frozen tower and
    projector hold nothing (model/build.py leaves their inputs without grad under checkpointing too)."""
    from transformers.modeling_layers import GradientCheckpointingLayer

    language = set(hf_model.get_decoder().modules())
    blocks = [m for m in hf_model.modules() if isinstance(m, GradientCheckpointingLayer) and m not in language]
    # Its buffers left out (CLIP's position ids, which an embedding saves): one for all the images, which this
    # count of one would multiply.
    saves = _Saves(hf_model, blocks, left_out=hf_model.buffers())
    (features, _), held = saves.run(
        lambda: hf_model.base_model.get_image_features(**image, return_dict=True),
        lambda encoded: (encoded.pooler_output, getattr(encoded, "deepstack_features", None)), _OnMeta())
    kept = {cdata: nbytes for cdata, (block, nbytes) in held.items() if block is None or not checkpointing}
    if checkpointing:
        # A checkpointed block keeps every tensor it is called with (its hidden states, and the position embeddings
        # all blocks share), each storage once.
        holding = {block for block, _ in held.values()} - {None}
        kept |= {cdata: nbytes for block in holding for cdata, nbytes in saves.inputs[block].items()}
    tokens = sum(leaf.numel() for leaf in pytree.tree_leaves(features) if isinstance(leaf, torch.Tensor))
    return sum(kept.values()), tokens // hf_model.config.get_text_config().hidden_size


def vision_plan(config, model_config, hf_model, layout: Layout) -> Vision:
    """The Vision of a vision-language model's plan, `hf_model` built on the meta device in the compute dtype with
    the recipe's features (what trains)."""
    from llmtune.model.multimodal import model_parts, part_of

    parts = model_parts(hf_model)
    counts = {part: [0, 0] for part in ("vision_tower", "projector")}
    for name, param in hf_model.named_parameters():
        if (part := part_of(name, parts)) in counts:
            counts[part][0] += param.numel()
            counts[part][1] += param.numel() if param.requires_grad else 0
    side = math.isqrt(config.data.image_max_pixels)
    image = planned_image(config, model_config, hf_model, side)
    (without, tokens), (with_checkpointing, _) = (vision_saved(hf_model, image, on) for on in (False, True))
    images = layout.micro_batch * max(1, layout.seq_len // tokens)
    return Vision(parts=tuple((part, total, trained) for part, (total, trained) in counts.items()), images=images,
                  side=side, tokens=tokens, activations=(images * without, images * with_checkpointing))


def planned_image(config, model_config, hf_model, side: int) -> dict:
    """The tensors of a blank image of side x side pixels as the run hands them to the vision tower: its family's
    image processor's (data/images.ImageInputs.encoded: those it names, of those the tower takes), the floating ones
    in the model's compute dtype, to which FSDP2's mixed precision casts the inputs of the run's forward."""
    from PIL import Image

    from llmtune.model.multimodal import image_input_names

    processor = image_processor(model_config, (config.model.name_or_path, config.model.tokenizer))
    out = processor(images=[Image.new("RGB", (side, side))], return_tensors="pt")
    names = set(processor.model_input_names) & set(image_input_names(hf_model.base_model))
    return {name: out[name].to(hf_model.dtype) if out[name].is_floating_point() else out[name]
            for name in names if name in out}


def image_processor(model_config, folders: tuple):
    """The family's PIL image processor, the class data/images.family_processor takes, with the settings of the
    first of `folders` (the model's, then model.tokenizer's) that holds them (preprocessor_config.json), as the run
    reads them; where none does (a folder of config.json alone), its class's defaults made the tower's
    (_tower_settings)."""
    import json
    from pathlib import Path

    import transformers
    from transformers.models.auto.image_processing_auto import IMAGE_PROCESSOR_MAPPING_NAMES

    from llmtune.data.images import PROCESSOR_FILE

    found = next((Path(folder) for folder in folders if folder and (Path(folder) / PROCESSOR_FILE).is_file()), None)
    named = json.loads((found / PROCESSOR_FILE).read_text()).get("image_processor_type", "") if found else ""
    pil = (IMAGE_PROCESSOR_MAPPING_NAMES.get(model_config.model_type) or {}).get("pil") \
        or f"{named.removesuffix('Fast')}Pil"
    if not hasattr(transformers, pil):
        raise UserError(f"model: transformers has no PIL image processor for {model_config.model_type} (its family's "
                        f"or the one a {PROCESSOR_FILE} beside its config names), so the plan cannot size its images; "
                        f"put the model's {PROCESSOR_FILE} beside its config.json")
    image_class = getattr(transformers, pil)
    return image_class.from_pretrained(found) if found else image_class(**_tower_settings(image_class(), model_config))


def _tower_settings(defaults, model_config) -> dict:
    """An image processor's settings made the model's from its class's `defaults`, which are one checkpoint's
    (Gemma 3's class resizes to 224 pixels, gemma-3-4b's tower takes 896): the sides it resizes and crops to made
    the tower's image_size (a fixed height and width, CLIP's shortest edge before its crop, Idefics3's crops'
    longest edge), and what the model's config holds under the processor's names (LLaVA-NeXT's
    image_grid_pinpoints)."""
    settings = defaults.to_dict()
    own = {key: value for key, value in model_config.to_dict().items() if key in settings}
    side = getattr(model_config.vision_config, "image_size", None)
    if not side:  # a tower of any size (Qwen's patches)
        return own
    sized = {key: {"height": side, "width": side} for key, value in settings.items()
             if isinstance(value, dict) and {"height", "width"} <= value.keys()}
    if settings.get("crop_size"):
        sized["size"] = {"shortest_edge": side}
    if settings.get("max_image_size"):
        sized["max_image_size"] = {"longest_edge": side}
    return {**sized, **own}


def shard_bytes(param: torch.Tensor, world_size: int, itemsize: int, split: int = 1) -> int:
    """One rank's share of `param` as FSDP2 shards it: dim 0 split in world_size rows of ceil(dim0 / world_size).
    split: dim 0 first cut in `split` equal parts, one of which FSDP2 shards (an experts module's parameter under
    expert parallelism: a rank's E / split experts)."""
    if param.dim() == 0:
        return itemsize
    rows = math.ceil(param.shape[0] // split / world_size)
    return rows * (param.numel() // max(param.shape[0], 1)) * itemsize


def loss_bytes(tokens: int, hidden: int, vocab: int, chunk: int, compute: int, head_trains: bool) -> int:
    """The loss's buffers at its peak (llmtune/model/loss.py): chunked, the gradients w.r.t. the hidden states
    [tokens, H] and, when lm_head trains, the fp32 one w.r.t. its weight [V, H] with its copy in the weight's dtype,
    plus one [chunk, V] block of fp32 logits (and of the compute dtype's matmul output); full logits (chunk 0):
    [tokens, V] logits in the compute dtype, their fp32 copy and its gradient."""
    if not chunk:
        return tokens * vocab * (compute + 8)
    rows = min(chunk, tokens)
    head = vocab * hidden * (4 + (compute if compute != 4 else 0)) if head_trains else 0
    return tokens * hidden * compute + head + rows * vocab * (4 + (compute if compute != 4 else 0))


def plan_memory(config, model_config, world_size: int) -> Plan:
    """The plan of a loaded, checked recipe (config.load_config with this world size) on world_size ranks."""
    from llmtune.features.adapters import Adapters
    from llmtune.features.freezing import Freezing
    from llmtune.features.multimodal_freezing import MultimodalFreezing
    from llmtune.features.registry import enabled_features
    from llmtune.model.attention import resolve_backend
    from llmtune.model.build import HALF_DTYPES, decoder_layers, meta_model, output_head
    from llmtune.model.expert_parallel import experts_modules
    from llmtune.model.multimodal import is_multimodal
    from llmtune.model.quantize import dequantized_bytes, nf4_bytes, quantized_linears, storage_dtype

    from llmtune.model.tensor_parallel import rank_share

    train = config.train
    half = train.half_precision()
    compute = 2 if half else 4
    # Every backend but eager is traced as sdpa, which _MetaAsOnDevice sends to the flash kernel: none saves the
    # [sequence, sequence] weights. Eager saves them, and is what `auto` gives a class without sdpa (Gemma-2,
    # gpt-oss): None lets transformers make that pick, as it does for the run.
    backend = resolve_backend(config.model.attn_implementation, model_config, torch.cuda.is_available(),
                              half is not None)

    def built(shapes):
        hf_model = meta_model(shapes, config.model,
                              attn_implementation="eager" if backend == "eager" else "sdpa" if backend else None,
                              dtype=HALF_DTYPES[half] if half else torch.float32)
        for feature in enabled_features(config).features:
            # Only the features that decide which parameters exist and train change the plan's sizes.
            if isinstance(feature, (Adapters, Freezing, MultimodalFreezing)):
                feature.build(hf_model, None)
        return hf_model

    whole = built(model_config)
    # parallel.tp_size: every size below but the model's counts is a tp rank's, planned on the model of its shapes
    # (tensor_parallel.rank_share). Its activations are counted as without sequence parallelism (which holds the
    # norms' inputs 1/tp): an upper bound.
    if config.parallel.tp_size > 1:
        model_config = rank_share(model_config, config.parallel.tp_size)
    hf_model = built(model_config) if config.parallel.tp_size > 1 else whole
    # Every FSDP unit build_model shards: the decoder layers and a vision-language model's vision blocks (the classes
    # of _no_split_modules), whose forward comes first and backward last. Resharded after their forward, the vision
    # blocks hold nothing gathered at the start of backward, the plan's peak, where the language model's layers are
    # in backward (the last of them kept gathered): `layers`, whose largest is counted there, and whose inputs
    # checkpointing keeps. Every unit is in all_layers: gathered together where the layers stay gathered
    # (reshard_after_forward false, between micro-batches, a generation phase), 1/n each under
    # reshard_after_forward n. A vision block larger than a language layer (Gemma 3's SigLIP block is a sixth of
    # one) would count at the tower's backward, at the end of the step's, the language model's activations freed.
    units = decoder_layers(hf_model)
    layers = language_layers(hf_model, units)
    in_layers = {id(p) for layer in units for p in layer.parameters()}
    params = list(hf_model.parameters())
    trainable = [p for p in params if p.requires_grad]
    # model.quantize: the weights features/quantization.py quantizes, counted in NF4's bytes (no torchao needed).
    nf4 = storage_dtype(half)
    quantized = {id(linear.weight): linear.weight.numel() for linear in quantized_linears(hf_model, units).values()
                 } if config.model.quantize != "none" else {}

    parallel = config.parallel
    rows, row_tokens = config.micro_batch_shape()
    layout = Layout(world_size, parallel.cp_size, rows, train.gradient_accumulation_steps, row_tokens,
                    parallel.dp_replicate, parallel.expert_parallel, parallel.tp_size)
    experts = experts_modules(hf_model)
    # parallel.expert_parallel: the experts modules' parameters split over the ep ranks (model/expert_parallel.py).
    split = {id(p) for module in experts for p in module.parameters(recurse=False)} if layout.ep > 1 else set()

    def sized(p, ranks: int, itemsize: int) -> int:
        """One rank's bytes of `p` sharded over `ranks` ranks (1: gathered whole), `itemsize` bytes a value unless
        quantized. A split expert's parameter: the rank's E / ep experts, sharded over ranks / ep of them (the efsdp
        ranks), so that a layer gathers those experts alone."""
        if id(p) in quantized:
            return nf4_bytes(quantized[id(p)] // ranks, nf4)
        if id(p) in split:
            return shard_bytes(p, math.ceil(ranks / layout.ep), itemsize, split=layout.ep)
        return shard_bytes(p, ranks, itemsize)

    # Stored as the run stores them (model.build_model): fp32 master weights, frozen ones in the compute dtype.
    stored = sum(sized(p, layout.shard, 4 if p.requires_grad or not half else 2) for p in params)
    trained = sum(sized(p, layout.shard, 4) for p in trainable)
    tokens = math.ceil(layout.seq_len / layout.cp)
    outside, per_layer, routed, kept = saved_activations(hf_model, layers, layout.micro_batch, tokens)
    if layout.ep > 1:
        # The split forward saves what the traced one does, and the outputs its experts' ranks sent back too, kept
        # for the routing weights' gradient (model/expert_parallel.py).
        per_layer = [saved + pairs for saved, pairs in zip(per_layer, routed)]
    hidden = model_config.get_text_config().hidden_size
    layer_inputs = len(layers) * layout.micro_batch * tokens * hidden * compute
    vision = vision_plan(config, model_config, hf_model, layout) if is_multimodal(model_config) else None
    tower_without, tower_with = vision.activations if vision else (0, 0)
    # Checkpointed (full), each layer keeps its input, and the layer in backward, recomputed, what it saves; selective
    # keeps the outputs its policy keeps too, and recomputes the rest. A vision tower's blocks are counted as under
    # full for both.
    activations = {"none": outside + sum(per_layer) + tower_without,
                   "full": outside + layer_inputs + max(per_layer) + tower_with,
                   "selective": outside + layer_inputs + sum(kept)
                   + max(saved - own for saved, own in zip(per_layer, kept)) + tower_with}
    head = output_head(hf_model).weight
    return Plan(
        layout=layout, params=stored, grads=trained, optimizer=2 * trained,
        largest_layer=max(sum(sized(p, 1, compute) for p in layer.parameters()) for layer in layers),
        all_layers=sum(sized(p, 1, compute) for layer in units for p in layer.parameters()),
        root=sum(p.numel() for p in params if id(p) not in in_layers) * compute,
        activations=activations[train.checkpointing()], activations_by_mode=activations,
        loss=loss_bytes(layout.micro_batch * tokens, hidden, head.shape[0], train.chunk_loss_size, compute,
                        head.requires_grad),
        trainable=sum(p.numel() for p in whole.parameters() if p.requires_grad),
        total_params=sum(p.numel() for p in whole.parameters()),
        averages=len(train.ema_decays()) * trained,
        # Every weight frozen, so stored in the compute dtype (model/build.py), the quantized ones in NF4; the shapes of
        # the policy's model (dpo.ref_model is another checkpoint of it).
        reference=sum(sized(p, layout.shard, compute) for p in params) if config.holds_reference_copy() else 0,
        offload=parallel.cpu_offload, whole_grads=sum(sized(p, 1, 4) for p in trainable),
        reshard_after_forward=parallel.reshard_after_forward, prefetch=parallel.prefetch_layers,
        reshard_between=parallel.reshard_between_micro_batches, quantized=sum(quantized.values()),
        dequantized=dequantized_bytes(max(quantized.values()), nf4) if quantized else 0,
        experts=max((module.num_experts for module in experts), default=0), routed=max(routed),
        **generation_phase(config, model_config, compute, world_size),
        sharded_modules=len(units) + 1 + (len(experts) if layout.ep > 1 else 0), vision=vision)


def generation_phase(config, model_config, compute: int, world_size: int) -> dict:
    """Plan's kv_cache and generation of the run's largest batch of completions: eval_generation's, grpo's rounds'
    (a rank's completions of a round, up to the engine's batch); none where the run generates nothing."""
    from llmtune.generation.engine import BATCH_SIZE, DEFAULTS

    batches = []  # (completions a batch, tokens of each: a prompt of up to data.max_seq_len and its completion, what)
    cfg = config.eval_generation
    if cfg.files:
        batches.append((cfg.batch_size, cfg.max_new_tokens or DEFAULTS["max_new_tokens"], "eval_generation"))
    if TASKS[config.task].rows == PROMPTS:
        grpo, dp = config.grpo, config.dp_size(world_size)
        # Each group of tp peers generates its share of the prompts together.
        groups = world_size // config.parallel.tp_size
        rank_completions = -(-grpo.round_prompts(config.train, dp) // groups) * grpo.num_generations
        batches.append((min(BATCH_SIZE, rank_completions), grpo.max_completion_length, "grpo's rounds"))
    if not batches:
        return {}
    sizes = [(kv_cache_bytes(model_config, batch, config.data.max_seq_len + new, compute), batch, what)
             for batch, new, what in batches]
    kv_cache, batch, what = max(sizes)
    return {"kv_cache": kv_cache, "generation": f"{what}, {batch} completions a batch"}


def kv_cache_bytes(model_config, batch: int, length: int, compute: int) -> int:
    """The keys and values of `batch` sequences of `length` tokens, every layer: a batch of completions, each of a
    prompt of up to data.max_seq_len tokens (the plan reads no prompt) and its new tokens."""
    text = model_config.get_text_config()
    heads = getattr(text, "num_key_value_heads", None) or text.num_attention_heads
    head_dim = getattr(text, "head_dim", None) or text.hidden_size // text.num_attention_heads
    return batch * length * text.num_hidden_layers * 2 * heads * head_dim * compute


def gib(nbytes: float) -> str:
    return f"{nbytes / GIB:.2f} GiB" if nbytes >= GIB else f"{nbytes / 2**20:.1f} MiB"


def changes(config, world_size: int, model_config):
    """(what to change, the config with it, its world size), cheapest first: the resharding choices that spend memory
    to save collectives taken back, what costs no hardware and no accuracy (checkpointing, the chunked loss, and for
    a mixture of experts expert parallelism: each layer gathers 1/N of its experts, its tokens sent to them by
    all-to-all), then a smaller micro-batch (the global batch kept by accumulation), context parallelism (sequences
    split over ranks), tensor parallelism (each layer's weights split over ranks), fewer HSDP replicas (each
    sharded over more ranks, its collectives wider), CPU offload (slower
    steps), more ranks, adapters, and adapters on a 4-bit base (where the model's linear weights can be quantized on
    these ranks)."""
    from llmtune.features.quantization import base_problems
    from llmtune.features.tensor_parallel import TensorParallel
    from llmtune.model.build import meta_model
    from llmtune.model.expert_parallel import expert_parallel_problem, experts_modules

    train, parallel = config.train, config.parallel
    memory_for_speed = {"reshard_after_forward": parallel.reshard_after_forward is not True,
                        "reshard_between_micro_batches": not parallel.reshard_between_micro_batches,
                        "prefetch_layers": parallel.prefetch_layers > 1}
    for key in (key for key, spent in memory_for_speed.items() if spent):
        default = getattr(ParallelConfig(), key)
        yield (f"parallel.{key}: {str(default).lower()}", replace(config, parallel=replace(parallel, **{key: default})),
               world_size)
    # The least recompute first: selective keeps what costs FLOPs to recompute.
    for mode in CHECKPOINTING[CHECKPOINTING.index(train.checkpointing()) + 1:]:
        yield (f"train.gradient_checkpointing: {mode}",
               replace(config, train=replace(train, gradient_checkpointing=mode)), world_size)
    if not train.chunk_loss_size:
        yield "train.chunk_loss_size: 1024", replace(config, train=replace(train, chunk_loss_size=1024)), world_size
    # Expert parallelism cannot share ranks with context parallelism yet. The degrees double from the recipe's while
    # the run's own checks accept them (they divide the shard ranks and every layer's experts): where one does not,
    # twice it does not either.
    model = meta_model(model_config, config.model) if parallel.cp_size == 1 else None
    experts = max((module.num_experts for module in experts_modules(model)), default=0) if model else 0
    ep = parallel.expert_parallel * 2
    while experts and expert_parallel_problem(model, ep) is None \
            and replace(parallel, expert_parallel=ep).layout_problem(world_size) is None:
        yield (f"parallel.expert_parallel: {ep} (each rank gathers {experts // ep} of a layer's {experts} experts, "
               "tokens sent to them by all-to-all)",
               replace(config, parallel=replace(parallel, expert_parallel=ep)), world_size)
        ep *= 2
    micro = train.per_device_train_batch_size
    while micro > 1:
        micro //= 2
        accumulation = train.gradient_accumulation_steps * train.per_device_train_batch_size // micro
        yield (f"train.per_device_train_batch_size: {micro} (accumulation {accumulation}, the same tokens per step)",
               replace(config, train=replace(train, per_device_train_batch_size=micro,
                                             gradient_accumulation_steps=accumulation)), world_size)
    heads = model_config.get_text_config().num_key_value_heads
    cp = parallel.cp_size * 2
    while cp <= world_size and heads % cp == 0:
        accumulation = train.gradient_accumulation_steps * cp // parallel.cp_size
        yield (f"parallel.cp_size: {cp} (each rank holds 1/{cp} of every sequence; accumulation {accumulation})",
               replace(config, parallel=replace(parallel, cp_size=cp),
                       train=replace(train, gradient_accumulation_steps=accumulation)), world_size)
        cp *= 2
    tp = parallel.tp_size * 2
    while replace(parallel, tp_size=tp).layout_problem(world_size) is None and not TensorParallel.check(
            replace(config, parallel=replace(parallel, tp_size=tp)), model_config, world_size):
        accumulation = train.gradient_accumulation_steps * tp // parallel.tp_size
        yield (f"parallel.tp_size: {tp} (each rank holds 1/{tp} of every layer's weights, heads and the vocabulary; "
               f"accumulation {accumulation})",
               replace(config, parallel=replace(parallel, tp_size=tp),
                       train=replace(train, gradient_accumulation_steps=accumulation)), world_size)
        tp *= 2
    replicate = parallel.dp_replicate // 2
    while replicate >= 1 and parallel.dp_replicate % replicate == 0:
        shard = world_size // replicate
        yield (f"parallel.dp_replicate: {replicate} (each parameter sharded over {shard} ranks)",
               replace(config, parallel=replace(parallel, dp_replicate=replicate, dp_shard=-1)), world_size)
        replicate //= 2
    if not parallel.cpu_offload:
        yield ("parallel.cpu_offload: true (parameters, gradients and optimizer state in CPU memory; slower steps)",
               replace(config, parallel=replace(parallel, cpu_offload=True)), world_size)
    for ranks in (world_size * 2, world_size * 4, world_size * 8):
        accumulation = max(1, train.gradient_accumulation_steps * world_size // ranks)
        yield (f"{ranks} ranks (--nproc or torchrun), accumulation {accumulation}",
               replace(config, train=replace(train, gradient_accumulation_steps=accumulation)), ranks)
    if config.peft.method == "none":
        yield "peft.method: lora (adapters of rank 16; the base frozen)", \
            replace(config, peft=replace(config.peft, method="lora")), world_size
    lora = replace(config.peft, method="lora") if config.peft.method == "none" else config.peft
    qlora = replace(config, model=replace(config.model, quantize="nf4"), peft=lora)
    if config.model.quantize == "none" and lora.method == "lora" \
            and not base_problems(qlora, model_config, world_size):
        yield "peft.method: qlora (LoRA on the base's linear weights held in 4 bits, model.quantize: nf4)", qlora, \
            world_size


def fits(plan: Plan, device_gib: float) -> bool:
    return max(plan.peak, plan.generation_peak if plan.kv_cache else 0) <= device_gib * GIB * USABLE_FRACTION


def cheapest_fit(config, model_config, world_size: int, device_gib: float) -> str | None:
    """The first of `changes` whose plan fits, or None."""
    for change, changed, ranks in changes(config, world_size, model_config):
        if fits(plan_memory(changed, model_config, ranks), device_gib):
            return change
    return None


def device_memory_gib(processes_here: int) -> float:
    """What one rank may plan for, in GiB: a CUDA device's whole memory, or on CPU the RAM available now, shared by
    the `processes_here` ranks of this node (their steps all live in it)."""
    if torch.cuda.is_available():
        return torch.cuda.get_device_properties(torch.cuda.current_device()).total_memory / GIB
    return psutil.virtual_memory().available / GIB / processes_here


# What each auto setting chooses, in the words of its decision's line.
AUTO_CHOICES = {"train.per_device_train_batch_size": "the largest micro-batch that fits",
                "train.gradient_checkpointing": "the least recompute that fits"}


def auto_micro_batch(config, model_config, world_size: int, device_gib: float) -> Plan:
    """train.per_device_train_batch_size: auto: the plan of the largest micro-batch that divides the global batch's
    share of a data-parallel rank (so that accumulation is whole) and whose peak fits device_gib. The largest is
    tried first: the peak is not monotonic in it, as one micro-batch per step needs no accumulated gradients.
    UserError with the plan's cheapest change when even a micro-batch of 1 does not fit."""
    train = config.train
    share = train.global_batch_size // config.dp_size(world_size)
    for micro in (m for m in range(share, 0, -1) if share % m == 0):
        candidate = replace(config, train=replace(train, per_device_train_batch_size=micro,
                                                  gradient_accumulation_steps=share // micro))
        plan = plan_memory(candidate, model_config, world_size)
        if fits(plan, device_gib):
            return plan
    fix = cheapest_fit(candidate, model_config, world_size, device_gib)
    raise UserError(f"train.per_device_train_batch_size: auto, but not even a micro-batch of 1 fits: a step's peak is "
                    f"{gib(plan.peak)} per rank, above the {device_gib * USABLE_FRACTION:.2f} GiB usable of "
                    f"{device_gib:.2f} GiB (llmtune plan shows its parts); " +
                    (f"cheapest change that fits: {fix}" if fix else
                     "no single change fits: combine them, or use a device with more memory"))


def auto_settings(config, model_config, world_size: int, device_gib: float) -> tuple[dict, Plan]:
    """The recipe's auto settings decided ({key: value}, Config.use_auto's) and the plan with them.
    train.gradient_checkpointing: auto: the least recompute (CHECKPOINTING's order) whose step fits device_gib, full
    where none does (the fit line then says so); with train.per_device_train_batch_size: auto, the first mode in
    which a micro-batch fits, with the largest that does (auto_micro_batch, whose UserError stands where not even a
    micro-batch of 1 fits under full checkpointing)."""
    train = config.train
    micro_auto = train.per_device_train_batch_size == AUTO
    modes = CHECKPOINTING if train.checkpointing() == AUTO else (train.checkpointing(),)
    for mode in modes:
        candidate = replace(config, train=replace(train, gradient_checkpointing=mode))
        if micro_auto:
            try:
                plan = auto_micro_batch(candidate, model_config, world_size, device_gib)
            except UserError:
                if mode == modes[-1]:
                    raise
                continue
        else:
            plan = plan_memory(candidate, model_config, world_size)
        if micro_auto or fits(plan, device_gib) or mode == modes[-1]:
            decided = {"train.per_device_train_batch_size": plan.layout.micro_batch} if micro_auto else {}
            return {**decided, **({"train.gradient_checkpointing": mode} if len(modes) > 1 else {})}, plan


def render(plan: Plan, config, model_config, device_gib: float | None, fix: str | None) -> str:
    layout, train = plan.layout, config.train
    dtype = train.half_precision() or "fp32"
    checkpointing = train.checkpointing()
    loss = f"chunked, {train.chunk_loss_size} tokens" if train.chunk_loss_size else "full logits"
    rows = [
        ("parameters (sharded; fp32 where they train" + ("; nf4)" if plan.quantized else ")"), plan.params),
        ("gradients (fp32, whole between micro-batches)", plan.whole_grads) if plan.kept_whole else
        ("gradients (fp32, sharded)", plan.grads),
        ("optimizer state (AdamW's two moments, fp32)", plan.optimizer),
        *([("moving averages (train.ema_decay, fp32, sharded)", plan.averages)] if plan.averages else []),
        *([(f"reference model ({config.reference_section().section}.reference: model; frozen, {dtype}, sharded)",
            plan.reference)]
          if plan.reference else []),
        (f"decoder layers gathered, with one gradient ({dtype})", plan.gathered),
        *([("largest quantized weight dequantized, transient", plan.dequantized)] if plan.dequantized else []),
        *([("expert all-to-all buffers, balanced routing", plan.dispatch),
           (f"  (all pairs to one rank's experts: {gib(plan.dispatch_worst)})", None)] if plan.dispatch else []),
        # A vision-language model's root holds its tower's weights outside the blocks too (patch embeddings, norm).
        (f"embeddings, lm_head{', norm, projector' if plan.vision else ' and norm,'} gathered ({dtype})", plan.root),
        (f"activations per micro-batch, checkpointing {checkpointing}", plan.activations),
        ("  (" + ", ".join(f"{mode}: {gib(plan.activations_by_mode[mode])}" for mode in CHECKPOINTING
                           if mode != checkpointing) + ")", None),
        *([(f"  of which the vision tower's ({plan.vision.images} images)",
            plan.vision.activations[checkpointing != "none"])] if plan.vision else []),
        (f"loss ({loss})", plan.loss),
        ("peak of a training step", plan.peak),
    ]
    if plan.offload:
        rows[-1] = ("peak of a training step on the device", plan.peak)
        rows.append(("sharded state in CPU memory (parallel.cpu_offload)", plan.sharded_state(plan.grads)))
    lines = [
        f"model: {type(model_config).__name__.removesuffix('Config')}, {plan.total_params / 1e9:.3g}B parameters, "
        f"{plan.trainable / 1e9:.3g}B trained; {dtype} compute",
        *([f"quantization: nf4 (model.quantize), {plan.quantized / 1e9:.3g}B parameters of the frozen base's linear "
           "layers in 4 bits, about 0.52 bytes each with their scales"] if plan.quantized else []),
        *(vision_lines(plan.vision) if plan.vision else []),
        f"layout: {config.parallel.describe(layout.world_size)}",
        *([f"experts per rank: {plan.experts // layout.ep} of each layer's {plan.experts}, "
           + (f"each sharded over {layout.efsdp} ranks" if layout.efsdp > 1 else "each whole on the rank")
           + f"; a layer gathers only these {plan.experts // layout.ep}"] if layout.ep > 1 else []),
        f"batch: micro-batch {layout.micro_batch} x {layout.seq_len} tokens ({math.ceil(layout.seq_len / layout.cp)} "
        f"per rank), accumulation {layout.accumulation}; {layout.tokens_per_step:,} tokens per optimizer step",
        "per rank:",
        *(f"  {name:<52} {gib(value) if value is not None else ''}".rstrip() for name, value in rows),
    ]
    if plan.kv_cache:
        gathers = f"{plan.sharded_modules} all-gathers a phase (one per sharded module), none per token" \
            if layout.shard > 1 else "no all-gather (one rank holds every weight)"
        lines += [
            f"generation ({plan.generation}), per rank:",
            f"  {'layers and root gathered, once a phase (' + dtype + ')':<52} "
            f"{gib(plan.all_layers + plan.root)}",
            f"  {'KV cache (prompts up to data.max_seq_len)':<52} {gib(plan.kv_cache)}",
            f"  {'peak of a generation phase':<52} {gib(plan.generation_peak)}",
            f"  {gathers}"]
    if device_gib is None:
        lines.append("fit: give --device-memory GiB to check it against a device")
    else:
        usable = device_gib * USABLE_FRACTION
        verdict = "fits" if fits(plan, device_gib) else "does not fit"
        lines.append(f"fit: {verdict} {device_gib:g} GiB ({usable:.1f} GiB usable: the CUDA context and the "
                     "allocator's fragmentation take the rest)")
        if not fits(plan, device_gib):
            lines.append(f"cheapest change that fits: {fix}" if fix else
                         "no single change fits: combine them, or use a device with more memory")
    return "\n".join(lines)


def vision_lines(vision: Vision) -> list[str]:
    """render's lines of a vision-language model's tower and images."""
    def trains(total: int, trained: int) -> str:
        return "frozen" if not trained else "trained" if trained == total else f"{trained / 1e9:.3g}B trained"

    parts = "; ".join(f"{part.removeprefix('vision_')} {total / 1e9:.3g}B parameters, {trains(total, trained)}"
                      for part, total, trained in vision.parts)
    return [f"vision: {parts}",
            f"images: {vision.images} of {vision.side} x {vision.side} a micro-batch, {vision.tokens} image tokens "
            "each: rows filled with images (no data is read; data.image_max_pixels)"]


def plan_recipe(config, model, world_size: int, device_gib: float | None, processes_here: int = 1) -> str:
    """The report of `llmtune plan` of the loaded recipe `config`, after the checks a run makes of its recipe, layout
    and model (the same messages), except that only the model's config is read: no weight, no data file is needed.
    model: the recipe's model section with its config's files fetched (inputs.fetched_config). processes_here: the
    ranks of one node, which share its RAM on CPU (train.per_device_train_batch_size: auto)."""
    from llmtune.features.registry import check_features
    from llmtune.model.build import check_model, load_model_config

    try:
        model_config = load_model_config(model, config.head())
    except (OSError, ValueError) as err:
        raise UserError(f"model: cannot read the config of {config.model.name_or_path or config.model.config} "
                        f"({str(err).splitlines()[0]})") from None
    # The recipe as the run reads it, the model's folder fetched: a vision-language model's image processor's
    # settings are read there (its preprocessor_config.json, which the fetch of its config files brings).
    config = replace(config, model=model)
    check_features(config, model_config, world_size)
    # The run's checks of the model's build, without those of its weights, which a plan does not read.
    check_model(replace(config.model, name_or_path=None), config.train, model_config)
    auto = config.has_auto()
    if device_gib is None and (torch.cuda.is_available() or auto):
        device_gib = device_memory_gib(processes_here)
    decided, plan = auto_settings(config, model_config, world_size, device_gib) if auto else \
        ({}, plan_memory(config, model_config, world_size))
    config.use_auto(decided, world_size)
    chosen = "".join(f"{key}: auto -> {value}, {AUTO_CHOICES[key]}\n" for key, value in decided.items())
    fix = None if device_gib is None or fits(plan, device_gib) else \
        cheapest_fit(config, model_config, world_size, device_gib)
    return chosen + render(plan, config, model_config, device_gib, fix)
