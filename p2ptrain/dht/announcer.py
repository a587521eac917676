"""Soft-state publishing: a peer's records live only while the peer keeps refreshing them.

Every `period_s` the announcer re-stores each record it owns with expiration now + `ttl_s`; a peer that
vanishes stops refreshing and its records expire on their own. A record that changes between refreshes is
stored alone at once: each store costs signing, replication and schema checks on a machine shared with
training. A deliberate exit writes tombstones (None under the same subkey, newer than the record), so readers
forget the peer at once rather than after ttl.
"""
from __future__ import annotations

import logging
import pickle
import threading
import time
from typing import Any

import hivemind
from hivemind.utils import get_dht_time

from p2ptrain.dht.keys import RUNS_KEY, metrics_key, owned_subkey, peers_key, plan_key, recipe_key, stage_key
from p2ptrain.dht.records import Membership, Metrics, PeerInfo, PlanRecord, RecipeRecord

logger = logging.getLogger(__name__)

_Slot = tuple[str, bytes]  # (key, subkey)
# hivemind's DHT process may read a call of over 16 KiB half-written and then exit (docs/design.md §7): a value, with
# the key, subkey and call around it, must stay below that
MAX_VALUE_BYTES = 14_000


class Announcer:
    """Publishes one peer's records and keeps them alive from a background thread."""

    def __init__(
        self,
        *,
        dht: hivemind.DHT,
        run_id: str,
        peer_id: str,
        owner_key: bytes,
        period_s: float,
        ttl_s: float,
        start: bool = True,
    ):
        """`owner_key` is the `local_public_key` of the RSASignatureValidator the DHT was created with.

        With start=False nothing runs in the background and `refresh()` publishes (tests, one-shot tools).
        """
        if not 0 < period_s < ttl_s:
            raise ValueError(f"need 0 < period_s < ttl_s so records never lapse; got {period_s}, {ttl_s}")
        self.dht, self.run_id, self.peer_id, self.owner_key = dht, run_id, peer_id, owner_key
        self.period_s, self.ttl_s = period_s, ttl_s
        self._subkey = owned_subkey(peer_id, owner_key)
        self._records: dict[_Slot, dict[str, Any] | None] = {}  # None: a tombstone not yet stored
        self._changed: set[_Slot] = set()  # slots set since the last store, stored on the next wake
        self._membership_key: str | None = None
        self._lock = threading.Lock()  # guards _records
        self._store_lock = threading.Lock()  # one refresh at a time, so a tombstone is never overtaken
        self._wake, self._stop = threading.Event(), threading.Event()
        self._thread: threading.Thread | None = None
        if start:
            self._thread = threading.Thread(target=self._run, name=f"Announcer({peer_id})", daemon=True)
            self._thread.start()

    def set_peer_info(self, info: PeerInfo) -> None:
        self._set(peers_key(self.run_id), self._own(info.peer_id), info.to_value())

    def set_membership(self, stage: int, record: Membership) -> None:
        """Join `stage`; a peer belongs to one stage at a time, so a previous membership is withdrawn."""
        key = stage_key(self.run_id, stage)
        value = record.to_value()
        subkey = self._own(record.peer_id)
        with self._lock:
            if self._membership_key not in (None, key):
                self._records[(self._membership_key, subkey)] = None
                self._changed.add((self._membership_key, subkey))
            self._membership_key = key
            self._records[(key, subkey)] = value
            self._changed.add((key, subkey))
        self._wake.set()

    def set_metrics(self, record: Metrics) -> None:
        self._set(metrics_key(self.run_id), self._own(record.peer_id), record.to_value())

    def set_recipe(self, record: RecipeRecord) -> None:
        """Publish the run's recipe, and the run in the DHT's list of runs (a peer given no run id finds it there)."""
        self._set(recipe_key(self.run_id), self._own(record.peer_id), record.to_value())
        self._set(RUNS_KEY, self._subkey, {"run_id": self.run_id})

    def set_plan(self, record: PlanRecord) -> None:
        """Publish the plan under this peer's bare owner key; readers trust it only if that is the planner's key."""
        self._set(plan_key(self.run_id), self.owner_key, record.to_value())

    def refresh(self, only: set[_Slot] | None = None) -> bool:
        """Store every owned record (and pending tombstone), or just the slots in `only`, now; False if the DHT
        refused or missed any."""
        with self._store_lock:
            with self._lock:
                snapshot = [(slot, value) for slot, value in self._records.items() if only is None or slot in only]
            expiration = get_dht_time() + self.ttl_s
            futures = [
                self.dht.store(key, value, expiration, subkey=subkey, return_future=True)
                for (key, subkey), value in snapshot
            ]
            all_ok = True
            for ((key, subkey), value), future in zip(snapshot, futures):
                ok = bool(future.result(timeout=self.ttl_s))
                if not ok:
                    # signature or schema refused, or no replica answered; the next period retries
                    what = "tombstone" if value is None else "record"
                    logger.warning("DHT did not store the %s under %s / %r", what, key, subkey[:40])
                    all_ok = False
                elif value is None:
                    with self._lock:  # forget the tombstone unless the record was set again meanwhile
                        if (key, subkey) in self._records and self._records[(key, subkey)] is None:
                            del self._records[(key, subkey)]
            return all_ok

    def withdraw(self) -> None:
        """Tombstone every owned record now; the announcer keeps running for records set later."""
        with self._lock:
            for slot in self._records:
                self._records[slot] = None
            self._membership_key = None
        self.refresh()

    def shutdown(self) -> None:
        """Withdraw, then stop the background thread."""
        try:
            self.withdraw()
        except Exception as e:  # e.g. the DHT is already down; the records expire within ttl_s anyway
            logger.warning("could not withdraw DHT records of %s: %s", self.peer_id, e)
        self._stop.set()
        self._wake.set()
        if self._thread is not None:
            self._thread.join(timeout=self.ttl_s)

    def _own(self, peer_id: str) -> bytes:
        if peer_id != self.peer_id:
            raise ValueError(f"this announcer publishes for peer {self.peer_id}, not {peer_id}")
        return self._subkey

    def _set(self, key: str, subkey: bytes, value: dict[str, Any]) -> None:
        size = len(pickle.dumps(value))
        if size > MAX_VALUE_BYTES:
            raise ValueError(f"a record of {size} bytes under {key} is too large for the DHT process to read safely "
                             f"(at most {MAX_VALUE_BYTES}; docs/design.md §7)")
        with self._lock:
            self._records[(key, subkey)] = value
            self._changed.add((key, subkey))
        self._wake.set()

    def _run(self) -> None:
        next_full = 0.0
        while not self._stop.is_set():
            self._wake.clear()  # before the snapshot: a change made during refresh wakes the next round
            full = time.monotonic() >= next_full
            with self._lock:
                changed, self._changed = self._changed, set()
            try:
                self.refresh(None if full else changed)
            except Exception:
                logger.exception("refreshing DHT records failed; retrying in %.1f s", self.period_s)
            if full:
                next_full = time.monotonic() + self.period_s
            self._wake.wait(max(0.0, next_full - time.monotonic()))
