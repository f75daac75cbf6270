"""The LLM API: sampling, stopping, salts, reset, stats, safetensors loading."""

from __future__ import annotations

import json

import pytest
import torch

from kvmosaic import LLM, SamplingParams
from kvmosaic.model.config import ModelConfig
from tests.conftest import make_llm

SYSTEM = "You are a terse assistant who answers questions about geography and tiles. " * 4


@pytest.fixture(scope="module")
def llm():
    return make_llm()


def test_kv_bytes_per_token_formula():
    cfg = ModelConfig(49152, 576, 1536, 30, 9, 3, 64, 1e5, 1e-5, 8192, True)
    assert cfg.kv_bytes_per_token(2) == 2 * 30 * 3 * 64 * 2 == 23040


def test_seeded_sampling_is_reproducible_and_filters_work(llm):
    prompt = "Once upon a time"
    sampled = SamplingParams(temperature=1.0, top_p=0.9, seed=7, max_tokens=8, ignore_eos=True)
    a, b = llm.generate([prompt, prompt], sampled)  # batched together, still independent
    assert a.token_ids == b.token_ids
    greedy = llm.generate(prompt, SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True))[0]
    top1 = llm.generate(prompt, SamplingParams(temperature=1.5, top_k=1, seed=1, max_tokens=8, ignore_eos=True))[0]
    tiny_p = llm.generate(prompt, SamplingParams(temperature=1.5, top_p=1e-6, seed=2, max_tokens=8, ignore_eos=True))[0]
    assert top1.token_ids == greedy.token_ids == tiny_p.token_ids


def test_stops(llm):
    base = llm.generate("Count: 1, 2, 3,", SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True))[0]
    assert base.finish_reason == "length" and len(base.token_ids) == 12
    stop = base.text[4:7]
    out = llm.generate("Count: 1, 2, 3,", SamplingParams(temperature=0.0, max_tokens=12, stop=[stop]))[0]
    assert out.finish_reason == "stop" and out.stop_reason == stop
    assert out.text == base.text[: base.text.index(stop)]
    tok = base.token_ids[2]
    out = llm.generate("Count: 1, 2, 3,", SamplingParams(temperature=0.0, max_tokens=12, stop_token_ids=[tok]))[0]
    assert out.token_ids == base.token_ids[:3] and out.stop_reason == tok
    chat = llm.chat([{"role": "user", "content": "What is the capital of France?"}], SamplingParams(temperature=0.0, max_tokens=32))[0]
    assert chat.finish_reason == "stop" and chat.token_ids[-1] == llm.tokenizer.eos_token_id


def test_text_is_decoded_incrementally_and_ends_as_a_whole_decode(llm):
    """Each step's text extends the last one (the decode stream), and every finished text equals
    the tokenizer's decode of all its ids, special tokens kept or skipped, multi-byte characters
    included (random ids split UTF-8 sequences across tokens)."""
    from kvmosaic.engine.sequence import Sequence

    engine, rng = llm.engine, torch.Generator().manual_seed(5)
    for skip in (True, False):
        ids = torch.randint(0, llm.tokenizer.vocab_size, (120,), generator=rng).tolist()
        seq = Sequence("r", None, [1, 2, 3], SamplingParams(max_tokens=120, ignore_eos=True, skip_special_tokens=skip))
        texts = []
        for tok in ids:
            seq.append_token(tok)
            engine.outputs.check_stop(seq, tok)
            texts.append(seq.output_text)
        assert all(b.startswith(a) for a, b in zip(texts, texts[1:]))
        assert seq.finish_reason == "length"
        assert seq.output_text == llm.tokenizer.decode(ids, skip_special_tokens=skip)
        greedy = llm.generate("Écris un poème: 🌊", SamplingParams(temperature=0.8, seed=3, max_tokens=40,
                                                                 ignore_eos=True, skip_special_tokens=skip))[0]
        assert greedy.text == llm.tokenizer.decode(greedy.token_ids, skip_special_tokens=skip)


def test_salts_isolate_and_same_salt_shares(llm):
    msgs = lambda q: [{"role": "system", "content": SYSTEM}, {"role": "user", "content": q}]  # noqa: E731
    params = SamplingParams(temperature=0.0, max_tokens=2)
    first = llm.chat(msgs("Where is Lisbon?"), params, cache_salt="tenant-a")[0]
    other = llm.chat(msgs("Where is Porto?"), params, cache_salt="tenant-b")[0]
    same = llm.chat(msgs("Where is Faro?"), params, cache_salt="tenant-a")[0]
    unsalted = llm.chat(msgs("Where is Braga?"), params)[0]
    assert first.num_cached_tokens == 0 and other.num_cached_tokens == 0 and unsalted.num_cached_tokens == 0
    assert same.num_cached_tokens >= 64
    salted_blocks = {b.block_id for b in llm.engine.pool.cached.values()}
    assert len(salted_blocks) == len(llm.engine.pool.cached)  # one block per name, no sharing


def test_reset_refused_while_running_then_clears(llm):
    llm.generate("warm the cache with this prompt " * 4, SamplingParams(max_tokens=1))
    llm.engine.add_request("a request that will be running " * 3, SamplingParams(max_tokens=4), request_id="r1")
    llm.engine.step()
    assert llm.reset_prefix_cache() is False and llm.engine.pool.cached
    while llm.engine.has_unfinished_requests():
        llm.engine.step()
    assert llm.reset_prefix_cache() is True and not llm.engine.pool.cached
    st = llm.get_stats()
    assert st.kv_cache_usage == 0 and st.num_cached_blocks == 0 and st.kv_bytes_per_token == 2 * 30 * 3 * 64 * 4


@pytest.mark.parametrize(
    "prompt, params, message",
    [
        ("", SamplingParams(), "empty"),
        ([1, 2, 10**9], SamplingParams(), "token ids"),
        ({"prompt": "hi", "cache_salt": 5}, SamplingParams(), "cache_salt"),
        ({"prompt": "hi", "colour": "red"}, SamplingParams(), "unknown"),
        ([7] * 9000, SamplingParams(), "context"),
        (3.5, SamplingParams(), "prompt must be"),
    ],
)
def test_bad_requests_change_nothing(llm, prompt, params, message):
    before = (len(llm.engine.requests), llm.engine.pool.num_free_blocks, len(llm.engine.scheduler.waiting))
    with pytest.raises(ValueError, match=message):
        llm.engine.add_request(prompt, params)
    assert before == (len(llm.engine.requests), llm.engine.pool.num_free_blocks, len(llm.engine.scheduler.waiting))


@pytest.mark.parametrize(
    "kwargs", [dict(max_tokens=0), dict(temperature=-1), dict(top_p=0), dict(top_k=-2), dict(n=0), dict(logprobs=99)]
)
def test_sampling_params_validate(kwargs):
    with pytest.raises(ValueError):
        SamplingParams(**kwargs)


def test_logprobs_are_returned(llm):
    out = llm.generate("The sky is", SamplingParams(temperature=0.0, max_tokens=3, logprobs=2))[0]
    assert len(out.logprobs) == 3
    for tok, lp in zip(out.token_ids, out.logprobs):
        assert tok in lp and max(lp.values()) == lp[tok] <= 0.0


def test_safetensors_folder_matches_transformers(tmp_path, tokenizer):
    """Any local Llama checkpoint loads through the same path: a tiny random one here."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=49152, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                      rope_theta=10000.0, rms_norm_eps=1e-5, tie_word_embeddings=False)
    ref = LlamaForCausalLM(cfg).eval()
    ref.save_pretrained(tmp_path, safe_serialization=True)
    tokenizer.save_pretrained(tmp_path)
    assert json.loads((tmp_path / "config.json").read_text())["num_hidden_layers"] == 2
    llm = LLM(model=str(tmp_path), dtype="float32", device="cpu", num_kv_blocks=32)
    ids = list(range(100, 140))
    logits = {}
    run = llm.engine.runner.execute

    def keep(batch):
        result = run(batch)
        logits[len(logits)] = result.logits[0].clone()
        return result

    llm.engine.runner.execute = keep
    out = llm.generate([ids], SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True))[0]
    with torch.no_grad():
        full = ref(torch.tensor([ids + out.token_ids])).logits[0]
    for step in range(3):
        assert (logits[step] - full[len(ids) - 1 + step]).abs().max() < 1e-4
    assert out.token_ids[0] == int(full[len(ids) - 1].argmax())


def test_a_request_the_pool_cannot_hold_ends_with_length():
    llm = make_llm(num_kv_blocks=6, block_size=4)  # 24 token slots in all
    params = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    outs = llm.generate([list(range(100, 110)), list(range(200, 210))], params)
    for out in outs:
        assert out.finish_reason == "length" and 0 < len(out.token_ids) < 40
    assert max(len(o.prompt_token_ids) + len(o.token_ids) for o in outs) <= 25
    st = llm.get_stats()
    assert st.num_preemptions > 0 and st.kv_cache_usage == 0 and not llm.engine.requests
    llm.engine.pool.check_invariants()


def test_dtype_auto_picks_what_the_hardware_computes_natively():
    import torch

    from kvmosaic.engine.config import EngineConfig, auto_dtype

    assert auto_dtype(torch.device("cuda")) == "bfloat16"
    native = torch.cpu._is_avx512_bf16_supported() or torch.cpu._is_amx_tile_supported()
    assert auto_dtype(torch.device("cpu")) == ("bfloat16" if native else "float32")
    assert EngineConfig(device="cpu").dtype == auto_dtype(torch.device("cpu"))
    assert EngineConfig(device="cpu", dtype="bfloat16").dtype == "bfloat16"


def test_slot_usage_counts_shared_blocks_once():
    from kvmosaic.engine.sampling_params import SamplingParams as SP
    from tests.conftest import make_llm

    eng = make_llm(max_num_batched_tokens=512).engine
    params = SP(temperature=0, max_tokens=4, ignore_eos=True)
    eng.add_request(list(range(100, 140)), params)  # 40 tokens: 3 blocks, the last one half full
    eng.step()
    st = eng.get_stats()
    assert (st.kv_slots_allocated, st.kv_slots_used) == (48, 40)
    eng.add_request(list(range(100, 140)) + [7], params)  # shares the first two blocks
    eng.step()  # the first decodes its 41st token; the second computes tokens 32-40 in a block of its own
    st = eng.get_stats()
    assert (st.kv_slots_allocated, st.kv_slots_used) == (4 * 16, 41 + 9)
    while eng.has_unfinished_requests():
        eng.step()
    st = eng.get_stats()
    assert (st.kv_slots_allocated, st.kv_slots_used) == (0, 0)


def test_structured_outputs_in_process():
    """``SamplingParams.structured_outputs`` (vLLM's): a choice and a regex, sampled hot; a regex
    llguidance refuses is a ValueError before anything is queued."""
    pytest.importorskip("llguidance")
    import re

    from kvmosaic import StructuredOutputs

    llm = make_llm()
    pick = SamplingParams(max_tokens=16, temperature=1.0, seed=1, n=4,
                          structured_outputs=StructuredOutputs(choice=["red", "green", "blue"]))
    assert {o.text for o in llm.generate(["Colour:"], pick)} <= {"red", "green", "blue"}
    number = SamplingParams(max_tokens=16, temperature=1.0, seed=2, structured_outputs=StructuredOutputs(regex=r"[1-9][0-9]{2}"))
    out = llm.generate(["Number:"], number)[0]
    assert re.fullmatch(r"[1-9][0-9]{2}", out.text) and out.finish_reason == "stop"
    with pytest.raises(ValueError, match="regex"):
        llm.generate(["x"], SamplingParams(structured_outputs=StructuredOutputs(regex="[0-9")))
    assert llm.engine.pool.num_used_blocks == 0 and not llm.engine.has_unfinished_requests()
    with pytest.raises(ValueError, match="exactly one"):
        StructuredOutputs(regex="a", choice=["a"])
