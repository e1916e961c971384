"""Build the model in one order: meta device -> the features' build -> frozen weights to bf16 (under bf16) ->
activation checkpointing -> (compile) -> fully_shard per decoder layer, then the root -> materialise -> load the
weights, each rank reading only its own shard -> the features' weights_ready (the values of what they added).

No rank ever holds the full pretrained model. A model trained from a config is the exception: its
random initialisation is done whole on every rank (with the same seed) and then sharded, so that
the initial weights do not depend on the number of ranks.
"""

import copy
import hashlib
import json
import math
from pathlib import Path

import torch
from accelerate import init_empty_weights
from torch import nn
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, PreTrainedModel
from transformers.conversion_mapping import get_model_conversion_mapping
from transformers.core_model_loading import WeightConverter, WeightRenaming, rename_source_key

from llmtune.errors import UserError
from llmtune.features.base import Features
from llmtune.loss import LossOptions, cross_entropy_sum


class CausalLMForTraining(nn.Module):
    """The FSDP root around an unmodified HF causal LM.

    Its forward runs the decoder and then the loss from the last hidden states and the lm_head
    weight, plus the features' loss terms. Being the root, FSDP has unsharded the embeddings and
    lm_head exactly where the loss needs them, and the HF model class is never edited.
    """

    def __init__(self, hf_model: PreTrainedModel, loss_options: LossOptions, features: Features):
        super().__init__()
        self.hf_model = hf_model
        self.loss_options = loss_options
        self.features = features

    def forward(self, input_ids, attention_mask=None, position_ids=None, shift_labels=None, **model_kwargs):
        """Summed loss over the labelled tokens (the lm_head never runs on the whole sequence), or the
        logits, as the HF model gives them, when no labels are given. model_kwargs reach the decoder and,
        through it, the attention function of every layer (context parallelism's full_position_ids)."""
        outputs = self.hf_model.get_decoder()(
            input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids, use_cache=False,
            **model_kwargs
        )
        head = self.hf_model.get_output_embeddings()
        if shift_labels is None:
            logits = head(outputs.last_hidden_state)
            cap = self.loss_options.logit_softcap
            return cap * torch.tanh(logits / cap) if cap else logits
        loss = cross_entropy_sum(outputs.last_hidden_state, head.weight, head.bias, shift_labels, self.loss_options)
        inputs = dict(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                      shift_labels=shift_labels, **model_kwargs)
        return sum(self.features.loss_terms(outputs, inputs), loss)


def load_tokenizer(model_cfg):
    return AutoTokenizer.from_pretrained(model_cfg.tokenizer or model_cfg.name_or_path,
                                         trust_remote_code=model_cfg.trust_remote_code)


def load_model_config(model_cfg):
    return AutoConfig.from_pretrained(model_cfg.name_or_path or model_cfg.config,
                                      trust_remote_code=model_cfg.trust_remote_code)


def attention_backend(model_cfg) -> str | None:
    """transformers' name for the recipe's attention backend; None (auto) lets transformers pick: sdpa where the
    model class has it, else eager."""
    return None if model_cfg.attn_implementation == "auto" else model_cfg.attn_implementation


def meta_model(model_config, model_cfg, **kwargs) -> PreTrainedModel:
    """The model of `model_config` with its parameters on the meta device (no memory): for checks of its shapes and
    names before anything is built."""
    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(model_config, trust_remote_code=model_cfg.trust_remote_code, **kwargs)


def check_model(model_cfg, model_config) -> None:
    """The model is built once on the meta device (no memory), before any process starts, so that what would
    otherwise stop every rank with a traceback stops the CLI with one line: a config with no causal LM class, a
    backend the recipe names that the class cannot run (as transformers judges it), a class with no decoder
    layer to shard."""
    backend = attention_backend(model_cfg)
    try:
        hf_model = meta_model(model_config, model_cfg, attn_implementation=backend)
    except (ValueError, ImportError) as err:
        reason = str(err).split(". ")[0].strip().rstrip(".")
        if backend is None:
            raise UserError(f"model: transformers cannot build a causal LM from this config ({reason})") from None
        raise UserError(f"model.attn_implementation: {backend} cannot run this model ({reason}); set "
                        "model.attn_implementation to auto, which picks a backend the model supports") from None
    decoder_layers(hf_model)


def check_vocab(config, tokenizer) -> None:
    if len(tokenizer) > config.vocab_size:
        raise UserError(f"model.tokenizer: the model's vocabulary ({config.vocab_size}) is smaller than the "
                        f"tokenizer's ({len(tokenizer)}); use a matching model config or tokenizer")


def decoder_layers(hf_model: PreTrainedModel) -> list[nn.Module]:
    names = set(hf_model._no_split_modules or ())
    # Sharded, a layer's class is FSDP's subclass of its own.
    layers = [m for m in hf_model.modules() if any(cls.__name__ in names for cls in type(m).__mro__)]
    if not layers:
        raise UserError(f"model: {type(hf_model).__name__} declares no decoder layer class "
                        "(_no_split_modules), so it cannot be sharded layer by layer")
    return layers


def build_model(model_config, model_cfg, train_cfg, state, features: Features) -> CausalLMForTraining:
    """`model_config`: the HF config (load_model_config); the features change the model before it is sharded."""
    config = copy.deepcopy(model_config)  # the model keeps and changes its config (its attention implementation)
    kwargs = dict(attn_implementation=attention_backend(model_cfg), trust_remote_code=model_cfg.trust_remote_code,
                  dtype=torch.float32)
    pretrained = model_cfg.name_or_path is not None
    if pretrained:
        # Parameters on the meta device; buffers (e.g. RoPE frequencies) computed for real, they are small.
        with init_empty_weights(include_buffers=False):
            hf_model = AutoModelForCausalLM.from_config(config, **kwargs)
        # from_config leaves meta parameters untied: tie them, so a tied lm_head is the embedding itself.
        hf_model.tie_weights()
    else:
        torch.manual_seed(train_cfg.seed)
        hf_model = AutoModelForCausalLM.from_config(config, **kwargs)
    features.build(hf_model, state)
    if train_cfg.bf16:
        # Frozen weights (an adapter run's base) are never updated, so they need no fp32 master copy: stored in bf16
        # they compute exactly as their fp32 copy cast to bf16 would, in half the memory.
        for param in hf_model.parameters():
            if not param.requires_grad:
                param.data = param.data.to(torch.bfloat16)
    if train_cfg.gradient_checkpointing:
        hf_model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
    layers = decoder_layers(hf_model)
    if train_cfg.compile:
        for layer in layers:
            layer.compile()
    module = CausalLMForTraining(hf_model, LossOptions.of_run(train_cfg, config), features)
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) if train_cfg.bf16 \
        else MixedPrecisionPolicy()
    for layer in layers:
        fully_shard(layer, mesh=state.fsdp_mesh, mp_policy=policy)
    fully_shard(module, mesh=state.fsdp_mesh, mp_policy=policy)
    if pretrained:
        buffers = {name: buffer.clone() for name, buffer in module.named_buffers()}
        module.to_empty(device=state.device)
        for name, buffer in module.named_buffers():
            buffer.copy_(buffers[name])
        load_weights(hf_model, Path(model_cfg.name_or_path), features.pretrained_parameters(hf_model))
    else:
        module.to(state.device)
    features.weights_ready(hf_model)
    return module


SAFETENSORS_DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
                      "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
                      "BOOL": torch.bool}


def checkpoint_index(folder: Path) -> dict[str, tuple[Path, int, dict]]:
    """Tensor name -> (safetensors file, where its data starts, its header entry)."""
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        files = sorted({folder / name for name in json.loads(index.read_text())["weight_map"].values()})
    elif (folder / "model.safetensors").is_file():
        files = [folder / "model.safetensors"]
    else:
        raise UserError(f"model.name_or_path: {folder} holds no model.safetensors (or its index); llmtune loads "
                        "safetensors weights only — convert .bin weights with save_pretrained")
    tensors = {}
    for path in files:
        with open(path, "rb") as f:
            size = int.from_bytes(f.read(8), "little")
            header = json.loads(f.read(size))
        header.pop("__metadata__", None)
        tensors.update({name: (path, 8 + size, entry) for name, entry in header.items()})
    return tensors


def base_record(config, model_cfg, model_config) -> dict:
    """The base a checkpoint of the trained parameters alone needs (checkpoint.validate.check_base): the recipe's
    model and the fingerprint of its weights. `model_cfg`: config.model as the run reads it (Hub ids fetched)."""
    return {"name_or_path": config.model.name_or_path or config.model.config,
            "fingerprint": base_fingerprint(model_cfg, model_config, config.train.seed)}


def base_fingerprint(model_cfg, model_config, seed: int) -> str:
    """What identifies the weights a run starts from, for checkpoints that hold only the parameters it trains: the
    pretrained checkpoint's index (every tensor's file, name, dtype, shape and offsets) and, since fine-tunes of one
    model share their index, 64 KiB of data from the start, middle and end of each file; for a model trained from
    model.config, that config and the seed that initialises it."""
    digest = hashlib.sha256()
    if not model_cfg.name_or_path:
        digest.update(f"{model_config.to_json_string(use_diff=False)} seed={seed}".encode())
        return digest.hexdigest()[:16]
    index = checkpoint_index(Path(model_cfg.name_or_path))
    digest.update(json.dumps(sorted([path.name, name, entry] for name, (path, _, entry) in index.items())).encode())
    sample = 2**16
    for path in sorted({path for path, _, _ in index.values()}):
        size = path.stat().st_size
        with open(path, "rb") as f:
            for at in (0, size // 2, max(0, size - sample)):
                f.seek(at)
                digest.update(f.read(sample))
    return digest.hexdigest()[:16]


def read_rows_into(target: torch.Tensor, path: Path, data_start: int, entry: dict, start: int) -> None:
    """The rows of one tensor from row `start` on, as many as `target` holds, read from the file alone with plain
    reads, not a memory map, so that the process holds nothing of the file but these rows: straight into `target`
    (this rank's shard) when it is on the CPU in the file's dtype, else through one buffer that is then copied and
    converted."""
    dtype = SAFETENSORS_DTYPES[entry["dtype"]]
    row_bytes = math.prod(entry["shape"][1:]) * dtype.itemsize
    direct = target.device.type == "cpu" and target.dtype == dtype and target.is_contiguous()
    buffer = target.detach() if direct else torch.empty(target.shape, dtype=dtype)
    view = memoryview(buffer.view(-1).view(torch.uint8).numpy())
    with open(path, "rb", buffering=0) as f:
        f.seek(data_start + entry["data_offsets"][0] + start * row_bytes)
        done = 0
        while done < len(view):  # one read returns at most ~2 GiB on Linux
            got = f.readinto(view[done:])
            if not got:
                raise UserError(f"model.name_or_path: {path} ends inside a tensor; the file is truncated")
            done += got
    if not direct:
        with torch.no_grad():
            target.copy_(buffer)


def checkpoint_names(hf_model: PreTrainedModel, params: dict, names, folder: Path) -> dict[str, str]:
    """Parameter name -> the checkpoint's name for it. Checkpoints keep the names a class had when they were written
    (GPT-NeoX's embed_out, a missing base-model prefix): transformers' own renaming rules for the class, as
    from_pretrained applies them, translate them; `params` (the model's, by name) tell whether the prefix is added
    or dropped. Tensors transformers converts on load (experts stored one by one, fused in the model) are refused
    by name."""
    transforms = get_model_conversion_mapping(hf_model)
    renamings = [t for t in transforms if isinstance(t, WeightRenaming)]
    converters = [t for t in transforms if isinstance(t, WeightConverter)]
    mapping = {}
    for name in names:
        renamed, converted = rename_source_key(name, renamings, converters, hf_model.base_model_prefix, params)
        if converted is not None:
            raise UserError(f"model.name_or_path: {folder} stores {name} in a layout transformers converts when "
                            f"loading {type(hf_model).__name__}; llmtune cannot load it shard by shard yet")
        mapping.setdefault(renamed, name)
    return mapping


def load_weights(hf_model: PreTrainedModel, folder: Path, params: dict[str, nn.Parameter]) -> None:
    """Copy into every parameter's local shard the rows of the checkpoint tensor that shard holds. `params`: the
    parameters the checkpoint holds, by their names in the unchanged model (Features.pretrained_parameters).

    Parameters tied to another (lm_head to the embeddings) appear once and are loaded once.
    """
    tensors = checkpoint_index(folder)
    names = checkpoint_names(hf_model, params, tensors, folder)
    tensors = {name: tensors[saved] for name, saved in names.items()}
    missing = [name for name in params if name not in tensors]
    if missing:
        raise UserError(f"model.name_or_path: {folder} lacks weights for {', '.join(missing[:5])}"
                        f"{' and more' if len(missing) > 5 else ''}; is it the checkpoint of this architecture?")
    for name, param in params.items():
        path, data_start, entry = tensors[name]
        if list(entry["shape"]) != list(param.shape):
            raise UserError(f"model.name_or_path: {name} has shape {entry['shape']} in {path.name} but the config "
                            f"gives {list(param.shape)}")
        local = param.to_local() if isinstance(param, DTensor) else param.data
        read_rows_into(local, path, data_start, entry, shard_start(param))


def whole(param: torch.Tensor) -> torch.Tensor:
    """The full value of a parameter, gathered from every rank when it is sharded (every rank must call)."""
    return param.full_tensor() if isinstance(param, DTensor) else param.detach()


def copy_rows(param: torch.Tensor, value: torch.Tensor) -> None:
    """Set a parameter, sharded or not, from its full value: each rank copies the rows its shard holds."""
    local = param.to_local() if isinstance(param, DTensor) else param.data
    start = shard_start(param)
    local.copy_(value[start:start + len(local)])


def shard_start(param: torch.Tensor) -> int:
    """The first row of dim 0 held by this rank (its local shard holds the rows that follow): FSDP2 shards dim 0
    as torch.chunk does."""
    if not isinstance(param, DTensor):
        return 0
    rows = param.shape[0]
    per_rank = -(-rows // param.device_mesh.size())
    return min(param.device_mesh.get_local_rank() * per_rank, rows)
