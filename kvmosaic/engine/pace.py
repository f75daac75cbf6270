"""How many prompt tokens a step may compute while other requests are decoding.

Chunked prefill bounds a step by tokens (``max_num_batched_tokens``), and on a GPU that bounds
its time too. On a CPU it does not: 2,048 prompt tokens take 0.5 s on one machine and 5 s on
another, and every stream that is decoding waits that long for its next token (measured: one
4,354-token prompt held a stream's next token for 11 s on a 2-core AVX2 CPU). So when any
request is decoding, the scheduler cuts the step's prefill to the tokens this engine computes
in ``max_decode_stall_ms`` (Sarathi-Serve's budget from a time-between-tokens target, with the
rate measured as the engine runs instead of profiled beforehand). With nothing decoding, the
token budget alone applies: a prompt nobody waits behind goes at full speed.

:class:`PrefillPace` models a step as ``base + per_token * prefill_tokens``: ``base`` the time
of the recent steps that computed no prompt tokens (the decodes' own cost), ``per_token`` the
recent prefill steps' time beyond it per prompt token, both moving averages. Attention makes a
token at position 4,000 dearer than one at 40; the averages follow the requests at hand.

Not cut: a prompt that segment reuse blends (blend/engine_hook.py) is computed in one step, since
its selective recompute needs the whole prompt; it costs a fraction of a full prefill, and for
that reason is not observed either (only the model runner's forward passes are: a blend's time
per prompt token, ~0.3 of a prefill's, would raise the allowance past the stall target).

Cut, between steps: the shadow audit's full prefill of an answer from reused KV (blend/shadow.py), one
piece of at most the allowance between two steps while any request decodes (``decode_allowance``), so a
stream waits for at most about two allowances (the step's prefill and the piece), not for the audit of a
whole prompt.

Invariants: the allowance is at least :data:`MIN_CHUNK` tokens (a prompt always advances);
before a step of :data:`MIN_SAMPLE` prompt tokens was measured it is :data:`UNMEASURED_CHUNK`; the
pace changes how a prompt is cut into steps, never what a request generates (a chunked prefill
is what a prefix-cache hit already runs: tests/test_pace.py compares the outputs).
"""

from __future__ import annotations

MIN_CHUNK = 16  # prompt tokens a step may always compute, however slow the machine
MIN_SAMPLE = 64  # prompt tokens a step needs to measure the per-token cost (fewer: fixed costs dominate)
UNMEASURED_CHUNK = 256  # the allowance before any such step was measured
SERVING_STALL_MS = 500.0  # max_decode_stall_ms when serving (EngineConfig): half of issue 25's 1 s bound
SMOOTHING = 0.5  # weight of the newest step in each moving average


class PrefillPace:
    """The measured step model and the allowance it gives (see the module docstring); the engine
    tells it every step's prompt tokens and seconds, the scheduler asks it before each step."""

    def __init__(self, stall_ms: float = 0.0) -> None:
        self.stall_s = max(0.0, stall_ms) / 1e3  # 0: no limit
        self.base: float | None = None  # seconds of a step without prompt tokens
        self.per_token: float | None = None  # seconds per prompt token beyond that

    def observe(self, prefill_tokens: int, seconds: float) -> None:
        """A step computed ``prefill_tokens`` prompt tokens (and any decodes) in ``seconds``."""
        if prefill_tokens <= 0:
            self.base = seconds if self.base is None else self.base + SMOOTHING * (seconds - self.base)
            return
        if prefill_tokens < MIN_SAMPLE:
            return
        cost = max(seconds - (self.base or 0.0), 0.0) / prefill_tokens
        self.per_token = cost if self.per_token is None else self.per_token + SMOOTHING * (cost - self.per_token)

    def allowance(self) -> int | None:
        """Prompt tokens a step beside decodes may compute; None: no limit (off)."""
        if not self.stall_s:
            return None
        if not self.per_token:
            return UNMEASURED_CHUNK
        spare = self.stall_s - (self.base or 0.0)
        return max(MIN_CHUNK, int(spare / self.per_token)) if spare > 0 else MIN_CHUNK
