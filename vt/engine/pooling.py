"""The pooling runner's requests (embedding models): a prompt in, its vector out, one output.

An embedding request is a Request of max_tokens 1 with greedy params, so the scheduler treats
it as any prompt: KV for the prompt alone, a long prompt chunked over several steps, prefix-cache
hits, preemption by recomputation, priorities. The step holding its last prompt token marks it
`sample`, and the scheduler, counting that as its one output planned, never schedules it again.
That step computes no logits: its output carries the request's pooled hidden state
(StepOutput.pooled, vt.runner.pooling), which becomes the vector of the request's one and
finishing RequestOutput (`embedding`, vt.model.pooling.pooled_vector). The vector is valid
even if the request was preempted after that step was launched: the step ran on its KV before
any later step could reuse the freed blocks.
"""

from __future__ import annotations

from vt.engine.outputs import PromptTooLongError
from vt.sampling_params import SamplingParams

# A pooling request's params: one "token", never sampled (the runner pools instead).
POOLING_PARAMS = SamplingParams(max_tokens=1, temperature=0.0)

NOT_POOLING = ("this engine runs a generative model: it has no embeddings (serve an embedding model, or "
               "start with --runner pooling)")
NOT_GENERATING = ("this engine runs an embedding model (--runner pooling): it generates no text; its "
                  "vectors come from embed() (on /v1/embeddings over HTTP)")


def check_embedding_prompt(num_tokens: int, max_model_len: int) -> None:
    """A prompt the pooling runner can take: not empty, and at most max_model_len tokens (an
    embedding generates nothing, so the whole context is the prompt's)."""
    if num_tokens == 0:
        raise ValueError("the prompt is empty")
    if num_tokens > max_model_len:
        raise PromptTooLongError(f"the input has {num_tokens} tokens; this model's maximum context length is "
                                 f"{max_model_len} tokens")
