"""docs/models.md is the support matrix the tests train, rendered: it cannot list a family they skip."""

from tests.helpers import REPO
from tests.model_matrix import table


def test_models_doc_is_rendered_from_the_tested_matrix():
    assert (REPO / "docs" / "models.md").read_text() == table(), "docs/models.md is stale: python docs/models_table.py"
