"""Reading the run's records back out of the DHT.

`dht.get(key, latest=True)` returns ValueWithExpiration(value={subkey: ValueWithExpiration(value, expiration)})
for a key written with subkeys, or None. hivemind has already dropped entries whose signature or schema
failed on DHTs built with `make_validators`; the readers check again (a peer's DHT may lack the validators)
and skip, with a warning, anything malformed or claiming a peer id its subkey does not carry.
"""
from __future__ import annotations

import contextlib
import logging
import threading
import weakref
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any, TypeVar

import hivemind
from hivemind.utils import get_dht_time

from p2ptrain.config import RUN_ID_PATTERN
from p2ptrain.dht.keys import RUNS_KEY, metrics_key, peers_key, plan_key, recipe_key, split_subkey, stage_key
from p2ptrain.dht.records import Membership, Metrics, PeerInfo, PlanRecord, RecipeRecord
from p2ptrain.recipe import Recipe

if TYPE_CHECKING:
    from p2ptrain.live.authority import Owner

logger = logging.getLogger(__name__)

# the longest a read waits for the DHT process. A healthy node answers within its own RPC timeouts (seconds); one shut
# down or killed with the read in flight never answers, and a thread left waiting on it kept its process from ever
# exiting: the interpreter, and asyncio.run's executor shutdown before it, wait for every such thread (a server that
# refused its checkpoint hung, its membership read cancelled but its thread still waiting; seen in CI)
READ_TIMEOUT_S = 30.0

R = TypeVar("R", PeerInfo, Membership, Metrics, RecipeRecord)

_reads_under_way: weakref.WeakKeyDictionary[hivemind.DHT, int] = weakref.WeakKeyDictionary()
_reads_changed = threading.Condition()


def get_peers(dht: hivemind.DHT, run_id: str) -> list[PeerInfo]:
    return _per_peer(dht, peers_key(run_id), PeerInfo.from_value)


def get_stage_members(dht: hivemind.DHT, run_id: str, stage: int, *, owner: Owner | None = None) -> list[Membership]:
    """Every peer's record of its place in `stage`; with the run's `owner`, only the servers it authorized there."""
    return get_authorized_members(dht, run_id, stage, owner=owner)[0]


def get_authorized_members(dht: hivemind.DHT, run_id: str, stage: int, *, owner: Owner | None
                           ) -> tuple[list[Membership], list[str]]:
    """(members, unauthorized): `get_stage_members`, and the peer ids of the servers the owner did not authorize.

    A server's record the owner certified wins over any other under the same peer id: anyone may write a record
    that names another peer (as a server or a worker), and one without the certificate must not hide the real one."""
    if owner is None:
        return _per_peer(dht, stage_key(run_id, stage), Membership.from_value), []

    def certified(member: Membership) -> bool:
        return member.role != "worker" and owner.signed(run_id=run_id, peer_id=member.peer_id, stage=stage,
                                                        role=member.role, data_source=member.data_source,
                                                        signature=member.certificate)

    members = _per_peer(dht, stage_key(run_id, stage), Membership.from_value, prefer=certified)
    return ([m for m in members if m.role == "worker" or certified(m)],
            [m.peer_id for m in members if m.role != "worker" and not certified(m)])


def frontal_order(members: list[Membership], *, owner: Owner | None) -> tuple[str, ...]:
    """The FS among a stage's `members`, data source first (of stage 0): with an owner, the ones whose certificate
    names them the data source come first; then by peer id."""
    named = {m.peer_id for m in members if m.data_source and owner is not None}
    return tuple(sorted((m.peer_id for m in members if m.role == "fs"), key=lambda peer: (peer not in named, peer)))


def get_recipe(dht: hivemind.DHT, run_id: str, *, owner: Owner | None = None) -> tuple[str, Recipe] | None:
    """(the data source, the recipe it publishes), or None while there is none: the recipe stored by the first
    stage-0 FS (`frontal_order`), signed with its key."""
    order = frontal_order(get_stage_members(dht, run_id, 0, owner=owner), owner=owner)
    return read_recipe(dht, run_id, order[0]) if order else None


def read_recipe(dht: hivemind.DHT, run_id: str, publisher: str) -> tuple[str, Recipe] | None:
    """(`publisher`, the recipe it stores), or None if it stores none that is one."""
    for record in _per_peer(dht, recipe_key(run_id), RecipeRecord.from_value):
        if record.peer_id == publisher:
            try:
                return record.peer_id, Recipe.from_value(record.recipe)
            except ValueError as e:
                logger.warning("the data source %s publishes a recipe that is not one: %s", record.peer_id, e)
    return None


def get_runs(dht: hivemind.DHT) -> list[str]:
    """The ids of the runs whose data sources announce them in this DHT."""
    runs = set()
    for _, value, _ in _live_entries(dht, RUNS_KEY):
        run_id = value.get("run_id") if isinstance(value, dict) else None
        if isinstance(run_id, str) and RUN_ID_PATTERN.fullmatch(run_id):
            runs.add(run_id)
    return sorted(runs)


def holding_servers(members: list[Membership]) -> frozenset[str]:
    """The peer ids of the servers among a stage's `members` that hold its state (every FS, a BS given --keep-state
    or that computes)."""
    return frozenset(m.peer_id for m in members if m.role != "worker" and m.holds_state)


def get_state_holders(dht: hivemind.DHT, run_id: str, stage: int, *, owner: Owner | None = None
                      ) -> tuple[list[str], list[str]]:
    """The peer ids of the peers that hold `stage`'s state and can be dialed for it: its servers that hold it (every
    FS, a BS given --keep-state or that computes) and, apart, its workers (clients) not in client mode."""
    return state_holders(get_stage_members(dht, run_id, stage, owner=owner))


def state_holders(members: list[Membership]) -> tuple[list[str], list[str]]:
    """`get_state_holders` of a stage's `members`."""
    servers = holding_servers(members)
    workers = {m.peer_id for m in members if m.role == "worker" and not m.client_mode}
    return sorted(servers), sorted(workers - servers)


def get_metrics(dht: hivemind.DHT, run_id: str) -> list[Metrics]:
    return _per_peer(dht, metrics_key(run_id), Metrics.from_value)


_REPORTED_ROGUES: set[tuple[str, object]] = set()


def get_plan(dht: hivemind.DHT, run_id: str, planner_public_key: bytes | None) -> PlanRecord | None:
    """The newest plan (highest version, then latest created) written under `planner_public_key`.

    `planner_public_key` is the planner's RSASignatureValidator.local_public_key; entries under any other
    key are ignored with a warning. None trusts every writer (single-operator runs and tools only).
    """
    best: PlanRecord | None = None
    for subkey, value, _ in _live_entries(dht, plan_key(run_id)):
        if planner_public_key is not None and subkey != planner_public_key:
            if (run_id, subkey) not in _REPORTED_ROGUES:  # once per writer: peers poll the plan every few seconds
                _REPORTED_ROGUES.add((run_id, subkey))
                logger.warning("ignoring a plan for run %s written by a key that is not the planner's", run_id)
            continue
        try:
            record = PlanRecord.from_value(value)
        except (TypeError, ValueError) as e:
            logger.warning("skipping a malformed plan for run %s: %s", run_id, e)
            continue
        if best is None or (record.version, record.created) > (best.version, best.created):
            best = record
    return best


def _per_peer(dht: hivemind.DHT, key: str, parse: Callable[[dict[str, Any]], R],
              prefer: Callable[[R], bool] = lambda record: True) -> list[R]:
    """One record per peer: a peer restarted with its identity signs with a new key, so its old entry lives on
    under another subkey until it expires; the entry stored last (which expires last) is the live one, among those
    `prefer` says are, if any."""
    records: dict[str, tuple[tuple[bool, float], R]] = {}
    for subkey, value, expiration in _live_entries(dht, key):
        try:
            peer_id, _owner = split_subkey(subkey)
            record = parse(value)
        except (TypeError, ValueError) as e:
            logger.warning("skipping a malformed entry of %s: %s", key, e)
            continue
        if record.peer_id != peer_id:
            # the owner key authenticates the writer; the peer id in the subkey pins which peer it speaks for
            logger.warning("skipping an entry of %s for peer %s stored under peer %s", key, record.peer_id, peer_id)
            continue
        rank = (prefer(record), expiration)
        if peer_id not in records or rank > records[peer_id][0]:
            records[peer_id] = (rank, record)
    return [record for _, (_, record) in sorted(records.items())]


def wait_for_reads(dht: hivemind.DHT, timeout: float) -> bool:
    """Until no read of `dht` is under way (True), or `timeout` passes (False). `stop_dht` waits so: a node shut down
    under a read never answers it, and the read would wait out READ_TIMEOUT_S, its thread holding its process's exit
    (a thread cannot be cancelled: a peer that stops cancels its readers' tasks, not their reads)."""
    with _reads_changed:
        return _reads_changed.wait_for(lambda: not _reads_under_way.get(dht), timeout=timeout)


@contextlib.contextmanager
def _under_way(dht: hivemind.DHT) -> Iterator[None]:
    with _reads_changed:
        _reads_under_way[dht] = _reads_under_way.get(dht, 0) + 1
    try:
        yield
    finally:
        with _reads_changed:
            _reads_under_way[dht] -= 1
            _reads_changed.notify_all()


def _live_entries(dht: hivemind.DHT, key: str) -> Iterator[tuple[bytes, Any, float]]:
    """(subkey, value, expiration time) of the unexpired, non-tombstone entries under `key`; a TimeoutError if the
    DHT process does not answer within READ_TIMEOUT_S."""
    try:
        with _under_way(dht):
            found = dht.get(key, latest=True, return_future=True).result(timeout=READ_TIMEOUT_S)
    except TimeoutError:
        raise TimeoutError(f"the DHT process did not answer a read of {key} within {READ_TIMEOUT_S:g} s") from None
    if found is None:
        return
    if not isinstance(found.value, dict):
        logger.warning("skipping %s: expected entries under subkeys, got a %s", key, type(found.value).__name__)
        return
    now = get_dht_time()
    for subkey, entry in found.value.items():
        if not isinstance(subkey, bytes):
            logger.warning("skipping an entry of %s under a non-bytes subkey %r", key, subkey)
            continue
        if entry.expiration_time < now or entry.value is None:  # expired, or withdrawn by its owner
            continue
        yield subkey, entry.value, entry.expiration_time
