"""Packed documents kept apart by the attention without a mask of the whole row, on one rank per sequence
(llmtune/model/attention.py; under context parallelism, features/ulysses.py does the same around its all-to-all).

A feature on when cp_size is 1, acting at two points:
- build: with sdpa or eager, installs `attention.document_attention` around the backend, so that transformers
  builds no [S, S] mask and the attention goes document span by span. flex attention builds a block-sparse
  mask of its own and needs nothing.
- transform: adds to every micro-batch what the attention reads: the document positions and their layout (read here,
  on the host copy: Trainer.prepare) for document_attention, or for a varlen backend (flash attention, Hub kernels)
  the documents' boundaries as cu_seq_lens.
"""

from functools import partial

import torch
from transformers import AttentionInterface

from llmtune.features.base import Feature
from llmtune.model.attention import (DOCUMENTS, document_attention, document_positions, document_spans, is_varlen,
                                    varlen_kwargs)
from llmtune.model.multimodal import set_text_attention, text_attention


class PackedDocuments(Feature):
    name = "packed_documents"
    on_reference = True

    @staticmethod
    def enabled(config) -> bool:
        return config.parallel.cp_size == 1

    def build(self, hf_model, state) -> None:
        backend = text_attention(hf_model)
        self.varlen = is_varlen(backend)
        self.spans = self.keeps_shared_prefixes = backend in ("sdpa", "eager")
        if self.spans:
            AttentionInterface.register(DOCUMENTS, partial(document_attention, backend=backend))
            set_text_attention(hf_model, DOCUMENTS)

    def transform(self, inputs: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        if self.spans:
            positions = document_positions(inputs)
            return {**inputs, "document_positions": positions, "document_spans": document_spans(positions)}
        if self.varlen:
            return {**inputs, **varlen_kwargs(document_positions(inputs))}
        return inputs
