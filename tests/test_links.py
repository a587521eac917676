"""Emulated links (`p2ptrain.links`): the caps as tc sees them, and, where the machine allows a network namespace,
a real transfer between two loopback addresses that takes as long as its sender's cap says, counted on its
sender's address only."""
from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import pytest

from p2ptrain import links
from p2ptrain.links import Links, peer_address


def test_every_peer_address_gets_a_class_and_a_filter_of_its_own_and_the_readers_address_none():
    commands = [" ".join(c) for c in Links(uplink_mbit=20, delay_ms=5, addresses=3).tc_commands()]
    for host in (2, 3, 4):
        assert any(f"classid 1:{host + 1:x} htb rate 20000kbit ceil 20000kbit" in c for c in commands)
        assert any(f"src 127.0.0.{host}/32 flowid 1:{host + 1:x}" in c for c in commands)
        assert any(f"parent 1:{host + 1:x} netem delay 5ms" in c for c in commands)
    assert not any("127.0.0.1/" in c or "127.0.0.5/" in c for c in commands)
    assert peer_address(0) == "127.0.0.2" and peer_address(9) == "127.0.0.11"


@pytest.mark.parametrize("kwargs, match", [({"uplink_mbit": 0}, "uplink_mbit"), ({"uplink_mbit": 1, "delay_ms": -1},
                                           "delay_ms"), ({"uplink_mbit": 1, "addresses": 251}, "addresses")])
def test_links_refuse_what_tc_cannot_carry(kwargs, match):
    with pytest.raises(ValueError, match=match):
        Links(**kwargs)


def test_the_command_needs_something_to_run():
    done = subprocess.run([sys.executable, "-m", "p2ptrain.links", "--uplink-mbit", "5"], capture_output=True,
                          text=True, timeout=60)
    assert done.returncode == 2 and "give the command to run after --" in done.stderr


TRANSFER = textwrap.dedent("""
    import json, socket, threading, time
    from p2ptrain import links
    size = 1_000_000
    server = socket.create_server(("127.0.0.3", 0))
    got = []
    def receive():
        conn, _ = server.accept()
        n = 0
        while chunk := conn.recv(1 << 16):
            n += len(chunk)
        got.append(n)
    thread = threading.Thread(target=receive)
    thread.start()
    client = socket.create_connection(server.getsockname(), source_address=("127.0.0.2", 0))
    began = time.monotonic()
    client.sendall(b"x" * size)
    client.close()
    thread.join()
    print(json.dumps({"seconds": time.monotonic() - began, "received": got[0], "sent": links.bytes_sent(),
                      "links": links.inside().uplink_mbit}))
""")


@pytest.mark.timeout(120)
def test_a_transfer_takes_as_long_as_its_senders_cap_says_and_counts_on_its_senders_address():
    reason = links.unavailable()
    if reason:
        pytest.skip(reason)
    done = subprocess.run([sys.executable, "-m", "p2ptrain.links", "--uplink-mbit", "8", "--addresses", "4", "--",
                           sys.executable, "-c", TRANSFER], capture_output=True, text=True, timeout=100)
    assert done.returncode == 0, done.stderr
    result = json.loads(done.stdout)
    assert result["received"] == 1_000_000 and result["links"] == 8.0
    # 8 Mbit/s is 1 MB/s: the burst (one loopback packet) goes at once, the rest at the cap
    assert 0.8 < result["seconds"] < 1.6, result
    sent = result["sent"]
    assert 1_000_000 < sent["127.0.0.2"] < 1_100_000  # the payload and its headers
    assert sent["127.0.0.3"] < 50_000  # the receiver's acknowledgements only
    assert sent["127.0.0.4"] == sent["127.0.0.5"] == 0
