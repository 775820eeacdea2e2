"""An embedding model (the pooling runner) on the GPU against transformers and the numpy backend.

The pooling step adds no backend op: it gathers each sequence's last row, applies the final norm
(gather_rows, rms_norm) and copies the bf16 rows to the slot's pinned buffer, widened to float32
on the host. Here the CUDA runner's vectors, eager and on per-layer graphs, with chunked prompts
beside short ones, are checked against transformers' fp32 pooled output within bf16 rounding
and against the numpy backend's.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from tests.unit.embedding_models import hf_embeddings, write_embedding_checkpoint

pytestmark = pytest.mark.gpu

SHAPE = dict(hidden_size=512, intermediate_size=1024, num_hidden_layers=4, num_attention_heads=8,
             num_key_value_heads=4, head_dim=64, max_position_embeddings=2048, initializer_range=0.02)
LENS = (700, 1, 33, 129, 5, 260, 17)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from vt.model.make_model import make_model

    root = tmp_path_factory.mktemp("embedding")
    tok = make_model(root / "tok", preset="tiny")
    return write_embedding_checkpoint(root / "model", tok, config_extra={"is_matryoshka": True}, **SHAPE)


@pytest.fixture(scope="module")
def prompts(checkpoint: Path) -> list[list[int]]:
    from vt.config import ModelConfig

    rng = np.random.default_rng(4)
    return [rng.integers(3, ModelConfig.from_dir(checkpoint).vocab_size, size=n).tolist() for n in LENS]


def _embed(checkpoint: Path, prompts: list[list[int]], device: str, **flags: object) -> tuple[list, dict]:
    from vt.llm import LLM

    with LLM(str(checkpoint), device=device, max_num_batched_tokens=256, max_num_seqs=8, **flags) as llm:
        got = llm.embed(prompts)
        return got, dict(llm.engine.runner.routes)


def _cosines(got: list[np.ndarray], want: list[np.ndarray]) -> list[float]:
    return [float(np.dot(g, w) / (np.linalg.norm(g) * np.linalg.norm(w)))
            for g, w in zip(got, want, strict=True)]


@pytest.mark.parametrize("enforce_eager", [False, True], ids=["layer-graphs", "eager"])
def test_cuda_vectors_match_transformers_and_numpy(checkpoint: Path, prompts: list[list[int]],
                                                   enforce_eager: bool) -> None:
    want = hf_embeddings(checkpoint, prompts)
    cpu, _ = _embed(checkpoint, prompts, "cpu")
    for c, w in zip(cpu, want, strict=True):
        np.testing.assert_allclose(c, w, rtol=0, atol=1e-5)
    gpu, routes = _embed(checkpoint, prompts, "cuda", enforce_eager=enforce_eager)
    if not enforce_eager:
        assert routes.get("layer_graphs", 0) > 0 and "graph" not in routes  # no decode graphs: no decodes
    for g in gpu:
        assert g.dtype == np.float32 and abs(float(np.linalg.norm(g)) - 1.0) < 1e-5
    # bf16 activations over four layers: unit vectors within a few bf16 ulps of fp32's
    assert min(_cosines(gpu, want)) > 0.999
    assert max(float(np.abs(g - c).max()) for g, c in zip(gpu, cpu, strict=True)) < 0.03


def test_cuda_matryoshka_dimensions(checkpoint: Path, prompts: list[list[int]]) -> None:
    from vt.llm import LLM

    with LLM(str(checkpoint), device="cuda", max_num_batched_tokens=256) as llm:
        got = llm.embed(prompts[:3], dimensions=64)
    assert all(g.shape == (64,) for g in got)
    assert min(_cosines(got, hf_embeddings(checkpoint, prompts[:3], dimensions=64))) > 0.999
