"""What a peer puts on the wire, by kind: the bytes of the messages it sends (requests it makes, replies it gives,
all-reduce parts), counted where they are serialized, before libp2p's framing and TCP/IP headers.

One `Traffic` per process (`METER`): every peer runs in a process of its own, so it is that peer's uplink. A message
for an epoch (a request or reply whose message names one, an all-reduce part of that epoch's round) also counts as
that epoch's, so that a swarm's averaging bytes per epoch are exact, whatever is in flight when they are read. The
DHT's own traffic is not here (hivemind sends it); an emulated link's counter (`p2ptrain.links.bytes_sent`) holds
all of it, headers included.

Beside the bytes, the meter counts the requests the process served, by method (`rpc_take_task`, ...): what keeps a
swarm's servers and daemons busy when it trains and when it idles (`benchmarks/dataplane.py`).
"""
from __future__ import annotations

import threading
from dataclasses import dataclass, field

# activations: rows, activations and their gradients between stages (and held-out evaluation);
# averaging: the all-reduce's parts and the gradients deposited before it; state: a stage's parameters and optimizer
# state downloaded by a joiner; probes: link probes; control: every other message (tasks, closures, epochs, norms)
KINDS = ("activations", "averaging", "state", "probes", "control")


@dataclass
class Traffic:
    """Bytes sent, by kind (KINDS), since the process began, and by the epoch the messages were for (those counted
    with one), for the newest `epochs_kept` epochs of each kind; thread-safe."""

    sent: dict[str, int] = field(default_factory=lambda: dict.fromkeys(KINDS, 0))
    served: dict[str, int] = field(default_factory=dict)  # requests served, by method (module doc)
    epochs_kept: int = 256
    _by_epoch: dict[str, dict[int, int]] = field(default_factory=lambda: {kind: {} for kind in KINDS}, repr=False)
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False, compare=False)

    def count(self, kind: str, nbytes: int, *, epoch: int | None = None) -> None:
        if kind not in self.sent:
            raise ValueError(f"unknown traffic kind {kind!r}; one of {KINDS}")
        with self._lock:
            self.sent[kind] += nbytes
            if epoch is not None:
                epochs = self._by_epoch[kind]
                epochs[epoch] = epochs.get(epoch, 0) + nbytes
                if len(epochs) > self.epochs_kept:
                    del epochs[min(epochs)]

    def count_served(self, method: str) -> None:
        with self._lock:
            self.served[method] = self.served.get(method, 0) + 1

    def snapshot(self) -> dict[str, int]:
        with self._lock:
            return dict(self.sent)

    def served_snapshot(self) -> dict[str, int]:
        with self._lock:
            return dict(self.served)

    def of_epoch(self, kind: str, epoch: int) -> int:
        """Bytes of `kind` sent for `epoch` so far (0 once it is older than the newest `epochs_kept`)."""
        with self._lock:
            return self._by_epoch[kind].get(epoch, 0)


METER = Traffic()  # this process's
