"""A request's body -> the engine's :class:`SamplingParams`, with the context and pool checks
that make a refused request a 400 naming the field (``max_tokens`` or the prompt)."""

from __future__ import annotations

from ..engine.sampling_params import SamplingParams
from .errors import APIError
from .protocol import SamplingFields


def sampling_params(req: SamplingFields, max_tokens: int | None, num_prompt: int, max_model_len: int,
                    logprobs: int | None, prompt_param: str, pool_tokens: int | None = None) -> SamplingParams:
    """vLLM's rule: prompt plus requested tokens must fit the context; with no max_tokens
    the request may use whatever the prompt leaves. Admission by capacity: prompt plus
    ``max_tokens`` must also fit the whole KV pool (``pool_tokens``), or the request could
    only ever be cut short; with no max_tokens it may use what the pool leaves."""
    if pool_tokens is not None and pool_tokens < max_model_len:
        if num_prompt >= pool_tokens:
            raise APIError(400, f"the prompt has {num_prompt} tokens but this server's KV cache holds at most "
                                f"{pool_tokens} tokens for one request", prompt_param)
        if max_tokens is not None and num_prompt + max_tokens > pool_tokens:
            raise APIError(400, f"this server's KV cache holds at most {pool_tokens} tokens for one request, but "
                                f"{num_prompt + max_tokens} were requested ({num_prompt} in the prompt, "
                                f"{max_tokens} in the completion); lower max_tokens to at most "
                                f"{pool_tokens - num_prompt}", "max_tokens")
        max_model_len = pool_tokens
    room = max_model_len - num_prompt
    if num_prompt == 0:
        raise APIError(400, "the prompt is empty", prompt_param)
    if room < 1:
        raise APIError(400, f"this model's maximum context length is {max_model_len} tokens; the prompt "
                            f"has {num_prompt}, leaving no room for a completion", prompt_param)
    if req.structured_outputs is not None and req.response_format is not None \
            and req.response_format.output_schema is not None:
        raise APIError(400, "response_format and structured_outputs both constrain the output: give one of them",
                       "structured_outputs")
    if req.echo_without_generation:  # the engine computes one token, dropped (server/echo.py)
        max_tokens = 1
    if max_tokens is not None and max_tokens > room:
        raise APIError(400, f"this model's maximum context length is {max_model_len} tokens, but "
                            f"{num_prompt + max_tokens} were requested ({num_prompt} in the prompt, "
                            f"{max_tokens} in the completion); lower max_tokens to at most {room}",
                       "max_tokens")
    try:
        return SamplingParams(
            max_tokens=room if max_tokens is None else max_tokens, temperature=req.temperature,
            top_p=req.top_p, top_k=req.top_k, seed=req.seed, stop=req.stop_list,
            stop_token_ids=req.stop_token_ids or [], ignore_eos=req.ignore_eos,
            include_stop_str_in_output=req.include_stop_str_in_output, logprobs=logprobs, n=req.n,
            allowed_token_ids=req.allowed_token_ids, presence_penalty=req.presence_penalty, frequency_penalty=req.frequency_penalty,
            repetition_penalty=req.repetition_penalty, min_p=req.min_p, logit_bias=req.logit_bias_ids,
            min_tokens=req.min_tokens, skip_special_tokens=req.skip_special_tokens,
            prompt_logprobs=prompt_logprobs_of(req, logprobs),
            json_schema=req.response_format.output_schema if req.response_format is not None else None,
            structured_outputs=req.structured_outputs.spec if req.structured_outputs is not None else None,
            extra_args=dict(req.vllm_xargs) if req.vllm_xargs is not None else None)
    except ValueError as e:
        raise APIError(400, str(e)) from None


def prompt_logprobs_of(req: SamplingFields, logprobs: int | None) -> int | None:
    """vLLM's rule: ``prompt_logprobs``, or with ``echo`` (completions) the ``logprobs`` asked for
    the completion."""
    if req.prompt_logprobs is not None:
        return req.prompt_logprobs
    return logprobs if req.echoes else None
