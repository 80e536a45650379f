#!/usr/bin/env python3
"""What scoring a prompt costs (vLLM's prompt logprobs, OpenAI's echo with logprobs): the same
1024-token prompt prefilled plain (`max_tokens: 1`) and scored (`echo`, `max_tokens: 0`,
`logprobs: 1`, as lm-evaluation-harness asks), alternating, each prompt new so neither reads the
prefix cache.

    python bench/prompt_scoring.py [base_url] [rounds]

against a running server (`./scripts/serve.sh`; default http://127.0.0.1:8000, 5 rounds), with
the project's Python (`.venv/bin/python`). Prints the two p50 times and their ratio.
"""

import random
import sys
import time

from completions_client import complete

base_url = sys.argv[1] if len(sys.argv) > 1 else "http://127.0.0.1:8000"
rounds = int(sys.argv[2]) if len(sys.argv) > 2 else 5
PROMPT_TOKENS = 1024


def timed(body):
    start = time.perf_counter()
    complete(base_url, body)
    return time.perf_counter() - start


plain, scored = [], []
for round_index in range(rounds):
    rng = random.Random(round_index)
    ids = [rng.randrange(100, 40000) for _ in range(PROMPT_TOKENS)]
    # Different first tokens: the two share no cached block.
    plain.append(timed({"prompt": [ids[0]] + ids[1:], "max_tokens": 1, "temperature": 0}))
    scored.append(timed({"prompt": [ids[0] + 1] + ids[1:], "max_tokens": 0, "echo": True, "logprobs": 1}))


def p50(times):
    return sorted(times)[len(times) // 2]


print(
    f"{PROMPT_TOKENS}-token prompt: plain prefill p50 {p50(plain) * 1e3:.0f} ms, "
    f"scored p50 {p50(scored) * 1e3:.0f} ms, ratio {p50(scored) / p50(plain):.2f} "
    f"(plain {[round(t * 1e3) for t in plain]}, scored {[round(t * 1e3) for t in scored]})"
)
