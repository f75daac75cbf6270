"""vLLM's request fields for scoring and token-level clients, against a real server: ``echo`` (with
``max_tokens`` 0: lm-evaluation-harness's log-likelihood request, checked against transformers),
``prompt_logprobs``, ``return_token_ids``, ``return_tokens_as_token_ids``, ``allowed_token_ids`` and
``truncate_prompt_tokens``; whole and streamed. Every test ends with nothing in use. (Through
``--replicas 2`` too: ``tests/test_server_errors.py``.)"""

from __future__ import annotations

import json

import httpx
import pytest

from kvmosaic.server.launch import ServerProcess
from tests.test_server_requests import BLOCK, CHAT, USER, C, client, complete, idle, unique


@pytest.fixture(scope="module")
def server():
    with ServerProcess("--dtype", "float32", "--num-kv-blocks", "512", "--max-model-len", "2048",
                       "--block-size", str(BLOCK)) as proc:
        yield proc


# ---- echo and prompt log-probabilities ----------------------------------------------------
def test_echo_with_max_tokens_zero_scores_the_prompt_as_lm_eval_asks(server, tokenizer):
    """lm-evaluation-harness's log-likelihood request: the prompt alone, each token's log-probability."""
    prompt = unique("The capital of France is Paris")
    body = {"prompt": prompt, "max_tokens": 0, "echo": True, "logprobs": 1, "temperature": 0}
    first, second = (httpx.post(server.url + C, json=body, timeout=120).json() for _ in range(2))
    ch, ids = first["choices"][0], tokenizer.encode(prompt, add_special_tokens=False)
    assert ch["text"] == prompt and ch["finish_reason"] == "length"
    assert first["usage"]["completion_tokens"] == 0 and first["usage"]["prompt_tokens"] == len(ids)
    lps = ch["logprobs"]
    assert "".join(lps["tokens"]) == prompt and len(lps["token_logprobs"]) == len(ids)
    assert lps["token_logprobs"][0] is None and lps["top_logprobs"][0] is None
    assert all(lp <= 0 for lp in lps["token_logprobs"][1:])
    assert lps["text_offset"] == [sum(len(t) for t in lps["tokens"][:i]) for i in range(len(ids))]
    vllm = ch["prompt_logprobs"]  # vLLM's field, the same numbers with ranks
    assert vllm[0] is None and all(vllm[i][str(t)]["logprob"] == lps["token_logprobs"][i] and vllm[i][str(t)]["rank"] >= 1
                                   for i, t in enumerate(ids) if i)
    assert second["choices"][0]["logprobs"] == lps  # computed again, not read from the cache
    assert second["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    idle(server)


def test_lm_eval_loglikelihood_requests_match_transformers(server, tokenizer, hf_model):
    """lm-evaluation-harness's ``local-completions`` request (token-id prompts, ``echo``, ``logprobs``
    1, ``max_tokens`` 1) and its reading of the answer (the continuation's ``token_logprobs``, the
    generated last one left out) give transformers' log-likelihoods on the same weights."""
    import torch

    ctx = tokenizer.encode("Question: what is the capital of France? Answer:", add_special_tokens=False)
    prompts = [ctx + tokenizer.encode(c, add_special_tokens=False) for c in (" Paris", " a small town in Peru")]
    body = {"prompt": prompts, "temperature": 0, "max_tokens": 1, "logprobs": 1, "seed": 1234, "echo": True}
    r = httpx.post(server.url + C, json=body, timeout=300)
    assert r.status_code == 200, r.text
    for choice, ids in zip(sorted(r.json()["choices"], key=lambda ch: ch["index"]), prompts):
        got = sum(choice["logprobs"]["token_logprobs"][len(ctx):-1])
        with torch.no_grad():
            lp = torch.log_softmax(hf_model(torch.tensor([ids])).logits[0].float(), dim=-1)
        want = sum(float(lp[i - 1, ids[i]]) for i in range(len(ctx), len(ids)))
        assert len(choice["logprobs"]["token_logprobs"]) == len(ids) + 1 and abs(got - want) < 1e-3, (got, want)
    idle(server)


def test_echo_with_a_completion_whole_and_streamed(server):
    prompt = unique("One, two, three,")
    c = client(server)
    whole = c.completions.create(model=None, prompt=prompt, max_tokens=4, temperature=0, echo=True, logprobs=2)
    plain = c.completions.create(model=None, prompt=prompt, max_tokens=4, temperature=0)
    ch = whole.choices[0]
    assert ch.text == prompt + plain.choices[0].text
    n_prompt = whole.usage.prompt_tokens
    assert len(ch.logprobs.tokens) == n_prompt + 4 and ch.logprobs.token_logprobs[0] is None
    assert ch.logprobs.text_offset == sorted(ch.logprobs.text_offset)
    with httpx.stream("POST", server.url + C, json={"prompt": prompt, "max_tokens": 4, "temperature": 0,
                                                    "echo": True, "logprobs": 2, "stream": True}, timeout=120) as r:
        chunks = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: {")]
    assert chunks[0]["choices"][0]["text"].startswith(prompt)
    assert "".join(x["choices"][0]["text"] for x in chunks) == ch.text
    streamed = [t for x in chunks for t in x["choices"][0]["logprobs"]["token_logprobs"]]
    assert streamed == ch.logprobs.token_logprobs
    idle(server)


def test_prompt_logprobs_in_chat_and_with_n(server):
    r = httpx.post(server.url + CHAT, json={"messages": USER, "max_tokens": 2, "prompt_logprobs": 0}, timeout=120)
    body = r.json()
    assert r.status_code == 200 and body["prompt_logprobs"][0] is None
    assert len(body["prompt_logprobs"]) == body["usage"]["prompt_tokens"]
    assert all(len(e) == 1 for e in body["prompt_logprobs"][1:])  # k = 0: the prompt's own token
    both = complete(server, unique("Colours:"), max_tokens=2, n=2, echo=True, prompt_logprobs=1)
    a, b = both["choices"]
    assert a["prompt_logprobs"] == b["prompt_logprobs"] and a["text"][:10] == b["text"][:10]
    idle(server)


def test_return_token_ids_whole_and_streamed(server, tokenizer):
    """vLLM's ``return_token_ids``: the generated ids beside the text and the prompt's ids; streamed,
    each chunk's new ids, the prompt's in the first chunk (chat: beside the choices)."""
    prompt = unique("Count: one, two,")
    whole = complete(server, prompt, max_tokens=6, return_token_ids=True)
    ch = whole["choices"][0]
    assert ch["prompt_token_ids"] == tokenizer.encode(prompt, add_special_tokens=False)
    assert len(ch["token_ids"]) == whole["usage"]["completion_tokens"] and tokenizer.decode(ch["token_ids"]) == ch["text"]
    with httpx.stream("POST", server.url + C, json={"prompt": prompt, "max_tokens": 6, "temperature": 0,
                                                    "return_token_ids": True, "stream": True}, timeout=120) as r:
        chunks = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: {")]
    assert chunks[0]["choices"][0]["prompt_token_ids"] == ch["prompt_token_ids"]
    assert all("prompt_token_ids" not in x["choices"][0] for x in chunks[1:])
    assert [t for x in chunks for t in x["choices"][0]["token_ids"]] == ch["token_ids"]
    chat = httpx.post(server.url + CHAT, json={"messages": USER, "max_tokens": 4, "temperature": 0,
                                               "return_token_ids": True}, timeout=120).json()
    assert len(chat["prompt_token_ids"]) == chat["usage"]["prompt_tokens"]
    assert len(chat["choices"][0]["token_ids"]) == chat["usage"]["completion_tokens"]
    with httpx.stream("POST", server.url + CHAT, json={"messages": USER, "max_tokens": 4, "temperature": 0,
                                                       "return_token_ids": True, "stream": True}, timeout=120) as r:
        chunks = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: {")]
    firsts = [x for x in chunks if "prompt_token_ids" in x]
    assert len(firsts) == 1 and firsts[0]["prompt_token_ids"] == chat["prompt_token_ids"]
    assert [t for x in chunks for t in x["choices"][0].get("token_ids", [])] == chat["choices"][0]["token_ids"]
    idle(server)


def test_allowed_token_ids_and_tokens_as_token_ids(server, tokenizer):
    allowed = [tokenizer.encode(w, add_special_tokens=False)[0] for w in (" cat", " dog")]
    out = complete(server, unique("Pets:"), max_tokens=5, temperature=1.0, seed=4, allowed_token_ids=allowed,
                   return_token_ids=True, logprobs=1, return_tokens_as_token_ids=True)["choices"][0]
    assert out["token_ids"] and set(out["token_ids"]) <= set(allowed)
    assert out["logprobs"]["tokens"] == [f"token_id:{t}" for t in out["token_ids"]]
    r = httpx.post(server.url + C, json={"prompt": "x", "allowed_token_ids": [10**8]}, timeout=60)
    assert r.status_code == 400 and "allowed_token_ids" in r.json()["error"]["message"]
    idle(server)


def test_truncate_prompt_tokens_keeps_the_last_tokens(server, tokenizer):
    ids = tokenizer.encode(unique("one two three four five six seven eight nine ten"), add_special_tokens=False)
    cut = complete(server, ids, max_tokens=4, truncate_prompt_tokens=5, echo=True)
    tail = complete(server, ids[-5:], max_tokens=4)
    assert cut["usage"]["prompt_tokens"] == 5
    assert cut["choices"][0]["text"] == tokenizer.decode(ids[-5:]) + tail["choices"][0]["text"]
    text = tokenizer.decode(ids)
    assert complete(server, text, max_tokens=1, truncate_prompt_tokens=100)["usage"]["prompt_tokens"] == len(ids)
    for bad in (0, -2):
        r = httpx.post(server.url + C, json={"prompt": "x", "truncate_prompt_tokens": bad}, timeout=60)
        assert r.status_code == 400 and "truncate_prompt_tokens" in r.json()["error"]["message"]
    r = httpx.post(server.url + C, json={"prompt": "x", "segments": ["a"], "truncate_prompt_tokens": 3}, timeout=60)
    assert r.status_code == 400 and "segments" in r.json()["error"]["message"]
    idle(server)
