"""Self-contained demo: generated corpus, addition task, tokenizer, tiny model config, evaluation."""
