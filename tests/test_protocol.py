"""The pure protocol pieces: row segmentation, compute shares, the ledger, the task pool, the epoch-closure rule and
the data of each microbatch under either fault policy."""
import pytest

from p2ptrain.protocol.closure import Verdict, judge
from p2ptrain.protocol.ledger import Ledger
from p2ptrain.protocol.messages import Closure, GroupMember, TaskReply
from p2ptrain.protocol.rows import Rows, route, segments, split_by_compute
from p2ptrain.protocol.slots import SlotPlan
from p2ptrain.protocol.taskpool import Kind, Task, TaskPool


def test_segments_cover_rows_evenly():
    for total in range(0, 30):
        for receivers in range(1, 6):
            parts = segments(total, receivers)
            assert parts[0].start == 0 and parts[-1].end == total
            assert all(a.end == b.start for a, b in zip(parts, parts[1:]))
            assert max(map(len, parts)) - min(map(len, parts)) <= 1


def test_route_two_senders_to_three_receivers_as_in_the_paper():
    total = 6
    first, second = segments(total, 2)
    assert route(first, 3, total) == [(0, Rows(0, 2)), (1, Rows(2, 3))]
    assert route(second, 3, total) == [(1, Rows(3, 4)), (2, Rows(4, 6))]


def test_split_by_compute_is_proportional_and_contiguous():
    shares = split_by_compute(Rows(10, 20), {"a": 1.0, "b": 3.0, "c": 1.0})
    assert [(w, len(r)) for w, r in shares] == [("a", 2), ("b", 6), ("c", 2)]
    assert shares[0][1].start == 10 and shares[-1][1].end == 20
    assert all(x[1].end == y[1].start for x, y in zip(shares, shares[1:]))
    with pytest.raises(ValueError):
        split_by_compute(Rows(0, 4), {})


def test_ledger_routes_gradient_rows_back_to_their_workers():
    ledger = Ledger()
    assert ledger.record(epoch=0, microbatch=1, worker="w1", rows=Rows(0, 3), task_id="t1")
    assert ledger.record(epoch=0, microbatch=1, worker="w2", rows=Rows(3, 8), task_id="t2")
    assert not ledger.record(epoch=0, microbatch=1, worker="w3", rows=Rows(2, 4), task_id="t3")  # duplicate rows
    assert ledger.covered(epoch=0, microbatch=1) == 8
    parts = ledger.split(epoch=0, microbatch=1, rows=Rows(2, 5))
    assert [(p.worker, p.rows, p.task_id) for p in parts] == [("w1", Rows(2, 3), "t1"), ("w2", Rows(3, 5), "t2")]
    with pytest.raises(KeyError):
        ledger.split(epoch=0, microbatch=1, rows=Rows(6, 9))
    ledger.forget_epoch(0)
    assert ledger.covered(epoch=0, microbatch=1) == 0


def _task(i: int, epoch: int = 0, preferred: str | None = None) -> Task:
    return Task(task_id=f"{epoch}:{i}", kind=Kind.FORWARD, epoch=epoch, microbatch=i, rows=Rows(0, 2),
                preferred=preferred)


def test_task_pool_prefers_own_tasks_then_oldest():
    pool = TaskPool(lease_timeout=5.0)
    pool.add(_task(0, preferred="a"))
    pool.add(_task(1, preferred="b"))
    assert pool.take("b", now=0.0).task_id == "0:1"
    assert pool.take("b", now=0.0).task_id == "0:0"  # nothing of its own left: takes another's
    assert pool.take("b", now=0.0) is None


def test_task_pool_requeues_timed_out_leases_and_counts_them():
    pool = TaskPool(lease_timeout=5.0)
    pool.add(_task(0))
    assert pool.take("a", now=0.0) is not None
    assert pool.expire(now=4.9) == []
    assert [t.task_id for t in pool.expire(now=5.0)] == ["0:0"]
    assert pool.redone == {0: 1}
    assert pool.take("b", now=6.0).task_id == "0:0"
    assert pool.complete("0:0") and not pool.complete("0:0")


def test_a_lease_lasts_what_the_caller_sizes_it_to_the_timeout_by_default_and_a_gone_worker_loses_its_leases():
    pool = TaskPool(lease_timeout=5.0)
    for i in range(4):
        pool.add(_task(i))
    fast = pool.take("a", now=0.0, lease_s=lambda task: 1.0)
    slow = pool.take("b", now=0.0, lease_s=lambda task: 60.0)  # a slow link's: the caller bounds it
    plain = pool.take("c", now=0.0)
    assert pool.lease(fast.task_id).deadline == 1.0 and pool.lease(fast.task_id).taken == 0.0
    assert pool.lease(slow.task_id).deadline == 60.0 and pool.lease(plain.task_id).deadline == 5.0
    assert [t.task_id for t in pool.expire(now=1.0)] == [fast.task_id]
    pool.take("b", now=1.0)
    assert pool.leased_to("b") and not pool.leased_to("a")
    assert {t.task_id for t in pool.requeue_worker("b")} == {fast.task_id, slow.task_id}
    assert pool.leased == 1 and pool.pending == 3


def test_refused_task_goes_to_another_worker():
    pool = TaskPool(lease_timeout=5.0)
    pool.add(_task(0, preferred="bad"))
    pool.take("bad", now=0.0)
    assert pool.fail("0:0", "someone-else") is None  # only the lease holder's refusal requeues
    assert pool.fail("0:0", "bad") is not None
    assert pool.take("bad", now=1.0) is None
    assert pool.take("good", now=1.0).task_id == "0:0"


def test_task_pool_gives_a_worker_only_tasks_of_its_epoch():
    pool = TaskPool(lease_timeout=5.0)
    pool.add(_task(0, epoch=1))
    assert pool.take("a", now=0.0, epoch=0) is None
    assert pool.take("a", now=0.0, epoch=2) is None
    assert pool.take("a", now=0.0, epoch=1) is not None


def test_closing_an_epoch_drops_its_leftover_tasks():
    pool = TaskPool(lease_timeout=5.0)
    pool.add(_task(0, epoch=0))
    pool.add(_task(1, epoch=0))
    pool.add(_task(2, epoch=1))
    pool.take("a", now=0.0, epoch=0)
    pool.forget_epoch(0)
    assert (pool.pending, pool.leased) == (1, 0)
    assert pool.take("a", now=0.0, epoch=0) is None


def _reply(closed: int, *closures: Closure) -> TaskReply:
    return TaskReply(closed_epoch=closed, closures=closures)


W1, W2 = GroupMember(peer_id="w1", client_mode=False), GroupMember(peer_id="w2", client_mode=True)
CLOSURE = Closure(epoch=3, fs=("fs-a", "fs-b"), group=(W1, W2))


def test_a_worker_waits_for_every_fs_of_the_epoch_layout_even_one_the_dht_misses():
    # fs-b is in epoch 3's layout but was not polled (missing from the DHT for a moment): no step yet
    verdict = judge(3, {"fs-a": _reply(3, CLOSURE)})
    assert verdict.group is None and verdict.catch_up_to is None and verdict.epoch_fs == ("fs-a", "fs-b")
    assert judge(3, {"fs-a": _reply(3, CLOSURE), "fs-b": _reply(2)}).group is None
    assert judge(3, {"fs-a": _reply(3, CLOSURE), "fs-b": None}).group is None


def test_a_worker_steps_with_the_group_of_the_layouts_first_fs():
    other = Closure(epoch=3, fs=("fs-a", "fs-b"), group=(W1,))  # fs-b saw fewer workers
    verdict = judge(3, {"fs-b": _reply(3, other), "fs-a": _reply(4, CLOSURE)})
    assert verdict.group == (W1, W2)


def test_an_abandoned_epoch_is_dropped_on_one_fs_word_even_if_another_fs_of_its_layout_is_gone():
    abandoned = Closure(epoch=3, fs=("fs-a", "fs-b"), group=(), abandoned=True)
    assert judge(3, {"fs-b": _reply(3, abandoned), "fs-a": None}) == Verdict(epoch_fs=(), abandoned=True)
    assert judge(3, {"fs-a": _reply(2)}, epoch_fs=("fs-a",)) == Verdict(epoch_fs=("fs-a",))  # not yet: wait


def test_an_fs_lost_for_good_is_left_out_of_the_closure_rule():
    assert judge(3, {"fs-a": _reply(3, CLOSURE), "fs-b": None}, gone={"fs-b"}).group == (W1, W2)
    other = Closure(epoch=3, fs=("fs-a", "fs-b"), group=(W1,))  # the first FS is gone: the next one's group
    assert judge(3, {"fs-a": None, "fs-b": _reply(3, other)}, gone={"fs-a"}).group == (W1,)


def test_a_worker_waits_while_its_epoch_is_open_and_catches_up_when_it_is_long_gone():
    assert judge(3, {"fs-a": _reply(2)}, epoch_fs=("fs-a",)) == Verdict(epoch_fs=("fs-a",))
    assert judge(0, {"fs-a": _reply(9, Closure(epoch=9, fs=("fs-a",), group=(W1,))), "fs-b": None}).catch_up_to == 10
    assert judge(0, {"fs-a": None}).catch_up_to is None
    # every FS of the layout closed the epoch, but the first one so long ago that it forgot the group: too late
    assert judge(3, {"fs-a": _reply(9), "fs-b": _reply(9, CLOSURE)}).catch_up_to == 10
    # an FS that restarted stands past the epochs it resumed after and remembers no group of them; while another FS
    # still has the epoch open, that one gives its group when it closes it (the worker may be in it): no catching up
    assert judge(13, {"fs-a": _reply(12), "fs-b": _reply(13)}) == Verdict(epoch_fs=())


def test_the_task_pool_trains_each_global_batch_whole_and_an_abandoned_one_again():
    plan = SlotPlan(microbatches=3, swarm=False)
    assert plan.slots(0, 0) == [(0, 0), (0, 1), (0, 2)]
    assert plan.refeed(0, 1) == [(0, 0), (0, 1), (0, 2)] and plan.retrained[1] == 0
    assert plan.slots(2, 1) == [(1, 0), (1, 1), (1, 2)]


def test_the_swarm_policy_feeds_dropped_microbatches_again_first_and_fresh_data_goes_on_where_it_stopped():
    plan = SlotPlan(microbatches=3, swarm=True)
    assert plan.slots(0, 0) == [(0, 0), (0, 1), (0, 2)]
    assert plan.slots(1, 1) == [(1, 0), (1, 1), (1, 2)]
    assert plan.dropped(0, 2) and plan.dropped(1, 0)
    assert not plan.dropped(0, 2)  # two stages dropped rows of it: fed again once
    assert not plan.dropped(9, 0)  # never fed (or forgotten)
    assert plan.slots(2, 2) == [(0, 2), (1, 0), (2, 0)] and plan.retrained[2] == 2
    assert plan.slots(3, 3) == [(2, 1), (2, 2), (3, 0)] and plan.retrained[3] == 0
    assert plan.dropped(2, 0)  # a microbatch fed again can lose rows again
    assert plan.refeed(3, 4) == [(2, 1), (2, 2), (3, 0)]  # an abandoned epoch's data comes whole, the queue waits
    assert plan.slots(5, 4) == [(0, 2), (3, 1), (3, 2)]
    plan.forget_before(4)
    assert not plan.dropped(3, 1) and plan.dropped(5, 1)
