from llmtune.run.cli import entry_point

entry_point()
