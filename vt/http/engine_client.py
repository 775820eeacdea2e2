"""What the HTTP layer uses from the engine, and nothing more (as vLLM's EngineClient).

vt.engine.engine.AsyncEngine meets these protocols, and so does a test's scripted engine. The
HTTP layer imports from vt.engine only the light modules this names (outputs, admission, stats),
never vt.engine.engine and the model runtime behind it.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol, runtime_checkable

from vt.config import ModelConfig
from vt.engine.admission import AdmissionLimits
from vt.engine.outputs import RequestStream
from vt.engine.stats import EngineStats
from vt.model.pooling import PoolingConfig
from vt.sampling_params import SamplingParams
from vt.structured.spec import GrammarSpec


@runtime_checkable
class PromptTokenizer(Protocol):
    """The tokenizer as the routes use it: prompts in, token texts out, chat templates.

    An implementation may also expose `raw` (a `tokenizers.Tokenizer`): its vocabulary and
    normalizer then bound the prompt text read before tokenizing (vt.http.prompt_prep)."""

    @property
    def vocab_size(self) -> int: ...

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]: ...

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str: ...

    def token_to_id(self, token: str) -> int | None: ...

    def id_to_token(self, token_id: int) -> str | None:
        """The vocabulary entry of an id, as the tokenizer stores it (vLLM's token_strs)."""
        ...

    def apply_chat_template(self, messages: list[dict[str, Any]], add_generation_prompt: bool = True,
                            **template: Any) -> str | list[int]:
        """The prompt text of a chat (or its token ids, where rendering tokenizes too);
        `template` holds JSON values a request sent (tools, chat_template_kwargs) and the
        template controls."""
        ...


@runtime_checkable
class EngineClient(Protocol):
    """The engine as the HTTP layer drives it, all from the event loop's thread.

    An engine may also expose `model_config` (a vt.config.ModelConfig): its vocab_size, where the
    model's vocabulary has rows past the tokenizer's, widens the ids /detokenize and token-id
    prompts accept."""

    @property
    def tokenizer(self) -> PromptTokenizer: ...

    @property
    def max_model_len(self) -> int: ...

    @property
    def limits(self) -> AdmissionLimits:
        """What a request's values are checked against before add_request; vocab_size is the
        logits width (it may exceed the tokenizer's)."""
        ...

    @property
    def health_problem(self) -> str | None:
        """Why the engine cannot serve, or None while it can."""
        ...

    async def compile_grammar(self, spec: GrammarSpec) -> object:
        """Compile a structured-output grammar off the event loop, so a request carrying it
        starts without compiling on the loop; raises GrammarError (a ValueError) for one that
        does not compile."""
        ...

    def add_request(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                    priority: int = 0, cache_salt: str | None = None) -> RequestStream:
        """Queue one sequence; its outputs arrive on the stream, in order, the last one finished.
        cache_salt: prefix-cache hits only among requests that give the same salt (the routes pass
        it only when a request sets one).
        Raises PromptTooLongError (a 400), QueueFullError or EngineDeadError (503s), or a
        ValueError naming what the request got wrong."""
        ...

    def abort(self, request_id: str) -> None:
        """Finish a request now ("abort"); an unknown or finished id is ignored."""
        ...

    def set_paused(self, request_id: str, paused: bool) -> None:
        """Stop (or resume) computing tokens for a request whose reader has fallen behind; it
        keeps its KV blocks."""
        ...

    def stats(self) -> EngineStats:
        """The engine's counters and gauges, current as of the call."""
        ...


@runtime_checkable
class PoolingClient(Protocol):
    """An engine that can serve embeddings as well (AsyncEngine): `pooling` is its embedding
    model's pooling, or None where it runs a generative model (whose server then answers
    /v1/embeddings with a 404, as an embedding model's answers the generation routes)."""

    @property
    def pooling(self) -> PoolingConfig | None: ...

    @property
    def model_config(self) -> ModelConfig: ...

    def embed(self, request_id: str, prompt_token_ids: list[int], dimensions: int | None = None,
              priority: int = 0, cache_salt: str | None = None) -> RequestStream:
        """Queue one prompt of an embedding model; its one output is finished and holds the
        vector (RequestOutput.embedding, float32; `dimensions`: its Matryoshka truncation).
        Raises as add_request does, and SamplingParamsError for `dimensions`."""
        ...
