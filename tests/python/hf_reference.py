"""Independent reference for Rivulet's tests: Hugging Face `transformers` on the same GGUF file.

Reads a JSON request on stdin and writes a JSON answer on stdout:
  {"task": "greedy", "prompts": [...], "max_new_tokens": N}
      -> {"results": [{"prompt_ids": [...], "output_ids": [...]}, ...], "eos_token_id": N}
  {"task": "tokenize", "texts": [...]} -> {"ids": [[...], ...]}
  {"task": "chat_prompt_ids", "messages": [...], "add_generation_prompt": B, "continue_final_message": B}
      -> {"text": ..., "ids": [...]}: the chat template applied by transformers, then tokenized
  {"task": "logprobs", "prompt_ids": [...], "output_ids": [...], "top": K}
      -> {"steps": [{"logprob", "top_ids", "top_values"}, ...]}: log-softmax at each output token
  {"task": "processed_greedy", "prompt_ids": [...], "max_new_tokens": N, "logit_bias": {"id": bias},
   "allowed_token_ids": [...] or null, "repetition_penalty": R}
      -> {"output_ids": [...], "logprobs": [...]}: greedy over the logits as transformers' own
      processors change them (the bias, then the repetition penalty: vLLM's order), every token
      not allowed masked first; each logprob the raw model's, as vLLM reports it
  {"task": "guided_greedy", "cases": [{"prompt_ids": [...], "pattern": "..."}], "max_new_tokens": N}
      -> {"results": [[...], ...], "eos_token_id": N}: for each case, greedy where each step may choose only the
      tokens whose bytes keep the text a possible match of `pattern` (the `regex` package's
      partial full match, nothing shared with Rivulet's automaton), and EOS only where the text
      matches whole; ends at EOS (not among the ids) or after N tokens
  {"task": "dequantize", "tensors": [...], "out_dir": "..."}
      -> {"tensors": [{"name", "type", "shape", "path"}]}; each path holds little-endian f32 values,
      dequantized by the `gguf` package's own dequantizer.
  {"task": "save_hf_folder", "out_dir": ...}: the model as a Hugging Face folder (config.json,
      safetensors, tokenizer files), as transformers dequantized it.
  {"task": "dequantize_raw", "type": "Q4_K", "path": ..., "out": ...}: raw blocks of that type
      dequantized the same way into `out` (little-endian f32).

transformers dequantizes GGUF weights to f32 and undoes llama.cpp's Q/K permutation itself, so
nothing here shares code or conventions with Rivulet's loader.

Loading the GGUF file through transformers takes ~20 s on two cores (the dequantization, the
GGUF tokenizer and the metadata reader), and the test suite asks for a reference a dozen times.
So the first call saves the model as transformers loaded it (its f32 state dict, config and
tokenizer: `save_hf_folder`'s files) under `target/hf-reference/`, keyed by the GGUF file (path,
size, modification time), this script and the library versions, and later calls load that folder
(~0.2 s): the same tensors bit for bit, the same tokenizer. A new key's folder replaces the others.
Greedy continuations are kept there too (`greedy`), since several tests ask for the same prompts.
"""
import functools
import hashlib
import json
import math
import os
import shutil
import sys
import tempfile

# Greedy continuations already computed, beside the cached model (see `greedy`).
GREEDY_STORE = "greedy.json"

CACHE_ROOT = os.path.normpath(os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "target", "hf-reference"))


def gguf_tokenizer(model_path):
    from gguf import GGUFReader
    from tokenizers import pre_tokenizers
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(os.path.dirname(model_path), gguf_file=os.path.basename(model_path))
    # transformers' GGUF converter ignores `tokenizer.ggml.pre` and always uses the GPT-2 split.
    # SmolLM2's own tokenizer.json (and llama.cpp's "smollm" pre-tokenizer) first splits every
    # digit on its own, which differs for non-ASCII digits (e.g. " ١٢٣"); restore that.
    field = GGUFReader(model_path).fields.get("tokenizer.ggml.pre")
    if field is not None and bytes(field.parts[field.data[0]]).decode() == "smollm":
        tokenizer.backend_tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
            [
                pre_tokenizers.Digits(individual_digits=True),
                pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=True, use_regex=True),
            ]
        )
    return tokenizer


def greedy(model_path, prompts, max_new_tokens):
    """Each prompt's greedy continuation. A prompt's first N tokens do not depend on how many
    follow (the same loop computes them), so continuations are kept beside the cached model
    (`greedy.json`, the longest one per prompt) and a request for no more than that many tokens
    is answered from there: the suite asks for the same prompts at several lengths."""
    import torch

    store_path = os.path.join(cached_hf_folder(model_path), GREEDY_STORE)
    store = read_json(store_path)
    tokenizer = load_tokenizer(model_path)
    model = None
    results = []
    with torch.no_grad():
        for prompt in prompts:
            known = store.get(prompt)
            if known is not None and len(known["output_ids"]) >= max_new_tokens:
                results.append({"prompt_ids": known["prompt_ids"], "output_ids": known["output_ids"][:max_new_tokens]})
                continue
            if model is None:
                torch.manual_seed(0)
                model = load_model(model_path)
            ids = tokenizer(prompt, add_special_tokens=False)["input_ids"]
            # A plain greedy loop with a KV cache: no EOS stopping, exactly max_new_tokens tokens.
            out = model(torch.tensor([ids]), use_cache=True)
            past = out.past_key_values
            generated = []
            while len(generated) < max_new_tokens:
                if generated:
                    out = model(torch.tensor([[generated[-1]]]), past_key_values=past, use_cache=True)
                    past = out.past_key_values
                generated.append(int(out.logits[0, -1].argmax()))
            results.append({"prompt_ids": ids, "output_ids": generated})
            store[prompt] = results[-1]
    if model is not None:
        # Merged with what other calls wrote meanwhile (the longer continuation wins), then
        # replaced atomically.
        merged = read_json(store_path)
        for prompt, result in store.items():
            if len(merged.get(prompt, {}).get("output_ids", [])) < len(result["output_ids"]):
                merged[prompt] = result
        staging = store_path + f".{os.getpid()}"
        with open(staging, "w") as out_file:
            json.dump(merged, out_file)
        os.replace(staging, store_path)
    return {"results": results, "eos_token_id": tokenizer.eos_token_id}


def read_json(path):
    try:
        with open(path) as in_file:
            return json.load(in_file)
    except (OSError, ValueError):
        return {}


def logprobs(model_path, prompt_ids, output_ids, top):
    import torch

    model = load_model(model_path)
    with torch.no_grad():
        logits = model(torch.tensor([prompt_ids + output_ids])).logits[0]
    log_probs = torch.log_softmax(logits.double(), dim=-1)
    steps = []
    for i, token in enumerate(output_ids):
        row = log_probs[len(prompt_ids) - 1 + i]
        values, ids = row.topk(top)
        steps.append({"logprob": float(row[token]), "top_ids": ids.tolist(), "top_values": values.tolist()})
    return {"steps": steps}


def processed_greedy(model_path, prompt_ids, max_new_tokens, logit_bias, allowed_token_ids, repetition_penalty):
    import torch
    from transformers import LogitsProcessorList, RepetitionPenaltyLogitsProcessor, SequenceBiasLogitsProcessor

    allowed = torch.tensor(sorted(set(allowed_token_ids))) if allowed_token_ids else None
    processors = LogitsProcessorList()
    if logit_bias:
        processors.append(SequenceBiasLogitsProcessor([[[int(token)], float(bias)] for token, bias in logit_bias.items()]))
    if repetition_penalty != 1.0:
        processors.append(RepetitionPenaltyLogitsProcessor(repetition_penalty))
    model = load_model(model_path)
    ids = list(prompt_ids)
    output_ids, logprobs = [], []
    with torch.no_grad():
        out = model(torch.tensor([ids]), use_cache=True)
        while len(output_ids) < max_new_tokens:
            if output_ids:
                out = model(torch.tensor([[output_ids[-1]]]), past_key_values=out.past_key_values, use_cache=True)
            raw = out.logits[:, -1].float()
            scores = raw.clone()
            if allowed is not None:
                scores = torch.full_like(scores, -math.inf).index_copy(1, allowed, scores[:, allowed])
            scores = processors(torch.tensor([ids + output_ids]), scores)
            token = int(scores[0].argmax())
            logprobs.append(float(torch.log_softmax(raw[0].double(), dim=-1)[token]))
            output_ids.append(token)
    return {"output_ids": output_ids, "logprobs": logprobs}


def guided_greedy(model_path, cases, max_new_tokens):
    import regex

    tokenizer = load_tokenizer(model_path)
    # GPT-2's byte-level alphabet (as in its paper's code): printable Latin-1 bytes stand for
    # themselves, the other 68 for the characters from U+0100 on, in byte order.
    printable = [*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAC + 1), *range(0xAE, 0xFF + 1)]
    shifted = [b for b in range(256) if b not in printable]
    byte_of = {chr(b): b for b in printable} | {chr(256 + i): b for i, b in enumerate(shifted)}
    special = set(tokenizer.all_special_ids) | set(tokenizer.added_tokens_decoder)
    pieces = {}
    # The tokens' bytes as a trie (byte -> child; None -> the ids ending there), so that a step
    # tests each prefix once and skips every token under a prefix that cannot match.
    trie = {}
    for token, token_id in tokenizer.get_vocab().items():
        if token_id not in special:
            pieces[token_id] = bytes(byte_of[char] for char in token)
            node = trie
            for byte in pieces[token_id]:
                node = node.setdefault(byte, {})
            node.setdefault(None, []).append(token_id)
    eos = tokenizer.eos_token_id
    model = load_model(model_path)
    results = [
        guided_case(model, pieces, trie, eos, case["prompt_ids"], regex.compile(case["pattern"]), max_new_tokens)
        for case in cases
    ]
    return {"results": results, "eos_token_id": eos}


def guided_case(model, pieces, trie, eos, prompt_ids, compiled, max_new_tokens):
    import torch

    def possible(text_bytes):
        """True, False, or None while the text ends inside a character."""
        try:
            text = text_bytes.decode("utf-8")
        except UnicodeDecodeError as error:
            return None if error.reason == "unexpected end of data" else False
        return compiled.fullmatch(text, partial=True) is not None

    def allowed_tokens(text):
        allowed, stack = [], [(text, trie)]
        while stack:
            prefix, node = stack.pop()
            for byte, child in node.items():
                if byte is None:
                    continue
                extended = prefix + bytes([byte])
                verdict = possible(extended)
                if verdict is False:
                    continue
                if verdict:
                    allowed.extend(child.get(None, []))
                stack.append((extended, child))
        return allowed

    output_ids, text = [], b""
    with torch.no_grad():
        out = model(torch.tensor([list(prompt_ids)]), use_cache=True)
        while len(output_ids) < max_new_tokens:
            if output_ids:
                out = model(torch.tensor([[output_ids[-1]]]), past_key_values=out.past_key_values, use_cache=True)
            logits = out.logits[0, -1].float()
            allowed = allowed_tokens(text)
            if compiled.fullmatch(text.decode("utf-8")) is not None:
                allowed.append(eos)
            scores = torch.full_like(logits, -math.inf)
            scores[allowed] = logits[allowed]
            token = int(scores.argmax())
            if token == eos:
                break
            output_ids.append(token)
            text += pieces[token]
    return output_ids


def chat_prompt_ids(model_path, messages, add_generation_prompt, continue_final_message):
    tokenizer = load_tokenizer(model_path)
    text = tokenizer.apply_chat_template(
        messages,
        tokenize=False,
        add_generation_prompt=add_generation_prompt,
        continue_final_message=continue_final_message,
    )
    return {"text": text, "ids": tokenizer(text, add_special_tokens=False)["input_ids"]}


def tokenize(model_path, texts):
    tokenizer = load_tokenizer(model_path)
    return {"ids": [tokenizer(text, add_special_tokens=False)["input_ids"] for text in texts]}


def dequantize(model_path, names, out_dir):
    import numpy as np
    from gguf import GGUFReader
    from gguf.quants import dequantize as gguf_dequantize

    reader = GGUFReader(model_path)
    by_name = {t.name: t for t in reader.tensors}
    answer = []
    for name in names:
        tensor = by_name[name]
        values = gguf_dequantize(tensor.data, tensor.tensor_type).astype("<f4")
        path = os.path.join(out_dir, name + ".f32")
        values.tofile(path)
        answer.append({"name": name, "type": tensor.tensor_type.name, "shape": list(values.shape), "path": path})
    return {"tensors": answer}


def dequantize_raw(type_name, path, out_path):
    import numpy as np
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
    from gguf.quants import dequantize as gguf_dequantize

    qtype = GGMLQuantizationType[type_name]
    _, type_size = GGML_QUANT_SIZES[qtype]
    raw = np.fromfile(path, dtype=np.uint8).reshape(-1, type_size)
    gguf_dequantize(raw, qtype).astype("<f4").reshape(-1).tofile(out_path)
    return {"path": out_path}


def convert_to_hf_folder(model_path, out_dir):
    """The GGUF file as transformers loads it, written as a Hugging Face folder."""
    import torch
    from transformers import AutoModelForCausalLM

    tokenizer = gguf_tokenizer(model_path)
    model = AutoModelForCausalLM.from_pretrained(
        os.path.dirname(model_path), gguf_file=os.path.basename(model_path), dtype=torch.float32
    )
    # transformers will not save_pretrained a model it loaded from GGUF; write the same files
    # directly: its dequantized f32 state dict as safetensors and its config.
    from safetensors.torch import save_file

    os.makedirs(out_dir, exist_ok=True)
    state = {name: tensor.contiguous() for name, tensor in model.state_dict().items()}
    if model.config.tie_word_embeddings:
        state.pop("lm_head.weight", None)
    save_file(state, os.path.join(out_dir, "model.safetensors"))
    config = model.config.to_dict()
    config.pop("quantization_config", None)
    with open(os.path.join(out_dir, "config.json"), "w") as out:
        json.dump(config, out, indent=2)
    tokenizer.save_pretrained(out_dir)


@functools.cache  # one key (and one conversion) per call of the script
def cached_hf_folder(model_path):
    """The cached folder for `model_path` (see the module's doc), converted on first use."""
    import gguf
    import torch
    import transformers

    stat = os.stat(model_path)
    with open(os.path.abspath(__file__), "rb") as script:
        script_hash = hashlib.sha256(script.read()).hexdigest()
    key = "|".join(
        [
            model_path,
            str(stat.st_size),
            str(stat.st_mtime_ns),
            script_hash,
            transformers.__version__,
            torch.__version__,
            getattr(gguf, "__version__", ""),
        ]
    )
    folder = os.path.join(CACHE_ROOT, hashlib.sha256(key.encode()).hexdigest()[:16])
    if not os.path.isdir(folder):
        os.makedirs(CACHE_ROOT, exist_ok=True)
        staging = tempfile.mkdtemp(dir=CACHE_ROOT, prefix="converting-")
        try:
            convert_to_hf_folder(model_path, staging)
            os.rename(staging, folder)  # atomic; fails if a concurrent call got there first
        except OSError:
            if not os.path.isdir(folder):
                raise
        finally:
            shutil.rmtree(staging, ignore_errors=True)
        # Each folder is ~540 MB of f32: older keys (an edited script, a rebuilt model) go.
        for name in os.listdir(CACHE_ROOT):
            if name != os.path.basename(folder) and not name.startswith("converting-"):
                shutil.rmtree(os.path.join(CACHE_ROOT, name), ignore_errors=True)
    return folder


def load_model(model_path):
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(cached_hf_folder(model_path), dtype=torch.float32)
    model.eval()
    return model


def load_tokenizer(model_path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(cached_hf_folder(model_path))


def save_hf_folder(model_path, out_dir):
    folder = cached_hf_folder(model_path)
    os.makedirs(out_dir, exist_ok=True)
    for name in os.listdir(folder):
        if name != GREEDY_STORE:
            shutil.copy(os.path.join(folder, name), os.path.join(out_dir, name))
    return {"files": sorted(os.listdir(out_dir))}


def main():
    request = json.load(sys.stdin)
    model_path = os.path.abspath(request["model"])
    task = request["task"]
    if task == "greedy":
        answer = greedy(model_path, request["prompts"], request["max_new_tokens"])
    elif task == "logprobs":
        answer = logprobs(model_path, request["prompt_ids"], request["output_ids"], request["top"])
    elif task == "processed_greedy":
        answer = processed_greedy(
            model_path,
            request["prompt_ids"],
            request["max_new_tokens"],
            request.get("logit_bias", {}),
            request.get("allowed_token_ids"),
            request.get("repetition_penalty", 1.0),
        )
    elif task == "guided_greedy":
        answer = guided_greedy(model_path, request["cases"], request["max_new_tokens"])
    elif task == "dequantize_raw":
        answer = dequantize_raw(request["type"], request["path"], request["out"])
    elif task == "save_hf_folder":
        answer = save_hf_folder(model_path, request["out_dir"])
    elif task == "chat_prompt_ids":
        answer = chat_prompt_ids(
            model_path, request["messages"], request["add_generation_prompt"], request["continue_final_message"]
        )
    elif task == "tokenize":
        answer = tokenize(model_path, request["texts"])
    elif task == "dequantize":
        answer = dequantize(model_path, request["tensors"], request["out_dir"])
    else:
        raise SystemExit(f"unknown task {task!r}")
    json.dump(answer, sys.stdout)


if __name__ == "__main__":
    main()
