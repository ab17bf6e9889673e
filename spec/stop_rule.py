"""When a freshly sampled token ends a request: the spec's one definition, in plain Python.

This module imports nothing (not even from the standard library) so that two programs share it:
:func:`spec.transitions.stop_reason` (the spec's step) and the whole-engine recorder
(``engines/recorder/schedspec_vllm_recorder.py``), which runs inside a vLLM engine's own Python, where
schedspec's package and its dependencies are not installed; the recorder loads this file by its path
(``spec/stop_rule.py`` in the same checkout) and must decide exactly as the checker will judge.
"""


def stop_reason_of(last_token: int, num_output_tokens: int, num_tokens: int, eos_token_id: int | None,
                   stop_token_ids: tuple[int, ...] | list[int], min_tokens: int, max_tokens: int,
                   max_model_len: int) -> str | None:
    """Whether a request whose newest output token is ``last_token`` (already counted in
    ``num_output_tokens`` and ``num_tokens``, the prompt's and outputs' tokens) stops, and the spec's
    reason: ``"stop"`` (its EOS id, null under ``ignore_eos``, or one of ``stop_token_ids``, once it has
    ``min_tokens`` outputs), then ``"max_model_len"`` (``num_tokens >= max_model_len``), then
    ``"length"`` (``num_output_tokens >= max_tokens``); ``None`` if it goes on.

    Source: vLLM 0.32 and 0.33 ``vllm/v1/core/sched/utils.py`` ``check_stop`` (identical in both), with
    one difference of order: vLLM tests EOS and stop ids before ``min_tokens`` and relies on its sampler
    (the min-tokens logits processor) never to sample them earlier; the spec does not stop on one sampled
    before ``min_tokens`` outputs. vLLM's repetition detection (``FINISHED_REPETITION``) is not in the
    spec (the recorder refuses requests that ask for it).
    """
    if num_output_tokens >= min_tokens and (
            (eos_token_id is not None and last_token == eos_token_id) or last_token in stop_token_ids):
        return "stop"
    if num_tokens >= max_model_len:
        return "max_model_len"
    if num_output_tokens >= max_tokens:
        return "length"
    return None
