"""Tensor parallelism on the numpy backend: the N-rank plan (heads and KV cache split, q/k/v and
gate/up by columns, o_proj and down by rows with an all-reduce, lm_head by vocabulary with the
logits gathered) run in one process, against the same model on one rank, on checkpoints made by
transformers."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from tests.unit.hf_models import make_hf_checkpoint
from tests.unit.test_model_parity import PagedRunner, prompts
from vt.config import ModelConfig
from vt.kernels import get_backend
from vt.kernels.numpy_ops import NumpyBackend
from vt.kernels.parallel import InProcessCommunicator, Ranked
from vt.kernels.rank_group import RankGroup
from vt.llm import LLM
from vt.model.loader import load_weights
from vt.model.make_model import make_model
from vt.model.shard import ShardError, TensorSplit
from vt.model.transformer import Transformer
from vt.sampling_params import SamplingParams

CASES = {
    # 2 KV heads: one a rank at N = 2, each held by two ranks at N = 4
    "qwen3": dict(arch="qwen3"),
    "qwen3-tied-3layers": dict(arch="qwen3", num_hidden_layers=3, tie_word_embeddings=True),
    # 4 KV heads: two a rank at N = 2; a vocabulary that does not divide by 2 or 4
    "llama-mha-odd-vocab": dict(arch="llama", num_key_value_heads=4, vocab_size=301),
    "qwen2-bias": dict(arch="qwen2"),
}
SIZES = (2, 4)


def _model(ckpt: Path, size: int) -> Transformer:
    cfg = ModelConfig.from_dir(ckpt)
    return Transformer(cfg, load_weights(ckpt, cfg), get_backend("cpu", size), size)


def _run(model: Transformer) -> tuple[list, list[list[int]]]:
    """Ragged chunked prefill (chunks of 3, 5, then the rest) of four prompts, then four greedy
    decode steps that feed back the model's own argmax: every step's logits (last rows), and the
    tokens each sequence decoded."""
    ps = prompts(model.cfg.vocab_size)
    runner = PagedRunner(model, num_blocks=64, block_size=4, seed=1)
    done, logits = [0] * len(ps), []
    last: dict[int, np.ndarray] = {}
    for size in (3, 5, 100):
        chunks = {s: p[done[s]: done[s] + size] for s, p in enumerate(ps) if done[s] < len(p)}
        for s, out in zip(chunks, runner.step(chunks), strict=True):
            done[s] += len(chunks[s])
            logits.append(out)
            last[s] = _rank0(out)[0]
    tokens: list[list[int]] = [[] for _ in ps]
    for _ in range(4):
        nxt = {s: int(np.argmax(row)) for s, row in last.items()}
        for s, t in nxt.items():
            tokens[s].append(t)
        outs = runner.step({s: [t] for s, t in nxt.items()})
        logits.extend(outs)
        last = {s: _rank0(o)[0] for s, o in enumerate(outs)}
    return logits, tokens


def _rank0(x: np.ndarray | Ranked) -> np.ndarray:
    return x.parts[0] if isinstance(x, Ranked) else x


@pytest.fixture(scope="module", params=list(CASES), ids=list(CASES))
def checkpoint(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_hf_checkpoint(tmp_path_factory.mktemp(request.param), seed=7, **CASES[request.param])


@pytest.fixture(scope="module")
def one_rank(checkpoint: Path) -> tuple[list, list[list[int]]]:
    return _run(_model(checkpoint, 1))


@pytest.mark.parametrize("size", SIZES)
def test_sharded_logits_equal_one_rank_within_fp32_rounding(checkpoint: Path, one_rank: tuple,
                                                            size: int) -> None:
    want_logits, want_tokens = one_rank
    got_logits, got_tokens = _run(_model(checkpoint, size))
    assert got_tokens == want_tokens
    for i, (got, want) in enumerate(zip(got_logits, want_logits, strict=True)):
        assert isinstance(got, Ranked) and len(got.parts) == size
        # every rank samples from its own copy: the gathered logits are the same bits on each
        for part in got.parts[1:]:
            np.testing.assert_array_equal(part, got.parts[0])
        # the products are summed in another order: a few float32 ulps of the logits, no more
        err = np.linalg.norm(got.parts[0] - want) / np.linalg.norm(want)
        assert err < 2e-6, f"step output {i}: relative error {err:.2e}"
        np.testing.assert_allclose(got.parts[0], want, rtol=0, atol=1e-5)


class _Recording(NumpyBackend):
    """A numpy rank that keeps the shape of every weight uploaded to it."""

    def __init__(self) -> None:
        super().__init__()
        self.uploads: list[tuple[int, ...]] = []

    def upload(self, host: np.ndarray) -> np.ndarray:
        self.uploads.append(tuple(host.shape))
        return super().upload(host)


def test_each_rank_uploads_only_its_shard(tmp_path: Path) -> None:
    ckpt = make_hf_checkpoint(tmp_path / "m", arch="qwen3", vocab_size=301)
    cfg = ModelConfig.from_dir(ckpt)
    weights = load_weights(ckpt, cfg)
    ranks = [_Recording() for _ in range(2)]
    model = Transformer(cfg, weights, RankGroup(ranks, InProcessCommunicator(2)), 2)
    h, d, inter = cfg.hidden_size, cfg.head_dim, cfg.intermediate_size
    replicated = sum(t.size for n, t in weights.items() if model.split.select(n, t) is t)
    for r, rank in enumerate(ranks):
        # what a rank receives: the replicated tensors and its own slice of every split one
        shard = sum(model.split.take(n, t, r).size for n, t in weights.items()
                    if model.split.select(n, t) is not t)
        assert sum(int(np.prod(s)) for s in rank.uploads) == replicated + shard
        assert shard < sum(t.size for t in weights.values()) // 2
        layer = model.layers[0]
        assert layer.qkv.parts[r].shape == ((cfg.num_heads + 2 * cfg.num_kv_heads) // 2 * d, h)
        assert layer.o_proj.parts[r].shape == (h, cfg.num_heads // 2 * d)
        assert layer.gate_up.parts[r].shape == (inter, h)
        assert layer.down.parts[r].shape == (h, inter // 2)
        assert model.lm_head.parts[r].shape == ((151, 150)[r], h)
        assert model.kv_dim * 2 == cfg.num_kv_heads * d
    # the embedding reaches each rank whole (a lookup needs every row); lm_head only its rows
    assert all(rank.uploads.count((cfg.vocab_size, h)) == 1 for rank in ranks)


def test_rank_slices_are_views_of_the_checkpoint(tmp_path: Path) -> None:
    ckpt = make_hf_checkpoint(tmp_path / "m", arch="llama")
    cfg = ModelConfig.from_dir(ckpt)
    weights = load_weights(ckpt, cfg)
    split = TensorSplit.of(cfg, 2)
    for name in ("model.layers.0.self_attn.q_proj.weight", "model.layers.0.mlp.down_proj.weight",
                 "lm_head.weight"):
        parts = split.select(name, weights[name])
        assert isinstance(parts, Ranked)
        for part in parts.parts:
            assert np.shares_memory(part, weights[name])  # sliced in the file's map, not copied
        assert sum(p.size for p in parts.parts) == weights[name].size


@pytest.mark.parametrize("fields, size, needles", [
    (dict(num_attention_heads=4, num_key_value_heads=2), 3,
     ["4 attention heads (num_attention_heads) do not divide by 3", "Sizes that can: 1, 2, 4"]),
    (dict(num_attention_heads=12, num_key_value_heads=4, intermediate_size=96), 3,
     ["4 KV heads (num_key_value_heads) neither divide by 3 nor divide it", "Sizes that can: 1, 2, 4, 12"]),
    (dict(num_attention_heads=4, num_key_value_heads=4, intermediate_size=130), 4,
     ["intermediate size 130 (intermediate_size) does not divide by 4", "Sizes that can: 1, 2"]),
    (dict(num_attention_heads=4, num_key_value_heads=4), 0, ["must be a positive integer, got 0"]),
])
def test_a_bad_split_says_what_does_not_divide_and_which_sizes_do(fields: dict, size: int,
                                                                  needles: list[str]) -> None:
    cfg = ModelConfig.from_dict({"architectures": ["LlamaForCausalLM"], "vocab_size": 300, "hidden_size": 64,
                                 "intermediate_size": 128, "num_hidden_layers": 1, "head_dim": 16,
                                 "max_position_embeddings": 64, **fields})
    with pytest.raises(ShardError) as err:
        TensorSplit.of(cfg, size)
    for needle in needles:
        assert needle in str(err.value)


def test_a_bad_split_fails_start_up_before_any_request(tmp_path: Path) -> None:
    model = make_model(tmp_path / "tiny")  # 4 heads, 2 KV heads
    with pytest.raises(ShardError, match="--tensor-parallel-size 3 cannot split this model"):
        LLM(str(model), device="cpu", tensor_parallel_size=3)


def test_cuda_refuses_more_than_one_rank_at_start() -> None:
    with pytest.raises(ValueError, match="the CUDA backend drives one GPU for now"):
        get_backend("cuda", 2)


def test_collectives_sum_and_gather_in_rank_order() -> None:
    comm = InProcessCommunicator(3)
    x = Ranked([np.full(4, r + 1, np.float32) for r in range(3)])
    comm.all_reduce(x)
    for part in x.parts:
        np.testing.assert_array_equal(part, np.full(4, 6, np.float32))
    parts = Ranked([np.arange(n, dtype=np.float32) + 10 * r for r, n in enumerate((3, 2, 2))])
    out = Ranked([np.zeros(7, np.float32) for _ in range(3)])
    comm.all_gather(parts, out)
    for part in out.parts:
        np.testing.assert_array_equal(part, [0, 1, 2, 10, 11, 20, 21])
    with pytest.raises(ValueError, match="2 parts for a group of 3 ranks"):
        comm.all_reduce(Ranked([np.zeros(1), np.zeros(1)]))
    with pytest.raises(TypeError, match="one array per rank"):
        np.asarray(x)


def _workload() -> tuple[list[list[int]], list[SamplingParams], list[int]]:
    """Greedy, seeded, penalized, logprobs, min_tokens, logit_bias and allowed_token_ids
    requests, two sharing a prefix."""
    rng = np.random.default_rng(5)
    shared = rng.integers(3, 900, size=40).tolist()
    ps = [rng.integers(3, 900, size=n).tolist() for n in (9, 23, 57, 31)] + [shared + [5], shared + [6, 7]]
    params = [
        SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True),
        SamplingParams(max_tokens=24, temperature=0.8, top_p=0.9, seed=11, ignore_eos=True,
                       logit_bias={"17": 3.0, "40": -5.0}),
        SamplingParams(max_tokens=24, temperature=0.0, logprobs=3, ignore_eos=True),
        SamplingParams(max_tokens=24, temperature=0.7, top_k=20, seed=3, presence_penalty=0.5,
                       frequency_penalty=0.3, repetition_penalty=1.2, ignore_eos=True),
        SamplingParams(max_tokens=24, temperature=0.0, min_tokens=4),
        SamplingParams(max_tokens=24, temperature=1.0, min_p=0.05, seed=8, ignore_eos=True,
                       allowed_token_ids=list(range(100, 160))),
    ]
    return ps, params, [2, 0, 1, 0, 2, 1]


def _serve(model: Path, **engine_args: object) -> tuple[list, int]:
    ps, params, priorities = _workload()
    with LLM(str(model), device="cpu", max_num_seqs=4, max_num_batched_tokens=32, block_size=16,
             num_gpu_blocks=9, **engine_args) as llm:
        outs = llm.generate(ps, params, priorities)
        return outs, llm.engine.stats().num_preemptions_total


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_model(tmp_path_factory.mktemp("tiny") / "tiny")


@pytest.mark.parametrize("size, policy, async_scheduling", [
    (2, "fcfs", True), (4, "priority", True), (2, "priority", False),
])
def test_served_outputs_equal_one_rank(tiny: Path, size: int, policy: str, async_scheduling: bool) -> None:
    """Through the engine: chunked prefill, a KV pool small enough to preempt, priorities, depth 1
    and 2: the same tokens as one rank, the same preemptions."""
    args = dict(scheduling_policy=policy, async_scheduling=async_scheduling)
    want, want_preempted = _serve(tiny, **args)
    got, preempted = _serve(tiny, tensor_parallel_size=size, **args)
    assert want_preempted > 0 and preempted == want_preempted
    for i, (g, w) in enumerate(zip(got, want, strict=True)):
        assert g.token_ids == w.token_ids and g.finish_reason == w.finish_reason, f"request {i}"
    assert set(got[5].token_ids) <= set(range(100, 160))
