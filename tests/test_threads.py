"""The thread budget (engine/threads.py): fewer threads while other work holds the cores, and
the same results whatever the count."""

from __future__ import annotations

import pytest
import torch

from kvmosaic.engine.threads import ThreadBudget, runnable_threads


@pytest.fixture
def restore_threads():
    before = torch.get_num_threads()
    yield
    torch.set_num_threads(before)


def write_load(path, running: int) -> None:
    path.write_text(f"0.50 0.40 0.30 {running}/300 12345\n")


def test_budget_gives_way_to_other_runnable_threads_and_comes_back(tmp_path, restore_threads):
    load = tmp_path / "loadavg"
    write_load(load, 1)  # only the caller
    budget = ThreadBudget(2, cores=2, path=str(load))
    assert budget.update() == 2
    write_load(load, 2)  # one other thread runnable: it holds one of the two cores
    counts = [budget.update() for _ in range(6)]
    assert counts[0] == 2, "one reading is smoothed, not obeyed at once"
    assert counts[-1] == 1 and torch.get_num_threads() == 1
    write_load(load, 1)
    assert [budget.update() for _ in range(6)][-1] == 2 and torch.get_num_threads() == 2


def test_budget_never_exceeds_its_maximum_nor_drops_below_one(tmp_path, restore_threads):
    load = tmp_path / "loadavg"
    write_load(load, 1)
    assert ThreadBudget(3, cores=16, path=str(load)).update() == 3
    write_load(load, 40)
    budget = ThreadBudget(4, cores=8, path=str(load))
    assert [budget.update() for _ in range(10)][-1] == 1
    assert ThreadBudget(2, cores=2, path=str(tmp_path / "missing")).update() == 2  # unknown load: no change


def test_runnable_threads_reads_this_machine():
    running = runnable_threads()
    assert running is None or running >= 1


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_outputs_do_not_depend_on_the_thread_count(dtype, restore_threads):
    """Prefill and batched decode with one thread and with two: the same greedy tokens, and
    log-probabilities equal up to float32 summation order (MKL's float32 GEMM blocks its sums by
    thread count), so the budget may change the count between any two steps."""
    from kvmosaic import LLM, SamplingParams

    llm = LLM(dtype=dtype, adaptive_threads=False, num_kv_blocks=64)
    prompts = [list(range(1000, 1000 + 70)), list(range(2000, 2000 + 35))]
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True, logprobs=5)
    runs = []
    for threads in (1, 2):
        torch.set_num_threads(threads)
        llm.engine.reset_prefix_cache()
        runs.append(llm.generate(prompts, params))
    for one, two in zip(*runs):
        assert one.token_ids == two.token_ids
        for a, b in zip(one.logprobs, two.logprobs):
            assert a.keys() == b.keys()
            assert max(abs(a[t] - b[t]) for t in a) < 1e-4
