"""Packed documents kept apart by the attention without a mask of the whole row, on one rank per sequence
(llmtune/model/attention.py; under context parallelism, features/ulysses.py does the same around its all-to-all).

A feature on when cp_size is 1, acting at two points:
- build: with sdpa or eager, installs `attention.document_attention` around the backend, so that transformers
  builds no [S, S] mask and the attention goes document span by span. flex attention builds a block-sparse
  mask of its own and needs nothing.
- transform: adds to every micro-batch what the attention reads: the document positions and their layout (read here,
  on the host copy: Trainer.prepare) for document_attention, with the image blocks of a family whose image tokens
  attend to each other both ways (Gemma 3), or for a varlen backend (flash attention, Hub kernels) the documents'
  boundaries as cu_seq_lens; for a model with linear-attention layers (Qwen3.5), whatever the backend, where each
  document starts, and build makes those layers run document by document (`attention.by_document`).
"""

from functools import partial

import torch
from transformers import AttentionInterface

from llmtune.features.base import Feature
from llmtune.model.attention import (DOCUMENTS, by_document, document_attention, document_bounds, document_positions,
                                    document_spans, is_varlen, linear_attention_layers, varlen_kwargs)
from llmtune.model.multimodal import image_blocks, set_text_attention, text_attention


class PackedDocuments(Feature):
    name = "packed_documents"
    on_reference = True

    @staticmethod
    def enabled(config) -> bool:
        return config.parallel.cp_size == 1

    def build(self, hf_model, state) -> None:
        backend = text_attention(hf_model)
        self.varlen = is_varlen(backend)
        self.spans = backend in ("sdpa", "eager")
        self.image_blocks = image_blocks(hf_model)
        self.linear = linear_attention_layers(hf_model)
        for layer in self.linear:
            layer.forward = by_document(layer.forward)
        # A branch goes on from its trunk's state at its first position, which a linear layer run document by
        # document does not keep.
        self.keeps_shared_prefixes = self.spans and not self.linear
        if self.spans:
            AttentionInterface.register(DOCUMENTS, partial(document_attention, backend=backend))
            set_text_attention(hf_model, DOCUMENTS)

    def transform(self, inputs: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        positions = document_positions(inputs)
        added = {"document_bounds": document_bounds(positions)} if self.linear else {}
        if self.spans:
            blocks = self.image_blocks and self.image_blocks(inputs["input_ids"])
            added.update(document_positions=positions, document_spans=document_spans(positions, None, blocks))
            if blocks is not None:
                added["image_blocks"] = blocks
        elif self.varlen:
            added.update(varlen_kwargs(positions))
        return {**inputs, **added}
