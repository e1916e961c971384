"""Low-rank adapters (LoRA, DoRA), built with peft into the HF model before it is sharded.

peft's layers are injected in place (inject_adapter_in_model: the model keeps its class, so the decoder, the loss
and the export see an HF model), and FSDP2 shards the frozen base weights and the adapters like any weights. What
peft cannot do on a model built on the meta device and sharded, llmtune does around it:
- initial values: the adapters are initialised by peft's own functions on the CPU, whole and with the run's seed,
  before sharding, and each rank copies its rows once the weights are in place (weights_ready), so that they do not
  depend on the number of ranks; DoRA's magnitudes are computed then, from the loaded base weights;
- modules_to_save are trained in place (requires_grad) rather than through peft's wrapper, which would keep a second
  copy of each module (the embeddings, the lm_head);
- the adapter folder (adapter_config.json + adapter_model.safetensors) is written with peft's names, so that
  peft.PeftModel.from_pretrained loads it; merging works on full tensors one layer at a time.
"""

import copy
import json
import re
import warnings
from contextlib import contextmanager
from pathlib import Path

import torch

from llmtune.errors import UserError
from llmtune.features.base import Feature
from llmtune.model.build import SCORE, meta_model
from llmtune.model.multimodal import frozen_pattern, save_processor
from llmtune.model.quantize import is_quantized
from llmtune.model.state import copy_rows, laid_out_like, whole
from llmtune.tasks.registry import SCORE_HEAD

ADAPTER = "default"  # peft's name of a model's only adapter
# peft's conversion for transformers' fused experts adds rank and alpha patterns of its own (for gate_up_proj) to a
# mixture-of-experts model's LoraConfig, and warns where they match no adapted module: about nothing the recipe set.
warnings.filterwarnings("ignore", message="The following (rank|alpha)_pattern keys did not match",
                        category=RuntimeWarning)
ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"


def lora_config(peft_cfg, classifier: bool = False):
    """peft's LoraConfig of the recipe's peft section, or of the adapter folder it continues from (which gives rank,
    alpha, targets and saved modules; the recipe gives the dropout). classifier: the model is a sequence classifier
    (rm): peft's SEQ_CLS task, whose all-linear leaves the score head out (it is trained in full, modules_to_save)."""
    from peft import LoraConfig

    if peft_cfg.adapter_path:
        config = LoraConfig.from_pretrained(peft_cfg.adapter_path)
        config.lora_dropout, config.inference_mode = peft_cfg.dropout, False
        return config
    target = peft_cfg.target_modules
    return LoraConfig(r=peft_cfg.r, lora_alpha=peft_cfg.alpha, lora_dropout=peft_cfg.dropout,
                      use_dora=peft_cfg.method == "dora", use_rslora=peft_cfg.use_rslora,
                      target_modules=target[0] if target == ["all-linear"] else target,
                      init_lora_weights=peft_cfg.init_lora_weights, task_type="SEQ_CLS" if classifier else "CAUSAL_LM")


def adapter_folder_problems(peft_cfg) -> list[str]:
    folder = Path(peft_cfg.adapter_path)
    missing = [name for name in (ADAPTER_CONFIG, ADAPTER_WEIGHTS) if not (folder / name).is_file()]
    if missing:
        return [f"peft.adapter_path: {folder} lacks {' and '.join(missing)}; name a folder written by "
                "PeftModel.save_pretrained or by llmtune (output_dir/adapter)"]
    saved = json.loads((folder / ADAPTER_CONFIG).read_text())
    if saved.get("peft_type") != "LORA":
        return [f"peft.adapter_path: {folder} holds a {saved.get('peft_type')} adapter; llmtune trains LORA ones"]
    kind = "dora" if saved.get("use_dora") else "lora"
    if peft_cfg.method != kind:
        return [f"peft.method: {peft_cfg.method}, but {folder} holds a {kind} adapter; set peft.method: {kind}"]
    return []


def saved_module_names(hf_model, modules_to_save: list[str]) -> list[str]:
    """The modules a modules_to_save entry names, as peft matches them: the module's own name or its last parts."""
    return [name for name, _ in hf_model.named_modules()
            if any(name == key or name.endswith("." + key) for key in modules_to_save)]


def lora_layers(hf_model) -> dict[str, torch.nn.Module]:
    from peft.tuners.lora import LoraLayer

    return {name: module for name, module in hf_model.named_modules() if isinstance(module, LoraLayer)}


def peft_key(name: str) -> str:
    """Our parameter name -> its key in adapter_model.safetensors, as PeftModel.save_pretrained writes it: under
    base_model.model., without the adapter's name, DoRA's magnitude without .weight."""
    key = name.replace(f".{ADAPTER}.", ".")
    key = re.sub(r"\.lora_magnitude_vector\.weight$", ".lora_magnitude_vector", key)
    return f"base_model.model.{key}"


def full_weights(layer) -> tuple[torch.Tensor, torch.Tensor]:
    """(base weight, B @ A) of one adapted layer, whole: gathered from every rank when sharded."""
    lora = whole(layer.lora_B[ADAPTER].weight) @ whole(layer.lora_A[ADAPTER].weight)
    return whole(layer.get_base_layer().weight), lora


def merged_weight(layer) -> torch.Tensor:
    """The layer's base weight with its adapter merged in, whole, as peft merges it (LoRA: W + s BA; DoRA: scaled
    row by row to the magnitudes), computed from the gathered tensors of this one layer."""
    from peft.utils.other import transpose

    weight, lora = full_weights(layer)
    scaling = layer.scaling[ADAPTER]
    merged = weight + transpose(lora * scaling, layer.fan_in_fan_out)
    if not layer.use_dora[ADAPTER]:
        return merged
    magnitude = layer.lora_magnitude_vector[ADAPTER]
    factor = whole(magnitude.weight) / magnitude.get_weight_norm(weight, lora, scaling)
    return transpose(factor.view(-1, 1), layer.fan_in_fan_out) * merged


def merge_adapters(hf_model) -> None:
    """Merge every adapter into its layer's weight and put the layer back in its place: hf_model becomes the plain
    HF model of the merged export. On a sharded model every rank calls it; one layer is gathered at a time. A
    quantized base weight (model.quantize) is merged dequantized and replaced by the result in its dtype, laid out
    as it was: quantized again, the merge would lose most of the adapters' update."""
    with torch.no_grad():
        for name, layer in lora_layers(hf_model).items():
            base = layer.get_base_layer()
            if is_quantized(base.weight):
                merged = merged_weight(layer).to(base.weight.dtype)
                base.weight = torch.nn.Parameter(laid_out_like(base.weight, merged), requires_grad=False)
            else:
                copy_rows(base.weight, merged_weight(layer))
            parent, _, child = name.rpartition(".")
            setattr(hf_model.get_submodule(parent), child, base)


class Adapters(Feature):
    """On when peft.method is lora or dora."""

    name = "adapters"

    def __init__(self, config):
        super().__init__(config)
        self.lora = lora_config(config.peft, config.head() == SCORE_HEAD)
        self.added: set[str] = set()  # the adapters' parameter names
        self.initial: dict[str, torch.Tensor] = {}  # name -> full initial value, until weights_ready

    @staticmethod
    def enabled(config) -> bool:
        return config.peft.method != "none"

    @staticmethod
    def check(config, model_config, world_size: int) -> list[str]:
        """The adapter folder, peft's own checks, and targets and saved modules that match no module of the model
        (built on the meta device)."""
        if config.train.freezes():
            return ["train.trainable_modules / frozen_modules / trainable_layers (finetuning_type freeze): not used "
                    "with peft, which freezes every weight but the adapters; name modules trained in full in "
                    "peft.modules_to_save"]
        if config.peft.adapter_path and (problems := adapter_folder_problems(config.peft)):
            return problems
        from peft import inject_adapter_in_model

        hf_model = meta_model(model_config, config.model)
        linear = sorted({name.rpartition(".")[2] for name, module in hf_model.named_modules()
                         if isinstance(module, torch.nn.Linear) and name != "lm_head"})
        try:
            lora = lora_config(config.peft, config.head() == SCORE_HEAD)
            lora.exclude_modules = frozen_pattern(hf_model, config.train)
            inject_adapter_in_model(lora, hf_model)
        except ValueError as err:
            reason = str(err).split(". ")[0].strip().rstrip(".")
            reason = "matches no layer of the model" if "not found in the base model" in reason else reason
            return [f"peft.target_modules: {config.peft.target_modules!r} {reason}; name layers of the model "
                    f"({', '.join(linear)}) or use all-linear"]
        # peft adapts a mixture-of-experts layer's stacked experts (and router) parameter by parameter (its
        # ParamWrapper), which llmtune's build, sharding and export of adapters do not serve yet.
        wrapped = sorted({name.rpartition(".")[2] for name, layer in lora_layers(hf_model).items()
                          if type(layer).__name__ == "ParamWrapper" and not name.endswith(".base_layer")})
        if wrapped:
            return [f"peft.target_modules: {config.peft.target_modules!r} reaches {', '.join(wrapped)} of "
                    f"{type(hf_model).__name__}'s mixture-of-experts layers, whose stacked parameters peft adapts in a "
                    f"form llmtune cannot train yet; name the linear layers to adapt ({', '.join(linear)})"]
        unmatched = [key for key in config.peft.modules_to_save if not saved_module_names(hf_model, [key])]
        if unmatched:
            return [f"peft.modules_to_save: {', '.join(unmatched)} match no module of the model; name modules such "
                    "as embed_tokens or lm_head"]
        return []

    def build(self, hf_model, state) -> None:
        from peft import inject_adapter_in_model

        # A vision-language model's frozen parts (its vision tower, by default) are never adapted.
        self.lora.exclude_modules = frozen_pattern(hf_model, self.config.train)
        # The adapters' initial values come from the run's seed alone, whatever came before.
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(self.config.train.seed)
            inject_adapter_in_model(self.lora, hf_model)
            self.added = {name for name, param in hf_model.named_parameters() if param.requires_grad}
            for name, layer in lora_layers(hf_model).items():
                self.initial.update(self._initialise(name, layer))
        for name in saved_module_names(hf_model, self.modules_to_save()):
            hf_model.get_submodule(name).requires_grad_(True)

    def _initialise(self, name: str, layer) -> dict[str, torch.Tensor]:
        """peft's initialisation of one layer's adapters, on the CPU, whole: peft made them on the base weight's
        device (the meta device, for a pretrained model), where they go back. Returns their values by name."""
        adapters = {"lora_A": layer.lora_A[ADAPTER], "lora_B": layer.lora_B[ADAPTER]}
        device = layer.get_base_layer().weight.device
        for module in adapters.values():
            module.to_empty(device="cpu")
            module.reset_parameters()
        layer.reset_lora_parameters(ADAPTER, self.lora.init_lora_weights)
        values = {f"{name}.{kind}.{ADAPTER}.{key}": param.detach().clone()
                  for kind, module in adapters.items() for key, param in module.named_parameters()}
        for module in adapters.values():
            module.to(device)
        return values

    @staticmethod
    @contextmanager
    def disabled(hf_model):
        """The base model: every adapter layer passes its input through its base layer alone (a preference task's
        reference, dpo.reference: adapter_off). The flag is peft's own, set directly: peft's enable_adapters would
        also turn the adapters' requires_grad off, which the optimizer and FSDP's gradients rely on."""
        layers = lora_layers(hf_model).values()
        for layer in layers:
            layer._disable_adapters = True
        try:
            yield
        finally:
            for layer in layers:
                layer._disable_adapters = False

    def modules_to_save(self) -> list[str]:
        """The modules trained in full: the recipe's (or the adapter folder's), and a sequence classifier's score head,
        which starts untrained (peft's SEQ_CLS models save it so too)."""
        named = list(self.lora.modules_to_save or self.config.peft.modules_to_save)
        return named + [SCORE] if self.config.head() == SCORE_HEAD and SCORE not in named else named

    def _read_adapter_folder(self, hf_model) -> dict[str, torch.Tensor]:
        from safetensors import safe_open

        path = Path(self.config.peft.adapter_path) / ADAPTER_WEIGHTS
        trainable = [name for name, param in hf_model.named_parameters() if param.requires_grad]
        with safe_open(str(path), "pt") as f:
            keys = set(f.keys())
            missing = [name for name in trainable if peft_key(name) not in keys]
            if missing:
                raise UserError(f"peft.adapter_path: {path} lacks {peft_key(missing[0])}"
                                f"{f' and {len(missing) - 1} more' if len(missing) > 1 else ''}; is it an adapter "
                                "of this model?")
            return {name: f.get_tensor(peft_key(name)).float() for name in trainable}

    def export_adapter(self, hf_model, tokenizer, out_dir: Path, dtype: torch.dtype, is_main: bool) -> None:
        """Write the adapter folder peft.PeftModel.from_pretrained(base, out_dir) loads: the adapters and the
        modules trained in full, under peft's keys (a module tied to another, the embeddings and the lm_head, under
        both names, so that peft's separate copies both take the trained values), with the adapter_config.json that
        names them and the run's base model, and the tokenizer. Every rank calls it (the adapters are gathered)."""
        from llmtune.atomic import save_tensors, write_folder

        gathered: dict[int, str] = {}  # parameter -> the key it was saved under first
        tensors = {}
        for name, param in hf_model.named_parameters(remove_duplicate=False):
            if not param.requires_grad:
                continue
            if id(param) in gathered:  # a second name: its own copy, as safetensors stores no shared tensors
                if is_main:
                    tensors[peft_key(name)] = tensors[gathered[id(param)]].clone()
                continue
            gathered[id(param)] = peft_key(name)
            full = whole(param)
            if is_main:
                tensors[peft_key(name)] = full.to(device="cpu", dtype=dtype)
        if not is_main:
            return
        saved = {name.rpartition(".")[0] for name, param in hf_model.named_parameters(remove_duplicate=False)
                 if param.requires_grad and name not in self.added}
        config = copy.deepcopy(self.lora)
        config.modules_to_save = sorted(saved) or None
        config.base_model_name_or_path = self.config.model.name_or_path
        config.inference_mode = True

        def fill(folder: Path) -> None:
            save_tensors({key: tensor.contiguous() for key, tensor in tensors.items()}, folder / ADAPTER_WEIGHTS,
                         metadata={"format": "pt"})
            config.save_pretrained(folder)
            tokenizer.save_pretrained(folder)
            save_processor(tokenizer, folder)

        write_folder(out_dir, fill)

    def pretrained_name(self, name: str) -> str | None:
        """Adapters are not in the pretrained checkpoint; a wrapped layer's weight is, under the layer's name."""
        return None if name in self.added else name.replace(".base_layer.", ".")

    def weights_ready(self, hf_model) -> None:
        """The adapters' initial values (the adapter folder's, when the run continues from one: modules trained in
        full and DoRA's magnitudes included); else DoRA's magnitudes from the loaded base, as peft computes them."""
        if self.config.peft.adapter_path:
            self.initial.update(self._read_adapter_folder(hf_model))
        params = dict(hf_model.named_parameters())
        with torch.no_grad():
            for name, value in self.initial.items():
                copy_rows(params[name], value)
            if self.lora.use_dora and not self.config.peft.adapter_path:
                for layer in lora_layers(hf_model).values():
                    magnitude = layer.lora_magnitude_vector[ADAPTER]
                    norm = magnitude.get_weight_norm(*full_weights(layer), scaling=layer.scaling[ADAPTER])
                    copy_rows(magnitude.weight, norm)
        self.initial = {}
