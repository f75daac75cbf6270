"""The segments extension of /v1/completions on a server with segment reuse on: documents
reused in another order are reported as segment tokens, and bad segment bodies get a 400."""

from __future__ import annotations

import httpx
import pytest

from kvmosaic.server.launch import ServerProcess

HEAD = "<|im_start|>system\nAnswer from the documents.<|im_end|>\n<|im_start|>user\n"
DOCS = [
    "Document A. The lighthouse on Gull Point was built in 1871 and painted red in 1902. ",
    "Document B. The ferry to Marsh Island leaves at seven and returns at four. ",
    "Document C. The bakery on Quay Street sells rye bread on Tuesdays only. ",
]
TAIL = "When was the lighthouse built?<|im_end|>\n<|im_start|>assistant\n"
SEP = "<|doc|>"


@pytest.fixture(scope="module")
def server():
    proc = ServerProcess("--dtype", "float32", "--num-kv-blocks", "256", "--max-model-len", "1024",
                         "--segment-reuse", "blend", "--blend-ratio", "0.3", "--segment-separator", SEP)
    with proc.start():
        yield proc


def complete(server, **body) -> httpx.Response:
    body = {"max_tokens": 4, "temperature": 0.0, **body}
    return httpx.post(server.url + "/v1/completions", json=body, timeout=120)


def test_segments_reused_in_another_order(server):
    first = complete(server, prompt=HEAD, segments=DOCS, segment_suffix=TAIL)
    assert first.status_code == 200, first.text
    details = first.json()["usage"]["prompt_tokens_details"]
    assert details["segment_tokens"] == 0  # the first time, every segment is computed
    again = complete(server, prompt=HEAD, segments=DOCS[::-1], segment_suffix=TAIL)
    assert again.status_code == 200, again.text
    usage = again.json()["usage"]
    reused = usage["prompt_tokens_details"]["segment_tokens"]
    assert reused > 0 and reused + usage["prompt_tokens_details"]["cached_tokens"] < usage["prompt_tokens"]
    assert server.health()["kv"]["num_used_blocks"] == 0


def test_a_separator_marks_segments_in_chat_messages(server):
    def chat(docs):
        content = "Answer from the documents." + SEP + SEP.join(docs) + SEP + "When was the lighthouse built?"
        body = {"messages": [{"role": "user", "content": content}], "max_tokens": 4, "temperature": 0.0}
        r = httpx.post(server.url + "/v1/chat/completions", json=body, timeout=120)
        assert r.status_code == 200, r.text
        return r.json()["usage"]["prompt_tokens_details"]["segment_tokens"]

    notes = [d.replace("Document", "Note") for d in DOCS]  # segments no other test stored
    assert chat(notes) == 0
    assert chat(notes[::-1]) > 0
    assert server.health()["kv"]["num_used_blocks"] == 0


@pytest.mark.parametrize(
    "body, words",
    [
        (dict(prompt=[1, 2, 3], segments=DOCS), "prompt must be a string"),
        (dict(prompt=HEAD, segments=[]), "segments"),
        (dict(prompt=HEAD, segments=["ok", 5]), "segments"),
        (dict(prompt=HEAD, segment_suffix=TAIL), "segment_suffix needs segments"),
    ],
)
def test_bad_segment_bodies_are_refused(server, body, words):
    r = complete(server, **body)
    assert r.status_code == 400, r.text
    assert words in r.json()["error"]["message"]
    assert server.health()["kv"]["num_used_blocks"] == 0
