"""From the PeerInfo records in the DHT to the planner's Swarm: which peers are ready, and their links.

Device ids are peer ids. Servers are the reliable devices (only they can be FS or BS); clients join the plan as
workers when they announced links to every planned server. A link i -> j is what i measured to j; when only j
measured the pair, the link is taken as symmetric; a pair nobody measured (two clients) gets the worst link
measured anywhere, so the planner never counts on a link it has not seen.
"""
from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from p2ptrain.dht import Link, PeerInfo
from p2ptrain.planner.swarmfile import GIB, MBPS, MS, TFLOPS, Swarm, parse_swarm

# A server that only serves (no --compute) takes no rows; the cost model has no such role, so it sees a device
# too slow to be given any share worth counting, and places workers beside it.
NONCOMPUTING_FLOPS = 1.0


def _measured(peer: PeerInfo) -> bool:
    return peer.compute > 0 and peer.memory > 0


def planning_peers(peers: Sequence[PeerInfo], *, expect: int) -> list[PeerInfo] | None:
    """The servers and clients to plan with, or None until `expect` servers have measured links to each other.

    A server counts once it announced its compute and memory; the set is ready when each of its servers holds a
    link to every other one (servers measure newcomers within seconds, so this settles unless one is stuck).
    """
    servers = [p for p in peers if p.role == "server" and _measured(p)]
    ids = {p.peer_id for p in servers}
    if len(servers) < expect or any(not ids - {p.peer_id} <= set(p.links) for p in servers):
        return None
    clients = [p for p in peers if p.role == "client" and _measured(p) and ids <= set(p.links)]
    return servers + clients


def swarm_from_peers(peers: Sequence[PeerInfo], *, source: str = "<dht>") -> Swarm:
    """The planner's view of `peers` (as chosen by `planning_peers`); raises SwarmFileError like a swarm file."""
    ids = {p.peer_id for p in peers}
    links: dict[tuple[str, str], Link] = {}
    for peer in peers:
        for other, link in peer.links.items():
            if other in ids and other != peer.peer_id:
                links[(peer.peer_id, other)] = link
    for (a, b), link in list(links.items()):
        links.setdefault((b, a), link)
    data: dict[str, Any] = {
        "device": [{"id": p.peer_id, "reliable": p.role == "server",
                    "tflops": (p.compute if p.computes else NONCOMPUTING_FLOPS) / TFLOPS,
                    "memory_gb": p.memory / GIB} for p in peers],
        "link": [{"from": a, "to": b, "latency_ms": link.latency_s / MS, "bandwidth_mbps": link.bandwidth_bps / MBPS}
                 for (a, b), link in sorted(links.items())],
    }
    if links:
        data["defaults"] = {"latency_ms": max(link.latency_s for link in links.values()) / MS,
                            "bandwidth_mbps": min(link.bandwidth_bps for link in links.values()) / MBPS}
    return parse_swarm(data, source=source)
