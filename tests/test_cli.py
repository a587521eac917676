"""Bad command lines (docs/design.md: "bad input gets a clear error that says what to fix"): every CLI checks its options
before anything starts. Each bad option ends with exit status 2 and a message naming the flag, and no process and
no DHT node is started."""
from __future__ import annotations

import importlib
import subprocess
import sys

import hivemind
import pytest


@pytest.fixture
def nothing_starts(monkeypatch):
    """Starting a peer process or a DHT node (and with it a p2p daemon) fails the test."""
    def forbidden(*args, **kwargs):
        raise AssertionError("a bad command line started something")

    monkeypatch.setattr(subprocess, "Popen", forbidden)
    monkeypatch.setattr(hivemind, "DHT", forbidden)


def run_main(capsys, module: str, *args: str) -> tuple[int, str]:
    """Run a CLI's main() in this process (imports are paid once); returns its exit code and stderr."""
    with pytest.raises(SystemExit) as exit_info:
        importlib.import_module(module).main(list(args))
    return exit_info.value.code, capsys.readouterr().err


@pytest.fixture
def files(tmp_path):
    short = tmp_path / "short.txt"
    short.write_text("too short")
    malformed = tmp_path / "broken.toml"
    malformed.write_text('[[device]]\nid = "gpu"\nsite = "nowhere"\nreliable = true\ntflops = 1\nmemory_gb = 8\n')
    a_file = tmp_path / "a-file"
    a_file.write_text("")
    return {"SHORT": str(short), "BROKEN": str(malformed), "FILE": str(a_file), "MISSING": str(tmp_path / "no.txt"),
            "NODIR": str(tmp_path / "no" / "such" / "dir" / "out.json")}


PEER = ["p2ptrain.peer", "--role", "client", "--stage", "0"]
PEER_CASES = [
    (["--epochs", "0"], "argument --epochs: 0: must be at least 1"),
    (["--batch-rows", "0"], "argument --batch-rows: 0: must be at least 1"),
    (["--microbatches", "-1"], "argument --microbatches: -1: must be at least 1"),
    (["--num-stages", "0"], "argument --num-stages: 0"),
    (["--num-stages", "99"], "--num-stages 99: must be between 1 and the model's 4 layers"),
    (["--seq-len", "0"], "argument --seq-len: 0"),
    (["--seq-len", "999"], "--seq-len 999: exceeds the model's max_seq_len 128"),
    (["--threads", "0"], "argument --threads: 0"),
    (["--max-in-flight", "0"], "argument --max-in-flight: 0"),
    (["--lr", "0"], "argument --lr: 0: must be positive"),
    (["--lr", "nan"], "argument --lr: 'nan' is not a finite number"),
    (["--weight-decay", "-1"], "argument --weight-decay: -1: must be 0 or more"),
    (["--seed", "-1"], "argument --seed: -1: must be 0 or more"),
    (["--compute-power", "0"], "argument --compute-power: 0"),
    (["--lease-timeout", "0"], "argument --lease-timeout: 0"),
    (["--averaging-timeout", "-5"], "argument --averaging-timeout: -5"),
    (["--model", "gpt-9"], "argument --model: invalid choice: 'gpt-9'"),
    (["--compression", "int4"], "argument --compression: invalid choice: 'int4'"),
    (["--fault", "fire"], "argument --fault: invalid choice: 'fire'"),
    (["--fault-policy", "pray"], "argument --fault-policy: invalid choice: 'pray'"),
    (["--log-level", "LOUD"], "argument --log-level: invalid choice: 'LOUD'"),
    (["--data", "MISSING"], "--data MISSING: no such file"),
    (["--data", "SHORT"], "--data SHORT: 9 bytes, too short for one sequence of 64 + 1 tokens"),
    (["--tokenizer", "MISSING"], "--tokenizer MISSING: no such file or folder; give the path of a local tokenizer.json"),
    (["--tokenizer", "SHORT"], "--tokenizer SHORT: not a tokenizers file"),
    (["--stage", "5", "--num-stages", "2"], "--stage 5: not in 0..1"),
    (["--layers", "3:9"], "--layers 3:9: must lie within 0:4"),
    (["--layers", "x"], "--layers x: expected START:END"),
    (["--initial-peers", "garbage"], "--initial-peers garbage: not a multiaddr"),
    (["--host-maddrs", "/ip4/1.2.3.4/nonsense"], "--host-maddrs /ip4/1.2.3.4/nonsense: not a multiaddr"),
    (["--run-id", "a b"], "argument --run-id: a b: use 1 to 64 letters"),
    (["--maddrs-file", "NODIR"], "argument --maddrs-file: NODIR: folder"),
    (["--dump-grads", "FILE"], "--dump-grads FILE: is a file; give a folder"),
    (["--bogus"], "unrecognized arguments: --bogus"),
]
PEER_ROLE_CASES = [
    (["p2ptrain.peer", "--role", "worker"], "argument --role: invalid choice: 'worker'"),
    (["p2ptrain.peer", "--role", "server", "--stage", "0"], "--role server needs --server-role fs or --server-role bs"),
    (["p2ptrain.peer", "--role", "server"], "--role server needs --stage K, or --planner-key PATH"),
    (["p2ptrain.peer", "--role", "client", "--stage-choice", "best"], "argument --stage-choice: invalid choice"),
    (["p2ptrain.peer", "--role", "client", "--stage", "0", "--stage-choice", "paper"],
     "--stage-choice is for a client started without --stage"),
    (["p2ptrain.peer", "--role", "server", "--planner-key", "FILE", "--stage-choice", "cost"],
     "--stage-choice is for a client"),
    (["p2ptrain.peer", "--role", "client", "--probe-delay", "-1"], "argument --probe-delay: -1: must be 0 or more"),
    (["p2ptrain.peer", "--role", "client", "--stage", "0", "--server-role", "fs"], "--server-role and --compute"),
    (["p2ptrain.peer", "--role", "client", "--stage", "0", "--keep-state"], "--keep-state is for a server"),
    (["p2ptrain.peer", "--role", "server", "--stage", "0", "--server-role", "bs", "--checkpoint-dir", "NODIR"],
     "--checkpoint-dir NODIR: a BS holds no state to save unless started with --keep-state"),
    (["p2ptrain.peer", "--role", "server", "--planner-key", "MISSING"], "argument --planner-key: MISSING: no such"),
    (["p2ptrain.peer", "--role", "server", "--planner-key", "FILE"], "--planner-key FILE: "),
    (["p2ptrain.peer", "--role", "server", "--plan", "--planner-identity", "k", "--expect", "1"], "--expect 1: a plan"),
    (["p2ptrain.peer", "--role", "server", "--plan", "--planner-identity", "k", "--plan-stages", "0"],
     "argument --plan-stages: 0"),
    (["p2ptrain.peer", "--role", "server", "--planner-key", "FILE", "--plan-timeout", "0"],
     "argument --plan-timeout: 0"),
    (["p2ptrain.peer", "--role", "client", "--stage", "0", "--metrics-period", "0"], "argument --metrics-period: 0"),
    (["p2ptrain.peer", "--role", "client", "--stage", "0", "--owner-key", "MISSING"],
     "argument --owner-key: MISSING: no such file"),
    (["p2ptrain.peer", "--role", "client", "--stage", "0", "--owner-key", "SHORT"],
     "--owner-key SHORT: not an owner public key"),
    (["p2ptrain.peer", "--role", "client", "--stage", "0", "--certificate", "FILE"],
     "--certificate is a server's, with --owner-key"),
]
LAUNCH_CASES = [
    (["--epochs", "0"], "argument --epochs: 0: must be at least 1"),
    (["--epochs", "-3"], "argument --epochs: -3"),
    (["--stages", "0"], "argument --stages: 0"),
    (["--stages", "9"], "--stages 9: must be between 1 and the model's 4 layers"),
    (["--stages", "3"], "--stages 3 needs 2 reliable devices per stage"),
    (["--stages", "x"], "argument --stages: 'x' is not a whole number"),
    (["--seq-len", "0"], "argument --seq-len: 0"),
    (["--seq-len", "999"], "--seq-len 999: exceeds the model's max_seq_len"),
    (["--timeout", "0"], "argument --timeout: 0"),
    (["--model", "gpt-9"], "argument --model: invalid choice: 'gpt-9'"),
    (["--compression", "int4"], "argument --compression: invalid choice"),
    (["--data", "MISSING"], "--data MISSING: no such file"),
    (["--data", "SHORT"], "--data SHORT: 9 bytes, too short"),
    (["--tokenizer", "gpt2"], "--tokenizer gpt2: no such file or folder; give the path of a local tokenizer.json"),
    (["--tokenizer", "SHORT"], "--tokenizer SHORT: not a tokenizers file"),
    (["--run-id", "a b"], "argument --run-id: a b"),
    (["--workdir", "FILE"], "--workdir FILE: is a file"),
    (["MISSING"], "MISSING: file: no such file"),
    (["BROKEN"], "BROKEN: [[device]] #1 (gpu): unknown site 'nowhere'"),
]
PLAN_CASES = [
    (["MISSING"], "MISSING: file: no such file"),
    (["BROKEN"], "BROKEN: [[device]] #1 (gpu): unknown site 'nowhere'"),
    (["peers/local.toml", "--batch-tokens", "0"], "argument --batch-tokens: 0"),
    (["peers/local.toml", "--microbatches", "0"], "argument --microbatches: 0"),
    (["peers/local.toml", "--stages", "0"], "argument --stages: 0"),
    (["peers/local.toml", "--stages", "5"], "--stages 5: peers/local.toml has 4 reliable devices"),
    (["peers/local.toml", "--seed", "-1"], "argument --seed: -1"),
    (["peers/local.toml", "--budget-s", "-1"], "argument --budget-s: -1"),
    (["peers/local.toml", "--budget-s", "1", "--rounds", "2"], "--budget-s and --rounds both bound"),
    (["peers/local.toml", "--planner", "paper", "--rounds", "2"], "--rounds applies to the refined planner, not paper"),
    (["peers/local.toml", "--searches", "2"], "--searches replays a plan's search with --rounds N; give --rounds too"),
    (["peers/local.toml", "--rounds", "2", "--searches", "0"], "argument --searches: 0"),
    (["peers/local.toml", "--donor", "1:2:3"], "--donor replays a plan's search with --rounds N; give --rounds too"),
    (["peers/local.toml", "--rounds", "4", "--donor", "1:2"], "argument --donor: '1:2': give SEED:ROUNDS:AT"),
    (["peers/local.toml", "--rounds", "4", "--donor", "1:-2:3"], "argument --donor: '1:-2:3': give SEED:ROUNDS:AT"),
    (["peers/local.toml", "--planner", "swarm", "--rounds", "4", "--donor", "1:2:3"],
     "--rounds applies to the refined planner, not swarm"),
    (["peers/local.toml", "--jobs", "0"], "argument --jobs: 0"),
    (["peers/local.toml", "--jobs", "2", "--rounds", "2"], "--rounds replays one search (give --seed the plan's"),
    (["peers/local.toml", "--planner", "paper", "--jobs", "2"], "--jobs applies to the refined planner, not paper"),
    (["peers/local.toml", "--heats", "0"], "argument --heats: 0"),
    (["peers/local.toml", "--heats", "2", "--rounds", "2"], "--heats applies to a budget"),
    (["peers/local.toml", "--planner", "dtfm", "--heats", "2"], "--heats applies to the refined planner, not dtfm"),
    (["peers/local.toml", "--planner", "oracle"], "argument --planner: invalid choice: 'oracle'"),
    (["peers/local.toml", "--model", "gpt-9"], "argument --model: invalid choice: 'gpt-9'"),
    (["peers/local.toml", "--json", "NODIR"], "argument --json: NODIR: folder"),
    (["--initial-peers", "garbage"], "--initial-peers garbage: not a multiaddr"),
    (["--initial-peers", "/ip4/127.0.0.1/tcp/1", "--expect", "0"], "argument --expect: 0"),
    (["--initial-peers", "/ip4/127.0.0.1/tcp/1", "--expect", "1"], "--expect 1: a plan needs at least 2 servers"),
    (["--initial-peers", "/ip4/127.0.0.1/tcp/1", "--expect-timeout", "0"], "argument --expect-timeout: 0"),
    (["--initial-peers", "/ip4/127.0.0.1/tcp/1", "--batch-rows", "0"], "argument --batch-rows: 0"),
    (["--initial-peers", "/ip4/127.0.0.1/tcp/1", "--run-id", "a b"], "argument --run-id: a b"),
    (["--initial-peers", "/ip4/127.0.0.1/tcp/1", "--model-config", "NODIR"], "--model-config NODIR: NODIR: not a "),
]
STATUS_CASES = [
    ([], "the following arguments are required: --initial-peers"),
    (["--initial-peers", "garbage"], "--initial-peers garbage: not a multiaddr"),
    (["--initial-peers", "/ip4/127.0.0.1/tcp/1", "--run-id", "a b"], "argument --run-id: a b"),
    (["--initial-peers", "/ip4/127.0.0.1/tcp/1", "--bogus"], "unrecognized arguments: --bogus"),
]
CASES = ([(PEER + args, expected) for args, expected in PEER_CASES] + PEER_ROLE_CASES
         + [(["p2ptrain.launch", *args], expected) for args, expected in LAUNCH_CASES]
         + [(["p2ptrain.plan", *args], expected) for args, expected in PLAN_CASES]
         + [(["p2ptrain.status", *args], expected) for args, expected in STATUS_CASES])


@pytest.mark.parametrize("args, expected", CASES, ids=lambda x: " ".join(x) if isinstance(x, list) else None)
def test_a_bad_option_exits_2_naming_the_flag_and_starts_nothing(capsys, nothing_starts, files, args, expected):
    args = [files.get(arg, arg) for arg in args]
    for name, path in files.items():
        expected = expected.replace(name, path)
    code, err = run_main(capsys, *args)
    assert code == 2 and expected in err, err


def test_the_real_entry_point_exits_2():
    result = subprocess.run([sys.executable, "-m", "p2ptrain.peer", "--role", "worker"], capture_output=True,
                            text=True, timeout=120)
    assert result.returncode == 2 and "invalid choice: 'worker'" in result.stderr, result.stderr


def test_a_client_without_stage_joins_by_probing_and_picks_by_cost_unless_told():
    from p2ptrain.peer import parse_args

    options = parse_args(["--role", "client"]).options
    assert options.placement is None and options.planning is None and options.stage_choice == "cost"
    options = parse_args(["--role", "client", "--stage-choice", "paper"]).options
    assert options.stage_choice == "paper" and options.probe_delay_s == 0.0
    server = parse_args(["--role", "server", "--stage", "1", "--server-role", "bs", "--probe-delay", "0.2"]).options
    assert server.probe_delay_s == 0.2


def test_a_peer_stores_its_metrics_as_often_as_told():
    from p2ptrain.config import RuntimeConfig
    from p2ptrain.peer import parse_args

    assert parse_args(["--role", "client", "--stage", "0"]).settings.metrics_period_s == RuntimeConfig.metrics_period_s
    assert parse_args(["--role", "client", "--stage", "0", "--metrics-period", "20"]).settings.metrics_period_s == 20
