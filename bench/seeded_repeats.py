#!/usr/bin/env python3
"""How often a seeded, sampled request gives other text the second time: once after a prefix-cache
hit (the same request twice in a row), once while other requests crowd its batches.

    python bench/seeded_repeats.py [base_url] [prompts]

against a running server (`./scripts/serve.sh`; default http://127.0.0.1:8000, 16 prompts), with
the project's Python (`.venv/bin/python`). Prints one line: how many of the prompts changed text
in each case. Each prompt is new (a random number in it), so its first run misses the prefix
cache and its second hits it.
"""

import concurrent.futures
import random
import sys
import time

import completions_client

base_url = sys.argv[1] if len(sys.argv) > 1 else "http://127.0.0.1:8000"
prompts = int(sys.argv[2]) if len(sys.argv) > 2 else 16


def complete(body):
    return completions_client.complete(base_url, body)["choices"][0]["text"]


changed_after_cache_hit = changed_in_crowd = 0
for k in range(prompts):
    prompt = f"Zebra {random.random()} story about the quick brown fox and a lazy dog number {k}, told in many words:"
    seeded = {"prompt": prompt, "max_tokens": 48, "temperature": 1.0, "seed": k}
    alone = complete(seeded)
    changed_after_cache_hit += complete(seeded) != alone
    with concurrent.futures.ThreadPoolExecutor(10) as pool:
        for i in range(10):
            pool.submit(complete, {"prompt": "Once upon a time " * (i % 5 + 1), "max_tokens": 64, "temperature": 0.8})
        time.sleep(0.3)
        changed_in_crowd += pool.submit(complete, seeded).result() != alone
print(
    f"seeded requests whose text changed: {changed_after_cache_hit} of {prompts} after a prefix-cache hit, "
    f"{changed_in_crowd} of {prompts} in a crowd"
)
