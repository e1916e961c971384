"""Rows in the forms users bring -> one canonical form per kind of rows (tasks/registry.py's `rows`).

Documents (pt) become {"text"}; pre-tokenized rows {"input_ids", "labels"}; conversations (sft) {"sample"}, one JSON
value that is either a conversation {"messages", "tools", "prompt_turns"} or a text pair {"prompt", "completion"}
(TRL's prompt-completion form with strings, trained without a chat template, as TRL trains it); preference pairs
(dpo) {"pair"}, one JSON value {"prompt", "chosen", "rejected", "tools"}: the prompt a list of messages and each
response a list of the messages that answer it, or all three strings (TRL's standard form, no chat template); KTO's
examples (kto) {"example", "desirable", "where"}: one JSON value {"prompt", "completion", "tools"} as a pair's, its
label as 1.0 (desirable) or 0.0, and the source and row it was read from (its tokenization follows the mix of the
sources, unpaired.py, and its errors name the row). The JSON value keeps tool-call arguments and tool schemas exactly
as written: Arrow columns of nested objects would give every row the union of all rows' keys, with nulls, which a
template would render.

A canonical message has a role (system, developer, user, assistant, tool), a string content, and where given
tool_calls (assistant; content may then be null or empty), reasoning_content (assistant; read from
reasoning_content, thinking or reasoning), tool_call_id and name (tool). A row that does not fit its form is
reported with the source, the row number, the field and the form that was assumed.
"""

import json
from dataclasses import dataclass, field
from pathlib import Path

from llmtune.data import images
from llmtune.errors import UserError
from llmtune.tasks.registry import CONVERSATIONS, DOCUMENTS, PAIRS, PROMPTS, TASKS, UNPAIRED

CHAT_ROLES = ("system", "developer", "user", "assistant", "tool")
REASONING_KEYS = ("reasoning_content", "thinking", "reasoning")
# Keys of a message kept besides role and content.
MESSAGE_KEYS = ("tool_call_id", "name")
FUNCTION_CALL = "function_call"  # LLaMA-Factory's turn holding an assistant's tool call(s) as JSON text
KTO_LABEL = "label"  # the label column of TRL's KTO form and of LLaMA-Factory's KTO files (their kto_tag)

# A canonical prompt: the row as read, one JSON value (its columns may hold anything a reward function reads).
PROMPT_ROW = "prompt_row"


# TRL's column of a pair's margin (its RewardTrainer's): in a built row, one value per sequence, 0.0 where the data has
# none.
MARGIN = "margin"


def prompt_problem(prompt) -> str | None:
    """What is wrong with a `prompt` value, or None: TRL's prompt-only forms, a string or a list of messages."""
    if isinstance(prompt, str):
        return None
    if isinstance(prompt, list) and prompt and all(isinstance(m, dict) and isinstance(m.get("role"), str)
                                                   and isinstance(m.get("content"), str) for m in prompt):
        return None
    if isinstance(prompt, list) and any(isinstance(m, dict) and isinstance(m.get("content"), list) for m in prompt):
        return ("the prompt's turns hold content parts (images); llmtune grpo samples from text prompts alone so far "
                "(sft and dpo train on images): give each turn's content as a string")
    return ("'prompt' must be a string or a list of messages ({'role': ..., 'content': ...}), as TRL's "
            "prompt-only datasets hold it")


# Each form's columns (role in the form -> column name), as auto-detection and LLaMA-Factory's defaults name them;
# the required ones identify the form.
FORMS = {
    "text": ({"text": "text"}, ("text",)),
    "messages": ({"messages": "messages", "system": "system", "tools": "tools", "images": "images"}, ("messages",)),
    "sharegpt": ({"messages": "conversations", "system": "system", "tools": "tools", "images": "images"},
                 ("messages",)),
    "alpaca": ({"prompt": "instruction", "query": "input", "response": "output", "system": "system",
                "history": "history", "tools": "tools"}, ("prompt", "response")),
    "prompt_completion": ({"prompt": "prompt", "completion": "completion", "tools": "tools"},
                          ("prompt", "completion")),
    "prompt_response": ({"prompt": "prompt", "response": "response", "system": "system"}, ("prompt", "response")),
    "tokenized": ({"input_ids": "input_ids", "labels": "labels"}, ("input_ids",)),
    # TRL's preference forms: explicit prompt (with llmtune's optional system) and implicit prompt.
    "prompt_chosen_rejected": ({"prompt": "prompt", "chosen": "chosen", "rejected": "rejected", "system": "system",
                                "tools": "tools", "images": "images"}, ("prompt", "chosen", "rejected")),
    "chosen_rejected": ({"chosen": "chosen", "rejected": "rejected", "tools": "tools"}, ("chosen", "rejected")),
    # LLaMA-Factory's ranking: true entries of its two formattings.
    "alpaca_ranking": ({"prompt": "instruction", "query": "input", "chosen": "chosen", "rejected": "rejected",
                        "system": "system", "history": "history", "tools": "tools"}, ("prompt", "chosen", "rejected")),
    "sharegpt_ranking": ({"messages": "conversations", "chosen": "chosen", "rejected": "rejected", "system": "system",
                          "tools": "tools", "images": "images"}, ("messages", "chosen", "rejected")),
    # TRL's unpaired (KTO) form, with llmtune's optional system; LLaMA-Factory's KTO entries of its two formattings
    # (kto_tag names the label column), and its kto_en_demo file (role/content messages) given by path.
    "prompt_completion_label": ({"prompt": "prompt", "completion": "completion", "kto_tag": KTO_LABEL,
                                 "system": "system", "tools": "tools"}, ("prompt", "completion", "kto_tag")),
    "alpaca_kto": ({"prompt": "instruction", "query": "input", "response": "output", "kto_tag": KTO_LABEL,
                    "system": "system", "history": "history", "tools": "tools"}, ("prompt", "response", "kto_tag")),
    "sharegpt_kto": ({"messages": "conversations", "kto_tag": KTO_LABEL, "system": "system", "tools": "tools"},
                     ("messages", "kto_tag")),
    "messages_kto": ({"messages": "messages", "kto_tag": KTO_LABEL, "system": "system", "tools": "tools"},
                     ("messages", "kto_tag")),
    # TRL's prompt-only forms (grpo): the other columns are kept for the reward functions.
    "prompt_only": ({"prompt": "prompt"}, ("prompt",)),
}
# The forms of each kind of rows, in the order auto-detection tries them (a form whose columns are a subset of
# another's comes after it).
ROWS_FORMS = {
    DOCUMENTS: ("text", "tokenized"),
    CONVERSATIONS: ("messages", "sharegpt", "alpaca", "prompt_completion", "prompt_response", "tokenized"),
    PAIRS: ("prompt_chosen_rejected", "alpaca_ranking", "sharegpt_ranking", "chosen_rejected"),
    UNPAIRED: ("prompt_completion_label", "alpaca_kto", "sharegpt_kto", "messages_kto"),
    PROMPTS: ("prompt_only",),
}
# LLaMA-Factory's formattings of a ranking: true entry (dpo's) and of a kto_tag entry (kto's) -> the form that reads
# it; the other kinds of rows read a formatting as the form of its name.
ENTRY_FORMS = {PAIRS: {"alpaca": "alpaca_ranking", "sharegpt": "sharegpt_ranking"},
               UNPAIRED: {"alpaca": "alpaca_kto", "sharegpt": "sharegpt_kto"}}
SHAREGPT_FORMS = ("sharegpt", "sharegpt_ranking", "sharegpt_kto")
# How a message names its role and content, and which role names mean what (LLaMA-Factory's sharegpt tags).
MESSAGE_TAGS = {"role_tag": "role", "content_tag": "content"}
SHAREGPT_TAGS = {"role_tag": "from", "content_tag": "value", "user_tag": "human", "assistant_tag": "gpt",
                 "observation_tag": "observation", "function_tag": FUNCTION_CALL, "system_tag": "system"}
TAG_ROLES = {"user_tag": "user", "assistant_tag": "assistant", "observation_tag": "tool",
             "function_tag": FUNCTION_CALL, "system_tag": "system"}
# Columns that tell the kind of rows a source holds (TRL's preference forms, LLaMA-Factory's dpo and kto files and
# its v1 chosen_messages/rejected_messages), whether given by path or as the column roles of a LLaMA-Factory
# dataset_info.json entry (registry.py, where the entry's ranking: true is read as such a column too). A task whose
# rows are of another kind refuses them, rather than reading preference rows as a conversation or dropping them with
# no label. TRL's KTO form names its column `label`, as other data does: only true/false values mark it.
KIND_COLUMNS = {"chosen": PAIRS, "rejected": PAIRS, "chosen_messages": PAIRS, "rejected_messages": PAIRS,
                "ranking": PAIRS, "kto_tag": UNPAIRED}
KIND_DATA = {PAIRS: "preference data (chosen/rejected columns, or ranking: true)",
             UNPAIRED: "KTO data (kto_tag, or a true/false label column)"}
# What a KTO label may be besides a JSON boolean: the text a CSV column holds (sources.py reads every one as text).
LABEL_TEXTS = {"true": 1.0, "false": 0.0}


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
        base = SHAREGPT_TAGS if form in SHAREGPT_FORMS else MESSAGE_TAGS
        return cls(form, dict(chosen), {**base, **(tags or {})})

    def required(self) -> list[str]:
        return [self.columns.get(role, FORMS[self.form][0][role]) for role in FORMS[self.form][1]]

    def roles(self) -> dict[str, str]:
        """Role name in the rows -> canonical role (or function_call). Canonical names always pass."""
        named = {self.tags[tag]: role for tag, role in TAG_ROLES.items() if self.tags.get(tag)}
        return {**{role: role for role in CHAT_ROLES}, "model": "assistant", **named}


def detect_format(columns: list[str], task: str, requested: str, source: str) -> RowFormat:
    forms = ROWS_FORMS[TASKS[task].rows]
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


def other_rows_error(where: str, marks: list[str], boolean_label: bool, task: str, key: str) -> UserError | None:
    """The error for rows whose columns (or dataset_info.json flags) `marks` say they are not `task`'s kind of rows,
    or None; `boolean_label`: their label column holds true/false."""
    kinds = [KIND_COLUMNS[mark] for mark in marks if mark in KIND_COLUMNS] + ([UNPAIRED] if boolean_label else [])
    other = next((kind for kind in kinds if kind != TASKS[task].rows), None)
    if other is None:
        return None
    tasks = " or ".join(f"llmtune {name}" for name, entry in TASKS.items() if entry.rows == other)
    return UserError(f"{where}: {KIND_DATA[other]} is for {tasks}, not {task}; train it with {tasks}, or leave it out "
                     f"of {key}")


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
    if form in ROWS_FORMS[UNPAIRED]:
        return ("example", "desirable", "where")
    if form in ROWS_FORMS[PROMPTS]:
        return (PROMPT_ROW,)
    return ("pair",) if form in ROWS_FORMS[PAIRS] else ("sample",)


def to_canonical(row: dict, row_format: RowFormat, where: str, media_dir: Path | None = None) -> dict:
    """One row -> its canonical form; `where` names the source and row for error messages; `media_dir`: where its
    relative image paths are found first (images.reference)."""
    reader = _Row(row, row_format, where, media_dir)
    if row_format.form == "text":
        return {"text": reader.text("text")}
    if row_format.form == "tokenized":
        input_ids = reader.token_list("input_ids")
        labels = reader.token_list("labels") if reader.get("labels") is not None else list(input_ids)
        if len(labels) != len(input_ids):
            raise UserError(f"{where}: labels has {len(labels)} tokens but input_ids has {len(input_ids)}; "
                            "give one label per input token")
        return {"input_ids": input_ids, "labels": labels}
    if row_format.form in ROWS_FORMS[PAIRS]:
        return {"pair": reader.pair()}
    if row_format.form in ROWS_FORMS[UNPAIRED]:
        return {"example": reader.example(), "desirable": reader.desirable(), "where": where}
    if row_format.form in ROWS_FORMS[PROMPTS]:
        return {PROMPT_ROW: reader.prompt_row()}
    return {"sample": reader.sample()}


class _Row:
    """One row read through its RowFormat's column names."""

    def __init__(self, row: dict, row_format: RowFormat, where: str, media_dir: Path | None = None):
        self.row, self.format, self.where, self.media_dir = row, row_format, where, media_dir
        self.named = f"data.format {row_format.form}"
        self.inline = []  # images given in the turns themselves (TRL's {"type": "image", "image": ...} parts)

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
        if found := self.images(messages):
            sample["images"] = found
        return sample

    def images(self, messages: list[dict]) -> list[str]:
        """The sample's images (images.reference): the images column's, or those given in the turns, as many as the
        turns' markers."""
        column = self.get("images")
        if column is not None and not isinstance(column, list):
            column = [column]
        if column and self.inline:
            raise UserError(f"{self.where}: images given both in the '{self.column('images')}' column and in the "
                            "turns; give them in one place")
        given = column or self.inline
        if given or images.count_markers(messages):
            images.check_count(messages, given, self.where)
        return [images.reference(image, self.media_dir, self.where) for image in given]

    def prompt_row(self) -> dict:
        """grpo's prompt: the row with its prompt under `prompt`, every other column as given."""
        prompt = self.row.get(self.column("prompt"))
        if problem := prompt_problem(prompt):
            raise UserError(f"{self.where}: {problem}")
        return {**self.row, "prompt": prompt}

    def pair(self) -> dict:
        """The canonical pair: {"prompt", "chosen", "rejected"} (and "tools"), all messages or all strings, and its
        "margin" where the row gives one (TRL's column, which rm's loss subtracts)."""
        pair = self._pair()
        margin = self.row.get(MARGIN)
        if margin is None:
            return pair
        if isinstance(margin, bool) or not isinstance(margin, (int, float)):
            raise UserError(f"{self.where}: field '{MARGIN}' must be a number (how far the chosen response's reward "
                            f"should exceed the rejected one's), not {margin!r}")
        return {**pair, MARGIN: float(margin)}

    def _pair(self) -> dict:
        form = self.format.form
        chosen, rejected = (self.response(role, "every pair needs a chosen and a rejected response")
                            for role in ("chosen", "rejected"))
        if form == "alpaca_ranking":
            prompt = self.system() + self.history() + [_message("user", self.instruction())]
            chosen, rejected = ([_message("assistant", self.text(role))] for role in ("chosen", "rejected"))
        elif form == "sharegpt_ranking":
            turns = self.get("messages")
            if not isinstance(turns, list) or not turns:
                raise UserError(f"{self.where}: field '{self.column('messages')}' needs a non-empty list of "
                                f"messages, the conversation before the answer ({self.named})")
            prompt = self.system() + self.messages(turns, self.column("messages"))
            chosen, rejected = (self.messages([self.answer(role)], self.column(role))
                                for role in ("chosen", "rejected"))
        else:
            explicit = form == "prompt_chosen_rejected"
            given = [chosen, rejected, self.get("prompt")] if explicit else [chosen, rejected]
            if not (all(isinstance(value, str) for value in given) or all(isinstance(value, list) for value in given)):
                named = "'prompt', 'chosen' and 'rejected'" if explicit else "'chosen' and 'rejected'"
                raise UserError(f"{self.where}: fields {named} must all be strings or all lists of messages "
                                f"({self.named})")
            if isinstance(chosen, list):
                chosen, rejected = (self.messages(value, self.column(role))
                                    for role, value in (("chosen", chosen), ("rejected", rejected)))
            if not explicit:
                prompt, chosen, rejected = self.shared_prompt(chosen, rejected)
            elif isinstance(given[2], list):
                prompt = self.system() + self.messages(given[2], self.column("prompt"))
            else:
                prompt = given[2]
        if isinstance(prompt, str):
            return self.strings({"prompt": prompt, "chosen": chosen, "rejected": rejected}, "pairs")
        if not prompt:
            raise UserError(f"{self.where}: the pair has no prompt: chosen and rejected share no leading turn; give "
                            f"the turns before the answer as the prompt ({self.named})")
        return self.conversation(prompt, {"chosen": chosen, "rejected": rejected})

    def example(self) -> dict:
        """The canonical KTO example: {"prompt", "completion"} (and "tools"), messages or both strings. LLaMA-Factory's
        conversations end with the completion, the assistant's last turn; the turns before it are the prompt."""
        form = self.format.form
        if form == "prompt_completion_label":
            prompt, completion = self.get("prompt"), self.response("completion", "every example needs a completion")
            if isinstance(prompt, str) and isinstance(completion, str):
                return self.strings({"prompt": prompt, "completion": completion}, "examples")
            if not (isinstance(prompt, list) and isinstance(completion, list)):
                raise UserError(f"{self.where}: fields '{self.column('prompt')}' and '{self.column('completion')}' "
                                f"must both be strings or both lists of messages ({self.named})")
            prompt = self.system() + self.messages(prompt, self.column("prompt"))
            completion = self.messages(completion, self.column("completion"))
        elif form == "alpaca_kto":
            prompt = self.system() + self.history() + [_message("user", self.instruction())]
            completion = [_message("assistant", self.text("response"))]
        else:
            turns = self.get("messages")
            if not isinstance(turns, list) or not turns:
                raise UserError(f"{self.where}: field '{self.column('messages')}' needs a non-empty list of "
                                f"messages, the conversation and its answer ({self.named})")
            messages = self.system() + self.messages(turns, self.column("messages"))
            if messages[-1]["role"] != "assistant":
                raise UserError(f"{self.where}: field '{self.column('messages')}' must end with the assistant's "
                                f"answer, the completion, not a {messages[-1]['role']} turn ({self.named})")
            prompt, completion = messages[:-1], messages[-1:]
        if not prompt:
            raise UserError(f"{self.where}: the example has no prompt; give the turns before the answer ({self.named})")
        return self.conversation(prompt, {"completion": completion})

    def desirable(self) -> float:
        """A KTO label as the loss weighs it: 1.0 desirable, 0.0 undesirable. A JSON boolean, or its text (CSV)."""
        value = self.get("kto_tag")
        if isinstance(value, bool):
            return float(value)
        if isinstance(value, str) and value.strip().lower() in LABEL_TEXTS:
            return LABEL_TEXTS[value.strip().lower()]
        raise UserError(f"{self.where}: field '{self.column('kto_tag')}' is {value!r}, not a boolean; label every "
                        f"example true (desirable) or false (undesirable) ({self.named})")

    def response(self, role: str, needed: str):
        """A value every row must give (a pair's chosen and rejected, an example's completion); `needed` says so."""
        value = self.get(role)
        if value is None or (isinstance(value, (str, list, dict)) and not value):
            raise UserError(f"{self.where}: field '{self.column(role)}' is {'missing' if value is None else 'empty'}; "
                            f"{needed} ({self.named})")
        return value

    def answer(self, role: str) -> dict:
        """LLaMA-Factory's sharegpt ranking: chosen and rejected are each one message object."""
        value = self.get(role)
        if not isinstance(value, dict):
            tags = self.format.tags
            raise UserError(f"{self.where}: field '{self.column(role)}' must be one message object, e.g. "
                            f'{{"{tags["role_tag"]}": "{tags.get("assistant_tag", "assistant")}", '
                            f'"{tags["content_tag"]}": "..."}} ({self.named})')
        return value

    def shared_prompt(self, chosen, rejected) -> tuple:
        """TRL's implicit prompt: what chosen and rejected begin with alike, turns of conversations or characters of
        strings (where the first difference follows a space, the space goes with the responses, as TRL's
        extract_prompt splits)."""
        shared = next((i for i, (a, b) in enumerate(zip(chosen, rejected)) if a != b), min(len(chosen), len(rejected)))
        if isinstance(chosen, str) and 0 < shared < min(len(chosen), len(rejected)) and chosen[shared - 1] == " ":
            shared -= 1
        for role, value in (("chosen", chosen), ("rejected", rejected)):
            if len(value) == shared:
                raise UserError(f"{self.where}: field '{self.column(role)}' holds nothing besides the beginning it "
                                f"shares with the other response, which is read as the prompt; chosen and rejected "
                                f"must differ after it ({self.named})")
        return chosen[:shared], chosen[shared:], rejected[shared:]

    def strings(self, values: dict[str, str], unit: str) -> dict[str, str]:
        """TRL's string forms (a pair's, an example's: `unit`), trained without a chat template: nothing could render
        a system text or tools."""
        for role in ("system", "tools"):
            if self.get(role):
                fields = ", ".join(list(values)[:-1]) + f" and {list(values)[-1]}"
                raise UserError(f"{self.where}: field '{self.column(role)}' needs a chat template, and string {unit} "
                                f"are trained without one; give {fields} as lists of messages ({self.named})")
        return values

    def conversation(self, prompt: list[dict], responses: dict[str, list[dict]]) -> dict:
        """A prompt and its responses (a pair's chosen and rejected, an example's completion), each beginning with the
        assistant's answer, and the row's tools."""
        for role, response in responses.items():
            if response[0]["role"] != "assistant":
                raise UserError(f"{self.where}: field '{self.column(role)}' must begin with the assistant's answer to "
                                f"the prompt, not a {response[0]['role']} turn ({self.named})")
            _check_tool_turns(prompt + response, self.where, self.named)
        conversation = {"prompt": prompt, **responses}
        tools = self.tools()
        if tools:
            conversation["tools"] = tools
        # A pair's images are its prompt's: both sequences hold them (TRL's DPO on vision-language models).
        if found := self.images(prompt):
            conversation["images"] = found
        return conversation

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
                            else _read_message(turn, role, content_key, where, self.inline))
        return messages


def _message(role: str, content: str) -> dict:
    return {"role": role, "content": content}


def _read_message(turn: dict, role: str, content_key: str, where: str, inline: list) -> dict:
    content = turn.get(content_key)
    if isinstance(content, list):
        content = _parts_text(content, where, inline)
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


def _parts_text(parts: list, where: str, inline: list) -> str:
    """TRL's content of typed parts ({"type": "text", "text": ...}, {"type": "image"}) -> the turn's text, each image
    part an image marker where it stands; an image the part holds itself ("image", "url" or "path") is added to
    `inline`, the sample's images in order."""
    text = ""
    for part in parts:
        kind = part.get("type") if isinstance(part, dict) else None
        if kind == "text" and isinstance(part.get("text"), str):
            text += part["text"]
        elif kind == "image":
            text += images.IMAGE
            held = next((part[key] for key in ("image", "url", "path") if part.get(key) is not None), None)
            if held is not None:
                inline.append(held)
        elif kind in ("video", "audio"):
            raise UserError(f"{where}: a {kind} part; llmtune reads images and text, not {kind}s")
        else:
            raise UserError(f"{where}: a content part must be {{\"type\": \"text\", \"text\": ...}} or "
                            f"{{\"type\": \"image\"}}, not {part!r}")
    return text


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
