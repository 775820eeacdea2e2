"""A request whose row is left with no token to sample at a step, and what it is told then.

A row has no token to sample when every logit is -inf once the request's constraints apply:
allowed_token_ids, the ids min_tokens holds back (end of sequence unless ignore_eos, and
stop_token_ids) and its grammar's mask. (logit_bias is bounded to [-100, 100], so it excludes no
token; vt has no bad_words.) One rule covers every way there:

- What a request states up front is checked at admission, a 400 naming the field
  (admission.check_first_token): its first token's allowed set from allowed_token_ids
  (check_params), and from its grammar's start once the grammar is compiled (add_request).
- What only shows at a step (a grammar state whose only continuations are held back) the
  sampler reports as token -1 (NO_TOKEN), never as a token the constraints exclude, and that
  request ends there, alone: at its grammar's end if what came so far is a whole match (vLLM
  lets a complete grammar stop under min_tokens), else with an error of its own (ERROR_REQUEST:
  a 400, or an error event and [DONE]).
"""

from __future__ import annotations

from collections.abc import Set

from vt.engine.admission import held_back
from vt.sampling_params import SamplingParams

NO_TOKEN = -1  # what the sampler returns for a row with no allowed token


def no_token_error(params: SamplingParams, eos_token_ids: Set[int], num_output: int, guided: bool) -> str:
    """The error of a request whose row had no token to sample for output token num_output + 1."""
    where = f"no token could be sampled for output token {num_output + 1}"
    if guided and held_back(params, eos_token_ids, num_output):
        return (f"{where}: the structured output allows only tokens that min_tokens ({params.min_tokens}) "
                f"holds back (the end of sequence and stop_token_ids)")
    if guided:
        return f"{where}: the request's other constraints exclude every token its structured output allows"
    return f"{where}: the request's constraints exclude every token"
