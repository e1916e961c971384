"""Rewrite the recipe reference table in README.md from the config dataclasses: python docs/recipe_table.py"""

from pathlib import Path

from llmtune.config import reference_table

README = Path(__file__).resolve().parents[1] / "README.md"
START, END = "| key | default | meaning |", "\n\n## "

text = README.read_text()
begin = text.index(START)
README.write_text(text[:begin] + reference_table() + text[text.index(END, begin):])
