"""The prefetch hint of each projection (Backend.linear's `then`): on CUDA a decode GEMV pulls the
first bytes of `then` into L2 while the small kernels after it run, so `then` must be the weight
the next projection actually reads (the lm_head after the last layer); a wrong one would cost
bandwidth for nothing. Checked on the numpy backend, whose projections record what they read."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from tests.unit.hf_models import make_hf_checkpoint
from tests.unit.test_model_parity import PagedRunner, prompts
from vt.config import ModelConfig
from vt.kernels.numpy_ops import NumpyBackend
from vt.model.loader import load_weights
from vt.model.quantization import ONLINE
from vt.model.transformer import Transformer


class RecordingBackend(NumpyBackend):
    """Each projection's weight and hint, and the lm_head's weight, in launch order."""

    def __init__(self) -> None:
        super().__init__()
        self.reads: list[tuple[Any, Any]] = []  # (weight read, weight named next)

    def linear(self, x, w, bias, then=None):
        self.reads.append((w, then))
        return super().linear(x, w, bias, then=then)

    def linear_residual(self, x, w, residual, then=None):
        self.reads.append((w, then))
        super().linear_residual(x, w, residual, then=then)

    def linear_fp8(self, x, w, bias, then=None):
        self.reads.append((w, then))
        return super().linear_fp8(x, w, bias, then=then)

    def linear_fp8_residual(self, x, w, residual, then=None):
        self.reads.append((w, then))
        super().linear_fp8_residual(x, w, residual, then=then)

    def logits(self, x, w):
        self.reads.append((w, None))
        return super().logits(x, w)


@pytest.mark.parametrize("fp8", [None, ONLINE])
def test_each_projection_names_the_weight_read_next(tmp_path, fp8):
    ckpt = make_hf_checkpoint(tmp_path / "m", arch="qwen3", dtype="bfloat16", seed=3)
    cfg = ModelConfig.from_dir(ckpt)
    ops = RecordingBackend()
    model = Transformer(cfg, load_weights(ckpt, cfg), ops, fp8=fp8)
    PagedRunner(model, num_blocks=16, block_size=4).step({0: prompts(cfg.vocab_size)[0][:5]})
    reads = ops.reads
    assert len(reads) == 4 * cfg.num_layers + 1 and reads[-1][0] is model.lm_head
    for i, ((_, then), (read_next, _)) in enumerate(zip(reads, reads[1:], strict=False)):
        assert then is read_next, f"projection {i} names another weight than the one read next"
    assert all(then is not None for _, then in reads[:-1])
    np.testing.assert_equal(len({id(w) for w, _ in reads}), len(reads))  # every weight read once
