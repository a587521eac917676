"""Swarm files: the issue's form parses to the right links, and every malformed file fails naming file, entry, fix."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from p2ptrain.plan import main
from p2ptrain.planner.swarmfile import MBPS, MS, SwarmFileError, load_swarm

EXAMPLE = """
[defaults]
latency_ms = 1.0
bandwidth_mbps = 10000

[[site]]
name = "hpc-a"
latency_ms = 0.1
bandwidth_mbps = 16000

[[site]]
name = "home-1"

[[site]]
name = "lab"

[[link]]
sites = ["hpc-a", "home-1"]
latency_ms = 120
bandwidth_mbps = 200

[[link]]
from = "home-1"
to = "hpc-a"
latency_ms = 130
bandwidth_mbps = 100

[[device]]
id = "v100"
count = 4
site = "hpc-a"
reliable = true
tflops = 15.7
memory_gb = 32

[[device]]
id = "gamer"
site = "home-1"
reliable = false
tflops = 10
memory_gb = 8
access_latency_ms = 5
access_mbps = 50

[[device]]
id = "lab-gpu"
site = "lab"
reliable = false
tflops = 20
memory_gb = 24

[[device]]
id = "loner"
reliable = false
tflops = 5
memory_gb = 8

[[link]]
devices = ["loner", "v100-0"]
latency_ms = 7
bandwidth_mbps = 300

[model]
preset = "llama-33b"

[batch]
tokens = 524288
microbatches = 128
"""


def write(tmp_path: Path, text: str, name: str = "swarm.toml") -> Path:
    path = tmp_path / name
    path.write_text(text)
    return path


def test_example_links_follow_the_documented_rules(tmp_path: Path) -> None:
    swarm = load_swarm(write(tmp_path, EXAMPLE))
    assert swarm.ids == ["v100-0", "v100-1", "v100-2", "v100-3", "gamer", "lab-gpu", "loner"]
    assert swarm.devices[0].flops == pytest.approx(15.7e12)
    assert swarm.devices[0].memory_bytes == 32 * 2**30
    assert swarm.latency("v100-0", "v100-1") == pytest.approx(0.1 * MS)          # the site's own link
    assert swarm.bandwidth("v100-0", "v100-1") == pytest.approx(16000 * MBPS)
    # undirected site link one way, the directed entry the other way; the gamer's access link on top
    assert swarm.latency("v100-1", "gamer") == pytest.approx((120 + 5) * MS)
    assert swarm.bandwidth("v100-1", "gamer") == pytest.approx(50 * MBPS)
    assert swarm.latency("gamer", "v100-1") == pytest.approx((130 + 5) * MS)
    # no [[link]] between hpc-a and lab: [defaults]
    assert swarm.latency("v100-2", "lab-gpu") == pytest.approx(1.0 * MS)
    assert swarm.bandwidth("lab-gpu", "v100-2") == pytest.approx(10000 * MBPS)
    # a device-level link is end to end, both directions
    assert swarm.latency("loner", "v100-0") == pytest.approx(7 * MS)
    assert swarm.bandwidth("v100-0", "loner") == pytest.approx(300 * MBPS)
    assert swarm.latency("loner", "v100-1") == pytest.approx(1.0 * MS)
    assert swarm.latency(0, 0) == 0.0
    assert swarm.model is not None and swarm.model.layers == 60
    assert (swarm.batch_tokens, swarm.microbatches) == (524288, 128)


def test_wan_defaults_apply_between_sites_only(tmp_path: Path) -> None:
    text = EXAMPLE.replace("bandwidth_mbps = 10000\n", "bandwidth_mbps = 10000\nwan_latency_ms = 40\n", 1)
    swarm = load_swarm(write(tmp_path, text))
    assert swarm.latency("v100-2", "lab-gpu") == pytest.approx(40 * MS)
    assert swarm.bandwidth("v100-2", "lab-gpu") == pytest.approx(10000 * MBPS)


BAD = {
    "unknown site": (EXAMPLE.replace('site = "lab"\n', 'site = "labb"\n'), '[[device]] #3 (lab-gpu)',
                     "unknown site 'labb'"),
    "missing field": (EXAMPLE.replace("tflops = 20\n", ""), "[[device]] #3 (lab-gpu)", "'tflops' is missing"),
    "negative bandwidth": (EXAMPLE.replace("bandwidth_mbps = 200", "bandwidth_mbps = -200"), "[[link]] #1",
                           "bandwidth_mbps = -200"),
    "no reliable device": (EXAMPLE.replace("reliable = true", "reliable = false"), "[[device]]",
                           "0 reliable device"),
    "stages need more reliable devices": (EXAMPLE + "\n[planner]\nstages = 3\n", "[planner]",
                                          "needs 6 reliable devices"),
    "unknown key": (EXAMPLE.replace("memory_gb = 24", "memory_gb = 24\nmemroy = 3"), "[[device]] #3 (lab-gpu)",
                    "unknown field 'memroy'"),
    "toml syntax": (EXAMPLE.replace('name = "lab"', 'name = lab'), "TOML syntax", "line"),
    "duplicate id": (EXAMPLE.replace('id = "loner"', 'id = "gamer"'), "[[device]] #4 (gamer)", "already used"),
    "link to unknown site": (EXAMPLE.replace('sites = ["hpc-a", "home-1"]', 'sites = ["hpc-a", "home-2"]'),
                             "[[link]] #1", "unknown site 'home-2'"),
    "no link and no defaults": (EXAMPLE.replace("latency_ms = 1.0\nbandwidth_mbps = 10000\n", "", 1),
                                "[defaults]", "no latency_ms for links inside site 'home-1'"),
    "no link between sites and no defaults": (
        EXAMPLE.replace("latency_ms = 1.0\nbandwidth_mbps = 10000\n", "", 1)
        .replace('name = "home-1"\n', 'name = "home-1"\nlatency_ms = 2\nbandwidth_mbps = 1000\n')
        .replace('name = "lab"\n', 'name = "lab"\nlatency_ms = 2\nbandwidth_mbps = 1000\n')
        .replace('id = "loner"\n', 'id = "loner"\nsite = "lab"\n'),
        "[defaults]", "no latency_ms for the link between sites 'home-1' and 'lab'"),
    "unknown preset": (EXAMPLE.replace('"llama-33b"', '"llama-34b"'), "[model]", "unknown preset"),
    "unknown averaging codec": (EXAMPLE.replace('preset = "llama-33b"',
                                                'preset = "llama-33b"\naveraging_codec = "int4"'),
                                "[model]", "unknown averaging_codec 'int4'"),
    "zero tflops": (EXAMPLE.replace("tflops = 5", "tflops = 0"), "[[device]] #4 (loner)", "tflops = 0"),
}


@pytest.mark.parametrize("case", sorted(BAD))
def test_malformed_file_names_file_entry_and_fix(tmp_path: Path, case: str) -> None:
    text, entry, problem = BAD[case]
    path = write(tmp_path, text)
    with pytest.raises(SwarmFileError) as caught:
        load_swarm(path)
    message = str(caught.value)
    assert message.startswith(f"{path}: {entry}:"), message
    assert problem in message
    assert "; fix: " in message and not message.endswith("fix: ")


@pytest.mark.parametrize("case", sorted(BAD))
def test_cli_exits_2_on_malformed_file(tmp_path: Path, case: str, capsys: pytest.CaptureFixture[str]) -> None:
    text, entry, _ = BAD[case]
    path = write(tmp_path, text)
    with pytest.raises(SystemExit) as caught:
        main([str(path)])
    assert caught.value.code == 2
    err = capsys.readouterr().err
    assert str(path) in err and entry in err and "fix:" in err


def test_cli_exits_2_on_bad_flags(tmp_path: Path) -> None:
    path = write(tmp_path, EXAMPLE)
    for argv in ([str(path), "--planner", "best"], [str(path), "--stages", "3"], [str(path), "--stages", "1",
                                                                                  "--planner", "random"],
                 [str(tmp_path / "missing.toml")]):
        with pytest.raises(SystemExit) as caught:
            main(argv)
        assert caught.value.code == 2, argv


def test_cli_stage_limit_message(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = write(tmp_path, EXAMPLE)
    with pytest.raises(SystemExit):
        main([str(path), "--stages", "3"])
    err = capsys.readouterr().err
    assert "4 reliable devices" in err and "between 1 and 2" in err


def test_the_averaging_codec_of_the_file_or_the_flag_sets_the_rounds_bytes(tmp_path: Path) -> None:
    """int8 averaging, in the file's [model] or by --averaging-codec, makes P and every stage's averaging time
    smaller than fp32's; the flag wins over the file."""
    local = (Path(__file__).parent.parent / "peers" / "local.toml").read_text()
    int8_file = write(tmp_path, local.replace('preset = "llama-tiny"',
                                              'preset = "llama-tiny"\naveraging_codec = "int8"'))
    plain = write(tmp_path, local, name="plain.toml")
    assert load_swarm(int8_file).averaging_codec == "int8" and load_swarm(plain).averaging_codec is None
    assert load_swarm(int8_file).model.param_bytes_per_layer <= load_swarm(plain).model.param_bytes_per_layer / 3.5

    def averaging(*argv: str) -> list[float]:
        out = tmp_path / "plan.json"
        assert main([*argv, "--json", str(out)]) == 0
        return json.loads(out.read_text())["predicted"]["averaging_s"]

    by_file, by_flag, fp32_flag = (averaging(str(int8_file)), averaging(str(plain), "--averaging-codec", "int8"),
                                   averaging(str(int8_file), "--averaging-codec", "fp32"))
    assert by_file == by_flag and averaging(str(plain)) == fp32_flag
    assert all(a < b for a, b in zip(by_flag, fp32_flag)), (by_flag, fp32_flag)


def test_cli_writes_json_with_every_device_once(tmp_path: Path) -> None:
    out = tmp_path / "plan.json"
    assert main([str(Path(__file__).parent.parent / "peers" / "local.toml"), "--json", str(out)]) == 0
    plan = json.loads(out.read_text())
    placed = [d for s in plan["stages"] for role in ("fs", "bs", "clients") for d in s[role]] + plan["idle"]
    assert sorted(placed) == sorted([f"server-{i}" for i in range(4)] + ["client-0", "client-1"])
    starts = [s["layers"][0] for s in plan["stages"]]
    ends = [s["layers"][1] for s in plan["stages"]]
    assert starts[0] == 0 and ends[-1] == 4 and starts[1:] == ends[:-1]
    p = plan["predicted"]
    assert p["efficiency"] == pytest.approx(p["lower_bound_s"] / p["batch_time_s"])
    assert len(p["stage_times_s"]) == len(plan["stages"])
