"""Rewrite docs/models.md from the support matrix the tests train: python docs/models_table.py"""

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from tests.model_matrix import table  # noqa: E402  (the repository root is importable only from here on)

(ROOT / "docs" / "models.md").write_text(table())
