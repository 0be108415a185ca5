"""What tool_choice auto and required do with the served model (issue 15, docs/server.md): the same
weather question over N seeds with a get_weather tool, against any OpenAI-compatible server.

    .venv/bin/python bench/tool_calls.py --base-url http://127.0.0.1:8000/v1 [--seeds 10]

Writes bench/results/tool_calls.json.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from openai import OpenAI

WEATHER = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 30},
                                            "unit": {"enum": ["celsius", "fahrenheit"]}},
           "required": ["city", "unit"], "additionalProperties": False}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Current weather in a city",
                                           "parameters": WEATHER}}]
MSGS = [{"role": "user", "content": "What is the weather like in Paris today?"}]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--base-url", required=True)
    ap.add_argument("--api-key", default="unused")
    ap.add_argument("--seeds", type=int, default=10)
    ap.add_argument("--out", default=str(Path(__file__).parent / "results" / "tool_calls.json"))
    args = ap.parse_args()
    c = OpenAI(base_url=args.base_url, api_key=args.api_key)
    model = c.models.list().data[0].id
    auto = []
    for seed in range(args.seeds):
        m = c.chat.completions.create(model=model, messages=MSGS, tools=TOOLS, max_tokens=60, seed=seed,
                                      temperature=0.7).choices[0].message
        auto.append({"seed": seed, "called": bool(m.tool_calls), "content": (m.content or "")[:120]})
    r = c.chat.completions.create(model=model, messages=MSGS, tools=TOOLS, max_tokens=60, temperature=0,
                                  tool_choice="required").choices[0]
    call = r.message.tool_calls[0].function if r.message.tool_calls else None
    res = {"model": model, "auto_calls": sum(a["called"] for a in auto), "auto_runs": len(auto), "auto": auto,
           "required_finish_reason": r.finish_reason,
           "required_call": {"name": call.name, "arguments": call.arguments} if call else None}
    print(f"auto: {res['auto_calls']} calls in {len(auto)} runs; required: {res['required_call']}")
    Path(args.out).write_text(json.dumps(res, indent=2))
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
