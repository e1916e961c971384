from llmtune.cli import entry_point

entry_point()
