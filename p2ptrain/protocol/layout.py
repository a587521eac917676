"""Where servers sit: which servers are the FS and BS of each stage for one epoch's microbatches, and a peer's
own place in the pipeline.

The stage-0 data source fixes a layout at each epoch start from the stage memberships in the DHT, and every
microbatch carries it, so all peers segment and route the rows of that microbatch the same way even while
servers join or leave.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from p2ptrain.protocol.rows import Rows, route, segments

PeerRole = Literal["bootstrap", "server", "client"]
ServerRole = Literal["fs", "bs"]


@dataclass(frozen=True)
class StageServers:
    fs: tuple[str, ...]
    bs: tuple[str, ...]

    def of(self, role: ServerRole) -> tuple[str, ...]:
        return self.fs if role == "fs" else self.bs


@dataclass(frozen=True)
class Layout:
    stages: tuple[StageServers, ...]

    def segment(self, stage: int, role: ServerRole, peer_id: str, total_rows: int) -> Rows:
        """The rows of a microbatch that `peer_id` holds as an FS or BS of `stage`; ValueError if it is neither."""
        servers = self.stages[stage].of(role)
        if peer_id not in servers:
            raise ValueError(f"{peer_id} is not a{'n FS' if role == 'fs' else ' BS'} of stage {stage} in this layout")
        return segments(total_rows, len(servers))[servers.index(peer_id)]

    def servers(self, *roles: ServerRole) -> list[tuple[str, ServerRole]]:
        """Every (peer, role) of the layout's stages, FS first, of the given roles (default both)."""
        roles = roles or ("fs", "bs")
        return [(peer, role) for role in roles for stage in self.stages for peer in stage.of(role)]

    def route(self, stage: int, role: ServerRole, rows: Rows, total_rows: int) -> list[tuple[str, Rows]]:
        """Which FS (or BS) of `stage` holds which part of `rows`."""
        servers = self.stages[stage].of(role)
        return [(servers[index], part) for index, part in route(rows, len(servers), total_rows)]


@dataclass(frozen=True, kw_only=True)
class Placement:
    """A peer's place: what `--stage K --server-role R --layers A:B --num-stages N` say on the command line,
    or what the planner's plan says."""

    stage: int
    server_role: ServerRole | None  # None for a client
    layers: tuple[int, int]
    num_stages: int
