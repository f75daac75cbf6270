"""The thread budget (engine/threads.py): fewer threads while other work holds the cores, and
the same results whatever the count."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from kvmosaic import cli
from kvmosaic.engine.threads import WINDOW, ThreadBudget, machine_busy_seconds, own_cpu_seconds


@pytest.fixture
def restore_threads():
    before = torch.get_num_threads()
    yield
    torch.set_num_threads(before)


class Machine:
    """A machine's CPU counters as /proc/stat shows them, and this process's CPU time, advanced
    by hand: ``run(seconds, others=cores busy elsewhere, own=cores this process used)``."""

    def __init__(self, path) -> None:
        self.path, self.now, self.busy, self.own = path, 0.0, 0.0, 0.0
        self._write()

    def _write(self) -> None:
        hz = os.sysconf("SC_CLK_TCK")
        self.path.write_text(f"cpu  {round(self.busy * hz)} 0 0 123456 0 0 0 0 0 0\ncpu0 0 0 0 0 0 0 0 0 0 0\n")

    def run(self, seconds: float, others: float, own: float = 1.0) -> None:
        self.now += seconds
        self.busy += seconds * (others + own)
        self.own += seconds * own
        self._write()

    def budget(self, max_threads: int, cores: int) -> ThreadBudget:
        return ThreadBudget(max_threads, cores, str(self.path), clock=lambda: self.now, own_cpu=lambda: self.own)


def steps(machine: Machine, budget: ThreadBudget, windows: int, others: float, own: float = 1.0) -> list[int]:
    counts = []
    for _ in range(windows):
        machine.run(WINDOW, others, own)
        counts.append(budget.update())
    return counts


def test_budget_gives_way_to_a_busy_process_and_comes_back(tmp_path, restore_threads):
    machine = Machine(tmp_path / "stat")
    budget = machine.budget(2, cores=2)
    assert steps(machine, budget, 3, others=0.0, own=2.0)[-1] == 2
    counts = steps(machine, budget, 6, others=1.0)  # another process spins on one core
    assert counts[0] == 2, "one window is smoothed, not obeyed at once"
    assert counts[-1] == 1 and torch.get_num_threads() == 1
    assert steps(machine, budget, 6, others=0.0, own=2.0)[-1] == 2 and torch.get_num_threads() == 2


def test_budget_ignores_light_work_and_its_own_spinning(tmp_path, restore_threads):
    """A client streaming the answers (a fifth of a core) takes no core; nor do this process's
    own OpenMP workers, however busy (they are in its own CPU time)."""
    machine = Machine(tmp_path / "stat")
    budget = machine.budget(2, cores=2)
    assert set(steps(machine, budget, 10, others=0.2, own=2.0)) == {2}


def test_budget_stays_within_one_and_its_maximum(tmp_path, restore_threads):
    machine = Machine(tmp_path / "stat")
    assert steps(machine, machine.budget(3, cores=16), 5, others=4.0)[-1] == 3
    assert steps(machine, machine.budget(4, cores=8), 10, others=12.0)[-1] == 1
    unknown = ThreadBudget(2, cores=2, path=str(tmp_path / "missing"))
    assert unknown.update() == 2


def test_budget_reads_this_machine():
    assert machine_busy_seconds() is None or machine_busy_seconds() > 0
    assert own_cpu_seconds() > 0


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


def test_serve_shortens_the_openmp_spin_before_torch_loads():
    """``kvmosaic serve`` sets libgomp's spin count (``cli.SERVE_GOMP_SPINCOUNT``) in its own
    process before torch is imported, unless the operator set one."""
    code = ("import os\nfrom kvmosaic.cli import main\ntry:\n    main(['serve', '--help'])\nexcept SystemExit:\n    pass\n"
            "print(os.environ.get('GOMP_SPINCOUNT'))")
    env = {k: v for k, v in os.environ.items() if k != "GOMP_SPINCOUNT"}

    def spin(environment: dict) -> str:
        done = subprocess.run([sys.executable, "-c", code], env=environment, capture_output=True, text=True, timeout=120)
        assert done.returncode == 0, done.stderr
        return done.stdout.split()[-1]

    assert spin(env) == cli.SERVE_GOMP_SPINCOUNT
    assert spin({**env, "GOMP_SPINCOUNT": "5"}) == "5"

