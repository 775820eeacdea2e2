"""Default sampling settings from a checkpoint's generation_config.json, as vLLM applies them.

`--generation-config auto` (the default) reads the model folder's file, a folder path reads that
folder's, and `vllm` reads none (vt's own defaults). A request field left unset takes the file's
value; `max_new_tokens` caps max_tokens whether or not the request sets it, as in vLLM.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from vt.sampling_params import SamplingParams, SamplingParamsError

GENERATION_CONFIG = "generation_config.json"
# generation_config.json field -> SamplingParams field (and request field)
_FIELDS = {"temperature": "temperature", "top_p": "top_p", "top_k": "top_k", "min_p": "min_p",
           "repetition_penalty": "repetition_penalty", "max_new_tokens": "max_tokens"}
# transformers' own defaults: vLLM reads the file as a difference from them, so a file that
# repeats one (top_k 50, say) sets nothing
_HF_DEFAULTS = {"temperature": 1.0, "top_p": 1.0, "top_k": 50, "repetition_penalty": 1.0}


@dataclass(frozen=True)
class SamplingDefaults:
    """Sampling values a request gets where it sets none; empty: vt's own defaults."""

    values: Mapping[str, Any] = field(default_factory=dict)   # SamplingParams field -> value
    source: str | None = None                                 # the file they came from

    def apply(self, params: SamplingParams, given: Callable[[str], bool]) -> SamplingParams:
        """`params` with every field the request did not set (`given(name)` false) taken from the
        defaults, and max_tokens capped by the file's max_new_tokens."""
        if not self.values:
            return params
        changes = {k: v for k, v in self.values.items() if k != "max_tokens" and not given(k)}
        cap = self.values.get("max_tokens")
        if cap is not None and (params.max_tokens is None or params.max_tokens > cap):
            changes["max_tokens"] = cap
        return dataclasses.replace(params, **changes) if changes else params

    def describe(self) -> str:
        return ", ".join(f"{k}={v}" for k, v in self.values.items())


def load_sampling_defaults(setting: str, model_dir: str | Path) -> SamplingDefaults:
    """The defaults `--generation-config SETTING` gives: auto, vllm or a folder with the file."""
    if setting == "vllm":
        return SamplingDefaults()
    folder = Path(model_dir) if setting == "auto" else Path(setting)
    file = folder / GENERATION_CONFIG
    if not file.is_file():
        if setting == "auto":
            return SamplingDefaults()
        raise ValueError(f"--generation-config {setting!r}: expected auto, vllm or a folder holding "
                         f"{GENERATION_CONFIG}, and there is no {file}")
    try:
        raw = json.loads(file.read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:
        raise ValueError(f"{file} cannot be read as JSON: {e}") from None
    if not isinstance(raw, dict):
        raise ValueError(f"{file} must hold a JSON object")
    values = {ours: raw[theirs] for theirs, ours in _FIELDS.items()
              if raw.get(theirs) is not None and raw[theirs] != _HF_DEFAULTS.get(theirs)}
    try:
        SamplingParams(**values)
    except SamplingParamsError as e:
        raise ValueError(f"{file}: {e} (--generation-config vllm ignores the file)") from None
    return SamplingDefaults(values, str(file))
