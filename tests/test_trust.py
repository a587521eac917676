"""Who may do what (docs/design.md §9), with real processes: a run whose owner authorized its four servers
(`python -m p2ptrain.owner authorize`) trains on while an outsider with its own DHT node announces itself as a
stage-0 FS with a peer id smaller than the data source's (so that it would lead an open swarm) and sends forged
epoch commits and abandons, forged rows for coming epochs and reports of tasks it does not hold. Every forged message
is refused, no process exits, the status names the outsider as unauthorized, and every closed epoch is fully
averaged. Also: certificates are checked when a server starts."""
from __future__ import annotations

import asyncio
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from hivemind.dht.crypto import RSASignatureValidator
from hivemind.p2p import P2P

from p2ptrain.dht import start_dht
from p2ptrain.live.authority import CertificateError, Owner, ServerCertificate, peer_id_of
from p2ptrain.live.identity import load_or_create_key, public_key_path
from p2ptrain.protocol.layout import Layout, StageServers
from p2ptrain.protocol.messages import BACKWARD_SERVER, FRONTAL_SERVER, EndEpoch, PushRows, ReportTask
from p2ptrain.protocol.rows import Rows
from p2ptrain.server.base import TASK_ID_PEER
from p2ptrain.transport import Caller, Refused

ROWS, MICROBATCHES, SEQ, EPOCHS = 4, 2, 32, 4
RECIPE = ["--num-stages", "2", "--batch-rows", str(ROWS), "--microbatches", str(MICROBATCHES), "--seq-len", str(SEQ)]
SERVERS = {"fs0": (0, "fs"), "bs0": (0, "bs"), "fs1": (1, "fs"), "bs1": (1, "bs")}


def authorize(workdir: Path, run_id: str, name: str, stage: int, role: str, *extra: str) -> Path:
    identity = workdir / f"{name}.id"
    out = subprocess.run([sys.executable, "-m", "p2ptrain.owner", "authorize", "--owner-identity",
                          str(workdir / "owner.key"), "--run-id", run_id, "--identity-path", str(identity),
                          "--stage", str(stage), "--server-role", role, *extra], capture_output=True, text=True,
                         timeout=60)
    assert out.returncode == 0, out.stderr
    return identity


def test_certificates_bind_a_peer_to_its_place_and_the_owners_key(tmp_path):
    key = load_or_create_key(tmp_path / "owner.key")
    identity = tmp_path / "fs0.id"
    P2P.generate_identity(str(identity))
    peer = peer_id_of(identity)
    certificate = ServerCertificate.issue(key, run_id="r", peer_id=peer, stage=0, role="fs", data_source=True)
    certificate.save(tmp_path / "fs0.id.cert")
    loaded = ServerCertificate.load(tmp_path / "fs0.id.cert")
    owner = Owner(public_key=RSASignatureValidator(key).local_public_key)
    owner.check(loaded, run_id="r", peer_id=peer, stage=0, role="fs")
    for place in ({"run_id": "other"}, {"peer_id": "someone"}, {"stage": 1}, {"role": "bs"}):
        kwargs = {"run_id": "r", "peer_id": peer, "stage": 0, "role": "fs"} | place
        with pytest.raises(CertificateError, match="not for"):
            owner.check(loaded, **kwargs)
    forged = ServerCertificate(**{**loaded.__dict__, "data_source": False})  # the flag is under the signature
    with pytest.raises(CertificateError, match="not signed"):
        owner.check(forged, run_id="r", peer_id=peer, stage=0, role="fs")
    stranger = Owner(public_key=RSASignatureValidator(load_or_create_key(tmp_path / "other.key")).local_public_key)
    with pytest.raises(CertificateError, match="not signed"):
        stranger.check(loaded, run_id="r", peer_id=peer, stage=0, role="fs")
    (tmp_path / "bad.cert").write_text("{not json")
    with pytest.raises(CertificateError, match="holds no server certificate"):
        ServerCertificate.load(tmp_path / "bad.cert")


def test_a_server_with_a_certificate_for_another_place_or_none_is_refused_at_start(tmp_path):
    identity = authorize(tmp_path, "owned", "fs0", 0, "fs")
    owner_key = public_key_path(tmp_path / "owner.key")
    base = [sys.executable, "-m", "p2ptrain.peer", "--role", "server", "--run-id", "owned", "--owner-key",
            str(owner_key), *RECIPE]
    for args, problem in (  # (the place and run a certificate binds: test_certificates_bind_...)
            (["--stage", "1", "--server-role", "fs", "--identity-path", str(identity)], "not for peer"),
            (["--stage", "0", "--server-role", "fs"], "needs --identity-path")):
        out = subprocess.run([*base, *args], capture_output=True, text=True, timeout=60)
        assert out.returncode == 2 and problem in out.stderr, (args, out.stderr)


async def attack(caller: Caller, *, me: str, layout: Layout, source: str, targets: dict[str, str]) -> list[str]:
    """What an outsider tries; every answer (all must be refusals)."""
    forged = Layout((StageServers(fs=(me, *layout.stages[0].fs), bs=layout.stages[0].bs), *layout.stages[1:]))
    tokens = [[0] * SEQ] * ROWS
    rows = PushRows(epoch=EPOCHS + 2, microbatch=0, rows=Rows(0, ROWS), total_rows=ROWS, layout=forged,
                    inputs=torch.tensor(tokens), labels=torch.tensor(tokens))
    honest_rows = PushRows(epoch=EPOCHS + 3, microbatch=0, rows=Rows(0, ROWS), total_rows=ROWS, layout=layout,
                           inputs=torch.tensor(tokens), labels=torch.tensor(tokens))
    messages = [
        (targets["fs0"], FRONTAL_SERVER, rows),
        (targets["fs0"], FRONTAL_SERVER, honest_rows),
        *[(targets[name], FRONTAL_SERVER if name.startswith("fs") else BACKWARD_SERVER, request)
          for name in SERVERS for request in (
              EndEpoch(epoch=epoch, abandoned=abandoned, layout=lay, batch=epoch)
              for epoch in (1, EPOCHS + 1) for abandoned in (False, True) for lay in (forged, layout))],
        *[(targets[name], FRONTAL_SERVER if name.startswith("fs") else BACKWARD_SERVER,  # tasks as servers name them
           ReportTask(task=f"0:{mb}:{SERVERS[name][0]}:{'F' if name.startswith('fs') else 'B'}{i}."
                           f"{targets[name][-TASK_ID_PEER:]}", worker=source, epoch=0, ok=ok))
          for name in SERVERS for mb in range(MICROBATCHES) for i in (1, 2) for ok in (True, False)],
    ]
    answers = []
    for peer, service, request in messages:
        try:  # retried on transport failures only: a peer just up may not be routable from here yet
            await caller.call_retrying(peer, service, request, attempts=5, backoff_s=1.0, backoff_max_s=4.0,
                                       what="an outsider's request")
            answers.append(f"ACCEPTED {type(request).__name__} at {peer}: {request}")
        except Refused as e:
            answers.append(f"refused: {e}")
        await asyncio.sleep(0.05)  # spread over the first epochs
    return answers


@pytest.mark.timeout(600)
def test_an_outsider_cannot_feed_end_or_report_and_the_owned_swarm_trains_on(make_swarm):
    swarm = make_swarm("owned", [*RECIPE, "--epochs", str(EPOCHS)])
    workdir = swarm.workdir
    identities = {name: authorize(workdir, "owned", name, stage, role, *(["--data-source"] if name == "fs0" else []))
                  for name, (stage, role) in SERVERS.items()}
    owner_key = str(public_key_path(workdir / "owner.key"))
    swarm.owner_key = Path(owner_key)  # the status this test reads trusts the owner's servers only, as users' should
    peers = {name: peer_id_of(identity) for name, identity in identities.items()}
    outsider = workdir / "outsider.id"
    while True:  # an outsider that, in an open swarm, would be the data source: the smallest stage-0 FS
        P2P.generate_identity(str(outsider))
        if peer_id_of(outsider) < peers["fs0"]:
            break
        outsider.unlink()
    for name, (stage, role) in SERVERS.items():
        if name != "fs0":
            swarm.peer(name, "--role", "server", "--stage", str(stage), "--server-role", role, "--identity-path",
                       str(identities[name]), "--owner-key", owner_key)
    for stage in ("0", "1"):
        swarm.peer(f"client{stage}", "--role", "client", "--stage", stage, "--owner-key", owner_key)
    # the impostor runs the open code: no owner key, no certificate
    swarm.peer("impostor", "--role", "server", "--stage", "0", "--server-role", "fs", "--identity-path", str(outsider))
    deadline = time.monotonic() + 180
    while sum(len(s["workers"]) for s in swarm.status()["stages"]) < 2:
        assert time.monotonic() < deadline, "the clients did not come up\n" + swarm.logs()
        time.sleep(1.0)
    swarm.peer("fs0", "--role", "server", "--stage", "0", "--server-role", "fs", "--identity-path",
               str(identities["fs0"]), "--owner-key", owner_key)
    while peers["fs0"] not in swarm.status()["stages"][0]["fs"]:
        assert time.monotonic() < deadline, "the data source did not come up\n" + swarm.logs()
        time.sleep(1.0)
    layout = Layout((StageServers(fs=(peers["fs0"],), bs=(peers["bs0"],)),
                     StageServers(fs=(peers["fs1"],), bs=(peers["bs1"],))))

    dht = start_dht("owned", initial_peers=swarm.initial_peers, client_mode=True)
    try:
        me = dht.peer_id.to_base58()

        async def over_the_network() -> list[str]:
            p2p = await dht.replicate_p2p()
            try:
                caller = Caller(p2p=p2p, peer_id=me, codec="none", timeout=30.0)
                return await attack(caller, me=me, layout=layout, source=peers["fs0"], targets=peers)
            finally:
                await p2p.shutdown()

        answers = asyncio.run(over_the_network())
    finally:
        dht.shutdown()
    assert not [a for a in answers if a.startswith("ACCEPTED")], "\n".join(answers)

    report = swarm.wait_finished(timeout=300)
    assert swarm.failed() == [] and all(process.poll() is None for process in swarm.processes.values())
    assert [e["epoch"] for e in report["epochs"] if not e["abandoned"]] == list(range(EPOCHS)), report["epochs"]
    for epoch in report["epochs"]:
        if not epoch["abandoned"]:
            for stage in epoch["stages"]:
                assert stage["rows_in_batch"] == ROWS * MICROBATCHES == stage["rows_averaged"], epoch
    impostor = peer_id_of(outsider)
    stages = swarm.status_cli()["stages"]
    assert stages[0]["fs"] == [peers["fs0"]] and stages[0]["unauthorized"] == [impostor], stages
    fs0_log = (workdir / "fs0.log").read_text()
    assert f"ignoring {impostor}" in fs0_log
