"""Internet links emulated on one machine: a command runs in a network namespace of its own whose loopback gives
every address 127.0.0.2 ... 127.0.0.N an uplink of its own, capped with `tc`, so that each local peer listening on
its own address (`--host-maddrs /ip4/127.0.0.K/tcp/0`) sends at most the cap, as a volunteer behind a home uplink.

    python -m p2ptrain.links --uplink-mbit 20 [--delay-ms 10] -- python -m p2ptrain.launch --own-addresses

Packets between two local addresses leave through the loopback's egress qdisc once, and are classed by their
source address: an HTB class per address carries its cap (optionally followed by a netem delay), and 127.0.0.1,
where status readers sit, is not capped. Only loopback addresses are used; the namespace, made with `unshare
--net`, ends with the last process in it, so nothing outlives the command. This needs root, `unshare`, `ip` and
`tc` with the HTB scheduler (`unavailable` says which is missing).

Inside, `LINKS_ENV` holds the caps as JSON, so a launcher knows to give each peer its own address (`peer_address`),
and `bytes_sent` reads how many bytes each address has put on its uplink (the wire's figure, headers included).
"""
from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
from dataclasses import asdict, dataclass
from typing import NoReturn

LINKS_ENV = "P2PTRAIN_LINKS"  # set inside an emulated namespace: the `Links` as JSON
FIRST_HOST = 2  # 127.0.0.1 stays uncapped, for readers; peers take 127.0.0.2 and up
MAX_ADDRESSES = 250
CLASS_SENT = re.compile(r"^class htb 1:([0-9a-f]+) .*\n\s*Sent (\d+) bytes", re.MULTILINE)


@dataclass(frozen=True)
class Links:
    """Each of `addresses` loopback addresses from 127.0.0.2 sends at most `uplink_mbit` Mbit/s, each packet held
    `delay_ms` more on its way out."""

    uplink_mbit: float
    delay_ms: float = 0.0
    addresses: int = 64

    def __post_init__(self) -> None:
        if not self.uplink_mbit > 0:
            raise ValueError(f"uplink_mbit must be positive, not {self.uplink_mbit}")
        if self.delay_ms < 0:
            raise ValueError(f"delay_ms must be zero or more, not {self.delay_ms}")
        if not 1 <= self.addresses <= MAX_ADDRESSES:
            raise ValueError(f"addresses must be in [1, {MAX_ADDRESSES}], not {self.addresses}")

    def tc_commands(self) -> list[list[str]]:
        """The `tc` commands that cap the loopback's egress per source address (run inside the namespace)."""
        rate = f"{self.uplink_mbit * 1000:.0f}kbit"
        # a class must be able to pass one whole loopback packet (64 KiB with segmentation offload) at once
        burst = max(64 * 1024 + 1024, int(self.uplink_mbit * 1e6 / 8 / 100))  # and 10 ms of its rate
        commands = [["qdisc", "add", "dev", "lo", "root", "handle", "1:", "htb", "default", "1", "r2q", "100"],
                    ["class", "add", "dev", "lo", "parent", "1:", "classid", "1:1", "htb", "rate", "100gbit"]]
        for index in range(self.addresses):
            host = FIRST_HOST + index
            classid = f"1:{host + 1:x}"
            commands += [
                ["class", "add", "dev", "lo", "parent", "1:", "classid", classid, "htb", "rate", rate, "ceil", rate,
                 "burst", str(burst), "cburst", str(burst), "quantum", "65536"],
                ["filter", "add", "dev", "lo", "parent", "1:", "protocol", "ip", "prio", "1", "u32", "match", "ip",
                 "src", f"127.0.0.{host}/32", "flowid", classid]]
            if self.delay_ms > 0:
                commands.append(["qdisc", "add", "dev", "lo", "parent", classid, "netem", "delay",
                                 f"{self.delay_ms}ms", "limit", "100000"])
        return commands


def peer_address(index: int) -> str:
    """The loopback address of the `index`-th peer (from 0) of an emulated swarm."""
    if not 0 <= index < MAX_ADDRESSES:
        raise ValueError(f"no emulated address for peer {index}: at most {MAX_ADDRESSES} peers")
    return f"127.0.0.{FIRST_HOST + index}"


def inside() -> Links | None:
    """The links this process runs behind, if it runs inside an emulated namespace."""
    text = os.environ.get(LINKS_ENV)
    return Links(**json.loads(text)) if text else None


def unavailable() -> str | None:
    """Why links cannot be emulated on this machine, or None if they can (it tries a namespace with an HTB qdisc)."""
    if os.geteuid() != 0:
        return "emulated links need root (a network namespace and tc)"
    for tool in ("unshare", "ip", "tc"):
        if shutil.which(tool) is None:
            return f"emulated links need `{tool}` (util-linux / iproute2), not found"
    probe = subprocess.run(["unshare", "--net", "sh", "-c",
                            "ip link set lo up && tc qdisc add dev lo root handle 1: htb default 1"],
                           capture_output=True, text=True, timeout=30)
    if probe.returncode != 0:
        return f"this machine refuses a network namespace with an HTB qdisc: {probe.stderr.strip()}"
    return None


def configure(links: Links) -> None:
    """Bring the namespace's loopback up and cap it (run inside a new namespace)."""
    subprocess.run(["ip", "link", "set", "lo", "up"], check=True)
    for command in links.tc_commands():
        subprocess.run(["tc", *command], check=True, capture_output=True)


def bytes_sent() -> dict[str, int]:
    """Bytes each capped address has sent since the namespace began, by address (run inside it)."""
    # tc's JSON output leaves HTB classes' statistics out; its text says "class htb 1:X ...\n Sent N bytes ..."
    out = subprocess.run(["tc", "-s", "class", "show", "dev", "lo"], check=True, capture_output=True,
                         text=True).stdout
    sent = {}
    for handle, nbytes in CLASS_SENT.findall(out):
        host = int(handle, 16) - 1
        if host >= FIRST_HOST:
            sent[f"127.0.0.{host}"] = int(nbytes)
    return sent


class Unavailable(RuntimeError):
    """Links cannot be emulated on this machine; the text says why (`unavailable`)."""


def exec_behind(links: Links, argv: list[str]) -> NoReturn:
    """Replace this process with `argv` run behind `links` in a namespace of its own; Unavailable if the machine
    cannot."""
    reason = unavailable()
    if reason:
        raise Unavailable(reason)
    os.execvp("unshare", command(links, argv))


def command(links: Links, argv: list[str]) -> list[str]:
    """The command line that runs `argv` behind `links`, in a namespace of its own."""
    return ["unshare", "--net", sys.executable, "-m", "p2ptrain.links", "--uplink-mbit", str(links.uplink_mbit),
            "--delay-ms", str(links.delay_ms), "--addresses", str(links.addresses), "--inside", "--", *argv]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m p2ptrain.links", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--uplink-mbit", type=float, required=True, help="every peer address's uplink cap")
    parser.add_argument("--delay-ms", type=float, default=0.0, help="added to every packet on its way out")
    parser.add_argument("--addresses", type=int, default=64,
                        help=f"how many peer addresses from 127.0.0.{FIRST_HOST} are capped")
    parser.add_argument("--inside", action="store_true", help=argparse.SUPPRESS)  # already in the new namespace
    parser.add_argument("argv", nargs=argparse.REMAINDER, help="-- the command to run behind the links")
    args = parser.parse_args(argv)
    cmd = args.argv[1:] if args.argv[:1] == ["--"] else args.argv
    if not cmd:
        parser.error("give the command to run after --")
    try:
        links = Links(uplink_mbit=args.uplink_mbit, delay_ms=args.delay_ms, addresses=args.addresses)
    except ValueError as e:
        parser.error(str(e))
    if not args.inside:
        try:
            exec_behind(links, cmd)
        except Unavailable as e:
            print(f"python -m p2ptrain.links: {e}", file=sys.stderr)
            sys.exit(3)
    configure(links)
    os.environ[LINKS_ENV] = json.dumps(asdict(links))
    os.execvp(cmd[0], cmd)


if __name__ == "__main__":
    main()
