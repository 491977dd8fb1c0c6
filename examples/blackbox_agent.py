#!/usr/bin/env python3
"""A black-box agent: an ordinary OpenAI program that LoongSage can train without changes.

It knows nothing about LoongSage. The OpenAI SDK reads ``OPENAI_BASE_URL`` and ``OPENAI_API_KEY``
from the environment; the ``command`` agent points them at the trajectory's router endpoint, so
every chat completion below becomes part of a training trajectory. The task comes from
``LOONGSAGE_PROMPT`` (or standard input), the final answer goes to standard output.

Try it against any OpenAI-compatible server::

    export OPENAI_BASE_URL=http://127.0.0.1:8000/v1 OPENAI_API_KEY=x
    python examples/blackbox_agent.py --turns 2 <<< "What is 2+3?"

In a job file::

    [[data]]
    agent = "command"
    agent_args = { command = ["python", "examples/blackbox_agent.py", "--turns", "2"] }
"""

from __future__ import annotations

import argparse
import os
import sys

from openai import OpenAI


def main() -> int:
    parser = argparse.ArgumentParser(description="answer a question, then revise the answer")
    parser.add_argument("--turns", type=int, default=2, help="model calls: one answer plus revisions")
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--model", default=os.environ.get("OPENAI_MODEL", "policy"))
    args = parser.parse_args()

    prompt = os.environ.get("LOONGSAGE_PROMPT") or sys.stdin.read()
    if not prompt.strip():
        print("no task: set LOONGSAGE_PROMPT or pass it on standard input", file=sys.stderr)
        return 2
    client = OpenAI()  # OPENAI_BASE_URL / OPENAI_API_KEY from the environment
    messages = [{"role": "system", "content": "Answer briefly."}, {"role": "user", "content": prompt}]
    answer = ""
    for turn in range(args.turns):
        reply = client.chat.completions.create(model=args.model, messages=messages, max_tokens=args.max_tokens)
        answer = reply.choices[0].message.content or ""
        messages.append({"role": "assistant", "content": answer})
        if turn + 1 < args.turns:
            messages.append({"role": "user", "content": "Check your answer. Reply with the final answer only."})
    print(answer)
    return 0


if __name__ == "__main__":
    sys.exit(main())
