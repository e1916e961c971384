"""Multimodal rope positions of packed documents: Qwen's vision-language models (Qwen2-VL to Qwen3.5) place each
image token by its row and column in the image (M-RoPE: temporal, height and width positions beside the text's),
which the model computes itself (`get_rope_index`) from a whole row taken as one sequence. In a packed row every
document must get the positions it has alone, so this feature computes them document by document, with the
model's own method on each document's tokens and its images' grids, and hands the model the [4, b, S] positions
transformers takes for packed rows: the text positions first (the documents' own, which keep the attention's
documents apart), then the three rope axes.

A feature on for every run that acts only once `build` finds a model with such positions; its transform runs after
the packed documents' (features/registry.py's order), which reads the text positions.
"""

import itertools

import torch

from llmtune.features.base import Feature
from llmtune.model.attention import document_positions, document_starts
from llmtune.model.multimodal import BLANK_IMAGES, is_multimodal


class MultimodalPositions(Feature):
    name = "multimodal_positions"
    on_reference = True
    rope_index = None

    @staticmethod
    def enabled(config) -> bool:
        return True

    def build(self, hf_model, state) -> None:
        if is_multimodal(hf_model.config):
            # A branch would leave out its prompt's image tokens, whose images the row holds for each sequence.
            self.keeps_shared_prefixes = False
        if is_multimodal(hf_model.config) and hasattr(hf_model.base_model, "get_rope_index"):
            self.rope_index = hf_model.base_model.get_rope_index
            self.image_token_id = hf_model.config.image_token_id

    def transform(self, inputs: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        if self.rope_index is None:
            return inputs
        text = document_positions(inputs)
        grids = iter(inputs.get("image_grid_thw", ()) if not inputs.get(BLANK_IMAGES) else ())
        rows = []
        for ids, positions in zip(inputs["input_ids"], text):
            starts = document_starts(positions[None])[0].nonzero().flatten().tolist() + [len(ids)]
            rows.append(torch.cat([self.document(ids[start:end], grids) for start, end in zip(starts, starts[1:])],
                                  dim=1))
        return {**inputs, "position_ids": torch.cat([text[None], torch.stack(rows, dim=1)])}

    def document(self, ids: torch.Tensor, grids) -> torch.Tensor:
        """[3, len(ids)] rope positions of one document, as the model gives them to it alone; `grids`: the
        micro-batch's image grids not yet used, the document's first."""
        types = (ids == self.image_token_id).int()
        images = sum(1 for kind, _ in itertools.groupby(types.tolist()) if kind)
        if not images:
            return torch.arange(len(ids)).expand(3, -1)
        own = torch.stack([next(grids) for _ in range(images)])
        positions, _ = self.rope_index(ids[None], mm_token_type_ids=types[None], image_grid_thw=own)
        return positions[:, 0]
