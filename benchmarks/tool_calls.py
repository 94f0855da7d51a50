"""Tool calls a real model makes through ``ember serve``: how many parse and follow their function's schema.

    python benchmarks/tool_calls.py MODEL [--calls 200] [--out FILE]

Starts ``ember serve MODEL`` on 127.0.0.1 (or uses ``--url``), asks questions that want one of four tools with
``tool_choice`` "required", a named function and "auto" (sampled at temperature 0.7, a seed each), and counts the
calls that parse as JSON and validate against their schema (jsonschema). For "auto" it also counts the replies that
called a tool at all: that rate is the model's, the validity is the server's.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from concurrent.futures import ThreadPoolExecutor

import jsonschema
import openai

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tests"))
from server_utils import running_server  # noqa: E402

TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "description": "Current weather in a city",
     "parameters": {"type": "object", "properties": {"city": {"type": "string"},
                                                     "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
                    "required": ["city"]}}},
    {"type": "function", "function": {"name": "search_web", "description": "Search the web",
     "parameters": {"type": "object", "properties": {"query": {"type": "string"},
                                                     "max_results": {"type": "integer", "minimum": 1,
                                                                     "maximum": 10}},
                    "required": ["query"]}}},
    {"type": "function", "function": {"name": "calculate", "description": "Evaluate an arithmetic expression",
     "parameters": {"type": "object", "properties": {"expression": {"type": "string"}},
                    "required": ["expression"]}}},
    {"type": "function", "function": {"name": "create_event", "description": "Put an event in the calendar",
     "parameters": {"type": "object", "properties": {
         "title": {"type": "string"}, "date": {"type": "string", "description": "YYYY-MM-DD"},
         "attendees": {"type": "array", "items": {"type": "string"}}}, "required": ["title", "date"]}}},
]
SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
QUESTIONS = [
    ("What's the weather like in Paris right now?", "get_weather"),
    ("Is it raining in Tokyo? Give me the temperature in fahrenheit.", "get_weather"),
    ("How cold is it in Oslo today?", "get_weather"),
    ("Find recent news about the James Webb telescope.", "search_web"),
    ("Search for the best pasta recipes, top 3 results.", "search_web"),
    ("Look up who won the 2022 World Cup.", "search_web"),
    ("What is 1234 * 5678?", "calculate"),
    ("Compute (17 + 25) / 3.", "calculate"),
    ("What's the square of 97?", "calculate"),
    ("Schedule a team meeting on 2026-12-03 with Ana and Bo.", "create_event"),
    ("Add 'dentist' to my calendar for 2027-01-15.", "create_event"),
    ("Create an event called Launch party on 2026-12-20.", "create_event"),
]


def _cpu() -> str:
    with open("/proc/cpuinfo") as f:
        return next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), "unknown")


def _valid(call) -> bool:
    try:
        jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])
        return True
    except (ValueError, KeyError, jsonschema.ValidationError):
        return False


def run(url: str, calls: int) -> dict:
    api = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0)
    model = api.models.list().data[0].id

    def ask(i: int, mode: str) -> dict:
        question, tool = QUESTIONS[i % len(QUESTIONS)]
        choice = {"type": "function", "function": {"name": tool}} if mode == "named" else mode
        r = api.chat.completions.create(model=model, messages=[{"role": "user", "content": question}], tools=TOOLS,
                                        tool_choice=choice, temperature=0.7, seed=i, max_tokens=160,
                                        parallel_tool_calls=False)
        c = r.choices[0]
        made = c.message.tool_calls or []
        return {"finish": c.finish_reason, "calls": len(made), "valid": sum(_valid(x) for x in made),
                "right_tool": sum(x.function.name == tool for x in made)}

    out = {"model": model, "requests_per_mode": calls, "date": time.strftime("%Y-%m-%d"), "cpu": _cpu(),
           "setup": "temperature 0.7, a seed per request, max_tokens 160, parallel_tool_calls false, 8 in flight"}
    with ThreadPoolExecutor(8) as pool:
        for mode in ("required", "named", "auto"):
            rows = list(pool.map(lambda i: ask(i, mode), range(calls)))
            made = sum(r["calls"] for r in rows)
            out[mode] = {"calls": made, "valid": sum(r["valid"] for r in rows),
                         "valid_rate": sum(r["valid"] for r in rows) / max(made, 1),
                         "replies_with_a_call": sum(r["calls"] > 0 for r in rows) / calls,
                         "right_tool": sum(r["right_tool"] for r in rows) / calls,
                         "cut_by_max_tokens": sum(r["finish"] == "length" for r in rows)}
            print(mode, json.dumps(out[mode]), flush=True)
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("model", nargs="?", default=None)
    p.add_argument("--url", default=None, help="a running server instead of starting one")
    p.add_argument("--calls", type=int, default=200, help="requests per tool_choice mode")
    p.add_argument("--out", default=None)
    args = p.parse_args()
    if args.url:
        result = run(args.url, args.calls)
    else:
        with running_server(*([args.model] if args.model else []), "--max-model-len", "4096") as srv:
            result = run(srv.url, args.calls)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
