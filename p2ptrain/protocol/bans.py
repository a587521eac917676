"""Bans for peers whose requests keep being refused as malformed or forged.

Anyone can dial a server in an open swarm, so what one peer's abuse costs must be bounded: a peer that commits
`offences` offences within `window_s` seconds is banned for `ban_s` seconds, doubling with each ban after that up to
`max_ban_s`. A banned peer's requests are refused before they are read. Only requests that no honest peer sends
count (a message that does not decode, an authority the sender does not have); a request refused as late or
duplicate is an honest peer's race and never counts.

Pure: the caller passes the time (`now`, monotonic seconds).
"""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field


@dataclass(kw_only=True)
class BanList:
    offences: int = 32
    window_s: float = 60.0
    ban_s: float = 30.0
    max_ban_s: float = 3600.0
    _offences: dict[str, deque[float]] = field(default_factory=dict, repr=False)
    _until: dict[str, float] = field(default_factory=dict, repr=False)
    _bans: dict[str, int] = field(default_factory=dict, repr=False)

    def __post_init__(self) -> None:
        if self.offences < 1 or self.window_s <= 0 or self.ban_s <= 0 or self.max_ban_s < self.ban_s:
            raise ValueError(f"a ban list needs offences >= 1, window_s > 0 and 0 < ban_s <= max_ban_s: {self}")

    def banned_for(self, peer: str, *, now: float) -> float:
        """Seconds left of `peer`'s ban; 0 if it is not banned."""
        return max(0.0, self._until.get(peer, 0.0) - now)

    def offend(self, peer: str, *, now: float) -> float:
        """Count one offence of `peer`; the length of the ban it earns with it, 0 if none."""
        times = self._offences.setdefault(peer, deque())
        times.append(now)
        while times and times[0] <= now - self.window_s:
            times.popleft()
        if len(times) < self.offences:
            return 0.0
        times.clear()
        ban = min(self.ban_s * 2 ** self._bans.get(peer, 0), self.max_ban_s)
        self._bans[peer] = self._bans.get(peer, 0) + 1
        self._until[peer] = now + ban
        return ban

    def forget(self, *, now: float) -> None:
        """Drop what no longer matters (offences out of the window, bans over), so the list stays as small as the
        set of recent offenders; a peer banned before keeps its count of bans, so its next ban is longer."""
        for peer in [peer for peer, times in self._offences.items() if not times or times[-1] <= now - self.window_s]:
            del self._offences[peer]
        for peer in [peer for peer, until in self._until.items() if until <= now]:
            del self._until[peer]

    def banned(self, *, now: float) -> tuple[str, ...]:
        """The peers banned at `now`."""
        return tuple(peer for peer, until in self._until.items() if until > now)
