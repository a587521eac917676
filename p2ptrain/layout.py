"""Which servers are the FS and BS of each stage for one epoch's microbatches.

The stage-0 data source fixes a layout at each epoch start from the stage memberships in the DHT, and every
microbatch carries it, so all peers segment and route the rows of that microbatch the same way even while
servers join or leave.
"""
from __future__ import annotations

from dataclasses import dataclass

from p2ptrain.protocol.rows import Rows, route, segments


@dataclass(frozen=True)
class StageServers:
    fs: tuple[str, ...]
    bs: tuple[str, ...]


@dataclass(frozen=True)
class Layout:
    stages: tuple[StageServers, ...]

    def to_header(self) -> list[list[list[str]]]:
        return [[list(s.fs), list(s.bs)] for s in self.stages]

    @classmethod
    def from_header(cls, value: list) -> Layout:
        return cls(tuple(StageServers(fs=tuple(fs), bs=tuple(bs)) for fs, bs in value))

    def fs_segment(self, stage: int, peer_id: str, total_rows: int) -> Rows:
        servers = self.stages[stage].fs
        return segments(total_rows, len(servers))[servers.index(peer_id)]

    def bs_segment(self, stage: int, peer_id: str, total_rows: int) -> Rows:
        servers = self.stages[stage].bs
        return segments(total_rows, len(servers))[servers.index(peer_id)]

    def route_to_fs(self, stage: int, rows: Rows, total_rows: int) -> list[tuple[str, Rows]]:
        servers = self.stages[stage].fs
        return [(servers[index], part) for index, part in route(rows, len(servers), total_rows)]

    def route_to_bs(self, stage: int, rows: Rows, total_rows: int) -> list[tuple[str, Rows]]:
        servers = self.stages[stage].bs
        return [(servers[index], part) for index, part in route(rows, len(servers), total_rows)]
