"""Completions from the model a run trains, or from a model folder: the engine, prompts, scorers and the evaluation
by generation."""
