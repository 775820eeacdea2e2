"""Embedding models: which runner a checkpoint gets, how its vector is pooled, and the vector itself.

A server runs one runner, as vLLM's does: `generate` (logits and sampling) or `pooling` (one
vector per prompt, served on /v1/embeddings). `--runner auto` picks pooling for a checkpoint that
says it is a sentence-transformers model (modules.json with a Pooling module, as vLLM's
get_pooling_config reads it) or whose architecture is a bare base model (`Qwen3Model`: no
lm_head), and generate otherwise. Qwen3-Embedding checkpoints are the Qwen3 decoder with
last-token pooling and an L2 normalization: their modules.json names `1_Pooling` (whose
config.json sets `pooling_mode_lasttoken`) and a Normalize module.

The pooled vector of a prompt is the final norm of its last token's hidden state (the rows the
lm_head would read), normalized when the checkpoint says so. Matryoshka truncation (a request's
`dimensions`) keeps the first d values and normalizes again; it is allowed only where config.json
declares the model was trained for it (`is_matryoshka`, or `matryoshka_dimensions` listing the
sizes), as vLLM allows it.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from vt.config import BASE_MODEL_ARCHITECTURES
from vt.sampling_params import SamplingParamsError

RUNNERS = ("auto", "generate", "pooling")
# sentence-transformers' pooling modes (1_Pooling/config.json) by the name vLLM gives them
_POOLING_MODES = {
    "pooling_mode_lasttoken": "LAST",
    "pooling_mode_cls_token": "CLS",
    "pooling_mode_mean_tokens": "MEAN",
    "pooling_mode_max_tokens": "MAX",
    "pooling_mode_mean_sqrt_len_tokens": "MEAN_SQRT_LEN",
    "pooling_mode_weightedmean_tokens": "WEIGHTED_MEAN",
}
_ST = "sentence_transformers.models."


class PoolingConfigError(ValueError):
    """A checkpoint asks for pooling vt does not do; the message names the file and the field."""


@dataclass(frozen=True)
class PoolingConfig:
    """How the pooling runner turns a prompt into its vector."""

    pooling_type: str = "LAST"                          # the only one served: the last token's state
    normalize: bool = True                              # L2-normalize the vector
    matryoshka: bool = False                            # `dimensions` may truncate it
    matryoshka_dimensions: tuple[int, ...] | None = None  # the sizes it may be truncated to (None: any)
    source: str = "the pooling defaults"                # where the settings came from, for the log

    def describe(self) -> str:
        """One line for the start-up summary."""
        how = "L2-normalized" if self.normalize else "not normalized"
        if self.matryoshka_dimensions is not None:
            dims = f"dimensions {list(self.matryoshka_dimensions)}"
        else:
            dims = "any dimensions (Matryoshka)" if self.matryoshka else "no dimensions (not Matryoshka)"
        return f"last-token pooling, {how}, {dims}; from {self.source}"

    def check_dimensions(self, dimensions: int | None, hidden_size: int, model_name: str) -> None:
        """SamplingParamsError naming `dimensions` where the model cannot give that many (vLLM's
        messages for a model not trained for Matryoshka truncation, or not at that size)."""
        if dimensions is None:
            return
        if not self.matryoshka:
            raise SamplingParamsError(
                "dimensions", f'Model "{model_name}" does not support matryoshka representation, changing '
                              f"output dimensions will lead to poor results.")
        if self.matryoshka_dimensions is not None and dimensions not in self.matryoshka_dimensions:
            raise SamplingParamsError(
                "dimensions", f'Model "{model_name}" only supports {list(self.matryoshka_dimensions)} '
                              f"matryoshka dimensions, use other output dimensions will lead to poor "
                              f"results.")
        if not 1 <= dimensions <= hidden_size:
            raise SamplingParamsError(
                "dimensions", f"'dimensions' must be in [1, {hidden_size}] (the model's embedding size), "
                              f"got {dimensions}")


def _read_json(path: Path) -> Any:
    try:
        return json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise PoolingConfigError(f"{path} is not readable JSON: {e}") from None


def sentence_transformers_pooling(model_dir: str | Path) -> PoolingConfig | None:
    """The pooling a sentence-transformers checkpoint declares (modules.json and its Pooling
    module's config.json), or None where it declares none."""
    model_dir = Path(model_dir)
    modules_file = model_dir / "modules.json"
    if not modules_file.is_file():
        return None
    modules = _read_json(modules_file)
    if not isinstance(modules, list) or not all(isinstance(m, dict) for m in modules):
        raise PoolingConfigError(f"{modules_file} must be a list of module objects")
    types = [str(m.get("type", "")) for m in modules]
    pooling = next((m for m, t in zip(modules, types, strict=True) if t == _ST + "Pooling"), None)
    if pooling is None:
        return None
    unserved = [t for t in types if t.startswith(_ST) and t[len(_ST):] not in ("Transformer", "Pooling",
                                                                                  "Normalize")]
    if unserved:
        raise PoolingConfigError(f"{modules_file} names {', '.join(unserved)}: vt applies a Transformer, "
                                 f"its Pooling and a Normalize module only")
    pooling_file = model_dir / str(pooling.get("path", "")) / "config.json"
    settings = _read_json(pooling_file) if pooling_file.is_file() else {}
    if not isinstance(settings, dict):
        raise PoolingConfigError(f"{pooling_file} must be a JSON object")
    modes = [_POOLING_MODES[k] for k, v in settings.items() if v is True and k in _POOLING_MODES]
    if len(modes) > 1:
        raise PoolingConfigError(f"{pooling_file} sets several pooling modes ({', '.join(modes)}); "
                                 f"vt pools one way")
    mode = modes[0] if modes else "LAST"
    if mode != "LAST":
        raise PoolingConfigError(f"{pooling_file} asks for {mode} pooling; vt serves last-token pooling "
                                 f"(pooling_mode_lasttoken) only")
    return PoolingConfig(pooling_type=mode, normalize=_ST + "Normalize" in types,
                         source=str(modules_file.relative_to(model_dir)))


def _architectures(raw: dict[str, Any]) -> list[str]:
    archs = raw.get("architectures")
    return [a for a in archs if isinstance(a, str)] if isinstance(archs, list) else []


def resolve_runner(model_dir: str | Path, runner: str = "auto") -> str:
    """`generate` or `pooling`: the runner asked for, or for `auto` the one vLLM would pick for
    this checkpoint (pooling for a sentence-transformers checkpoint or a bare base model)."""
    if runner not in RUNNERS:
        raise PoolingConfigError(f"unknown runner {runner!r}; expected one of {', '.join(RUNNERS)}")
    if runner != "auto":
        return runner
    if sentence_transformers_pooling(model_dir) is not None:
        return "pooling"
    raw = _read_json(Path(model_dir) / "config.json")
    archs = _architectures(raw) if isinstance(raw, dict) else []
    # vLLM runs `*Model` architectures (a decoder without its lm_head) as pooling models
    return "pooling" if archs and all(a in BASE_MODEL_ARCHITECTURES for a in archs) else "generate"


def load_pooling_config(model_dir: str | Path, runner: str = "auto") -> PoolingConfig | None:
    """The pooling of a checkpoint served by the pooling runner (None: it is served generating).
    Without sentence-transformers files a pooling model pools the last token and normalizes, as
    vLLM's embedding adapter of a decoder does."""
    if resolve_runner(model_dir, runner) != "pooling":
        return None
    model_dir = Path(model_dir)
    cfg = sentence_transformers_pooling(model_dir) or PoolingConfig()
    raw = _read_json(model_dir / "config.json")
    raw = raw if isinstance(raw, dict) else {}
    dims = raw.get("matryoshka_dimensions")
    if dims is not None and (not isinstance(dims, list) or not all(
            isinstance(d, int) and not isinstance(d, bool) and d > 0 for d in dims)):
        raise PoolingConfigError(f"config field 'matryoshka_dimensions' must be a list of positive "
                                 f"integers, got {dims!r}")
    return PoolingConfig(pooling_type=cfg.pooling_type, normalize=cfg.normalize,
                         matryoshka=bool(dims) or raw.get("is_matryoshka") is True,
                         matryoshka_dimensions=tuple(dims) if dims else None, source=cfg.source)


def pooled_vector(hidden: np.ndarray, normalize: bool, dimensions: int | None = None) -> np.ndarray:
    """A request's vector from its pooled hidden state (float32 [H]): the first `dimensions`
    values (Matryoshka truncation), then L2-normalized in float32 when `normalize` (a zero vector
    stays zero)."""
    v = np.asarray(hidden, dtype=np.float32)
    if dimensions is not None:
        v = v[:dimensions]
    if not normalize:
        return np.array(v, dtype=np.float32)
    norm = np.float32(np.sqrt(np.dot(v, v)))
    # torch.nn.functional.normalize's floor, which sentence-transformers' Normalize applies
    return (v / max(norm, np.float32(1e-12))).astype(np.float32)
