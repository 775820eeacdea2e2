"""Structured outputs: grammars a request's output must follow (JSON schema, regex, choice, Lark /
GBNF), compiled with llguidance off the event loop, and the per-request matchers whose token
masks the sampler applies on the device. docs/structured_outputs.md explains how masks stay
exact when two steps are in flight."""
