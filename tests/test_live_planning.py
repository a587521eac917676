"""Live planning (issue 3, Must show 4): servers and clients started without --stage announce what they measured,
the planner plans from the DHT and publishes the plan signed, the peers take their places and the swarm trains;
a plan signed by any other key is ignored with a warning. Plus fast checks of the pieces, without a network."""
from __future__ import annotations

import subprocess
import sys
import time

import hivemind
import pytest
from hivemind.dht.crypto import RSASignatureValidator
from hivemind.utils import get_dht_time
from hivemind.utils.crypto import RSAPrivateKey

from p2ptrain.dht import Link, PeerInfo, PlanRecord, get_peers, get_plan, plan_key, start_dht
from p2ptrain.live.identity import load_or_create_identity, public_key_path, read_planner_key
from p2ptrain.live.planning import place_client, place_server, plan_stages
from p2ptrain.live.swarm import NONCOMPUTING_FLOPS, planning_peers, swarm_from_peers
from p2ptrain.planner import make_plan
from p2ptrain.planner.presets import model_spec
from tests.test_cli import run_main

GIB = 2**30


def peer(name: str, role: str, *, links: dict[str, tuple[float, float]], compute: float = 2e9,
         computes: bool = True) -> PeerInfo:
    return PeerInfo(peer_id=name, role=role, reliable=role == "server", computes=computes, compute=compute,
                    memory=4 * GIB, state="joining", started=0.0,
                    links={other: Link(latency_s=lat, bandwidth_bps=bw) for other, (lat, bw) in links.items()})


SERVERS = ["s0", "s1", "s2", "s3"]


def servers_linked(*, skip: tuple[str, str] | None = None, computes: bool = True) -> list[PeerInfo]:
    """Four servers that measured each other: 1 ms and 100 MB/s, except s0 -> s1 (5 ms, 10 MB/s)."""
    out = []
    for s in SERVERS:
        links = {o: ((5e-3, 1e7) if (s, o) == ("s0", "s1") else (1e-3, 1e8)) for o in SERVERS
                 if o != s and (s, o) != skip}
        out.append(peer(s, "server", links=links, computes=computes))
    return out


def test_swarm_from_peers_uses_measured_links_mirrors_one_sided_ones_and_assumes_the_worst_otherwise():
    clients = [peer("c0", "client", links={s: (2e-3, 5e7) for s in SERVERS}, compute=4e9),
               peer("c1", "client", links={s: (3e-3, 2e7) for s in SERVERS})]
    swarm = swarm_from_peers(servers_linked() + clients)
    assert swarm.ids == [*SERVERS, "c0", "c1"]
    assert swarm.reliable.tolist() == [True] * 4 + [False] * 2
    assert swarm.devices[4].flops == pytest.approx(4e9) and swarm.devices[0].memory_bytes == pytest.approx(4 * GIB)
    assert swarm.latency("s0", "s1") == pytest.approx(5e-3) and swarm.bandwidth("s0", "s1") == pytest.approx(1e7)
    assert swarm.latency("s1", "s0") == pytest.approx(1e-3)  # each direction as its sender measured it
    assert swarm.latency("s2", "c0") == pytest.approx(2e-3)  # only the client measured: taken as symmetric
    assert swarm.bandwidth("s2", "c1") == pytest.approx(2e7)
    # nobody measured client to client: the worst latency and bandwidth seen anywhere
    assert swarm.latency("c0", "c1") == pytest.approx(5e-3) and swarm.bandwidth("c0", "c1") == pytest.approx(1e7)


def test_a_server_that_does_not_compute_gets_no_share_worth_counting():
    swarm = swarm_from_peers(servers_linked(computes=False))
    assert [d.flops for d in swarm.devices] == [NONCOMPUTING_FLOPS] * 4


def test_planning_waits_for_enough_servers_linked_to_each_other():
    assert planning_peers(servers_linked(), expect=5) is None
    assert planning_peers(servers_linked(skip=("s2", "s3")), expect=4) is None  # s2 has not measured s3 yet
    unmeasured = PeerInfo(peer_id="s9", role="server", reliable=True, compute=0.0, started=0.0)  # started with --stage
    late = peer("c1", "client", links={"s0": (1e-3, 1e8)})  # has not measured every server yet
    ready = planning_peers([*servers_linked(), unmeasured, peer("c0", "client", links={s: (1e-3, 1e8) for s in
                                                                                      SERVERS}), late], expect=4)
    assert ready is not None and [p.peer_id for p in ready] == [*SERVERS, "c0"]


def test_a_live_plan_is_a_valid_dht_record_and_places_every_peer():
    peers = servers_linked() + [peer("c0", "client", links={s: (1e-3, 1e8) for s in SERVERS})]
    plan = make_plan(swarm_from_peers(peers), model_spec("llama-tiny"), batch_tokens=256, microbatches=2,
                     stages=2).to_json()
    record = PlanRecord.from_value(PlanRecord(plan=plan, version=1, created=0.0).to_value())
    stages = plan_stages(record.plan, num_layers=4)
    placed = {s: place_server(stages, s) for s in SERVERS}
    assert sorted((p.stage, p.server_role) for p in placed.values()) == [(0, "bs"), (0, "fs"), (1, "bs"), (1, "fs")]
    assert all(p.num_stages == 2 and p.layers == tuple(stages[p.stage]["layers"]) for p in placed.values())
    assert place_server(stages, "c0") is None
    with pytest.raises(ValueError, match="covers 4 layers but this peer's model has 8"):
        plan_stages(record.plan, num_layers=8)


def test_a_client_takes_its_planned_stage_else_the_least_crowded():
    stages = [{"layers": [0, 2], "fs": ["a"], "bs": ["b"], "clients": []},
              {"layers": [2, 4], "fs": ["c"], "bs": ["d"], "clients": ["named"]}]
    assert place_client(stages, "named", {0: {"x", "y"}}).stage == 1
    assert place_client(stages, "other", {}).stage == 0  # 2 workers against 3
    assert place_client(stages, "other", {0: {"x", "y"}}).stage == 1
    # a tie spreads clients by peer id instead of sending them all to stage 0
    tied = [{**s, "clients": []} for s in stages]
    assert {place_client(tied, f"client-{i}", {}).stage for i in range(16)} == {0, 1}


def test_the_planner_identity_round_trips_and_peers_refuse_a_file_without_a_key(tmp_path):
    signer = load_or_create_identity(tmp_path / "planner.key")
    assert load_or_create_identity(tmp_path / "planner.key").local_public_key == signer.local_public_key
    assert read_planner_key(public_key_path(tmp_path / "planner.key")) == signer.local_public_key
    (tmp_path / "junk.pub").write_text("not a key")
    with pytest.raises(ValueError, match="does not hold a planner public key"):
        read_planner_key(tmp_path / "junk.pub")


@pytest.mark.parametrize("args, expected", [
    (["p2ptrain.plan"], "give a swarm file (offline planning) or --initial-peers"),
    (["p2ptrain.plan", "peers/local.toml", "--initial-peers", "/ip4/127.0.0.1/tcp/1"], "not both"),
    (["p2ptrain.plan", "peers/local.toml", "--publish"], "--publish is for live planning"),
    (["p2ptrain.plan", "--initial-peers", "/ip4/127.0.0.1/tcp/1", "--publish"], "needs --planner-identity"),
    (["p2ptrain.plan", "--initial-peers", "/ip4/127.0.0.1/tcp/1", "--batch-tokens", "64"], "--batch-tokens is for"),
    (["p2ptrain.plan", "--initial-peers", "/ip4/127.0.0.1/tcp/1", "--model-config", "/nonexistent"], "--model-config"),
    (["p2ptrain.peer", "--role", "server", "--planner-key", "/nonexistent.pub"], "--planner-key"),
    (["p2ptrain.peer", "--role", "server", "--plan"], "--plan needs --planner-identity"),
    (["p2ptrain.peer", "--role", "client", "--plan", "--planner-identity", "k"], "--plan is for a server"),
    (["p2ptrain.peer", "--role", "server", "--stage", "0", "--server-role", "fs", "--expect", "4"], "go with --plan"),
    (["p2ptrain.peer", "--role", "server", "--stage", "0", "--server-role", "fs", "--planner-key", __file__],
     "without --stage"),
])
def test_bad_live_planning_flags_exit_2(capsys, args, expected):
    code, err = run_main(capsys, *args)
    assert code == 2 and expected in err, err


def test_a_peer_without_stage_refuses_a_role_the_plan_should_set(capsys, tmp_path):
    load_or_create_identity(tmp_path / "planner.key")
    code, err = run_main(capsys, "p2ptrain.peer", "--role", "server", "--server-role", "fs", "--planner-key",
                         str(tmp_path / "planner.key.pub"))
    assert code == 2 and "the plan sets the stage" in err, err


ROWS, MICROBATCHES, EPOCHS, SEQ = 4, 2, 2, 32
# --num-stages 1 on every peer: the plan's two stages must override it
RECIPE = ["--num-stages", "1", "--batch-rows", str(ROWS), "--microbatches", str(MICROBATCHES), "--seq-len", str(SEQ),
          "--epochs", str(EPOCHS)]


def wait_for_servers(dht: hivemind.DHT, run_id: str, count: int, timeout: float) -> list[str]:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        servers = [p.peer_id for p in get_peers(dht, run_id) if p.role == "server" and p.state == "joining"]
        if len(servers) >= count:
            return servers
        time.sleep(1.0)
    raise AssertionError(f"{count} servers did not announce themselves within {timeout} s")


def planned_swarm(make_swarm, run_id: str) -> tuple:
    """A swarm and a planner key pair: (swarm, private key path, public key, path of the .pub file)."""
    swarm = make_swarm(run_id, RECIPE)
    planner_key = swarm.workdir / "planner.key"
    public_key = load_or_create_identity(planner_key).local_public_key
    return swarm, planner_key, public_key, str(public_key_path(planner_key))


def check_trained_as_planned(report: dict, planned: list[dict], servers: list[str]) -> None:
    """The status shows the plan's two stages with their FS and BS, every server in one role, and every epoch
    trained with all its rows averaged."""
    assert len(planned) == 2 and len(report["stages"]) == 2, report["stages"]
    for stage, plan in zip(report["stages"], planned):
        assert stage["fs"] == sorted(plan["fs"]) and stage["bs"] == sorted(plan["bs"]), (stage, plan)
        assert stage["fs"] and stage["bs"]
    roles = [p for s in report["stages"] for p in s["fs"] + s["bs"]]
    assert sorted(roles) == sorted(servers), "every server takes exactly one role"
    assert [e["epoch"] for e in report["epochs"]] == list(range(EPOCHS))
    for epoch in report["epochs"]:
        assert epoch["loss"] is not None
        for stage in epoch["stages"]:
            assert stage["rows_in_batch"] == ROWS * MICROBATCHES == stage["rows_averaged"], epoch


@pytest.mark.timeout(420)
def test_servers_take_their_places_from_the_signed_plan_and_the_swarm_trains(make_swarm):
    run_id = "live"
    swarm, planner_key, planner_public_key, pub = planned_swarm(make_swarm, run_id)
    for i in range(4):
        swarm.peer(f"server{i}", "--role", "server", "--compute", "--planner-key", pub)
    for i in range(2):
        swarm.peer(f"client{i}", "--role", "client", "--planner-key", pub)

    rogue = RSASignatureValidator(RSAPrivateKey())
    dht = start_dht(run_id, signer=rogue, initial_peers=swarm.initial_peers, client_mode=True)
    try:
        # before the planner runs: a plan naming the real servers, one stage, a version no real plan beats
        servers = wait_for_servers(dht, run_id, 4, timeout=180)
        fake = {"planner": "rogue", "idle": [], "predicted": {},
                "stages": [{"layers": [0, 4], "fs": servers[:2], "bs": servers[2:], "clients": []}]}
        assert dht.store(plan_key(run_id), PlanRecord(plan=fake, version=2**40, created=time.time()).to_value(),
                         get_dht_time() + 300, subkey=rogue.local_public_key)

        log = open(swarm.workdir / "planner.log", "w")
        swarm.processes["planner"] = subprocess.Popen(
            [sys.executable, "-m", "p2ptrain.plan", "--initial-peers", *swarm.initial_peers, "--run-id", run_id,
             "--publish", "--planner-identity", str(planner_key), "--expect", "4", "--stages", "2",
             "--batch-rows", str(ROWS), "--microbatches", str(MICROBATCHES), "--seq-len", str(SEQ)],
            stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        report = swarm.wait_finished(timeout=300)

        record = get_plan(dht, run_id, planner_public_key)
        assert record is not None and record.plan["planner"] == "refined", "the planner's plan is not in the DHT"
        planned = record.plan["stages"]
    finally:
        dht.shutdown()

    check_trained_as_planned(report, planned, servers)
    logs = swarm.logs(tail=10**6)
    assert "written by a key that is not the planner's" in logs, "the rogue plan was not reported"
    assert logs.count("places this server in stage") == 4 and logs.count("places this client in stage") == 2


@pytest.mark.timeout(420)
def test_a_server_started_with_plan_places_the_swarm_and_itself(make_swarm):
    run_id = "selfplan"
    swarm, planner_key, planner_public_key, pub = planned_swarm(make_swarm, run_id)
    swarm.peer("server0", "--role", "server", "--compute", "--plan", "--planner-identity", str(planner_key),
               "--expect", "4", "--plan-stages", "2")
    for i in range(1, 4):
        swarm.peer(f"server{i}", "--role", "server", "--compute", "--planner-key", pub)
    swarm.peer("client0", "--role", "client", "--planner-key", pub)
    report = swarm.wait_finished(timeout=300)

    dht = start_dht(run_id, initial_peers=swarm.initial_peers, client_mode=True)
    try:
        record = get_plan(dht, run_id, planner_public_key)
        servers = [p.peer_id for p in get_peers(dht, run_id) if p.role == "server"]
    finally:
        dht.shutdown()
    assert record is not None and record.plan["planner"] == "refined", "the planning server's plan is not in the DHT"
    check_trained_as_planned(report, record.plan["stages"], servers)
    logs = swarm.logs(tail=10**6)
    assert "published plan" in logs and logs.count("places this server in stage") == 4, logs[-3000:]
    # stopped as pkill or systemd stop it, the planning server withdraws its plan and exits (it waited for the launcher's
    # SIGKILL: its stop waited for the planner, which ends only once stopped)
    planning = swarm.processes["server0"]
    planning.terminate()
    assert planning.wait(timeout=12) == 0, swarm.logs(["server0"])
