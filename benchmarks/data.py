"""Data pipeline benchmark: tokenization throughput, packing, and the cost of the tool-call forms.

It measures:
- tokenization throughput (samples/s) with the cache cold and warm, on a skewed length distribution;
- the share of non-pad tokens with packing vs padding to the longest in the batch, on the same rows;
- on a seeded tool-call corpus, the throughput of a cold sft build (read, convert, tokenize) of the same
  conversations in three forms: `messages` with tool calls, tools and (where the template renders it) reasoning;
  LLaMA-Factory sharegpt with function_call / observation turns and tools as JSON text; and, as the baseline, the
  old plain messages path (user/assistant text only), with each new form's throughput as a ratio of the baseline's.

    python benchmarks/data.py [--samples 20000] [--tool-samples 2000] [--repeats 3] [--tokenizer PATH]

Uses the demo's generated tokenizer with the built-in `basic` template; --tokenizer adds a run of the tool-call
corpus with that tokenizer and its own chat template. Everything is built in a temporary folder.
"""

import argparse
import json
import random
import tempfile
import time
from pathlib import Path
from unittest import mock

import datasets
from transformers import AutoTokenizer

from llmtune.config import DataConfig
from llmtune.data.build import build_datasets, load_or_build
from llmtune.data.templates import apply_recipe_template, render
from llmtune.demo.assets import write_demo_assets
from llmtune.run.parallel import ParallelState

CITIES = ("Paris", "Lagos", "Osaka", "Lima", "Oslo", "Denver")
CURRENCIES = ("EUR", "USD", "JPY", "GBP", "BRL")
# name -> (description, {parameter: (JSON type, values)}): each row offers 1-3 of them and calls one per round.
TOOLS = {
    "get_weather": ("Current weather in a city.",
                    {"city": ("string", CITIES), "unit": ("string", ("celsius", "fahrenheit"))}),
    "convert_currency": ("Convert an amount of money from one currency to another.",
                         {"amount": ("number", (12.5, 40, 250, 1999.99)), "source": ("string", CURRENCIES),
                          "target": ("string", CURRENCIES)}),
    "search_web": ("Search the web and return the titles of the best results.",
                   {"query": ("string", ("fsdp2 sharding", "sourdough starter", "tide tables", "bike repair")),
                    "max_results": ("integer", (3, 5, 10))}),
    "get_time": ("Current local time in an IANA time zone.",
                 {"timezone": ("string", ("Europe/Oslo", "Asia/Tokyo", "America/Lima"))}),
    "stock_price": ("Latest traded price of a stock ticker.", {"ticker": ("string", ("ACME", "INIT", "ZZZ"))}),
}


def skewed_rows(count: int, seed: int) -> list[dict]:
    """Many short samples and a few long ones (90% of 1-3 sentences, 10% of 20-60)."""
    rng = random.Random(seed)
    rows = []
    for i in range(count):
        sentences = rng.randint(20, 60) if rng.random() < 0.1 else rng.randint(1, 3)
        text = " ".join(f"{rng.randint(0, 99)} plus {rng.randint(0, 99)} is a sum." for _ in range(sentences))
        rows.append({"prompt": f"Question {i}: {text}", "response": str(rng.randint(0, 198))})
    return rows


def tool_schema(name: str) -> dict:
    """OpenAI's description of TOOLS[name]; every tool has the same keys, as real tool lists do."""
    description, parameters = TOOLS[name]
    properties = {param: {"type": kind, "description": f"The {param.replace('_', ' ')}."}
                  for param, (kind, _) in parameters.items()}
    return {"type": "function", "function": {"name": name, "description": description, "parameters": {
        "type": "object", "properties": properties, "required": list(parameters)}}}


def tool_round(rng: random.Random, offered: list[str], number: int, reasoning: bool) -> list[dict]:
    """A user question, the assistant's call (content null), the tool's result and the answer that uses it."""
    name = rng.choice(offered)
    arguments = {param: rng.choice(values) for param, (_, values) in TOOLS[name][1].items()}
    asked, action = ", ".join(f"{k} {v}" for k, v in arguments.items()), name.replace("_", " ")
    call = {"role": "assistant", "content": None, "tool_calls": [
        {"id": f"call_{number}", "type": "function", "function": {"name": name, "arguments": arguments}}]}
    if reasoning:
        call["reasoning_content"] = f"The user wants me to {action} with {asked}; {name} does exactly that."
    as_of = f"2024-0{rng.randint(1, 9)}-1{rng.randint(0, 9)}"
    result = {"status": "ok", "value": rng.randint(1, 10_000), "as_of": as_of}
    return [{"role": "user", "content": f"{'Now c' if number else 'C'}ould you {action} with {asked}?"}, call,
            {"role": "tool", "tool_call_id": f"call_{number}", "content": json.dumps(result)},
            {"role": "assistant", "content": f"The {action} gave {result['value']} (as of {as_of})."}]


def tool_conversations(count: int, seed: int, reasoning: float) -> list[tuple[list[dict], list[dict]]]:
    """(messages, tools) in OpenAI's form: 1-3 tools offered, one round of call and answer (30% of rows two),
    reasoning before a `reasoning` share of the calls. The draws do not depend on `reasoning`: the
    conversations differ only by their reasoning."""
    rng = random.Random(seed)
    conversations = []
    for _ in range(count):
        offered = rng.sample(sorted(TOOLS), rng.randint(1, 3))
        rounds = 2 if rng.random() < 0.3 else 1
        messages = [m for number in range(rounds) for m in tool_round(rng, offered, number, rng.random() < reasoning)]
        conversations.append((messages, [tool_schema(name) for name in offered]))
    return conversations


def renders_reasoning(tokenizer) -> bool:
    """Whether the chat template shows an assistant's reasoning. The pipeline refuses reasoning that the template
    would drop (neither `basic` nor Qwen2.5's renders any), so the corpus carries reasoning only where it is shown."""
    marker = "reasoning-probe-7f3a"
    turns = [{"role": "user", "content": "q"},
             {"role": "assistant", "content": "a", "reasoning_content": marker, "thinking": marker}]
    return marker in render(tokenizer, turns, False)


def call_text(message: dict) -> str:
    """An assistant's tool call as the JSON text {"name", "arguments"}."""
    return json.dumps(message["tool_calls"][0]["function"])


def messages_row(messages: list[dict], tools: list[dict]) -> dict:
    return {"messages": messages, "tools": tools}


def sharegpt_row(messages: list[dict], tools: list[dict]) -> dict:
    """LLaMA-Factory's sharegpt; it has no field for reasoning, which is left out."""
    tags = {"user": "human", "assistant": "gpt", "tool": "observation"}
    turns = [{"from": "function_call", "value": call_text(m)} if m.get("tool_calls") else
             {"from": tags[m["role"]], "value": m["content"]} for m in messages]
    return {"conversations": turns, "tools": json.dumps(tools)}


def plain_row(messages: list[dict], tools: list[dict]) -> dict:
    """What the old path read: user/assistant text only, so the call is the assistant's text and the result a
    user turn; no tools, no reasoning."""
    turns = [{"role": "assistant", "content": call_text(m)} if m.get("tool_calls") else
             {"role": "user" if m["role"] == "tool" else m["role"], "content": m["content"]} for m in messages]
    return {"messages": turns}


REASONING_SHARE = 0.3  # of the tool calls, where the template renders reasoning
# label -> how a conversation is written; the baseline first, as the others are compared with it.
TOOL_FORMS = {"old messages path": plain_row, "new: tool calls": messages_row,
              "new: sharegpt function_call": sharegpt_row}


def timed_build(data: DataConfig, tokenizer, batch_size: int, state: ParallelState):
    """(seconds, stats, whether it tokenized rather than read the cache)."""
    with mock.patch("llmtune.data.build.build_datasets", wraps=build_datasets) as tokenize:
        started = time.perf_counter()
        _, _, _, stats = load_or_build("sft", data, tokenizer, 0, batch_size, state)
        return time.perf_counter() - started, stats, tokenize.called


def demo_tokenizer(root: Path):
    """The demo's generated tokenizer (it ships no chat template) with the built-in `basic` template."""
    write_demo_assets(root / "assets")
    tokenizer = AutoTokenizer.from_pretrained(root / "assets" / "tokenizer")
    apply_recipe_template(tokenizer, "basic")
    return tokenizer


def measure(args, state: ParallelState) -> dict:
    """{packing: (cold seconds, warm seconds, stats)}, built in a temporary folder."""
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        tokenizer = demo_tokenizer(root)
        path = root / "skewed.jsonl"
        path.write_text("".join(json.dumps(r) + "\n" for r in skewed_rows(args.samples, 0)))
        results = {}
        for packing in (False, True):
            data = DataConfig(train_files=[str(path)], max_seq_len=args.max_seq_len, packing=packing,
                              cache_dir=str(root / "cache"))
            cold, stats, cold_tokenized = timed_build(data, tokenizer, args.batch_size, state)
            warm, _, warm_tokenized = timed_build(data, tokenizer, args.batch_size, state)
            assert cold_tokenized and not warm_tokenized
            results[packing] = (cold, warm, stats)
        return results


def cold_build(path: Path, lines: str, args, tokenizer) -> tuple[float, int, float]:
    """(seconds, rows kept, tokens per row) of a build from scratch of `lines` written to the new file `path`:
    datasets would serve a file it has read before from its own cache."""
    path.write_text(lines)
    data = DataConfig(train_files=[str(path)], max_seq_len=args.max_seq_len, packing=False,
                      cache_dir=str(path.with_suffix(".cache")))
    started = time.perf_counter()
    train, _, _ = build_datasets("sft", data, tokenizer, 0)
    seconds = time.perf_counter() - started
    return seconds, len(train), sum(map(len, train["input_ids"])) / len(train)


def measure_tool_forms(args, tokenizer, reasoning: float) -> dict:
    """{label: (seconds, rows kept, tokens per row)} of the fastest cold build of the tool-call corpus in each form.
    The forms take turns for --repeats rounds, so that a busy spell of the machine slows them alike, and the
    fastest build counts, as other load only ever slows one."""
    conversations = tool_conversations(args.tool_samples, 0, reasoning)
    lines = {label: "".join(json.dumps(write(*c)) + "\n" for c in conversations) for label, write in TOOL_FORMS.items()}
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        for repeat in range(args.repeats):
            for number, label in enumerate(TOOL_FORMS):
                built = cold_build(Path(tmp) / f"tools-{number}-{repeat}.jsonl", lines[label], args, tokenizer)
                if label not in results or built[0] < results[label][0]:
                    results[label] = built
    return results


def report_padding(args) -> None:
    # load_or_build waits for its builder through the process group: here a world of one.
    state = ParallelState.initialize()
    try:
        results = measure(args, state)
    finally:
        state.close()
    cold, warm, padded = results[False]
    print(f"{args.samples} samples, max_seq_len {args.max_seq_len}, micro-batch {args.batch_size} rows")
    print(f"tokenization, cache cold: {args.samples / cold:,.0f} samples/s ({cold:.2f} s)")
    print(f"tokenization, cache warm: {args.samples / warm:,.0f} samples/s ({warm:.2f} s), "
          f"{cold / warm:.1f}x faster")
    packed = results[True][2]
    print(f"padding to the longest in the batch: {padded.efficiency:.1%} non-pad tokens ({padded.rows} rows)")
    print(f"packing:                             {packed.efficiency:.1%} non-pad tokens ({packed.rows} rows), "
          f"{packed.efficiency / padded.efficiency:.2f}x the padded share")


def report_tool_forms(args, name: str, tokenizer) -> None:
    reasoning = REASONING_SHARE if renders_reasoning(tokenizer) else 0.0
    results = measure_tool_forms(args, tokenizer, reasoning)
    base = args.tool_samples / results["old messages path"][0]
    shown = f"reasoning before {reasoning:.0%} of the calls" if reasoning else "no reasoning (the template drops it)"
    print(f"tool-call corpus, {args.tool_samples} conversations, {name}, {shown}, "
          f"fastest of {args.repeats} cold builds:")
    for label, (seconds, kept, tokens) in results.items():
        rate = args.tool_samples / seconds
        ratio = "" if label == "old messages path" else f", {rate / base:.2f}x the old path"
        print(f"  {label + ':':28} {rate:,.0f} samples/s ({seconds:.2f} s, {kept} kept, {tokens:.0f} tokens/sample)"
              f"{ratio}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--samples", type=int, default=20000)
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--max-seq-len", type=int, default=1024)
    parser.add_argument("--tool-samples", type=int, default=2000)
    parser.add_argument("--repeats", type=int, default=3, help="cold builds of each tool-call form; the fastest counts")
    parser.add_argument("--tokenizer", help="also build the tool-call corpus with this tokenizer and its own "
                                            "chat template (a folder or Hub name)")
    args = parser.parse_args()
    # datasets keeps an Arrow copy of every file it reads; the benchmark's files are temporary, so are the copies.
    with tempfile.TemporaryDirectory() as tmp, mock.patch.object(datasets.config, "HF_DATASETS_CACHE", tmp):
        report_padding(args)
        report_tool_forms(args, "demo tokenizer, basic template", demo_tokenizer(Path(tmp)))
        if args.tokenizer:
            tokenizer = AutoTokenizer.from_pretrained(args.tokenizer)
            apply_recipe_template(tokenizer, None)  # refuses a tokenizer without a chat template
            report_tool_forms(args, f"{Path(args.tokenizer).name}, its chat template", tokenizer)


if __name__ == "__main__":
    main()
