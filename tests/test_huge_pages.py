"""The engine's large CPU tensors on transparent huge pages (kvmosaic/huge_pages.py).

The end-to-end test builds engines in fresh processes: torch latches ``THP_MEM_ALLOC_ENABLE`` at a
process's first large allocation, which this test process made long ago.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from kvmosaic.huge_pages import ENV, request_huge_pages

SYSFS = "/sys/kernel/mm/transparent_hugepage/enabled"


def kernel_mode(path: str = SYSFS) -> str:
    """The kernel's THP mode (``always``, ``madvise`` or ``never``; "" where it does not say): huge
    pages back torch's requests under the first two."""
    try:
        with open(path) as f:
            text = f.read()
    except OSError:
        return ""
    start, end = text.find("["), text.find("]")
    return text[start + 1:end] if 0 <= start < end else ""

CHILD = r"""
import json
import os

def thp_faults():
    # the kernel's huge-page faults so far, served and fallen back to 4 KB pages (none free)
    with open("/proc/vmstat") as f:
        counts = dict(line.split() for line in f)
    return int(counts.get("thp_fault_alloc", 0)), int(counts.get("thp_fault_fallback", 0))

before = thp_faults()
from kvmosaic import LLM, SamplingParams

def huge_kb(address):
    # AnonHugePages of the mapping that holds address, from /proc/self/smaps
    inside, kb = False, 0
    with open("/proc/self/smaps") as f:
        for line in f:
            head = line.split()[0]
            if "-" in head and not head.endswith(":"):
                lo, hi = (int(x, 16) for x in head.split("-"))
                inside = lo <= address < hi
            elif inside and head == "AnonHugePages:":
                kb = int(line.split()[1])
    return kb

llm = LLM(dtype="bfloat16", num_kv_blocks=512, num_threads=1, adaptive_threads=False)
engine = llm.engine
after = thp_faults()
out = llm.generate(["The three primary colours are"], SamplingParams(max_tokens=8, temperature=0.0, logprobs=1))[0]
print(json.dumps({
    "env": os.environ.get("THP_MEM_ALLOC_ENABLE"),
    "fallbacks": after[1] - before[1],
    "embedding_kb": huge_kb(engine.model.embed_tokens.weight.data_ptr()),
    "pool_kb": huge_kb(engine.kv.k[0].data_ptr()),
    "tokens": out.token_ids,
    "logprobs": [step[token] for step, token in zip(out.logprobs, out.token_ids)],
}))
"""


def _child(env_value: str | None) -> dict:
    env = {k: v for k, v in os.environ.items() if k != ENV}
    if env_value is not None:
        env[ENV] = env_value
    done = subprocess.run([sys.executable, "-c", CHILD], env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_an_operators_value_is_kept(monkeypatch):
    monkeypatch.setenv(ENV, "0")
    request_huge_pages()
    assert os.environ[ENV] == "0"
    monkeypatch.delenv(ENV)
    request_huge_pages()
    assert os.environ[ENV] == "1"


def test_kernel_mode_reads_the_bracketed_choice(tmp_path):
    path = tmp_path / "enabled"
    path.write_text("always [madvise] never\n")
    assert kernel_mode(str(path)) == "madvise"
    assert kernel_mode(str(tmp_path / "missing")) == ""


@pytest.mark.skipif(kernel_mode() not in ("always", "madvise"), reason="the kernel gives no transparent huge pages")
def test_weights_and_pool_on_huge_pages_with_the_same_outputs():
    on, off = _child(None), _child("0")
    assert on["env"] == "1" and off["env"] == "0"
    # the 56 MB embedding (the LM head's weight too) and a layer's K pool: 2 MB pages by default, unless the
    # kernel had none free when they were first written (asked for all the same: its fallback count rose)
    if on["fallbacks"] == 0:
        assert on["embedding_kb"] >= 2048 and on["pool_kb"] >= 2048, on
    if kernel_mode() == "madvise":  # else the kernel backs them with huge pages whatever torch asks
        assert off["embedding_kb"] == 0 and off["pool_kb"] == 0, off
    assert on["tokens"] == off["tokens"]
    assert on["logprobs"] == off["logprobs"]  # the same bits: pages never change a result
