"""Rows in the formats users bring -> one canonical form per task.

pt rows become {"text"}; sft rows become {"messages": [{"role", "content"}, ...]}; pre-tokenized
rows become {"input_ids", "labels"}. A row that does not fit its format is reported with the
source, the row number, the field and the format that was assumed.
"""

from llmtune.errors import UserError

# Columns that identify each format, in the order auto-detection tries them.
SFT_FORMATS = {
    "messages": ("messages",),
    "sharegpt": ("conversations",),
    "alpaca": ("instruction", "output"),
    "prompt_response": ("prompt", "response"),
}
PT_FORMATS = {"text": ("text",)}
TOKENIZED = {"tokenized": ("input_ids",)}
SHAREGPT_ROLES = {"human": "user", "user": "user", "gpt": "assistant", "assistant": "assistant",
                  "system": "system", "model": "assistant"}
CHAT_ROLES = ("system", "user", "assistant")


def detect_format(columns: list[str], task: str, requested: str, source: str) -> str:
    known = {**(PT_FORMATS if task == "pt" else SFT_FORMATS), **TOKENIZED}
    if requested != "auto":
        if requested not in known:
            raise UserError(f"data.format: {requested!r} is not a {task} format; use one of auto, {', '.join(known)}")
        missing = [c for c in known[requested] if c not in columns]
        if missing:
            raise UserError(f"{source}: data.format {requested} needs column(s) {', '.join(missing)}; the rows have "
                            f"{', '.join(columns)}")
        return requested
    for name, needed in known.items():
        if all(c in columns for c in needed):
            return name
    expected = " or ".join("/".join(cols) for cols in known.values())
    raise UserError(f"{source}: cannot tell the {task} format from the columns {', '.join(columns)}; expected "
                    f"{expected}, or set data.format")


def canonical_columns(fmt: str) -> tuple[str, ...]:
    if fmt == "text":
        return ("text",)
    if fmt == "tokenized":
        return ("input_ids", "labels")
    return ("messages",)


def to_canonical(row: dict, fmt: str, where: str) -> dict:
    """One row -> its canonical form; `where` names the source and row for error messages."""
    if fmt == "text":
        return {"text": _text(row, "text", fmt, where)}
    if fmt == "tokenized":
        input_ids = _token_list(row, "input_ids", where)
        labels = _token_list(row, "labels", where) if row.get("labels") is not None else list(input_ids)
        if len(labels) != len(input_ids):
            raise UserError(f"{where}: labels has {len(labels)} tokens but input_ids has {len(input_ids)}; "
                            "give one label per input token")
        return {"input_ids": input_ids, "labels": labels}
    return {"messages": _messages(row, fmt, where)}


def _messages(row: dict, fmt: str, where: str) -> list[dict]:
    if fmt == "prompt_response":
        return [_message("user", _text(row, "prompt", fmt, where)),
                _message("assistant", _text(row, "response", fmt, where))]
    if fmt == "alpaca":
        instruction = _text(row, "instruction", fmt, where)
        extra = row.get("input") or ""
        messages = [_message("system", row["system"])] if row.get("system") else []
        messages.append(_message("user", f"{instruction}\n\n{extra}" if extra else instruction))
        messages.append(_message("assistant", _text(row, "output", fmt, where)))
        return messages
    turns = row.get("conversations" if fmt == "sharegpt" else "messages")
    if not isinstance(turns, list) or not turns:
        raise UserError(f"{where}: data.format {fmt} needs a non-empty list in "
                        f"'{'conversations' if fmt == 'sharegpt' else 'messages'}'")
    messages = [_message("system", row["system"])] if fmt == "sharegpt" and row.get("system") else []
    role_key, content_key = ("from", "value") if fmt == "sharegpt" else ("role", "content")
    for number, turn in enumerate(turns):
        if not isinstance(turn, dict) or not isinstance(turn.get(content_key), str):
            raise UserError(f"{where}: turn {number} needs a string '{content_key}' (data.format {fmt})")
        role = turn.get(role_key)
        role = SHAREGPT_ROLES.get(role) if fmt == "sharegpt" else role
        if role not in CHAT_ROLES:
            raise UserError(f"{where}: turn {number} has {role_key} {turn.get(role_key)!r}; expected one of "
                            f"{', '.join(SHAREGPT_ROLES if fmt == 'sharegpt' else CHAT_ROLES)} (data.format {fmt})")
        messages.append(_message(role, turn[content_key]))
    return messages


def _message(role: str, content: str) -> dict:
    return {"role": role, "content": content}


def _text(row: dict, field: str, fmt: str, where: str) -> str:
    value = row.get(field)
    if not isinstance(value, str):
        raise UserError(f"{where}: field '{field}' is {'missing' if value is None else 'not a string'} "
                        f"(data.format {fmt})")
    return value


def _token_list(row: dict, field: str, where: str) -> list[int]:
    value = row.get(field)
    if not isinstance(value, list) or not all(isinstance(t, int) for t in value):
        raise UserError(f"{where}: field '{field}' must be a list of token ids (data.format tokenized)")
    return value
