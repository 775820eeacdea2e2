"""KV-cache events on the wire in vLLM's format: `--kv-events-config`, a ZMQ PUB socket and its
replay socket.

Each message is three frames: the topic, an 8-byte big-endian sequence number (from 0, one per
batch) and a msgpack batch `[ts, [event, ...], data_parallel_rank]` whose events are maps tagged
by "type": BlockStored (block_hashes, parent_block_hash, token_ids, block_size, lora_id, medium,
lora_name), BlockRemoved (block_hashes, medium) and AllBlocksCleared. The replay socket (ROUTER)
answers a request `[empty, start_seq]` with every buffered batch from start_seq on, each as
`[empty, seq, payload]`, then `[empty, -1, b""]`.

publish() never blocks: it queues the batch for one publisher thread that encodes and sends. If
the queue is full the batch is dropped and the next publish() starts with AllBlocksCleared and a
snapshot of the whole cache, so subscribers converge again. pyzmq and msgpack are the `kv-events`
extra; they are imported only when events are enabled.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from typing import Any

from vt.config import KVEventsConfig
from vt.sched.kv_events import AllBlocksCleared, BlockRemoved, BlockStored, KVEvent

log = logging.getLogger("vt.kv_events")
END_SEQ = (-1).to_bytes(8, "big", signed=True)
MEDIUM = "GPU"  # vLLM's medium for blocks in the engine's own KV cache (the numpy backend's too)


def encode_event(event: KVEvent) -> dict[str, Any]:
    """One event as vLLM's msgspec tagged struct encodes it (required fields always present)."""
    if isinstance(event, BlockStored):
        return {"type": "BlockStored", "block_hashes": list(event.block_hashes),
                "parent_block_hash": event.parent_block_hash, "token_ids": list(event.token_ids),
                "block_size": event.block_size, "lora_id": None, "medium": MEDIUM, "lora_name": None}
    if isinstance(event, BlockRemoved):
        return {"type": "BlockRemoved", "block_hashes": list(event.block_hashes), "medium": MEDIUM}
    if isinstance(event, AllBlocksCleared):
        return {"type": "AllBlocksCleared"}
    raise TypeError(f"not a KV event: {event!r}")


def encode_batch(ts: float, events: Sequence[KVEvent], data_parallel_rank: int = 0) -> bytes:
    import msgpack

    return msgpack.packb([ts, [encode_event(e) for e in events], data_parallel_rank])


def _binds(endpoint: str) -> bool:
    # vLLM's rule: a wildcard address or a local transport is bound; anything else is connected to
    return "*" in endpoint or "::" in endpoint or endpoint.startswith(("ipc://", "inproc://"))


class BatchQueue:
    """Event batches on their way to the publisher thread: bounded, and put() never blocks. A batch
    that finds the queue full is dropped, and the next batch put() accepts is replaced by
    AllBlocksCleared and a snapshot of the whole cache, so subscribers converge again."""

    def __init__(self, maxsize: int) -> None:
        self._queue: queue.Queue[tuple[float, list[KVEvent]] | None] = queue.Queue(maxsize)
        self._resync = False
        self.num_dropped = 0

    def put(self, events: list[KVEvent], snapshot: Callable[[], list[BlockStored]]) -> bool:
        """Queue a batch (snapshot is called on the caller's thread, only to resync); False if
        it was dropped."""
        if self._queue.full():
            self.num_dropped += 1
            if not self._resync:
                log.warning("KV event queue full: dropping batches until it drains, then resyncing")
            self._resync = True
            return False
        if self._resync:
            events = [AllBlocksCleared(), *snapshot()]
            self._resync = False
        self._queue.put_nowait((time.time(), events))  # the only producer: room is still there
        return True

    def get(self, timeout: float) -> tuple[float, list[KVEvent]] | None:
        """The next batch, None once close() was called; raises queue.Empty after `timeout`."""
        return self._queue.get(timeout=timeout)

    def close(self, timeout: float) -> bool:
        """Queue the end marker, waiting up to `timeout` s for room; whether it went in."""
        try:
            self._queue.put(None, timeout=timeout)
            return True
        except queue.Full:
            return False


class ZmqEventPublisher:
    """Publishes KV event batches from a thread; publish() is called on the engine's loop."""

    def __init__(self, cfg: KVEventsConfig) -> None:
        try:
            import msgpack  # noqa: F401
            import zmq
        except ImportError:
            raise RuntimeError("KV cache events need pyzmq and msgpack: "
                               "pip install 'vt[kv-events]'") from None
        self.cfg = cfg
        self._ctx = zmq.Context()
        self._pub = self._ctx.socket(zmq.PUB)
        self._pub.set_hwm(cfg.hwm)
        self._replay = None
        try:
            if _binds(cfg.endpoint):
                self._pub.bind(cfg.endpoint)
            else:
                self._pub.connect(cfg.endpoint)
            if cfg.replay_endpoint is not None:
                self._replay = self._ctx.socket(zmq.ROUTER)
                self._replay.bind(cfg.replay_endpoint)
        except zmq.ZMQError as e:
            self._close_sockets()
            where = cfg.endpoint if cfg.replay_endpoint is None else f"{cfg.endpoint} / {cfg.replay_endpoint}"
            raise RuntimeError(f"--kv-events-config: cannot open {where}: {e}") from None
        self._queue = BatchQueue(cfg.max_queue_size)
        self._buffer: deque[tuple[int, bytes]] = deque(maxlen=cfg.buffer_steps)
        self._topic = cfg.topic.encode()
        self.num_published = 0   # batches sent (publisher thread)
        self._thread = threading.Thread(target=self._run, name="vt-kv-events", daemon=True)
        self._thread.start()

    @property
    def num_dropped(self) -> int:
        return self._queue.num_dropped

    def publish(self, events: list[KVEvent], snapshot: Callable[[], list[BlockStored]]) -> None:
        """Queue one batch without blocking (see BatchQueue)."""
        self._queue.put(events, snapshot)

    def shutdown(self, timeout: float = 1.0) -> None:
        """Send what is queued (for up to `timeout` s), then close the sockets."""
        deadline = time.monotonic() + timeout
        self._queue.close(timeout)
        self._thread.join(max(0.0, deadline - time.monotonic()))
        if self._thread.is_alive():
            log.warning("the KV event publisher did not stop within %.1f s", timeout)
            return  # the thread still uses the sockets; the process exit closes them
        self._close_sockets()

    def _close_sockets(self) -> None:
        for sock in (self._pub, self._replay):
            if sock is not None:
                sock.close(linger=0)
        self._ctx.term()

    # ---- the publisher thread -------------------------------------------------------------------
    def _run(self) -> None:
        seq = 0
        while True:
            if self._replay is not None:
                try:
                    while self._replay.poll(0):
                        self._serve_replay()
                except Exception:
                    log.exception("serving a KV event replay request failed")
            try:
                item = self._queue.get(timeout=0.05)
            except queue.Empty:
                continue
            if item is None:
                return
            ts, events = item
            try:
                payload = encode_batch(ts, events)
                seq_bytes = seq.to_bytes(8, "big")
                self._pub.send_multipart((self._topic, seq_bytes, payload))
                self._buffer.append((seq, payload))
                seq += 1
                self.num_published += 1
            except Exception:
                log.exception("publishing a KV event batch failed")

    def _serve_replay(self) -> None:
        frames = self._replay.recv_multipart()
        if len(frames) != 3 or len(frames[2]) != 8:
            log.warning("ignoring a malformed KV event replay request (%d frames)", len(frames))
            return
        client, _, start = frames
        start_seq = int.from_bytes(start, "big", signed=True)
        for seq, payload in list(self._buffer):
            if seq >= start_seq:
                self._replay.send_multipart((client, b"", seq.to_bytes(8, "big"), payload))
        self._replay.send_multipart((client, b"", END_SEQ, b""))
