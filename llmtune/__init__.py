"""llmtune: FSDP2 fine-tuning of HF causal language models, correct by construction."""

__version__ = "0.1.0"
