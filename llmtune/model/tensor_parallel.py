"""Tensor parallelism (parallel.tp_size): every decoder layer's linear weights split over the tp ranks by the model
family's own plan (transformers' config.base_model_tp_plan), applied with DTensor's parallelize_module before
context parallelism, checkpointing, compile and FSDP2 (model/build.py, through features/tensor_parallel.py).

The plan names, for each layer's linears, colwise (q/k/v, gate/up: the output features split, so each rank computes
its own heads and its own part of the MLP's intermediate) or rowwise (o, down: the input features split, the outputs
summed over the tp ranks), and for a per-head norm (Qwen3's q/k norms) replicated_with_grad_allreduce. What the plan
leaves out llmtune lays itself, as torchtitan does:
- the embedding split over the vocabulary (each rank looks up the ids of its rows, the lookups summed);
- the lm_head split over the vocabulary, which the loss reads shard by shard (model/loss.py: loss parallel, no
  rank holds a [tokens, vocab] block of the whole vocabulary); its own forward (generation) gathers the logits;
- with parallel.sequence_parallel, the residual stream and the norms outside the tensor-parallel regions (the
  modules holding the planned linears: attention, MLP) hold 1/tp of each row's tokens: a region's inputs are
  gathered as it starts, its outputs reduce-scattered where they end (torchtitan's SequenceParallel layout). The
  stream is a DTensor of the whole row's shape between them, so transformers' own code around the layers (masks,
  positions, RoPE) reads the sizes it would read on one rank. The final norm's output, the decoder's last hidden
  states, stays split so: the loss computes on each rank's tokens (model/loss.py TokenShard: its hidden-state
  gradient 1/tp of the whole), and what reads them whole gathers them (the lm_head's own forward, in generate; a
  sequence classifier's score head, whole_tokens).
- a mixture-of-experts block (the layer's module holding an experts module: Qwen3-MoE's mlp) is not split by
  columns: it runs whole on 1/tp of each row's tokens per rank (torchtitan's expert tensor parallel degree 1), its
  experts split over the ep ranks where parallel.expert_parallel is set (model/expert_parallel.py: the ep groups
  take in tp peers, each with tokens of its own), its router the same on every tp rank with its gradient summed
  over them; the plan's styles for the experts (packed_colwise, moe_tp_experts, shared experts) are not laid.

Each tp rank computes the same tokens, so the loss and every count are the same on the tp peers (ParallelState
counts them once), and the gradient of the whole hidden states reaches each of them whole (the loss sums it over the
vocabulary shards).
"""

import torch
from torch import nn
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard, distribute_tensor
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, SequenceParallel, parallelize_module
from torch.utils import _pytree as pytree

from llmtune.model.expert_parallel import experts_modules

# The styles of transformers' plans that llmtune lays with torch's, by the plan's name for them.
COLWISE, ROWWISE, REPLICATED = "colwise", "rowwise", "replicated_with_grad_allreduce"
STYLES = (COLWISE, ROWWISE, REPLICATED)
# The sequence dimension of the residual stream [batch, sequence, hidden].
SEQUENCE = 1
# The heads dimension of a per-head norm's input [batch, sequence, heads, head_dim] (Qwen3's q/k norms).
HEADS = 2


def layer_plan(model_config) -> dict[str, str]:
    """The family's plan of a decoder layer: {the module's path inside the layer: style}; {} for a family without
    one."""
    plan = getattr(model_config.get_text_config(), "base_model_tp_plan", None) or {}
    return {key.split("layers.*.", 1)[1]: style for key, style in plan.items() if key.startswith("layers.*.")}


def _for_experts(path: str) -> bool:
    """Whether a planned path is inside a mixture-of-experts block (its experts, shared experts), which runs whole
    over the rank's tokens rather than split by the plan."""
    return any("expert" in part for part in path.split("."))


def plan_problems(model_config, tp: int) -> list[str]:
    """What stops this model from being split over tp ranks, one line each: a family without a plan or with styles
    llmtune does not lay, heads, key/value heads, the intermediate size or the vocabulary that tp does not divide."""
    text = model_config.get_text_config()
    plan = layer_plan(model_config)
    name = text.model_type
    if not plan:
        return [f"parallel.tp_size: {name} has no tensor-parallel plan in transformers (config.base_model_tp_plan); "
                "set parallel.tp_size 1"]
    others = sorted({style for path, style in plan.items() if style not in STYLES and not _for_experts(path)})
    if others:
        return [f"parallel.tp_size: {name}'s tensor-parallel plan uses {', '.join(others)}, which llmtune does not "
                f"lay (it lays {', '.join(STYLES)}); set parallel.tp_size 1"]
    problems = []
    heads = getattr(text, "num_attention_heads", None)
    kv_heads = getattr(text, "num_key_value_heads", None) or heads
    for key, value in (("attention heads", heads), ("key/value heads", kv_heads),
                       ("intermediate size", getattr(text, "intermediate_size", None)),
                       ("vocabulary", getattr(text, "vocab_size", None))):
        if value is not None and value % tp:
            problems.append(f"parallel.tp_size: {tp} does not divide the model's {key} ({value}); choose a tp_size "
                            "that divides it")
    return problems


def rank_share(model_config, tp: int):
    """The config of the model one tp rank holds of `model_config` (whose sizes plan_problems accepted): its heads,
    key/value heads, intermediate size and vocabulary divided by tp, the head size and hidden size kept, so that a
    model built from it on the meta device has a rank's shapes (llmtune plan)."""
    import copy

    share = copy.deepcopy(model_config)
    text = share.get_text_config()
    head_dim = getattr(text, "head_dim", None) or text.hidden_size // text.num_attention_heads
    text.head_dim = head_dim
    for key in ("num_attention_heads", "num_key_value_heads", "intermediate_size", "vocab_size"):
        if getattr(text, key, None):
            setattr(text, key, getattr(text, key) // tp)
    return share


def apply_tensor_parallel(hf_model: nn.Module, layers: list[nn.Module], tp_mesh, sequence_parallel: bool) -> None:
    """Split `hf_model` (on the meta device or materialised) over `tp_mesh` in place; `layers`: its decoder layers."""
    plan = layer_plan(hf_model.config)
    stream = Shard(SEQUENCE) if sequence_parallel else Replicate()
    # torch's styles make new parameters, some of which (SequenceParallel's) would train whatever the old ones did.
    frozen = {name for name, param in hf_model.named_parameters() if not param.requires_grad}
    for layer in layers:
        blocks = {name for name, child in layer.named_children() if experts_modules(child)}
        laid = {path: style for path, style in plan.items()
                if _has(layer, path) and path.split(".", 1)[0] not in blocks}
        for path, style in laid.items():
            _split(layer.get_submodule(path), style, tp_mesh, sequence_parallel)
        regions = {path.split(".", 1)[0] for path, style in laid.items() if style != REPLICATED}
        for name, child in layer.named_children():
            if name in blocks:
                _over_tokens(child, tp_mesh, sequence_parallel)
            elif name in regions:
                if sequence_parallel:
                    child.register_forward_pre_hook(_replicated_inputs, with_kwargs=True)
            elif sequence_parallel and any(True for _ in child.parameters()):
                parallelize_module(child, tp_mesh, SequenceParallel())
    decoder = hf_model.get_decoder()
    embedding, head = hf_model.get_input_embeddings(), hf_model.get_output_embeddings()
    tied = head is not None and head.weight is embedding.weight
    parallelize_module(embedding, tp_mesh, RowwiseParallel(input_layouts=Replicate(), output_layouts=stream,
                                                           use_local_output=not sequence_parallel))
    embedding.register_forward_hook(_settled)
    if sequence_parallel:
        in_layers = {id(module) for layer in layers for module in layer.modules()}
        for name, child in decoder.named_children():
            if id(child) not in in_layers and child is not embedding and any(True for _ in child.parameters(False)):
                # The final norm: its output, the decoder's, split over the sequence as the stream is.
                parallelize_module(child, tp_mesh, SequenceParallel())
    if head is not None:
        parallelize_module(head, tp_mesh, ColwiseParallel(input_layouts=stream, output_layouts=Replicate()))
        if tied:
            head.weight = embedding.weight
    for name, param in hf_model.named_parameters():
        param.requires_grad_(name not in frozen)


def _split(module: nn.Module, style: str, tp_mesh, sequence_parallel: bool) -> None:
    """One planned module split by its style; of a layer peft adapted (LoRA), its base layer so, and its adapters to
    match: of a colwise base, lora_A whole and lora_B colwise (each rank its own output features of B A x, the
    gradient of B's input summed over the ranks); of a rowwise base, lora_A rowwise (its output summed over the
    ranks, or reduce-scattered into the stream) and lora_B whole (a replicated DTensor under sequence parallelism,
    its gradient summed over the ranks' tokens)."""
    base = getattr(module, "base_layer", module)
    parallelize_module(base, tp_mesh, _style(style, sequence_parallel))
    for name in getattr(module, "lora_A", {}):
        lora_a, lora_b = module.lora_A[name], module.lora_B[name]
        if style == COLWISE:
            lora_a.register_forward_pre_hook(_local_inputs)
            parallelize_module(lora_b, tp_mesh, ColwiseParallel())
        else:
            parallelize_module(lora_a, tp_mesh, _style(ROWWISE, sequence_parallel))
            if sequence_parallel:
                parallelize_module(lora_b, tp_mesh, SequenceParallel())


def _over_tokens(block: nn.Module, tp_mesh, sequence_parallel: bool) -> None:
    """A mixture-of-experts block run on this rank's 1/tp of each row's tokens (the stream's sequence shard, or its
    slice of the whole stream without sequence parallelism), its output given back in the stream's layout. Its
    parameters not split already (the router; the experts themselves where ep is 1) become DTensors replicated over
    the tp ranks, computed on as plain tensors whose gradients, of each rank's tokens, are summed over them (a
    Partial gradient, which FSDP2 reduces to the parameter's Replicate before its own reduce-scatter)."""
    whole = [(module, name) for module in block.modules() if not hasattr(module, "expert_parallel_group")
             for name, param in module.named_parameters(recurse=False) if not isinstance(param, DTensor)]
    for module, name in whole:
        param = getattr(module, name)
        replicated = distribute_tensor(param.detach(), tp_mesh, [Replicate()], src_data_rank=None)
        setattr(module, name, nn.Parameter(replicated, requires_grad=param.requires_grad))
    # Of the forward under way: the stream it was called on, and the parameters (FSDP2's, gathered) it swapped out.
    under_way = []

    def enter(module, args, kwargs):
        stream = args[0] if isinstance(args[0], DTensor) \
            else DTensor.from_local(args[0], tp_mesh, [Replicate()], run_check=False)
        params = [owner._parameters[name] for owner, name in whole]
        under_way.append((stream, params))
        for (owner, name), param in zip(whole, params):
            owner._parameters[name] = param.to_local(grad_placements=[Partial()])
        return (stream.redistribute(placements=[Shard(SEQUENCE)]).to_local(), *args[1:]), kwargs

    def leave(module, args, kwargs, output):
        stream, params = under_way.pop()
        for (owner, name), param in zip(whole, params):
            owner._parameters[name] = param
        tokens = DTensor.from_local(output, tp_mesh, [Shard(SEQUENCE)], run_check=False, shape=stream.shape,
                                    stride=stream.stride())
        return tokens if sequence_parallel else tokens.full_tensor()

    block.register_forward_pre_hook(enter, with_kwargs=True)
    block.register_forward_hook(leave, with_kwargs=True)


def gathered_tokens(local: torch.Tensor, rows: tuple[int, int], tp_mesh) -> torch.Tensor:
    """Values a mixture-of-experts block computed per token of this rank's share (local: [b x s/tp, ...], the
    order _over_tokens gives them), for every token of the rows ([b x s, ...], the rows' order) on every tp rank;
    backward keeps this rank's part of a gradient that is the same on every tp rank."""
    batch, length = rows
    shape = (batch, length, *local.shape[1:])
    whole = DTensor.from_local(local.reshape(batch, -1, *local.shape[1:]), tp_mesh, [Shard(SEQUENCE)],
                               run_check=False, shape=shape, stride=torch.empty(shape, device="meta").stride())
    return whole.full_tensor().reshape(batch * length, *local.shape[1:])


def _local_inputs(module, args):
    """A whole (replicated) DTensor input as this rank's plain tensor, for a module whose weights are whole."""
    return pytree.tree_map(lambda value: value.to_local() if isinstance(value, DTensor) else value, args)


def _has(layer: nn.Module, path: str) -> bool:
    try:
        layer.get_submodule(path)
    except AttributeError:
        return False
    return True


def _style(style: str, sequence_parallel: bool):
    if style == COLWISE:
        return ColwiseParallel()
    if style == ROWWISE:
        # The region's output: reduce-scattered over the sequence into the stream, or summed whole.
        return RowwiseParallel(output_layouts=Shard(SEQUENCE), use_local_output=False) if sequence_parallel \
            else RowwiseParallel()
    # A per-head norm: its input holds this rank's heads, and its weight, the same on every rank, has its
    # gradient summed over them.
    return SequenceParallel(sequence_dim=HEADS, use_local_output=True)


def _replicated_inputs(module, args, kwargs):
    """A tensor-parallel region's inputs whole on every tp rank: the stream's tokens gathered."""
    def whole(value):
        return value.redistribute(placements=[Replicate()]) if isinstance(value, DTensor) else value
    return pytree.tree_map(whole, args), pytree.tree_map(whole, kwargs)


def _settled(module, args, output: torch.Tensor) -> torch.Tensor:
    """The embedding's output, the sum of the ranks' lookups, as a tensor that holds it: torch's collective leaves a
    pending result (an AsyncCollectiveTensor, alone or inside the stream's DTensor), which a compiled first layer
    took as its input wrongly (train.compile: its gradient lost, or AOT autograd failing on its symbolic sizes). A
    copy waits for the collective, as the first op on it would."""
    return output.clone()


def whole_tokens(hidden: torch.Tensor) -> torch.Tensor:
    """The decoder's last hidden states as a plain tensor of the whole rows on every tp rank: gathered where sequence
    parallelism splits them (backward keeps this rank's tokens of their gradient, the same on every tp rank)."""
    return hidden.full_tensor() if isinstance(hidden, DTensor) else hidden


def sequence_shard(hidden: torch.Tensor):
    """(the process group of the tp ranks, this rank's index among them, their number) for the decoder's last hidden
    states [b, S, H] split over the sequence by sequence parallelism, S a multiple of the ranks (the rows padded so
    in training: features/tensor_parallel.py); None for hidden states whole on this rank or split unevenly (a decode
    step's single token)."""
    if not isinstance(hidden, DTensor) or hidden.placements != (Shard(SEQUENCE),):
        return None
    mesh = hidden.device_mesh
    if hidden.shape[SEQUENCE] % mesh.size():
        return None
    return mesh.get_group(), mesh.get_local_rank(), mesh.size()


def vocabulary_shard(weight: torch.Tensor):
    """(this rank's rows of a head weight split over the vocabulary, the process group of its tp ranks, the first
    vocabulary id it holds); None for a head weight that is whole on this rank. Read where FSDP2 has gathered the
    weight: a DTensor of the tp ranks alone, split evenly (the vocabulary is a multiple of tp_size)."""
    if not isinstance(weight, DTensor):
        return None
    local = weight.to_local()
    return local, weight.device_mesh.get_group(), weight.device_mesh.get_local_rank() * local.shape[0]
