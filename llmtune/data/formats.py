"""Rows in the forms users bring -> one canonical form per task.

pt rows become {"text"}; pre-tokenized rows {"input_ids", "labels"}; sft rows {"sample"}, one JSON value that is
either a conversation {"messages", "tools", "prompt_turns"} or a text pair {"prompt", "completion"} (TRL's
prompt-completion form with strings, trained without a chat template, as TRL trains it). The JSON value keeps
tool-call arguments and tool schemas exactly as written: Arrow columns of nested objects would give every row the
union of all rows' keys, with nulls, which a template would render.

A canonical message has a role (system, developer, user, assistant, tool), a string content, and where given
tool_calls (assistant; content may then be null or empty), reasoning_content (assistant; read from
reasoning_content, thinking or reasoning), tool_call_id and name (tool). A row that does not fit its form is
reported with the source, the row number, the field and the form that was assumed.
"""

import json
from dataclasses import dataclass, field

from llmtune.errors import UserError

CHAT_ROLES = ("system", "developer", "user", "assistant", "tool")
REASONING_KEYS = ("reasoning_content", "thinking", "reasoning")
# Keys of a message kept besides role and content.
MESSAGE_KEYS = ("tool_call_id", "name")
FUNCTION_CALL = "function_call"  # LLaMA-Factory's turn holding an assistant's tool call(s) as JSON text

# Each form's columns (role in the form -> column name), as auto-detection and LLaMA-Factory's defaults name them;
# the required ones identify the form, in the order auto-detection tries them.
FORMS = {
    "text": ({"text": "text"}, ("text",)),
    "messages": ({"messages": "messages", "system": "system", "tools": "tools"}, ("messages",)),
    "sharegpt": ({"messages": "conversations", "system": "system", "tools": "tools"}, ("messages",)),
    "alpaca": ({"prompt": "instruction", "query": "input", "response": "output", "system": "system",
                "history": "history", "tools": "tools"}, ("prompt", "response")),
    "prompt_completion": ({"prompt": "prompt", "completion": "completion", "tools": "tools"},
                          ("prompt", "completion")),
    "prompt_response": ({"prompt": "prompt", "response": "response", "system": "system"}, ("prompt", "response")),
    "tokenized": ({"input_ids": "input_ids", "labels": "labels"}, ("input_ids",)),
}
PT_FORMS = ("text", "tokenized")
SFT_FORMS = ("messages", "sharegpt", "alpaca", "prompt_completion", "prompt_response", "tokenized")
# How a message names its role and content, and which role names mean what (LLaMA-Factory's sharegpt tags).
MESSAGE_TAGS = {"role_tag": "role", "content_tag": "content"}
SHAREGPT_TAGS = {"role_tag": "from", "content_tag": "value", "user_tag": "human", "assistant_tag": "gpt",
                 "observation_tag": "observation", "function_tag": FUNCTION_CALL, "system_tag": "system"}
TAG_ROLES = {"user_tag": "user", "assistant_tag": "assistant", "observation_tag": "tool",
             "function_tag": FUNCTION_CALL, "system_tag": "system"}
# Rows llmtune does not train, told by their columns (TRL's preference forms, LLaMA-Factory's dpo and kto files and
# its v1 chosen_messages/rejected_messages), whether given by path or as the column roles of a LLaMA-Factory
# dataset_info.json entry (registry.py). TRL's KTO form names its column `label`, as other data does: only true/false
# values mark it.
PREFERENCE = "preference data (chosen/rejected columns) is for DPO or reward training, not sft or pt"
KTO = "KTO data (kto_tag, or a true/false label column) is for KTO training, not sft or pt"
NOT_SFT_COLUMNS = {"chosen": PREFERENCE, "rejected": PREFERENCE, "chosen_messages": PREFERENCE,
                   "rejected_messages": PREFERENCE, "kto_tag": KTO}
KTO_LABEL = "label"


@dataclass(frozen=True)
class RowFormat:
    """How one source's rows are read: the form, its columns (role -> column name) and, for conversations, the
    message tags. From auto-detection (every column of the form that the rows have) or a LLaMA-Factory
    dataset_info.json entry (the columns it lists)."""
    form: str
    columns: dict = field(default_factory=dict)
    tags: dict = field(default_factory=dict)

    @classmethod
    def of(cls, form: str, present: list[str] | None = None, columns: dict | None = None, tags: dict | None = None):
        """`present`: the rows' columns, for the defaults (an optional column is read where the rows have it)."""
        defaults, _ = FORMS[form]
        chosen = columns if columns is not None else \
            {role: column for role, column in defaults.items() if present is None or column in present}
        base = SHAREGPT_TAGS if form == "sharegpt" else MESSAGE_TAGS
        return cls(form, dict(chosen), {**base, **(tags or {})})

    def required(self) -> list[str]:
        return [self.columns.get(role, FORMS[self.form][0][role]) for role in FORMS[self.form][1]]

    def roles(self) -> dict[str, str]:
        """Role name in the rows -> canonical role (or function_call). Canonical names always pass."""
        named = {self.tags[tag]: role for tag, role in TAG_ROLES.items() if self.tags.get(tag)}
        return {**{role: role for role in CHAT_ROLES}, "model": "assistant", **named}


def detect_format(columns: list[str], task: str, requested: str, source: str) -> RowFormat:
    forms = PT_FORMS if task == "pt" else SFT_FORMS
    if requested != "auto":
        if requested not in forms:
            raise UserError(f"data.format: {requested!r} is not a {task} format; use one of auto, {', '.join(forms)}")
        row_format = RowFormat.of(requested, columns)
        check_columns(row_format, columns, source, f"data.format {requested}")
        return row_format
    for form in forms:
        defaults, needed = FORMS[form]
        if all(defaults[role] in columns for role in needed):
            return RowFormat.of(form, columns)
    expected = " or ".join("/".join(FORMS[form][0][role] for role in FORMS[form][1]) for form in forms)
    raise UserError(f"{source}: cannot tell the {task} format from the columns {', '.join(columns)}; expected "
                    f"{expected}, or set data.format")


def not_sft_reason(columns: list[str], boolean_label: bool) -> str | None:
    """Why rows with these columns are neither sft nor pt data, or None; `boolean_label`: their label column holds
    true/false."""
    named = [NOT_SFT_COLUMNS[column] for column in columns if column in NOT_SFT_COLUMNS]
    return named[0] if named else KTO if boolean_label else None


def not_sft_error(where: str, reason: str, key: str) -> UserError:
    return UserError(f"{where}: {reason}; llmtune trains sft and pt, leave it out of {key}")


def check_columns(row_format: RowFormat, columns: list[str], source: str, named_by: str) -> None:
    missing = [c for c in row_format.required() if c not in columns]
    if missing:
        raise UserError(f"{source}: {named_by} needs column(s) {', '.join(missing)}; the rows have "
                        f"{', '.join(columns)}")


def canonical_columns(form: str) -> tuple[str, ...]:
    if form == "text":
        return ("text",)
    if form == "tokenized":
        return ("input_ids", "labels")
    return ("sample",)


def to_canonical(row: dict, row_format: RowFormat, where: str) -> dict:
    """One row -> its canonical form; `where` names the source and row for error messages."""
    reader = _Row(row, row_format, where)
    if row_format.form == "text":
        return {"text": reader.text("text")}
    if row_format.form == "tokenized":
        input_ids = reader.token_list("input_ids")
        labels = reader.token_list("labels") if reader.get("labels") is not None else list(input_ids)
        if len(labels) != len(input_ids):
            raise UserError(f"{where}: labels has {len(labels)} tokens but input_ids has {len(input_ids)}; "
                            "give one label per input token")
        return {"input_ids": input_ids, "labels": labels}
    return {"sample": reader.sample()}


class _Row:
    """One row read through its RowFormat's column names."""

    def __init__(self, row: dict, row_format: RowFormat, where: str):
        self.row, self.format, self.where = row, row_format, where
        self.named = f"data.format {row_format.form}"

    def column(self, role: str) -> str:
        return self.format.columns.get(role, FORMS[self.format.form][0].get(role, role))

    def get(self, role: str):
        return self.row.get(self.column(role)) if role in self.format.columns else None

    def text(self, role: str) -> str:
        value = self.get(role)
        if not isinstance(value, str):
            raise UserError(f"{self.where}: field '{self.column(role)}' is "
                            f"{'missing' if value is None else 'not a string'} ({self.named})")
        return value

    def token_list(self, role: str) -> list[int]:
        value = self.get(role)
        if not isinstance(value, list) or not all(isinstance(t, int) for t in value):
            raise UserError(f"{self.where}: field '{self.column(role)}' must be a list of token ids ({self.named})")
        return value

    def sample(self) -> dict:
        form = self.format.form
        prompt_turns = 0
        if form == "prompt_completion":
            prompt, completion = self.get("prompt"), self.get("completion")
            if isinstance(prompt, str) and isinstance(completion, str):
                return {"prompt": prompt, "completion": completion}
            if not (isinstance(prompt, list) and isinstance(completion, list)):
                raise UserError(f"{self.where}: fields 'prompt' and 'completion' must both be strings or both lists "
                                f"of messages ({self.named})")
            messages = self.messages(prompt, "prompt") + self.messages(completion, "completion", len(prompt))
            prompt_turns = len(prompt)
        elif form == "prompt_response":
            messages = self.system() + [_message("user", self.text("prompt")),
                                        _message("assistant", self.text("response"))]
        elif form == "alpaca":
            messages = self.system() + self.history() + [_message("user", self.instruction()),
                                                         _message("assistant", self.text("response"))]
        else:
            turns = self.get("messages")
            if not isinstance(turns, list) or not turns:
                raise UserError(f"{self.where}: field '{self.column('messages')}' needs a non-empty list of "
                                f"messages ({self.named})")
            messages = self.system() + self.messages(turns, self.column("messages"))
        _check_tool_turns(messages, self.where, self.named)
        sample = {"messages": messages, "prompt_turns": prompt_turns}
        tools = self.tools()
        if tools:
            sample["tools"] = tools
        return sample

    def system(self) -> list[dict]:
        system = self.get("system")
        if system is not None and not isinstance(system, str):
            raise UserError(f"{self.where}: field '{self.column('system')}' is not a string ({self.named})")
        return [_message("system", system)] if system else []

    def instruction(self) -> str:
        # Joined with one newline, as LLaMA-Factory joins them: a model trained there and here sees the same prompt.
        query = self.get("query")
        if query is not None and not isinstance(query, str):
            raise UserError(f"{self.where}: field '{self.column('query')}' is not a string ({self.named})")
        return "\n".join(part for part in (self.text("prompt"), query) if part)

    def history(self) -> list[dict]:
        history = self.get("history") or []
        pairs = []
        for number, pair in enumerate(history if isinstance(history, list) else [None]):
            if not (isinstance(pair, (list, tuple)) and len(pair) == 2 and all(isinstance(t, str) for t in pair)):
                raise UserError(f"{self.where}: field '{self.column('history')}' item {number} must be a pair "
                                f"[instruction, response] of strings ({self.named})")
            pairs += [_message("user", pair[0]), _message("assistant", pair[1])]
        return pairs

    def tools(self) -> list | None:
        tools = self.get("tools")
        if isinstance(tools, str):
            if not tools.strip():
                return None
            try:
                tools = json.loads(tools)
            except json.JSONDecodeError as err:
                raise UserError(f"{self.where}: field '{self.column('tools')}' is not valid JSON ({err.msg}); give a "
                                f"list of tool schemas ({self.named})") from None
        if tools is not None and not (isinstance(tools, list) and all(isinstance(t, dict) for t in tools)):
            raise UserError(f"{self.where}: field '{self.column('tools')}' must be a list of tool schemas (JSON "
                            f"objects) ({self.named})")
        return tools or None

    def messages(self, turns, field_name: str, first: int = 0) -> list[dict]:
        if not isinstance(turns, list):
            raise UserError(f"{self.where}: field '{field_name}' must be a list of messages ({self.named})")
        roles = self.format.roles()
        role_key, content_key = self.format.tags["role_tag"], self.format.tags["content_tag"]
        messages = []
        for number, turn in enumerate(turns, start=first):
            where = f"{self.where}: field '{field_name}' turn {number}"
            if not isinstance(turn, dict):
                raise UserError(f"{where} is not an object ({self.named})")
            role = roles.get(turn.get(role_key))
            if role is None:
                raise UserError(f"{where} has {role_key} {turn.get(role_key)!r}; expected one of "
                                f"{', '.join(roles)} ({self.named})")
            messages.append(_function_call(turn.get(content_key), where) if role == FUNCTION_CALL
                            else _read_message(turn, role, content_key, where))
        return messages


def _message(role: str, content: str) -> dict:
    return {"role": role, "content": content}


def _read_message(turn: dict, role: str, content_key: str, where: str) -> dict:
    content = turn.get(content_key)
    message = _message(role, "" if content is None else content)
    calls = turn.get("tool_calls")
    if role == "assistant" and calls:
        message["tool_calls"] = _tool_calls(calls, where)
    if not isinstance(content, str) and not (content is None and "tool_calls" in message):
        raise UserError(f"{where} needs a string '{content_key}' (null only beside tool_calls)")
    reasoning = next((turn[key] for key in REASONING_KEYS if turn.get(key) is not None), None)
    if reasoning is not None:
        if role != "assistant" or not isinstance(reasoning, str):
            raise UserError(f"{where}: reasoning ({'/'.join(REASONING_KEYS)}) must be a string, on an assistant turn")
        message["reasoning_content"] = reasoning
    message.update({key: turn[key] for key in MESSAGE_KEYS if turn.get(key) is not None})
    return message


def _function_call(value, where: str) -> dict:
    """LLaMA-Factory's function_call turn: JSON text of one call {"name", "arguments"} or a list of them."""
    try:
        calls = json.loads(value) if isinstance(value, str) else None
    except json.JSONDecodeError as err:
        raise UserError(f"{where}: a function_call turn holds JSON of a tool call ({err.msg})") from None
    return {"role": "assistant", "content": "", "tool_calls": _tool_calls(calls if isinstance(calls, list) else
                                                                           [calls], where)}


def _tool_calls(calls, where: str) -> list[dict]:
    """Tool calls in the form chat templates read: {"type": "function", "function": {"name", "arguments"}}
    (a call given as {"name", "arguments"} is put in it; arguments given as JSON text stay text)."""
    if not isinstance(calls, list):
        calls = [calls]
    out = []
    for call in calls:
        function = call.get("function", call) if isinstance(call, dict) else None
        if not isinstance(function, dict) or not isinstance(function.get("name"), str):
            raise UserError(f"{where}: a tool call needs a function name: {{\"name\": ..., \"arguments\": {{...}}}}")
        normal = {"type": "function", "function": {"name": function["name"],
                                                   "arguments": function.get("arguments", {})}}
        if isinstance(call, dict) and call.get("id") is not None:
            normal["id"] = call["id"]
        out.append(normal)
    return out


def _check_tool_turns(messages: list[dict], where: str, named: str) -> None:
    """A tool result answers a tool call: it follows an assistant turn with tool_calls, or another tool result."""
    for number, message in enumerate(messages):
        if message["role"] != "tool":
            continue
        before = next((m for m in reversed(messages[:number]) if m["role"] != "tool"), None)
        if before is None or not before.get("tool_calls"):
            after = f"after a {before['role']} turn" if before else "first"
            raise UserError(f"{where}: message {number} is a tool result {after} with no tool call before it; a "
                            f"tool (observation) turn must follow an assistant turn with tool_calls (function_call) "
                            f"({named})")
