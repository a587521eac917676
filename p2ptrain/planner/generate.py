"""Seeded swarms: random geo-distributed ones for benchmarks and tests, and the paper's §4 setups as swarm files.

``python -m p2ptrain.planner.generate peers/`` rewrites the ``peers/paper-*.toml`` files (the random link values in
them come from the ranges the paper gives, drawn with the seed written in each file) and ``peers/geo-64.toml``, a
geo swarm of 64 devices with the benchmarks' model and batch.
"""
from __future__ import annotations

import sys
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from p2ptrain.planner.swarmfile import Swarm, parse_swarm


@dataclass(frozen=True, kw_only=True)
class Gpu:
    name: str
    tflops: float       # effective mixed-precision training throughput
    memory_gb: float


GPUS: tuple[Gpu, ...] = (
    Gpu(name="a100", tflops=120.0, memory_gb=80), Gpu(name="v100", tflops=60.0, memory_gb=32),
    Gpu(name="rtx4090", tflops=80.0, memory_gb=24), Gpu(name="rtx3090", tflops=40.0, memory_gb=24),
    Gpu(name="rtx3080", tflops=30.0, memory_gb=10), Gpu(name="rtx2080", tflops=20.0, memory_gb=8),
    Gpu(name="t4", tflops=15.0, memory_gb=16),
)


def geo_swarm_data(devices: int, seed: int) -> dict:
    """A random geo-distributed swarm as swarm-file data (nothing tuned to any planner).

    Sites sit at random points of a 4,000 km square; WAN latency is 5 ms plus 1 ms per 100 km plus jitter, WAN
    bandwidth 0.2-10 Gbit/s. About a third of the devices are in datacenters (one GPU model per site, reliable,
    fast internal links), a sixth in universities (mixed GPUs, reliable or not), the rest at home: unreliable,
    each its own site behind a 20-500 Mbit/s uplink with 5-40 ms of access latency, on the default WAN link
    (40 ms, 1 Gbit/s) to everything else.
    """
    rng = np.random.default_rng(seed)
    n_dc = max(2, devices // 24)
    n_uni = max(1, devices // 48)
    home_count = devices - int(devices * 0.5)
    site_devices = devices - home_count
    names = [f"dc-{i}" for i in range(n_dc)] + [f"uni-{i}" for i in range(n_uni)]
    where = rng.uniform(0, 4000, size=(len(names), 2))
    weights = rng.uniform(0.5, 1.5, size=len(names))
    per_site = np.maximum(2, np.round(weights / weights.sum() * site_devices)).astype(int)
    sites = []
    for i, name in enumerate(names):
        dc = name.startswith("dc")
        latency = rng.uniform(0.02, 0.2) if dc else rng.uniform(0.2, 2)
        sites.append({"name": name, "latency_ms": round(float(latency), 3),
                      "bandwidth_mbps": round(float(rng.choice([25000, 50000, 100000]) if dc else
                                                    rng.choice([1000, 10000])))})
    links = []
    for i in range(len(names)):
        for j in range(i + 1, len(names)):
            km = float(np.linalg.norm(where[i] - where[j]))
            links.append({"sites": [names[i], names[j]],
                          "latency_ms": round(5 + km / 100 + float(rng.exponential(5)), 2),
                          "bandwidth_mbps": round(float(np.exp(rng.uniform(np.log(200), np.log(10000)))))})
    out_devices = []
    for i, name in enumerate(names):
        dc = name.startswith("dc")
        gpu = GPUS[int(rng.integers(0, 4 if dc else len(GPUS)))]
        for j in range(int(per_site[i])):
            if not dc:
                gpu = GPUS[int(rng.integers(0, len(GPUS)))]
            reliable = bool(dc or rng.random() < 0.5)
            out_devices.append({"id": f"{name}-{gpu.name}-{j}", "site": name, "reliable": reliable,
                                "tflops": gpu.tflops, "memory_gb": gpu.memory_gb})
    for j in range(devices - len(out_devices)):
        gpu = GPUS[int(rng.integers(2, len(GPUS)))]
        out_devices.append({"id": f"home-{j}-{gpu.name}", "reliable": False, "tflops": gpu.tflops,
                            "memory_gb": gpu.memory_gb, "access_latency_ms": round(float(rng.uniform(5, 40)), 1),
                            "access_mbps": round(float(np.exp(rng.uniform(np.log(20), np.log(500)))))})
    # home devices reach everything over the default WAN link, then their own uplink
    defaults = {"latency_ms": 1.0, "bandwidth_mbps": 10000, "wan_latency_ms": 40.0, "wan_bandwidth_mbps": 1000}
    return {"defaults": defaults, "site": sites, "link": links, "device": out_devices[:devices]}


def geo_swarm(devices: int, seed: int) -> Swarm:
    return parse_swarm(geo_swarm_data(devices, seed), source=f"<geo swarm n={devices} seed={seed}>")


def _value(v: object) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, str):
        return f'"{v}"'
    if isinstance(v, list):
        return "[" + ", ".join(_value(x) for x in v) + "]"
    return f"{v:g}" if isinstance(v, float) else str(v)


def to_toml(data: dict, header: str) -> str:
    """Swarm-file data as TOML, in the section order a reader expects."""
    lines = [f"# {line}" if line else "#" for line in header.strip().splitlines()]
    for name in ("defaults", "model", "batch", "planner"):
        if name in data:
            lines += ["", f"[{name}]"] + [f"{k} = {_value(v)}" for k, v in data[name].items()]
    for name in ("site", "link", "device"):
        for entry in data.get(name, []):
            lines += ["", f"[[{name}]]"] + [f"{k} = {_value(v)}" for k, v in entry.items()]
    return "\n".join(lines) + "\n"


V100 = {"tflops": 15.7, "memory_gb": 32}                  # fp32 peak, as the example
RTX2080 = {"tflops": round(15.7 / 1.55, 2), "memory_gb": 8}  # §4.1: 55% longer training time than a V100
LLAMA_41 = {"preset": "llama-33b", "precision": "fp16", "offload": "optimizer"}
BATCH_41 = {"tokens": 512 * 2048, "microbatches": 128}   # 512 sequences of 2048 tokens, minibatches of 4


def _hpc(name: str, count: int, reliable: bool = True) -> dict:
    return {"id": f"{name}-v100", "count": count, "site": name, "reliable": reliable, **V100}


def _standalone(rng: np.random.Generator, name: str, spec: dict, reliable: bool, latency: tuple[float, float],
                mbps: tuple[float, float]) -> dict:
    return {"id": name, "reliable": reliable, **spec, "access_latency_ms": round(float(rng.uniform(*latency)), 1),
            "access_mbps": round(float(rng.uniform(*mbps)))}


def _wan_pairs(rng: np.random.Generator, sites: list[str], latency: tuple[float, float],
               mbps: tuple[float, float]) -> list[dict]:
    return [{"sites": [a, b], "latency_ms": round(float(rng.uniform(*latency)), 1),
             "bandwidth_mbps": round(float(rng.uniform(*mbps)))} for i, a in enumerate(sites) for b in sites[i + 1:]]


def paper_case_files(seed: int = 2025) -> dict[str, str]:
    """The paper's §4 setups as swarm files; random values drawn from the paper's ranges with ``seed``."""
    rng = np.random.default_rng(seed)
    files = {}
    hpc_site = {"latency_ms": 0.1, "bandwidth_mbps": 16000}  # 2 GB/s inside an HPC (§4.1 case 1)
    mixed = ("Memory: Llama-33B does not fit 16 V100s with Adam state on the GPU (60 layers x 8.6 GB > 512 GB);\n"
             "the file assumes mixed precision with ZeRO-Offload of the optimizer (1.1 GB per layer on the GPU).")
    files["paper-case1.toml"] = to_toml({
        "defaults": {"latency_ms": 0.1, "bandwidth_mbps": 16000},
        "model": LLAMA_41, "batch": BATCH_41,
        "site": [{"name": "dc", **hpc_site}], "device": [_hpc("dc", 16)],
    }, f"Paper §4.1 case 1: single datacenter, 16 V100s, 2 GB/s between nodes.\n{mixed}")
    sites = [f"hpc-{i}" for i in range(4)]
    files["paper-case2.toml"] = to_toml({
        "defaults": {"latency_ms": 0.1, "bandwidth_mbps": 16000},
        "model": LLAMA_41, "batch": BATCH_41,
        "site": [{"name": s, **hpc_site} for s in sites],
        "link": _wan_pairs(rng, sites, (10, 100), (8000, 24000)),
        "device": [_hpc(s, 4) for s in sites],
    }, f"Paper §4.1 case 2: four HPCs of four V100s; between HPCs 1-3 GB/s and 10-100 ms (seed {seed}).\n{mixed}")
    for case, reliable in ((3, True), (4, False)):
        case_rng = np.random.default_rng(seed + case)
        hpcs = ["hpc-0", "hpc-1"]
        devices = [_hpc(s, 4) for s in hpcs]
        devices += [_standalone(case_rng, f"rtx2080-{i}", RTX2080, reliable, (100, 150), (50, 300)) for i in range(8)]
        what = ("" if reliable else
                "\nCase 4 adds disconnections (90% of batches); the RTX 2080s are the unreliable clients.")
        files[f"paper-case{case}.toml"] = to_toml({
            "defaults": {"latency_ms": 0.1, "bandwidth_mbps": 16000, "wan_latency_ms": 0.0,
                         "wan_bandwidth_mbps": 100000},
            "model": LLAMA_41, "batch": BATCH_41,
            "site": [{"name": s, **hpc_site} for s in hpcs],
            "link": _wan_pairs(case_rng, hpcs, (10, 100), (8000, 24000)),
            "device": devices,
        }, f"Paper §4.1 case {case}: two HPCs of four V100s and eight standalone RTX 2080s (55% slower).\n"
           f"Standalone GPUs sit behind 50-300 Mbit/s, 100-150 ms access links (seed {seed + case}); the WAN\n"
           f"itself adds nothing (wan_latency_ms = 0), so two standalone GPUs see the sum of their access delays.\n"
           f"{mixed}{what}")
    r42 = np.random.default_rng(seed + 42)
    files["paper-sec42.toml"] = to_toml({
        "defaults": {"latency_ms": 0.1, "bandwidth_mbps": 16000, "wan_latency_ms": 0.0, "wan_bandwidth_mbps": 100000},
        "model": LLAMA_41, "batch": BATCH_41,
        "site": [{"name": s, **hpc_site} for s in ("hpc-0", "hpc-1")],
        "link": _wan_pairs(r42, ["hpc-0", "hpc-1"], (10, 100), (8000, 24000)),
        "device": [_hpc("hpc-0", 3), _hpc("hpc-1", 3)] +
                  [_standalone(r42, f"rtx2080-{i}", RTX2080, False, (100, 150), (50, 300)) for i in range(10)],
    }, f"Paper §4.2: 6 reliable V100s (two HPCs of three) and 10 unreliable RTX 2080s; links as §4.1 case 3\n"
       f"(seed {seed + 42}).\n{mixed}")
    for n in (16, 24, 32, 48):
        r43 = np.random.default_rng(seed + n)
        devices = [_standalone(r43, f"v100-{i}", V100, i % 2 == 0, (25, 75), (100, 300)) for i in range(n)]
        files[f"paper-sec43-{n}.toml"] = to_toml({
            "defaults": {"latency_ms": 0.1, "bandwidth_mbps": 16000, "wan_latency_ms": 0.0,
                         "wan_bandwidth_mbps": 100000},
            "model": LLAMA_41, "batch": BATCH_41, "device": devices,
        }, f"Paper §4.3 at {n} GPUs: V100s with 50-150 ms latency and 100-300 Mbit/s between any two, modelled as\n"
           f"access links of 25-75 ms and 100-300 Mbit/s per device (seed {seed + n}); half are unreliable.\n{mixed}")
    r44 = np.random.default_rng(seed + 44)
    # fp64 rates: RTX 4090 1.29 TFLOP/s, RTX 3080 0.47 TFLOP/s peak; 70% of peak as effective training rate
    rtx4090 = {"tflops": 0.9, "memory_gb": 24}
    rtx3080 = {"tflops": 0.33, "memory_gb": 10}
    isp = [{"id": f"rtx3080-{i}", "site": "isp", "reliable": i < 2, **rtx3080,
            "access_latency_ms": round(float(r44.uniform(2, 10)), 1),
            "access_mbps": round(float(r44.uniform(80, 300)))} for i in range(6)]
    files["paper-sec44.toml"] = to_toml({
        "defaults": {"latency_ms": 1.0, "bandwidth_mbps": 1000},
        "model": {"preset": "llama-33b", "precision": "fp64", "offload": "all"},
        "batch": {"tokens": 512 * 1024, "microbatches": 128},
        "site": [{"name": "cloud", "latency_ms": 0.2, "bandwidth_mbps": 10000},
                 {"name": "campus", "latency_ms": 0.1, "bandwidth_mbps": 10000},
                 {"name": "isp", "latency_ms": 6.0, "bandwidth_mbps": 500}],
        "link": [{"sites": ["cloud", "campus"], "latency_ms": 28.0, "bandwidth_mbps": 800},
                 {"sites": ["campus", "isp"], "latency_ms": 9.0, "bandwidth_mbps": 300},
                 {"sites": ["cloud", "isp"], "latency_ms": 33.0, "bandwidth_mbps": 200}],
        "device": [{"id": "cloud-4090", "count": 3, "site": "cloud", "reliable": True, **rtx4090},
                   {"id": "campus-4090", "count": 3, "site": "campus", "reliable": True, **rtx4090}] + isp,
    }, "Paper §4.4 real-world testbed: three RTX 4090s in a cloud HPC, three in a campus HPC, six RTX 3080s on a\n"
       "local ISP (two reliable, four unreliable). Llama-33B in double precision with ZeRO-Offload, as the paper\n"
       "ran it. The paper's measured matrix (its Figure 3) is not in the text: the links are assumptions of the\n"
       "same shape (fast inside each HPC, slower between, home uplinks of 80-300 Mbit/s; seed "
       f"{seed + 44}).\n"
       "Memory: with optimizer and parameters offloaded (offload = \"all\") a GPU keeps per layer only the\n"
       "checkpointed input of one 2048-token row in fp64 (6656 x 2048 x 8 B = 109 MB), so a 10 GB RTX 3080 holds\n"
       "93 layers and memory binds little; keeping fp64 weights on the GPU (4.3 GB per layer) would not even let\n"
       "the 12 GPUs hold the model (264 GB > 204 GB).")
    return files


GEO_MODEL = {"preset": "llama-33b", "precision": "fp16", "offload": "optimizer"}
GEO_BATCH = {"tokens": 2048 * 2048, "microbatches": 256}


def geo_files(seed: int = 0) -> dict[str, str]:
    """A generated geo swarm of 64 devices as a swarm file, the size at which planning must stay fast."""
    data = {**geo_swarm_data(64, seed), "model": GEO_MODEL, "batch": GEO_BATCH}
    header = f"A random geo-distributed swarm of 64 devices (geo_swarm_data(64, seed={seed})),\nwith the planner " \
             "benchmark's model and batch."
    return {"geo-64.toml": to_toml(data, header)}


if __name__ == "__main__":
    target = Path(sys.argv[1] if len(sys.argv) > 1 else "peers")
    for name, text in {**paper_case_files(), **geo_files()}.items():
        (target / name).write_text(text)
        print(target / name)
