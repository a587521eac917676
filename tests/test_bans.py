"""The ban list for repeat offenders (pure: the tests pass the time)."""
import pytest

from p2ptrain.protocol.bans import BanList


def test_a_peer_is_banned_at_its_offences_th_offence_within_the_window_and_not_before():
    bans = BanList(offences=3, window_s=10.0, ban_s=5.0)
    assert bans.offend("a", now=0.0) == 0.0
    assert bans.offend("a", now=1.0) == 0.0
    assert bans.banned_for("a", now=1.0) == 0.0
    assert bans.offend("a", now=2.0) == 5.0
    assert bans.banned_for("a", now=3.0) == pytest.approx(4.0)
    assert bans.banned(now=3.0) == ("a",)
    assert bans.banned_for("b", now=3.0) == 0.0
    assert bans.banned_for("a", now=7.0) == 0.0
    assert bans.banned(now=7.0) == ()


def test_offences_spread_wider_than_the_window_never_ban():
    bans = BanList(offences=3, window_s=10.0, ban_s=5.0)
    assert all(bans.offend("a", now=6.0 * i) == 0.0 for i in range(20))


def test_each_ban_doubles_up_to_the_longest():
    bans = BanList(offences=1, window_s=1.0, ban_s=5.0, max_ban_s=30.0)
    lengths = [bans.offend("a", now=100.0 * i) for i in range(6)]
    assert lengths == [5.0, 10.0, 20.0, 30.0, 30.0, 30.0]


def test_forget_drops_stale_offences_and_ended_bans_but_not_the_count_of_bans():
    bans = BanList(offences=2, window_s=10.0, ban_s=5.0)
    bans.offend("a", now=0.0)
    bans.offend("a", now=1.0)
    bans.offend("b", now=1.0)
    bans.forget(now=20.0)
    assert bans.banned(now=20.0) == () and not bans._offences and not bans._until
    bans.offend("a", now=30.0)
    assert bans.offend("a", now=31.0) == 10.0


def test_a_ban_list_that_could_never_ban_is_refused():
    with pytest.raises(ValueError, match="offences"):
        BanList(offences=0)
    with pytest.raises(ValueError):
        BanList(ban_s=10.0, max_ban_s=5.0)
