"""Deadlines that follow the link (`protocol.deadlines`): a floor plus the bytes' time at the measured rate."""
from __future__ import annotations

import pytest

from p2ptrain.protocol.deadlines import MIN_TIMED_BYTES, Throughput, all_reduce_bytes, transfer_deadline_s


def test_a_deadline_is_its_floor_plus_slack_times_the_bytes_time_on_the_link():
    assert transfer_deadline_s(0, rate=1e6, floor_s=30.0, slack=3.0) == 30.0
    assert transfer_deadline_s(5e6, rate=1e6, floor_s=30.0, slack=3.0) == pytest.approx(45.0)
    with pytest.raises(ValueError, match="rate must be positive"):
        transfer_deadline_s(1, rate=0.0, floor_s=1.0, slack=1.0)


def test_a_link_is_assumed_slow_until_a_transfer_big_enough_to_time_measured_it():
    link = Throughput(assumed=125_000.0)  # 1 Mbit/s
    assert link.rate == 125_000.0 and link.deadline_s(1_250_000, floor_s=10.0, slack=2.0) == pytest.approx(30.0)
    link.observe(MIN_TIMED_BYTES - 1, 1e-6)  # a small call times the round trip, not the rate: ignored
    link.observe(10**6, 0.0)
    assert link.measured is None
    link.observe(4_000_000, 2.0)
    assert link.rate == 2_000_000.0
    link.observe(1_000_000, 1.0)  # the link slowed: half the newest counts
    assert link.rate == 1_500_000.0


def test_throughput_refuses_what_cannot_be_a_rate():
    with pytest.raises(ValueError, match="assumed must be positive"):
        Throughput(assumed=0.0)
    with pytest.raises(ValueError, match="weight"):
        Throughput(assumed=1.0, weight=0.0)


def test_an_all_reduce_member_sends_its_parts_and_the_average_of_its_share():
    assert all_reduce_bytes(1000, members=1, itemsize=8) == 0
    assert all_reduce_bytes(1000, members=2, itemsize=8) == 8000  # half out, half's average back
    assert all_reduce_bytes(1000, members=4, itemsize=8) == 12000  # 2 * 3/4 of 8000
    # two of three reduce: a reducer sends the other reducer half its values and its half's average to both others
    assert all_reduce_bytes(1000, members=3, itemsize=8, reducers=2) == 12000
    assert all_reduce_bytes(1000, members=3, itemsize=8, reducers=1) == 16000  # the whole average to both others
