"""vt: a one-process LLM serving engine with an OpenAI-compatible streaming API."""

__version__ = "0.1.0"
