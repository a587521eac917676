"""Bad command lines and swarm files end with a message that names the problem, and exit code 2."""
from __future__ import annotations

import importlib
import subprocess
import sys

import pytest


def run_main(capsys, module: str, *args: str) -> tuple[int, str]:
    """Run a CLI's main() in this process (imports are paid once); returns its exit code and stderr."""
    with pytest.raises(SystemExit) as exit_info:
        importlib.import_module(module).main(list(args))
    return exit_info.value.code, capsys.readouterr().err


@pytest.mark.parametrize("args, expected", [
    (["p2ptrain.peer", "--role", "worker"], "invalid choice: 'worker'"),
    (["p2ptrain.peer", "--role", "server", "--stage", "0"], "--server-role fs or --server-role bs"),
    (["p2ptrain.peer", "--role", "client"], "needs --stage K"),
    (["p2ptrain.peer", "--role", "client", "--stage", "0", "--server-role", "fs"], "for --role server only"),
    (["p2ptrain.peer", "--role", "client", "--stage", "2", "--num-stages", "2"], "--stage 2: not in 0..1"),
    (["p2ptrain.peer", "--role", "client", "--stage", "0", "--layers", "3:9"], "--layers 3:9"),
    (["p2ptrain.peer", "--role", "client", "--stage", "0", "--data", "/nonexistent.txt"], "--data /nonexistent.txt: no such file"),
    (["p2ptrain.peer", "--role", "client", "--stage", "0", "--compression", "int4"], "invalid choice: 'int4'"),
    (["p2ptrain.peer", "--role", "client", "--stage", "0", "--bogus"], "unrecognized arguments: --bogus"),
    (["p2ptrain.status"], "--initial-peers"),
    (["p2ptrain.launch", "--stages", "x"], "argument --stages: 'x' is not a whole number"),
])
def test_bad_flags_exit_2_naming_the_problem(capsys, args, expected):
    code, err = run_main(capsys, *args)
    assert code == 2 and expected in err, err


def test_launch_refuses_a_malformed_swarm_file(capsys, tmp_path):
    peers = tmp_path / "broken.toml"
    peers.write_text('[[device]]\nid = "gpu"\nsite = "nowhere"\nreliable = true\ntflops = 1\nmemory_gb = 8\n')
    code, err = run_main(capsys, "p2ptrain.launch", str(peers))
    assert code == 2 and "broken.toml" in err and "nowhere" in err, err


def test_the_real_entry_point_exits_2():
    result = subprocess.run([sys.executable, "-m", "p2ptrain.peer", "--role", "worker"], capture_output=True,
                            text=True, timeout=120)
    assert result.returncode == 2 and "invalid choice: 'worker'" in result.stderr, result.stderr
