"""A KV-event subscriber as a prefix-aware router writes one against vLLM: a SUB socket for the
live stream, a REQ socket on the replay endpoint to fetch what it missed, and the cache rebuilt
from BlockStored / BlockRemoved / AllBlocksCleared. It decodes with plain msgpack, knowing nothing
of vt."""

from __future__ import annotations

import threading
from dataclasses import dataclass, field

import msgpack
import zmq

END_SEQ = -1


@dataclass
class MirrorState:
    blocks: dict[int, tuple[int | None, tuple[int, ...]]] = field(default_factory=dict)  # hash -> content
    last_seq: int = -1
    num_replayed: int = 0          # batches obtained through the replay socket
    num_stored: int = 0
    num_removed: int = 0
    num_cleared: int = 0
    errors: list[str] = field(default_factory=list)


class KVEventSubscriber:
    """Rebuilds one replica's cached-block set from its events, in a thread; stop() ends it."""

    def __init__(self, endpoint: str, replay_endpoint: str, topic: str = "", bind: bool = False) -> None:
        self.state = MirrorState()
        self._lock = threading.Lock()
        self._ctx = zmq.Context()
        self._sub = self._ctx.socket(zmq.SUB)
        self._sub.setsockopt_string(zmq.SUBSCRIBE, topic)
        if bind:
            self._sub.bind(endpoint)
        else:
            self._sub.connect(endpoint)
        self._replay_endpoint = replay_endpoint
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def snapshot(self) -> MirrorState:
        with self._lock:
            return MirrorState(dict(self.state.blocks), self.state.last_seq, self.state.num_replayed,
                               self.state.num_stored, self.state.num_removed, self.state.num_cleared,
                               list(self.state.errors))

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(5)
        self._sub.close(linger=0)
        self._ctx.term()

    # ---- the thread -----------------------------------------------------------------------------
    def _run(self) -> None:
        while not self._stop.is_set():
            if not self._sub.poll(50):
                continue
            _topic, seq_bytes, payload = self._sub.recv_multipart()
            seq = int.from_bytes(seq_bytes, "big", signed=True)
            with self._lock:
                if seq > self.state.last_seq + 1:
                    self._replay(self.state.last_seq + 1, seq)
                if seq == self.state.last_seq + 1:
                    self._apply(seq, payload)
                elif seq > self.state.last_seq + 1:
                    self.state.errors.append(f"batches {self.state.last_seq + 1}..{seq - 1} lost for good")

    def _replay(self, start: int, upto: int) -> None:
        # A DEALER, not a REQ: the publisher answers one request with many messages. The empty
        # first frame is the delimiter a REQ socket would add.
        dealer = self._ctx.socket(zmq.DEALER)
        dealer.connect(self._replay_endpoint)
        try:
            dealer.send_multipart((b"", start.to_bytes(8, "big")))
            while True:
                if not dealer.poll(5000):
                    self.state.errors.append("replay request timed out")
                    return
                _empty, seq_bytes, payload = dealer.recv_multipart()
                seq = int.from_bytes(seq_bytes, "big", signed=True)
                if seq == END_SEQ:
                    return
                if seq == self.state.last_seq + 1 and seq < upto:
                    self._apply(seq, payload)
                    self.state.num_replayed += 1
        finally:
            dealer.close(linger=0)

    def _apply(self, seq: int, payload: bytes) -> None:
        st = self.state
        st.last_seq = seq
        ts, events, *_rank = msgpack.unpackb(payload)
        for ev in events:
            kind = ev["type"]
            if kind == "BlockStored":
                hashes, bs, tokens = ev["block_hashes"], ev["block_size"], ev["token_ids"]
                if len(tokens) != len(hashes) * bs:
                    st.errors.append(f"BlockStored with {len(hashes)} hashes and {len(tokens)} tokens")
                parent = ev["parent_block_hash"]
                for i, h in enumerate(hashes):
                    st.blocks[h] = (parent, tuple(tokens[i * bs:(i + 1) * bs]))
                    parent = h
                st.num_stored += len(hashes)
            elif kind == "BlockRemoved":
                for h in ev["block_hashes"]:
                    if st.blocks.pop(h, None) is None:
                        st.errors.append(f"BlockRemoved for unknown hash {h:#x}")
                st.num_removed += len(ev["block_hashes"])
            elif kind == "AllBlocksCleared":
                st.blocks.clear()
                st.num_cleared += 1
            else:
                st.errors.append(f"unknown event type {kind!r}")
