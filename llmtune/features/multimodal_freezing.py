"""What of a vision-language model trains: LLaMA-Factory's freeze_vision_tower (default true),
freeze_multi_modal_projector (true) and freeze_language_model (false), as train.* keys. A frozen part's weights stay
as loaded, in full fine-tuning and under peft alike (adapters.py leaves its modules out of the targets,
model/multimodal.frozen_pattern). A feature on for every run that acts on a vision-language model alone; after the
adapters and train.trainable_modules' freezing (features/registry.py's order), which it only narrows."""

from llmtune.features.base import Feature
from llmtune.model.multimodal import frozen_parts, is_multimodal, model_parts, part_of


class MultimodalFreezing(Feature):
    name = "multimodal_freezing"

    @staticmethod
    def enabled(config) -> bool:
        return True

    @staticmethod
    def check(config, model_config, world_size: int) -> list[str]:
        if is_multimodal(model_config) and len(frozen_parts(config.train)) == 3 and config.peft.method == "none":
            return ["train.freeze_vision_tower, freeze_multi_modal_projector and freeze_language_model freeze every "
                    "part of the model: nothing is left to train; set one of them false"]
        return []

    def build(self, hf_model, state) -> None:
        parts, frozen = model_parts(hf_model), frozen_parts(self.config.train)
        for name, param in hf_model.named_parameters(remove_duplicate=False):
            if part_of(name, parts) in frozen:
                param.requires_grad_(False)
