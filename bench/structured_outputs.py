"""What a structured output costs a running server: output tok/s of CLIENTS concurrent chat
requests held to a JSON schema against the same requests unguided, alternating, and the time
to the first token of a schema the server has not compiled yet against one it has.

Usage: python bench/structured_outputs.py BASE_URL [CLIENTS] [ROUNDS]
(start a server first: README "Serving it"; e.g. http://127.0.0.1:8000)
"""

import concurrent.futures
import json
import sys
import time
import urllib.request

base_url = sys.argv[1]
clients = int(sys.argv[2]) if len(sys.argv) > 2 else 16
rounds = int(sys.argv[3]) if len(sys.argv) > 3 else 3
TOKENS = 64


def schema(tag):
    """A list of people: long enough that every output runs to TOKENS (`tag` makes it new)."""
    person = {
        "type": "object",
        "properties": {"name": {"type": "string", "maxLength": 20}, "age": {"type": "integer"}, tag: {"type": "boolean"}},
        "required": ["name", "age", tag],
    }
    return {"type": "object", "properties": {"people": {"type": "array", "items": person}}, "required": ["people"]}


def chat(body):
    request = urllib.request.Request(
        base_url + "/v1/chat/completions",
        data=json.dumps(body).encode(),
        headers={"content-type": "application/json"},
    )
    started = time.monotonic()
    with urllib.request.urlopen(request) as response:
        answer = json.loads(response.read())
    return answer, time.monotonic() - started


def body(i, guided_schema):
    request = {
        "messages": [{"role": "user", "content": f"List people number {i} knows, as JSON."}],
        "max_tokens": TOKENS,
        "temperature": 0.0,
    }
    if guided_schema is None:
        request["ignore_eos"] = True
    else:
        request["response_format"] = {"type": "json_schema", "json_schema": {"name": "people", "schema": guided_schema}}
    return request


def round_trip(guided_schema):
    started = time.monotonic()
    with concurrent.futures.ThreadPoolExecutor(clients) as pool:
        answers = list(pool.map(lambda i: chat(body(i, guided_schema))[0], range(clients)))
    elapsed = time.monotonic() - started
    tokens = sum(a["usage"]["completion_tokens"] for a in answers)
    if guided_schema is not None:
        for a in answers:
            text = a["choices"][0]["message"]["content"]
            if a["choices"][0]["finish_reason"] == "stop":
                json.loads(text)
    return tokens / elapsed


shared = schema("known")
chat(body(0, shared))  # compiled once, before the timed rounds
plain, guided = [], []
for r in range(rounds):
    plain.append(round_trip(None))
    guided.append(round_trip(shared))
    print(f"round {r + 1}: unguided {plain[-1]:.1f} tok/s, JSON schema {guided[-1]:.1f} tok/s", flush=True)
print(f"{clients} clients, {TOKENS} tokens each: JSON schema / unguided = {sum(guided) / sum(plain):.3f}")

one = {"max_tokens": 1, "temperature": 0.0, "messages": [{"role": "user", "content": "A person as JSON."}]}
fresh, warm = [], []
for r in range(rounds):
    new_schema = schema(f"field_{time.monotonic_ns()}")
    fresh.append(chat(one | {"response_format": {"type": "json_schema", "json_schema": {"name": "p", "schema": new_schema}}})[1])
    warm.append(chat(one | {"response_format": {"type": "json_schema", "json_schema": {"name": "p", "schema": new_schema}}})[1])
print(
    "one-token request: a new schema "
    + ", ".join(f"{t * 1000:.0f}" for t in fresh)
    + " ms; the same schema again "
    + ", ".join(f"{t * 1000:.0f}" for t in warm)
    + " ms"
)
