"""Sampling parameters, shaped like vLLM's, validated on construction."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

# Below this temperature sampling is greedy (vLLM's _SAMPLING_EPS): dividing logits by a
# temperature like 1e-300 would overflow every one of them to infinity.
SAMPLING_EPS = 1e-5
# Samples per request: OpenAI allows up to 128; each is a running sequence here.
MAX_N = 64


@dataclass(frozen=True)
class StructuredOutputs:
    """vLLM's ``structured_outputs``: the output follows exactly one of a JSON schema (``json``), any
    JSON object (``json_object``), a regular expression (``regex``, Rust's regex syntax), one of
    the strings in ``choice``, or a ``grammar`` (Lark, llguidance's dialect) (engine/structured.py)."""

    json: dict | str | None = None
    regex: str | None = None
    choice: tuple[str, ...] | None = None
    grammar: str | None = None
    json_object: bool | None = None

    def __post_init__(self) -> None:
        given = [k for k in ("json", "regex", "choice", "grammar", "json_object") if getattr(self, k) is not None]
        _check(len(given) == 1, "structured_outputs takes exactly one of json, regex, choice, grammar and "
                                f"json_object; got {', '.join(given) or 'none'}")
        if self.choice is not None:
            object.__setattr__(self, "choice", tuple(self.choice))
            _check(len(self.choice) > 0 and all(isinstance(c, str) and c for c in self.choice),
                   "structured_outputs.choice must be non-empty strings")
        _check(self.json_object is None or self.json_object is True, "structured_outputs.json_object must be true")


@dataclass
class SamplingParams:
    """How to pick tokens and when to stop.

    ``temperature == 0`` (or any value below ``SAMPLING_EPS``, 1e-5) is greedy. ``top_k`` of -1 (or 0) and ``top_p`` of 1 disable those
    filters. ``seed`` makes a sampled request reproducible regardless of what it is batched
    with. ``logprobs=k`` returns the top-k log-probabilities of each generated token (of the
    raw distribution, before the processors below); ``prompt_logprobs=k`` the same for every
    prompt token but the first, which makes the request compute its whole prompt.

    Logits processing (vLLM's semantics, applied batched in ``logits_processors.py`` before
    any sampling, greedy included; at their defaults the logits are untouched):
    ``repetition_penalty`` (> 0, 1 = off) divides a positive logit and multiplies a negative
    one for every token seen in the prompt or the output; ``presence_penalty`` and
    ``frequency_penalty`` (in [-2, 2]) subtract a constant, and the token's count times a
    constant, for tokens of the output only; ``logit_bias`` adds to the named tokens' logits
    (in [-100, 100]); ``allowed_token_ids`` makes every other token impossible; ``min_tokens``
    forbids EOS and ``stop_token_ids`` until that many tokens were generated, and stop strings
    match only after them (vLLM's rule). ``min_p`` (in
    [0, 1]) drops tokens less likely than ``min_p`` times the most likely one (sampled
    requests only, after temperature). ``json_schema``: the output is JSON valid against it
    (``structured.py``; needs llguidance). ``skip_special_tokens=False`` keeps special tokens
    in the text. ``n > 1``: the engine forks ``n - 1`` more samples once the prompt is
    computed; they share its KV blocks (``llm_engine.py``).
    """

    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    include_stop_str_in_output: bool = False
    logprobs: int | None = None
    n: int = 1
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    min_p: float = 0.0
    logit_bias: dict[int, float] | None = None
    allowed_token_ids: list[int] | None = None  # vLLM's: sample only among these
    min_tokens: int = 0
    skip_special_tokens: bool = True
    # vLLM's prompt_logprobs: for every prompt token but the first, its log-probability and the
    # top-k at the position before (engine/prompt_logprobs.py). The request then reads nothing
    # from the cache: its whole prompt is computed.
    prompt_logprobs: int | None = None
    # Structured output (engine/structured.py): the output is a JSON document of this schema
    # (``{"type": "object"}``: any JSON object), or follows ``structured_outputs`` (vLLM's: a
    # regex, a choice, a grammar too). At most one of the two; None: free text.
    json_schema: dict | str | None = None
    structured_outputs: StructuredOutputs | None = None
    # vLLM's custom arguments (a request body's ``vllm_xargs``): carried with the request for extensions.
    # This engine reads one: ``auto_reuse_max_drift``, a number >= 0 that bounds the automatic-reuse
    # guard's drift estimate for this request below the engine's ``auto_reuse_max_drift`` (never above
    # it); 0: no automatic reuse for it, an exact prefill (blend/engine_hook.py).
    extra_args: dict | None = None

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop or [])
        self.stop_token_ids = list(self.stop_token_ids or [])
        _check(isinstance(self.max_tokens, int) and not isinstance(self.max_tokens, bool), "max_tokens must be an integer")
        _check(self.max_tokens >= 1, f"max_tokens must be at least 1, got {self.max_tokens}")
        _check(isinstance(self.temperature, (int, float)) and math.isfinite(self.temperature)
               and 0.0 <= self.temperature <= 100.0,
               f"temperature must be in [0, 100], got {self.temperature}")
        _check(isinstance(self.top_p, (int, float)) and math.isfinite(self.top_p) and 0.0 < self.top_p <= 1.0,
               f"top_p must be in (0, 1], got {self.top_p}")
        _check(isinstance(self.top_k, int) and (self.top_k == -1 or self.top_k >= 0), f"top_k must be -1 or >= 0, got {self.top_k}")
        _check(self.seed is None or isinstance(self.seed, int), "seed must be an integer")
        _check(all(isinstance(s, str) and s for s in self.stop), "stop must be non-empty strings")
        _check(all(isinstance(t, int) and t >= 0 for t in self.stop_token_ids), "stop_token_ids must be token ids")
        _check(self.logprobs is None or (isinstance(self.logprobs, int) and 0 <= self.logprobs <= 20),
               f"logprobs must be in [0, 20], got {self.logprobs}")
        _check(self.prompt_logprobs is None or (isinstance(self.prompt_logprobs, int) and not isinstance(
            self.prompt_logprobs, bool) and 0 <= self.prompt_logprobs <= 20),
               f"prompt_logprobs must be in [0, 20], got {self.prompt_logprobs}")
        _check(isinstance(self.n, int) and 1 <= self.n <= MAX_N, f"n must be in [1, {MAX_N}], got {self.n}")
        for name in ("presence_penalty", "frequency_penalty"):
            v = getattr(self, name)
            _check(isinstance(v, (int, float)) and -2.0 <= v <= 2.0, f"{name} must be in [-2, 2], got {v}")
        _check(isinstance(self.repetition_penalty, (int, float)) and math.isfinite(self.repetition_penalty)
               and 0.0 < self.repetition_penalty <= 100.0,
               f"repetition_penalty must be in (0, 100], got {self.repetition_penalty}")
        _check(isinstance(self.min_p, (int, float)) and 0.0 <= self.min_p <= 1.0, f"min_p must be in [0, 1], got {self.min_p}")
        self.logit_bias = {int(k): float(v) for k, v in (self.logit_bias or {}).items()} or None
        _check(all(t >= 0 and -100.0 <= b <= 100.0 for t, b in (self.logit_bias or {}).items()),
               "logit_bias maps token ids to values in [-100, 100]")
        if self.allowed_token_ids is not None:
            self.allowed_token_ids = list(self.allowed_token_ids)
            _check(len(self.allowed_token_ids) > 0 and all(isinstance(t, int) and not isinstance(t, bool) and t >= 0
                                                           for t in self.allowed_token_ids),
                   "allowed_token_ids must be a non-empty list of token ids")
        _check(isinstance(self.min_tokens, int) and 0 <= self.min_tokens <= self.max_tokens,
               f"min_tokens must be in [0, max_tokens={self.max_tokens}], got {self.min_tokens}")
        _check(self.json_schema is None or self.structured_outputs is None,
               "give json_schema or structured_outputs, not both")
        _check(self.extra_args is None or (isinstance(self.extra_args, dict)
                                           and all(isinstance(k, str) for k in self.extra_args)),
               "extra_args must map names to values")
        drift = (self.extra_args or {}).get("auto_reuse_max_drift")
        _check(drift is None or (isinstance(drift, (int, float)) and not isinstance(drift, bool)
                                 and math.isfinite(drift) and drift >= 0),
               f"auto_reuse_max_drift must be a number >= 0, got {drift!r}")

    @property
    def grammar(self) -> StructuredOutputs | None:
        """What the output must follow (engine/structured.py), or None for free text."""
        if self.json_schema is not None:
            return StructuredOutputs(json=self.json_schema)
        return self.structured_outputs

    @property
    def processes_logits(self) -> bool:
        """Whether any logits processor has work for this request (logits_processors.py)."""
        return (self.presence_penalty != 0.0 or self.frequency_penalty != 0.0 or self.repetition_penalty != 1.0
                or bool(self.logit_bias) or self.min_tokens > 0 or bool(self.allowed_token_ids))

    @property
    def auto_reuse_max_drift(self) -> float | None:
        """This request's own bound on automatic reuse's drift estimate (``extra_args``), or None."""
        drift = (self.extra_args or {}).get("auto_reuse_max_drift")
        return None if drift is None else float(drift)

    @property
    def greedy(self) -> bool:
        return self.temperature < SAMPLING_EPS


def _check(ok: bool, message: str) -> None:
    if not ok:
        raise ValueError(message)
