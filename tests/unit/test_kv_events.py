"""KV-cache events: the pool records them, the publisher puts them on ZMQ in vLLM's format, and a
subscriber that knows only that format rebuilds exactly the engine's cached-block set, through a
mixed load with evictions and a replay of what it missed."""

from __future__ import annotations

import socket
import time
from pathlib import Path

import msgpack
import numpy as np
import pytest

from tests.kv_subscriber import KVEventSubscriber
from vt.config import KVEventsConfig, parse_kv_events_config
from vt.llm import LLM
from vt.model.make_model import make_model
from vt.sampling_params import SamplingParams
from vt.sched.kv_cache import BlockPool, hash_block
from vt.sched.kv_events import AllBlocksCleared, BlockRemoved, BlockStored, KVEventLog
from vt.sched.kv_publisher import encode_batch

WAIT_S = 20.0


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# ---- the pool's record ----------------------------------------------------------------------------

def test_pool_records_stores_as_chains_and_evictions_as_removals() -> None:
    pool = BlockPool(num_blocks=3, block_size=2)
    pool.events = KVEventLog(2)
    a, b, c = pool.allocate(3)
    h1 = pool.register_full(a, None, [1, 2])
    h2 = pool.register_full(b, h1, [3, 4])
    h3 = pool.register_full(c, None, [9, 9])      # a new chain
    pool.register_full(c, None, [9, 9])           # already cached: nothing new
    assert pool.events.take() == [BlockStored((h1, h2), None, (1, 2, 3, 4), 2),
                                  BlockStored((h3,), None, (9, 9), 2)]
    assert pool.events.take() == []
    pool.free([c, b, a])                          # freed blocks stay cached: no event
    assert pool.events.take() == []
    pool.allocate(2)                              # evicts the two least recently freed: c, then b
    assert pool.events.take() == [BlockRemoved((h3, h2))]
    assert [e.block_hashes for e in pool.cached_blocks()] == [(h1,)]
    assert h2 == hash_block(h1, [3, 4])


def test_duplicate_content_in_another_block_is_not_stored_twice() -> None:
    pool = BlockPool(num_blocks=2, block_size=2)
    pool.events = KVEventLog(2)
    a, b = pool.allocate(2)
    pool.register_full(a, None, [5, 6])
    pool.register_full(b, None, [5, 6])
    assert len(pool.events.take()) == 1
    pool.free([b])
    pool.allocate(1)                              # b was never the cache entry: no removal
    assert pool.events.take() == []


# ---- config and wire format --------------------------------------------------------------------

def test_config_parses_vllm_fields_and_names_the_bad_one() -> None:
    cfg = parse_kv_events_config('{"enable_kv_cache_events": true, "endpoint": "tcp://*:6000", '
                                 '"replay_endpoint": "tcp://*:6001", "topic": "kv"}')
    assert cfg.enabled and cfg.publisher == "zmq" and cfg.endpoint == "tcp://*:6000"
    assert not parse_kv_events_config('{"enable_kv_cache_events": false}').enabled
    assert not parse_kv_events_config('{"enable_kv_cache_events": true, "publisher": "null"}').enabled
    for text, word in [("[]", "JSON object"), ("{", "JSON object"), ('{"endpont": "x"}', "endpont"),
                       ('{"hwm": 0}', "hwm"), ('{"enable_kv_cache_events": "yes"}', "enable_kv_cache_events"),
                       ('{"publisher": "kafka"}', "publisher"), ('{"buffer_steps": true}', "buffer_steps")]:
        with pytest.raises(ValueError, match=word):
            parse_kv_events_config(text)


def test_batch_is_vllms_layout() -> None:
    payload = encode_batch(12.5, [BlockStored((7, 8), 3, (1, 2, 3, 4), 2), BlockRemoved((7,)),
                                  AllBlocksCleared()])
    ts, events, rank = msgpack.unpackb(payload)
    assert (ts, rank) == (12.5, 0)
    assert events == [
        {"type": "BlockStored", "block_hashes": [7, 8], "parent_block_hash": 3, "token_ids": [1, 2, 3, 4],
         "block_size": 2, "lora_id": None, "medium": "GPU", "lora_name": None},
        {"type": "BlockRemoved", "block_hashes": [7], "medium": "GPU"},
        {"type": "AllBlocksCleared"},
    ]


def test_cli_rejects_a_bad_config_with_a_message(capsys: pytest.CaptureFixture[str],
                                                 tmp_path: Path) -> None:
    from vt.launch.cli import main

    model = make_model(tmp_path / "m")
    rc = main(["serve", str(model), "--device", "cpu", "--kv-events-config", '{"hwm": -1}'])
    assert rc != 0
    assert "hwm" in capsys.readouterr().err


# ---- the whole path ----------------------------------------------------------------------------

def _mixed_load(rng: np.random.Generator) -> list[list[int]]:
    """Groups sharing long prefixes, plus one-off prompts that push shared blocks out."""
    prompts = []
    for _ in range(3):
        prefix = rng.integers(3, 1000, size=int(rng.integers(40, 90))).tolist()
        prompts += [prefix + rng.integers(3, 1000, size=int(rng.integers(1, 20))).tolist()
                    for _ in range(3)]
    prompts += [rng.integers(3, 1000, size=int(rng.integers(20, 120))).tolist() for _ in range(4)]
    rng.shuffle(prompts)
    return prompts


def test_subscriber_rebuilds_the_engines_cache_through_evictions_and_replay(tmp_path: Path) -> None:
    model = make_model(tmp_path / "m")
    sub_port, replay_port = _free_port(), _free_port()
    # The engine connects to a bound subscriber (vLLM's rule for an address without a wildcard);
    # the replay socket is bound by the engine, on loopback.
    cfg = KVEventsConfig(enable_kv_cache_events=True, publisher="zmq",
                         endpoint=f"tcp://127.0.0.1:{sub_port}",
                         replay_endpoint=f"tcp://127.0.0.1:{replay_port}", topic="kv")
    rng = np.random.default_rng(7)
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    subscriber = None
    with LLM(str(model), device="cpu", num_gpu_blocks=40, block_size=8, max_num_seqs=6,
             max_num_batched_tokens=128, kv_events_config=cfg) as llm:
        engine = llm.engine
        try:
            # Round 1 is published before anyone listens: the subscriber gets it by replay.
            llm.generate(_mixed_load(rng), params)
            subscriber = KVEventSubscriber(f"tcp://127.0.0.1:{sub_port}", f"tcp://127.0.0.1:{replay_port}",
                                           topic="kv", bind=True)
            for _ in range(3):
                llm.generate(_mixed_load(rng), params)
                time.sleep(0.2)  # lets the subscription reach the publisher between rounds
            # Mirror and engine are compared when the engine is idle and every batch is out.
            published = engine.kv_publisher.num_published
            deadline = time.monotonic() + WAIT_S
            while subscriber.snapshot().last_seq < published - 1 and time.monotonic() < deadline:
                time.sleep(0.05)
            mirror = subscriber.snapshot()
            own = {e.block_hashes[0]: (e.parent_block_hash, e.token_ids)
                   for e in engine.scheduler.pool.cached_blocks()}
            engine.scheduler.check_invariants()
        finally:
            if subscriber is not None:
                subscriber.stop()
    assert mirror.errors == []
    assert mirror.last_seq == published - 1
    assert engine.kv_publisher.num_dropped == 0
    assert mirror.num_replayed > 0, "round 1 should have come through the replay socket"
    assert mirror.num_cleared >= 1          # the engine's start-up AllBlocksCleared
    assert mirror.num_removed > 0, "the load should have evicted cached blocks"
    assert len(own) > 0
    assert mirror.blocks == own


def test_a_dropped_batch_is_followed_by_a_full_resync() -> None:
    from vt.sched.kv_publisher import BatchQueue

    snapshot = [BlockStored((5,), None, (1, 2), 2), BlockStored((6,), 5, (3, 4), 2)]
    q = BatchQueue(maxsize=1)
    assert q.put([BlockRemoved((1,))], lambda: snapshot)
    assert not q.put([BlockRemoved((2,))], lambda: snapshot)   # full: dropped, never blocks
    assert not q.put([BlockRemoved((3,))], lambda: snapshot)
    assert q.num_dropped == 2
    assert q.get(1.0)[1] == [BlockRemoved((1,))]
    assert q.put([BlockRemoved((4,))], lambda: snapshot)
    assert q.get(1.0)[1] == [AllBlocksCleared(), *snapshot]     # not the new events alone
    assert q.put([BlockRemoved((7,))], lambda: snapshot)
    assert q.get(1.0)[1] == [BlockRemoved((7,))]                # back to plain batches
