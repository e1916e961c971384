"""benchmarks/llamafactory_real.py documents every option in --help, and its template check can fail: it reads a
folder laid out as ../shared/real is (a tokenizer, LLaMA-Factory's dataset_info.json and demo rows), written here,
and finds a template that renders LLaMA-Factory's rows otherwise. The real files are never read here (their runs are
by hand, docs/from-other-trainers.md)."""

import json
from pathlib import Path

from tests.helpers import byte_level_tokenizer, script_module, undocumented_options
from tests.unit.test_lf_templates import PLAIN_CHATML

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "llamafactory_real.py"


def test_help_documents_every_option():
    assert not undocumented_options(SCRIPT)


def test_the_template_check_counts_rows_alike_and_finds_those_that_are_not(tmp_path):
    benchmark = script_module(SCRIPT)
    byte_level_tokenizer(tmp_path / "tokenizers" / "plain-chatml", PLAIN_CHATML)
    data = tmp_path / "llamafactory" / "data"
    data.mkdir(parents=True)
    turn = [{"from": "human", "value": "\nWhat is 2 plus 3?"}, {"from": "gpt", "value": "It is 5. "}]
    rows = {"identity": [{"instruction": "What is 2 plus 3?", "input": "", "output": "It is 5."}],
            "alpaca_en_demo": [{"instruction": "Add 2 and 3.", "input": "", "output": "5"}],
            "dpo_en_demo": [{"conversations": turn[:1], "chosen": turn[1], "rejected": {"from": "gpt", "value": "6"}}],
            "kto_en_demo": [{"messages": turn, "label": True}]}
    info = {"identity": {"file_name": "identity.json"}, "alpaca_en_demo": {"file_name": "alpaca_en_demo.json"},
            "dpo_en_demo": {"file_name": "dpo_en_demo.json", "ranking": True, "formatting": "sharegpt",
                            "columns": {"messages": "conversations", "chosen": "chosen", "rejected": "rejected"}},
            "kto_en_demo": {"file_name": "kto_en_demo.json", "formatting": "sharegpt",
                            "columns": {"messages": "messages", "kto_tag": "label"}}}
    for name, found in rows.items():
        (data / f"{name}.json").write_text(json.dumps(found))
    (data / "dataset_info.json").write_text(json.dumps(info))
    records = {record["template"]: record for record in benchmark.check_templates(tmp_path, 10)}
    every_row = {name: 1 for name in rows}
    assert records["qwen3_nothink"]["trains with"] == "the model's own chat template"
    assert records["qwen3_nothink"]["rows alike"] == every_row
    assert records["qwen"]["trains with"] == "refused"  # its default system text, which the model's template lacks
    # The check itself: LLaMA-Factory's qwen (a default system text) against the plain ChatML llmtune trains with.
    demo = benchmark.demo_rows(data, 10)
    tokenizer = benchmark.encodes(tmp_path / "tokenizers" / "plain-chatml")
    from llmtune.data.lf_templates import TEMPLATES

    assert not any(benchmark.row_alike(tokenizer, TEMPLATES["qwen"], name, row)
                   for name, found in demo.items() for row in found)
