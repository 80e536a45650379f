"""Rivulet's OpenAI-compatible HTTP front, driven by the real `openai` package and read by the
real Prometheus text parser (`prometheus_client`), as a user of either would.

Usage: openai_client.py BASE_URL API_KEY EXPECTED_JSON
EXPECTED_JSON: {"prompt": str, "max_tokens": int, "grpc_token_ids": [int],
                "chat": [{"role", "content"}], "grpc_chat_token_ids": [int]}
(the gRPC front's greedy token ids for the same requests). Exits non-zero with the failing check.
"""

import json
import math
import sys
import time
import urllib.error
import urllib.request

import openai
from prometheus_client.parser import text_string_to_metric_families

base_url, api_key, expected = sys.argv[1], sys.argv[2], json.loads(sys.argv[3])
client = openai.OpenAI(base_url=base_url + "/v1", api_key=api_key, max_retries=0)
prompt, max_tokens = expected["prompt"], expected["max_tokens"]
greedy = {"temperature": 0.0, "max_tokens": max_tokens, "extra_body": {"return_token_ids": True, "ignore_eos": True}}


def check(condition, what):
    if not condition:
        raise AssertionError(what)


def scrape():
    """Every sample of /metrics (no key needed), keyed by name and sorted labels."""
    with urllib.request.urlopen(base_url + "/metrics") as response:
        check(response.status == 200, "/metrics answers 200")
        text = response.read().decode()
    samples = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            labels = tuple(sorted((k, v) for k, v in sample.labels.items() if k != "model_name"))
            samples[(sample.name, labels)] = sample.value
    return samples


def metric(samples, name, **labels):
    return samples.get((name, tuple(sorted(labels.items()))), 0.0)


# --- /v1/models
models = client.models.list()
model = models.data[0].id
check(len(models.data) == 1 and model, f"one served model: {models}")

# --- metrics move by the right amounts after known requests (nothing else runs meanwhile)
before = scrape()
check(metric(before, "rivulet:workers", state="ready") == 1, "one ready worker")
# A prompt of several KV blocks, twice: the second is served from the prefix cache.
long_prompt = "A lighthouse keeper kept a log of every ship that passed the rocks. " * 6
known = [client.completions.create(model=model, prompt=long_prompt, **greedy) for _ in range(2)]
after = scrape()
prompt_tokens = sum(c.usage.prompt_tokens for c in known)
generated = sum(c.usage.completion_tokens for c in known)
check(generated == 2 * max_tokens, f"ignore_eos gives max_tokens each: {generated}")
for name, delta in [
    ("rivulet:prompt_tokens_total", prompt_tokens),
    ("rivulet:generation_tokens_total", generated),
    ("rivulet:time_to_first_token_seconds_count", 2),
    ("rivulet:e2e_request_latency_seconds_count", 2),
    ("rivulet:request_queue_time_seconds_count", 2),
    ("rivulet:request_time_per_output_token_seconds_count", 2),
    ("rivulet:time_per_output_token_seconds_count", generated - 2),
    ("rivulet:request_generation_tokens_sum", generated),
]:
    moved = metric(after, name) - metric(before, name)
    check(moved == delta, f"{name} moved by {moved}, expected {delta}")
moved = metric(after, "rivulet:request_success_total", finished_reason="length") - metric(
    before, "rivulet:request_success_total", finished_reason="length"
)
check(moved == 2, f"two requests finished by length: {moved}")
# The second identical prompt was served from the prefix cache: queries and hits both moved.
check(metric(after, "rivulet:prefix_cache_hits_total") > metric(before, "rivulet:prefix_cache_hits_total"), "cache hits")
steps = metric(after, "rivulet:iteration_tokens_total_count") - metric(before, "rivulet:iteration_tokens_total_count")
check(steps > 0, "steps")
check(metric(after, "rivulet:batch_utilization_count") - metric(before, "rivulet:batch_utilization_count") == steps, "one utilisation per step")
check(metric(after, "rivulet:num_requests_running") == 0 and metric(after, "rivulet:kv_cache_usage_perc") == 0, "idle")
print("metrics: counters and histograms moved as expected")

# --- completions, whole and streamed, equal to gRPC's greedy tokens
completion = client.completions.create(model=model, prompt=prompt, **greedy)
choice = completion.choices[0]
check(choice.token_ids == expected["grpc_token_ids"], f"HTTP {choice.token_ids} != gRPC {expected['grpc_token_ids']}")
check(choice.finish_reason == "length" and completion.object == "text_completion", str(completion))
check(completion.usage.total_tokens == completion.usage.prompt_tokens + max_tokens, str(completion.usage))
# vLLM's return_token_ids also gives the prompt's ids, as the model reads them.
prompt_ids = choice.prompt_token_ids
check(len(prompt_ids) == completion.usage.prompt_tokens, f"prompt ids {prompt_ids}")
by_ids = client.completions.create(model=model, prompt=prompt_ids, **greedy).choices[0]
check(by_ids.prompt_token_ids == prompt_ids and by_ids.token_ids == choice.token_ids, f"by ids {by_ids}")
stream = client.completions.create(
    model=model, prompt=prompt, stream=True, stream_options={"include_usage": True}, **greedy
)
text, ids, reasons, usage, streamed_prompt = "", [], [], None, []
for chunk in stream:
    if chunk.usage is not None:
        check(chunk.choices == [], "the usage chunk has no choices")
        usage = chunk.usage
        continue
    streamed_prompt.append(getattr(chunk.choices[0], "prompt_token_ids", None))
    text += chunk.choices[0].text
    ids += chunk.choices[0].token_ids or []
    reasons.append(chunk.choices[0].finish_reason)
check(ids == expected["grpc_token_ids"] and text == choice.text, f"streamed {ids} / {text!r}")
check(reasons[-1] == "length" and all(r is None for r in reasons[:-1]), f"finish reasons {reasons}")
check(streamed_prompt[0] == prompt_ids and not any(streamed_prompt[1:]), "prompt ids on the first chunk only")
check(usage is not None and usage.completion_tokens == max_tokens, f"usage chunk {usage}")
# As OpenAI sends them: every chunk before the usage chunk says `"usage": null`.
request = urllib.request.Request(
    base_url + "/v1/completions",
    data=json.dumps({"prompt": prompt, "max_tokens": 3, "stream": True, "stream_options": {"include_usage": True}}).encode(),
    headers={"content-type": "application/json", "authorization": f"Bearer {api_key}"},
)
with urllib.request.urlopen(request) as response:
    events = [json.loads(line[6:]) for line in response.read().decode().splitlines() if line.startswith("data: {")]
check(
    all("usage" in event for event in events) and [event["usage"] is None for event in events[:-1]] == [True] * (len(events) - 1),
    f"usage null before the last chunk: {events}",
)
print("completions: whole and streamed match gRPC")

# --- logprobs in the completions shape
with_logprobs = client.completions.create(model=model, prompt=prompt, logprobs=3, **greedy)
lp = with_logprobs.choices[0].logprobs
check(len(lp.tokens) == max_tokens and len(lp.token_logprobs) == max_tokens, str(lp))
check(all(len(top) >= 1 for top in lp.top_logprobs) and all(v <= 0 for v in lp.token_logprobs), str(lp))
# As OpenAI defines them and vLLM lists them: the chosen token first, then the likeliest, up to
# logprobs + 1 entries; with logprobs 0, the chosen token alone.
check(all(next(iter(top)) == token and len(top) <= 4 for top, token in zip(lp.top_logprobs, lp.tokens)), str(lp))
sampled = client.completions.create(model=model, prompt=prompt, logprobs=0, temperature=1.5, seed=3, max_tokens=max_tokens)
chosen = sampled.choices[0].logprobs
check(all(list(top) == [token] for top, token in zip(chosen.top_logprobs, chosen.tokens)), f"logprobs 0: {chosen}")
check(lp.text_offset == sorted(lp.text_offset), "text offsets ascend")
# Characters split across tokens: each token shows as `\ufffd`, but the offsets count the text's
# own characters (whole tokens sit where their offsets say), and chat's `bytes` join into the text.
split = dict(greedy, max_tokens=16)
japanese = "English: hello. Japanese: こんにちは. English: thank you. Japanese:"
kana = client.completions.create(model=model, prompt=japanese, logprobs=1, **split).choices[0]
placed = [(o, t) for o, t in zip(kana.logprobs.text_offset, kana.logprobs.tokens) if "\ufffd" not in t]
check(len(placed) < len(kana.logprobs.tokens), f"no character split across tokens: {kana.logprobs.tokens}")
check(all(kana.text[o : o + len(t)] == t for o, t in placed), f"offsets {kana.logprobs.text_offset} of {kana.text!r}")
kana_chat = client.chat.completions.create(
    model=model, messages=[{"role": "user", "content": "Write the word 'hello' in Japanese."}], logprobs=True, **split
).choices[0]
joined = b"".join(bytes(token.bytes) for token in kana_chat.logprobs.content)
check(joined.decode("utf-8", errors="replace") == kana_chat.message.content, f"bytes {joined!r}")
check(any("\ufffd" in token.token for token in kana_chat.logprobs.content), "a split character in chat")

# --- the confidence stop (Rivulet's extra): ends right after the first token less likely than the
# threshold, finish_reason "stop" with vLLM's stop_reason saying which stop
probabilities = [math.exp(v) for v in lp.token_logprobs]
threshold = 0.9 if min(probabilities) < 0.85 else min(probabilities) + 1e-3
stop_at = next(i for i, p in enumerate(probabilities) if p < threshold)
confident = dict(greedy, extra_body=dict(greedy["extra_body"], confidence_threshold=threshold))
low = client.completions.create(model=model, prompt=prompt, **confident).choices[0]
check(low.token_ids == expected["grpc_token_ids"][: stop_at + 1], f"confidence stop at {stop_at}: {low.token_ids}")
check(low.finish_reason == "stop" and getattr(low, "stop_reason", None) == "low_confidence", str(low))
# vLLM's stop_reason: the stop string or the stop token id that ended the output, else null.
text_ids = expected["grpc_token_ids"]
plain_text = client.completions.create(model=model, prompt=prompt, **greedy).choices[0]
stop_string = plain_text.text[len(plain_text.text) // 2 :][:3]
by_string = client.completions.create(model=model, prompt=prompt, stop=[stop_string], **greedy).choices[0]
check(by_string.finish_reason == "stop" and by_string.stop_reason == stop_string, f"{stop_string!r}: {by_string}")
stopping_token = dict(greedy, extra_body=dict(greedy["extra_body"], stop_token_ids=[text_ids[2]]))
by_token = client.completions.create(model=model, prompt=prompt, **stopping_token).choices[0]
check(by_token.finish_reason == "stop" and by_token.stop_reason == text_ids[2], f"{text_ids[2]}: {by_token}")
check(plain_text.finish_reason == "length" and plain_text.stop_reason is None, str(plain_text))
print("completions: the confidence stop ends where the probabilities say; stop_reason names the stop")

# --- chat, whole and streamed, equal to gRPC's chat tokens
chat_greedy = dict(greedy)
chat = client.chat.completions.create(model=model, messages=expected["chat"], logprobs=True, top_logprobs=2, **chat_greedy)
message = chat.choices[0]
check(message.token_ids == expected["grpc_chat_token_ids"], f"chat {message.token_ids}")
check(message.message.role == "assistant" and chat.object == "chat.completion", str(chat))
check(len(chat.prompt_token_ids) == chat.usage.prompt_tokens, f"chat prompt ids {chat.prompt_token_ids}")
check(len(message.logprobs.content) == max_tokens and len(message.logprobs.content[0].top_logprobs) == 2, "chat logprobs")
pieces, roles, chunk_prompts = [], [], []
for chunk in client.chat.completions.create(model=model, messages=expected["chat"], stream=True, **chat_greedy):
    check(chunk.object == "chat.completion.chunk", chunk.object)
    chunk_prompts.append(getattr(chunk, "prompt_token_ids", None))
    delta = chunk.choices[0].delta
    roles.append(delta.role)
    pieces.append(delta.content or "")
check(roles[0] == "assistant" and "".join(pieces) == message.message.content, f"chat stream {pieces}")
check(chunk_prompts[0] == chat.prompt_token_ids and not any(chunk_prompts[1:]), "chat prompt ids once")
print("chat: whole and streamed match gRPC")

# --- several choices: a batch of prompts times n, OpenAI's order, each as it would be alone
batch = client.completions.create(model=model, prompt=[prompt, long_prompt], n=2, **greedy)
check([c.index for c in batch.choices] == [0, 1, 2, 3], f"indexes {[c.index for c in batch.choices]}")
long_ids = known[0].choices[0].token_ids
for c, ids in zip(batch.choices, [expected["grpc_token_ids"]] * 2 + [long_ids] * 2):
    check(c.token_ids == ids, f"choice {c.index}: {c.token_ids} != {ids}")
# Each choice with its own prompt's ids.
long_prompt_ids = known[0].choices[0].prompt_token_ids
for c, ids in zip(batch.choices, [prompt_ids] * 2 + [long_prompt_ids] * 2):
    check(c.prompt_token_ids == ids, f"choice {c.index}: the prompt ids of another prompt")
check(
    batch.usage.completion_tokens == 4 * max_tokens
    and batch.usage.prompt_tokens == completion.usage.prompt_tokens + known[0].usage.prompt_tokens,
    f"each prompt counted once, every choice's output: {batch.usage}",
)
# A prompt's copies wait for its first choice's prefill, then take the prompt from the prefix cache.
fresh_prompt = "A ferry crossed the bay at dawn and again at dusk, carrying carts and cattle. " * 8
before = scrape()
copies = client.completions.create(model=model, prompt=fresh_prompt, n=4, **greedy)
hit = metric(scrape(), "rivulet:prefix_cache_hits_total") - metric(before, "rivulet:prefix_cache_hits_total")
whole_blocks = (copies.usage.prompt_tokens // 16 - 1) * 16
check(hit >= 3 * whole_blocks, f"3 copies of a {copies.usage.prompt_tokens}-token prompt hit only {hit} cached tokens")
check(len({tuple(c.token_ids) for c in copies.choices}) == 1, "greedy copies agree")
seeded = dict(temperature=1.0, max_tokens=max_tokens, seed=11, n=3, extra_body={"return_token_ids": True, "ignore_eos": True})
first, again = (client.completions.create(model=model, prompt=prompt, **seeded) for _ in range(2))
draws = [c.token_ids for c in first.choices]
check(draws == [c.token_ids for c in again.choices], "a seeded request draws the same choices again")
check(len({tuple(d) for d in draws}) > 1, f"n seeded choices draw differently: {draws}")
streamed, opened = {}, {}
for chunk in client.chat.completions.create(model=model, messages=expected["chat"], n=2, stream=True, **chat_greedy):
    for c in chunk.choices:
        streamed[c.index] = streamed.get(c.index, "") + (c.delta.content or "")
        if c.delta.role == "assistant":
            opened[c.index] = getattr(chunk, "prompt_token_ids", None)
check(streamed == {0: message.message.content, 1: message.message.content}, f"streamed chat choices {streamed}")
# As vLLM: each choice's first chunk carries the conversation's ids.
check(opened == {0: chat.prompt_token_ids, 1: chat.prompt_token_ids}, f"prompt ids on each opening: {opened}")
print("choices: a batch of prompts and n, whole and streamed")

# --- logit_bias (OpenAI's, keys as strings) and vLLM's allowed_token_ids steer the choice
plain = client.completions.create(model=model, prompt=prompt, **greedy).choices[0].token_ids
forced = plain[-1]
biased = client.completions.create(model=model, prompt=prompt, logit_bias={str(forced): 100}, **greedy).choices[0]
check(biased.token_ids == [forced] * max_tokens, f"a +100 bias on {forced}: {biased.token_ids}")
banned = client.completions.create(model=model, prompt=prompt, logit_bias={str(plain[0]): -100}, **greedy)
check(banned.choices[0].token_ids[0] != plain[0], f"a -100 bias on {plain[0]}: {banned.choices[0].token_ids}")
allowed = sorted(set(plain[1:]))
only = client.chat.completions.create(
    model=model, messages=expected["chat"], temperature=1.0, seed=7, max_tokens=8,
    extra_body={"allowed_token_ids": allowed, "return_token_ids": True, "ignore_eos": True},
).choices[0]
check(set(only.token_ids) <= set(allowed), f"only {allowed}: {only.token_ids}")
for bias, param in [({"abc": 1}, "logit_bias"), ({"99999999": 1}, "logit_bias"), ({"5": "high"}, "logit_bias")]:
    try:
        client.completions.create(model=model, prompt=prompt, logit_bias=bias, max_tokens=2)
        check(False, f"logit_bias {bias} is refused")
    except openai.BadRequestError as error:
        check(error.body["param"] == param and error.body["message"].startswith(param), f"{error.body}")
try:
    client.completions.create(model=model, prompt=prompt, max_tokens=2, extra_body={"allowed_token_ids": []})
    check(False, "an empty allowed_token_ids is refused")
except openai.BadRequestError as error:
    check(error.body["param"] == "allowed_token_ids", f"{error.body}")
print("logit_bias and allowed_token_ids: steer the choice, bad ones refused")

# --- echo (OpenAI's) and prompt_logprobs (vLLM's): the prompt repeated, and each of its tokens
# scored given the ones before it (the first has nothing before it: null)
plain = client.completions.create(model=model, prompt=prompt, **greedy).choices[0]
only = client.completions.create(model=model, prompt=prompt, echo=True, max_tokens=0, logprobs=2)
scored = only.choices[0]
check(scored.text == prompt and scored.finish_reason == "length", f"echo alone: {scored.text!r} {scored.finish_reason}")
check(only.usage.completion_tokens == 0, f"echo alone generates nothing: {only.usage}")
echoed = scored.logprobs
check(len(echoed.tokens) == only.usage.prompt_tokens, f"one entry per prompt token: {len(echoed.tokens)}")
check(echoed.token_logprobs[0] is None and echoed.top_logprobs[0] is None, "nothing scores the first token")
check(all(lp <= 0 for lp in echoed.token_logprobs[1:]), f"logprobs: {echoed.token_logprobs}")
check(all(1 <= len(top) <= 3 for top in echoed.top_logprobs[1:]), f"the token and 2 alternatives: {echoed.top_logprobs}")
check("".join(echoed.tokens) == prompt and echoed.text_offset[0] == 0, f"tokens {echoed.tokens}")
both = client.completions.create(model=model, prompt=prompt, echo=True, logprobs=2, **greedy).choices[0]
check(both.text == prompt + plain.text, f"echo then the completion: {both.text!r}")
check(both.token_ids == plain.token_ids, "token_ids stay the generated ones")
check(len(both.logprobs.tokens) == len(echoed.tokens) + max_tokens, "prompt entries, then the output's")
check(
    all(math.isclose(a, b, abs_tol=1e-4) for a, b in zip(both.logprobs.token_logprobs[1 : len(echoed.tokens)], echoed.token_logprobs[1:])),
    "the prompt scored alike either way",
)
vllm = client.completions.create(model=model, prompt=prompt, max_tokens=1, extra_body={"prompt_logprobs": 1}).choices[0]
listed = vllm.model_extra["prompt_logprobs"]
check(listed[0] is None and len(listed) == len(echoed.tokens), f"prompt_logprobs: {listed[:2]}")
prompt_ids = [int(next(iter(entry))) for entry in listed[1:]]
for i, (entry, token) in enumerate(zip(listed[1:], prompt_ids)):
    own = entry[str(token)]
    check(math.isclose(own["logprob"], echoed.token_logprobs[i + 1], abs_tol=1e-4), f"entry {i}: {own}")
    check(own["rank"] >= 1 and own["decoded_token"] == echoed.tokens[i + 1], f"entry {i}: {own}")
    check(any(e["rank"] == 1 for e in entry.values()), f"entry {i} lists the likeliest token: {entry}")
chat_scored = client.chat.completions.create(
    model=model, messages=expected["chat"], max_tokens=1, extra_body={"prompt_logprobs": 0}
)
scored_list = chat_scored.model_extra["prompt_logprobs"]
check(scored_list[0] is None and len(scored_list) == chat_scored.usage.prompt_tokens, f"chat's: {scored_list[:2]}")
streamed = "".join(c.choices[0].text for c in client.completions.create(model=model, prompt=prompt, echo=True, stream=True, **greedy))
check(streamed == prompt + plain.text, f"a streamed echo: {streamed!r}")
for endpoint, body, param in [
    (client.completions, {"prompt": prompt, "stream": True, "extra_body": {"prompt_logprobs": 1}}, "prompt_logprobs"),
    (client.chat.completions, {"messages": expected["chat"], "extra_body": {"echo": True}}, "echo"),
    (client.completions, {"prompt": prompt, "extra_body": {"prompt_logprobs": 21}}, "prompt_logprobs"),
    (client.completions, {"prompt": prompt, "max_tokens": 0}, "max_tokens"),
]:
    try:
        endpoint.create(model=model, **body)
        check(False, f"{param} in {body} is refused")
    except openai.BadRequestError as error:
        check(error.body["param"] == param, f"{body}: {error.body}")
# Special tokens are echoed as written, text or token ids, and the offsets count them so.
special = "A<|im_end|>B C"
marked = client.completions.create(model=model, prompt=special, echo=True, max_tokens=0, logprobs=0).choices[0]
by_ids = client.completions.create(
    model=model, prompt=[32, 2, 33], echo=True, max_tokens=0, logprobs=0
).choices[0]
for echo in (marked, by_ids):
    lp = echo.logprobs
    check(
        all(echo.text[o : o + len(t)] == t for o, t in zip(lp.text_offset, lp.tokens)),
        f"offsets {lp.text_offset} into {echo.text!r} for {lp.tokens}",
    )
check("<|im_end|>" in by_ids.text, f"a token-id prompt's special token echoed: {by_ids.text!r}")
# A prompt that fills the whole context may still be scored: nothing is generated after it.
context = client.models.list().data[0].model_extra["max_model_len"]
full = client.completions.create(model=model, prompt=[33] * context, echo=True, max_tokens=0, logprobs=0)
check(len(full.choices[0].logprobs.tokens) == context and full.usage.completion_tokens == 0, "a full context echoed")
# n copies share their first choice's scores.
copies = client.completions.create(model=model, prompt=prompt, n=2, echo=True, logprobs=1, **greedy).choices
scored_prompt = [c.logprobs.token_logprobs[: len(echoed.tokens)] for c in copies]
check(scored_prompt[0] == scored_prompt[1], f"both choices score the prompt alike: {scored_prompt}")
check(all(math.isclose(a, b, abs_tol=1e-4) for a, b in zip(scored_prompt[0][1:], echoed.token_logprobs[1:])), "as alone")
print("echo and prompt_logprobs: the prompt repeated and scored, alike on every path")

# --- structured outputs: OpenAI's response_format, vLLM's structured_outputs and guided_* extras
ask = lambda question: [{"role": "user", "content": question}]
schema = {
    "type": "object",
    "properties": {"name": {"type": "string", "maxLength": 30}, "age": {"type": "integer"}, "pets": {"type": "array", "items": {"enum": ["cat", "dog", "fish"]}, "maxItems": 3}},
    "required": ["name", "age", "pets"],
}
person = client.chat.completions.create(
    model=model, messages=ask("Describe a person as JSON."), temperature=0.0, max_tokens=120,
    response_format={"type": "json_schema", "json_schema": {"name": "person", "schema": schema, "strict": True}},
).choices[0]
value = json.loads(person.message.content)
check(list(value) == ["name", "age", "pets"] and isinstance(value["age"], int), f"the schema's object: {value}")
check(len(value["name"]) <= 30 and all(pet in ("cat", "dog", "fish") for pet in value["pets"]), f"{value}")
check(person.finish_reason == "stop", f"ends where the object does: {person}")
any_object = client.chat.completions.create(
    model=model, messages=ask("Give me a JSON object about the weather."), temperature=0.0, max_tokens=120,
    response_format={"type": "json_object"},
).choices[0]
check(isinstance(json.loads(any_object.message.content), dict), f"an object: {any_object.message.content!r}")
choices = ["positive", "negative", "neutral"]
sentiment = client.chat.completions.create(
    model=model, messages=ask("Is 'I love this film' positive or negative?"), temperature=0.0, max_tokens=10,
    extra_body={"guided_choice": choices},
).choices[0].message.content
check(sentiment in choices, f"one of the choices: {sentiment!r}")
streamed = "".join(
    chunk.choices[0].delta.content or ""
    for chunk in client.chat.completions.create(
        model=model, messages=ask("Is 'I love this film' positive or negative?"), temperature=0.0, max_tokens=10,
        stream=True, extra_body={"structured_outputs": {"choice": choices}},
    )
    if chunk.choices
)
check(streamed == sentiment, f"streamed as whole: {streamed!r} vs {sentiment!r}")
phone = client.completions.create(
    model=model, prompt="Call me at ", temperature=0.0, max_tokens=12, n=2, seed=7,
    extra_body={"structured_outputs": {"regex": "[0-9]{3}-[0-9]{4}"}},
)
for c in phone.choices:
    check(len(c.text) == 8 and c.text[3] == "-" and (c.text[:3] + c.text[4:]).isdigit(), f"a number: {c.text!r}")
for body, param in [
    ({"structured_outputs": {"regex": "(unclosed"}}, "structured_outputs"),
    ({"guided_grammar": "root ::= 'a'"}, "guided_grammar"),
    ({"guided_regex": "[a-z]+", "guided_choice": ["a"]}, "guided_choice"),
    ({"guided_json": {"type": "no-such-type"}}, "guided_json"),
]:
    try:
        client.completions.create(model=model, prompt=prompt, max_tokens=4, extra_body=body)
        check(False, f"refused: {body}")
    except openai.BadRequestError as error:
        check(error.body["param"] == param, f"{body}: {error.body}")
print("structured outputs: a schema, any object, choices (whole and streamed), a regex; bad ones refused")

# --- tool calls: a named function, "required" (a list of calls), "auto" as text; agent loops
weather_tool = {"type": "function", "function": {
    "name": "get_weather", "description": "The current weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20},
                   "unit": {"enum": ["celsius", "fahrenheit"]}}, "required": ["city", "unit"]}}}
time_tool = {"type": "function", "function": {"name": "get_time", "description": "The time now"}}
question = ask("What is the weather in Paris?")
named = client.chat.completions.create(
    model=model, messages=question, temperature=0.0, max_tokens=60, tools=[weather_tool, time_tool],
    tool_choice={"type": "function", "function": {"name": "get_weather"}},
).choices[0]
call = named.message.tool_calls[0]
arguments = json.loads(call.function.arguments)
check(len(named.message.tool_calls) == 1 and call.function.name == "get_weather" and call.type == "function", f"{named}")
check(list(arguments) == ["city", "unit"] and arguments["unit"] in ("celsius", "fahrenheit"), f"{arguments}")
check(call.id.startswith("chatcmpl-tool-") and not named.message.content and named.finish_reason == "stop", f"{named}")
parts = [
    chunk.choices[0].delta
    for chunk in client.chat.completions.create(
        model=model, messages=question, temperature=0.0, max_tokens=60, tools=[weather_tool, time_tool],
        tool_choice={"type": "function", "function": {"name": "get_weather"}}, stream=True,
    )
    if chunk.choices and chunk.choices[0].delta.tool_calls
]
check(parts[0].tool_calls[0].function.name == "get_weather" and parts[0].tool_calls[0].id, f"opens the call: {parts[0]}")
streamed_arguments = "".join(part.tool_calls[0].function.arguments for part in parts)
check(streamed_arguments == call.function.arguments, f"streamed as whole: {streamed_arguments!r}")
required = client.chat.completions.create(
    model=model, messages=question, temperature=0.0, max_tokens=120, tools=[weather_tool, time_tool],
    tool_choice="required",
).choices[0]
calls = required.message.tool_calls
check(required.finish_reason == "tool_calls" and len(calls) >= 1, f"{required}")
for made in calls:
    check(made.function.name in ("get_weather", "get_time"), f"{made}")
    made_arguments = json.loads(made.function.arguments)
    wanted = [] if made.function.name == "get_time" else ["city", "unit"]
    check(list(made_arguments) == wanted, f"{made}")
check(len({made.id for made in calls}) == len(calls), f"distinct ids: {calls}")
one_call = client.chat.completions.create(
    model=model, messages=question, temperature=0.0, max_tokens=120, tools=[weather_tool, time_tool],
    tool_choice="required", parallel_tool_calls=False, stream=True,
)
streamed_calls = [tc for chunk in one_call if chunk.choices for tc in (chunk.choices[0].delta.tool_calls or [])]
check(len(streamed_calls) == 1 and streamed_calls[0].index == 0, f"one call: {streamed_calls}")
auto = client.chat.completions.create(model=model, messages=question, temperature=0.0, max_tokens=8, tools=[weather_tool])
check(auto.choices[0].message.tool_calls is None and auto.choices[0].message.content, f"auto is text: {auto}")
# The calls and their results sent back, as an agent loop does; the answer is text.
follow_up = client.chat.completions.create(
    model=model, temperature=0.0, max_tokens=8, tools=[weather_tool, time_tool], messages=question + [
        {"role": "assistant", "content": None, "tool_calls": [call.model_dump(exclude_none=True)]},
        {"role": "tool", "tool_call_id": call.id, "content": "18 degrees and sunny"},
    ],
).choices[0]
check(follow_up.message.content and follow_up.message.tool_calls is None, f"{follow_up}")
# The response's own message sent back as the package dumps it (empty content, `refusal`, ...):
# the model is shown the same calls.
dumped = client.chat.completions.create(
    model=model, temperature=0.0, max_tokens=8, tools=[weather_tool, time_tool], messages=question + [
        named.message.model_dump(), {"role": "tool", "tool_call_id": call.id, "content": "18 degrees and sunny"},
    ],
)
loop = client.chat.completions.create(
    model=model, temperature=0.0, max_tokens=8, tools=[weather_tool, time_tool], messages=question + [
        {"role": "assistant", "content": None, "tool_calls": [tc.model_dump() for tc in named.message.tool_calls]},
        {"role": "tool", "tool_call_id": call.id, "content": "18 degrees and sunny"},
    ],
)
silent = client.chat.completions.create(
    model=model, temperature=0.0, max_tokens=8, messages=question + [
        {"role": "assistant", "content": ""}, {"role": "tool", "content": "18 degrees and sunny"},
    ],
)
shown_calls = dumped.usage.prompt_tokens - silent.usage.prompt_tokens
check(dumped.usage.prompt_tokens == loop.usage.prompt_tokens and shown_calls > 10, f"{dumped.usage} vs {loop.usage}, {silent.usage}")
for body, param in [
    ({"tool_choice": "required"}, "tool_choice"),
    ({"tools": [time_tool], "tool_choice": {"type": "function", "function": {"name": "get_news"}}}, "tool_choice"),
    ({"tools": [{"type": "function", "function": {"name": "two words"}}]}, "tools"),
    ({"tools": [time_tool], "tool_choice": "required", "response_format": {"type": "json_object"}}, "tool_choice"),
]:
    try:
        client.chat.completions.create(model=model, messages=question, max_tokens=4, extra_body=body)
        check(False, f"refused: {body}")
    except openai.BadRequestError as error:
        check(error.body["param"] == param, f"{body}: {error.body}")
print("tool calls: named (whole and streamed), required (a list; one without parallel calls), auto as text, a loop")

# --- errors in OpenAI's shape
try:
    client.completions.create(model=model, prompt=prompt, temperature=-1)
    check(False, "a negative temperature is refused")
except openai.BadRequestError as error:
    check(error.status_code == 400 and error.body["param"] == "temperature", f"{error.body}")
try:
    client.completions.create(model=model, prompt=prompt, n=65)
    check(False, "more than 64 choices are refused")
except openai.BadRequestError as error:
    check(error.body["param"] == "n", f"{error.body}")
try:
    client.chat.completions.create(model=model, messages=expected["chat"], max_completion_tokens=0)
    check(False, "a zero max_completion_tokens is refused")
except openai.BadRequestError as error:
    # Named as the client named it, not as its older alias max_tokens.
    check(error.body["param"] == "max_completion_tokens", f"{error.body}")
    check(error.body["message"].startswith("max_completion_tokens:"), f"{error.body}")
try:
    client.completions.create(model=model, prompt=prompt, extra_body={"logits_processors": []})
    check(False, "an unknown parameter is refused")
except openai.BadRequestError as error:
    check("logits_processors" in error.message, error.message)
try:
    client.completions.create(model="no-such-model", prompt=prompt)
    check(False, "an unknown model is refused")
except openai.NotFoundError as error:
    check(error.body["code"] == "model_not_found", f"{error.body}")
try:
    openai.OpenAI(base_url=base_url + "/v1", api_key="wrong", max_retries=0).models.list()
    check(False, "a wrong key is refused")
except openai.AuthenticationError as error:
    check(error.status_code == 401, str(error))
# Bodies that are not one JSON value, or too large to read, are refused in the same JSON shape.
def raw_post(body, path="/v1/completions", key=api_key):
    request = urllib.request.Request(
        base_url + path,
        data=body,
        headers={"content-type": "application/json", "authorization": f"Bearer {key}"},
    )
    try:
        with urllib.request.urlopen(request) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as error:
        return error.code, json.loads(error.read())
for body, status in [
    (b'{"prompt": "Hi", "max_tokens": 2} trailing', 400),
    (b'{"prompt": "Hi"', 400),
    (json.dumps({"prompt": "a" * (3 << 20)}).encode(), 413),
]:
    code, answer = raw_post(body)
    check(code == status and answer["error"]["param"] is None, f"{body[:40]!r}: {code} {answer}")
# Health and metrics need no key; the request id comes back.
request = urllib.request.Request(base_url + "/health", headers={"x-request-id": "probe-42"})
with urllib.request.urlopen(request) as response:
    check(response.status == 200 and response.headers["x-request-id"] == "probe-42", "health 200 with the id")
raw = client.completions.with_raw_response.create(model=model, prompt=prompt, **greedy)
check(len(raw.headers.get("x-request-id", "")) > 0, "a generated request id")
print("errors, key and request ids: as specified")

# --- vLLM's /tokenize and /detokenize: the ids a request is served with, and back
def post_json(path, body, key=api_key):
    return raw_post(json.dumps(body).encode(), path, key)
served = client.completions.create(model=model, prompt=prompt, **greedy)
code, counted = post_json("/tokenize", {"prompt": prompt, "return_token_strs": True})
check(code == 200 and counted["tokens"] == served.choices[0].prompt_token_ids, f"tokenize: {counted}")
# The vocabulary's own strings, as vLLM gives them (a byte-level space reads "Ġ").
strs = counted["token_strs"]
check(counted["count"] == served.usage.prompt_tokens == len(strs) and strs[1].startswith("\u0120"), f"{counted}")
code, empty = post_json("/tokenize", {"prompt": ""})
check(code == 200 and empty["count"] == 0 and empty["tokens"] == [], f"an empty prompt: {empty}")
check(counted["max_model_len"] == client.models.list().data[0].model_extra["max_model_len"], f"{counted}")
code, counted = post_json("/tokenize", {"messages": expected["chat"]})
check(code == 200 and counted["tokens"] == chat.prompt_token_ids, f"tokenize a conversation: {counted}")
code, text = post_json("/detokenize", {"tokens": served.choices[0].prompt_token_ids})
check(code == 200 and text == {"prompt": prompt}, f"detokenize: {text}")
for path, body, status, param in [
    ("/tokenize", {}, 400, "prompt"),
    ("/tokenize", {"prompt": "x", "messages": expected["chat"]}, 400, "messages"),
    ("/detokenize", {"tokens": [1 << 30]}, 400, "tokens"),
    ("/tokenize", {"prompt": "x", "model": "no-such-model"}, 404, "model"),
]:
    code, answer = post_json(path, body)
    check(code == status and answer["error"]["param"] == param, f"{path} {body}: {code} {answer}")
check(post_json("/tokenize", {"prompt": "x"}, key="wrong")[0] == 401, "tokenize needs the key")
print("tokenize and detokenize: the served ids, and back")

# --- a client that goes away cancels its request: it ends as `abort` and frees its KV blocks
before = scrape()
stream = client.completions.create(
    model=model, prompt=long_prompt, stream=True, temperature=0.0, max_tokens=500, extra_body={"ignore_eos": True}
)
next(iter(stream))
stream.close()
deadline = time.monotonic() + 30
while True:
    now = scrape()
    aborted = metric(now, "rivulet:request_success_total", finished_reason="abort") - metric(
        before, "rivulet:request_success_total", finished_reason="abort"
    )
    idle = metric(now, "rivulet:num_requests_running") == 0 and metric(now, "rivulet:kv_cache_usage_perc") == 0
    if aborted == 1 and idle:
        break
    check(time.monotonic() < deadline, f"the abandoned stream was not cancelled: aborted {aborted}, idle {idle}")
    time.sleep(0.2)
generated = metric(now, "rivulet:generation_tokens_total") - metric(before, "rivulet:generation_tokens_total")
check(generated < 500, f"generation stopped early: {generated} tokens")
print("disconnect: cancelled, blocks freed")
