"""`llmtune score MODEL_DIR FILE`: a reward model's folder (an `llmtune rm` run's output_dir/hf, or any sequence
classifier of one label) scores a JSONL file of prompts and responses, one number per row, through grpo's scorer
(generation/reward_model.py), which renders each row as rm training renders a pair's sequence: printed one per line,
or written with each row (--out, whole or not at all). Every row is read and rendered, and any refused, before the
weights load."""

import json
from argparse import Namespace
from pathlib import Path

from llmtune.atomic import write_text
from llmtune.data.formats import prompt_problem
from llmtune.errors import UserError
from llmtune.generation.prompts import json_lines

FORM = ("write each row as {\"prompt\": ..., \"completion\": ...} (both strings, or both lists of messages), or "
        "{\"messages\": [...]} ending with the assistant's answer")


def read_rows(path: str) -> list[tuple[int, dict]]:
    """(line number, JSON object) of each row of a JSONL file, one a line (blank lines skipped)."""
    rows = []
    for number, row in json_lines(path):
        if not isinstance(row, dict):
            raise UserError(f"{path}: line {number} is not a JSON object; {FORM}")
        rows.append((number, row))
    if not rows:
        raise UserError(f"{path}: no rows to score; {FORM}")
    return rows


def is_messages(value) -> bool:
    """A non-empty list of {"role", "content"} strings (TRL's conversational form)."""
    return isinstance(value, list) and prompt_problem(value) is None


def scored_parts(row: dict, where: str) -> tuple:
    """(prompt, completion, tools) of a row in TRL's forms: prompt + completion, both strings or both messages (the
    completion beginning with the assistant's answer), or one conversation, `messages`, whose last turn, the
    assistant's, is the completion; tools (a list of tool schemas) beside messages."""
    if "system" in row:
        raise UserError(f"{where}: a 'system' column is not read here; give the system text as the first message of "
                        "the prompt")
    if "prompt" in row or "completion" in row:
        prompt, completion = row.get("prompt"), row.get("completion")
        if completion is None or prompt is None:
            given, missing = ("prompt", "completion") if completion is None else ("completion", "prompt")
            raise UserError(f"{where}: a '{given}' but no '{missing}'; {FORM}")
        if problem := prompt_problem(prompt):
            raise UserError(f"{where}: {problem}")
        if isinstance(prompt, str) and not isinstance(completion, str) or \
                isinstance(prompt, list) and not is_messages(completion):
            raise UserError(f"{where}: 'prompt' is {'a string' if isinstance(prompt, str) else 'a list of messages'}"
                            f" and 'completion' is not; {FORM}")
    elif "messages" in row:
        messages = row["messages"]
        if not is_messages(messages) or len(messages) < 2 or messages[-1]["role"] != "assistant":
            raise UserError(f"{where}: 'messages' must be a list of messages ({{'role': ..., 'content': ...}}), the "
                            "prompt's turns and then the assistant's answer, the one scored")
        prompt, completion = messages[:-1], messages[-1:]
    else:
        raise UserError(f"{where}: no 'prompt' and 'completion' (nor 'messages'); {FORM}")
    if isinstance(completion, list) and completion[0]["role"] != "assistant":
        raise UserError(f"{where}: 'completion' must begin with the assistant's answer, not a "
                        f"{completion[0]['role']} turn")
    tools = row.get("tools")
    if tools is not None and not (isinstance(prompt, list) and isinstance(tools, list)
                                  and all(isinstance(tool, dict) for tool in tools)):
        raise UserError(f"{where}: 'tools' must be a list of tool schemas (JSON objects), beside a prompt of messages")
    return prompt, completion, tools


def checked_inputs(parsed: Namespace):
    """(the scorer, the rows, their sequences' token ids): every refusal made before the weights load."""
    from llmtune.generation.reward_model import BATCH_SIZE, RewardModel

    scorer = RewardModel(parsed.model_dir, parsed.batch or BATCH_SIZE)
    rows, sequences = [], []
    for number, row in read_rows(parsed.file):
        where = f"{parsed.file}: line {number}"
        prompt, completion, tools = scored_parts(row, where)
        sequences.append(scorer.sequence(prompt, completion, where, tools))
        rows.append(row)
    return scorer, rows, sequences


def run(parsed: Namespace) -> None:
    scorer, rows, sequences = checked_inputs(parsed)
    scores = scorer.scores(sequences)
    if parsed.out:
        write_scores(Path(parsed.out), rows, scores)
    else:
        print("\n".join(map(str, scores)))


def write_scores(out: Path, rows: list[dict], scores: list[float]) -> None:
    """`out` holds every row with its `score` (one the row has is replaced), whole, or what it held before."""
    try:
        write_text(out, "".join(json.dumps({**row, "score": score}) + "\n" for row, score in zip(rows, scores)))
    except OSError as err:
        raise UserError(f"--out: cannot write {out} ({err.strerror}); give a path in a folder you can write to") \
            from None
