"""DataManager: sources -> transforms (pt packing | sft templating) -> sampler -> loader."""
