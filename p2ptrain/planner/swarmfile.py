"""Swarm files (``peers/*.toml``): devices, sites, links, and optionally the model, batch and stage count.

Units: ``latency_ms`` in milliseconds, ``bandwidth_mbps`` in megabits per second, ``tflops`` in 1e12 FLOP/s of
effective training throughput, ``memory_gb`` in GiB (as GPU memory is quoted).

How the link i -> j between two different devices is found, first rule that applies:
1. a ``[[link]]`` naming a device at both ends (``devices = [a, b]``, or ``from``/``to`` where a name is a device
   id): the measured end-to-end link, used as is;
2. a ``[[link]]`` between their sites (``sites = [x, y]`` both directions, ``from``/``to`` one direction; a
   directed entry beats an undirected one);
3. same site: the site's ``latency_ms``/``bandwidth_mbps``, else ``[defaults]``;
4. different sites: ``[defaults] wan_latency_ms``/``wan_bandwidth_mbps``, else ``[defaults]``.
Rules 2-4 then add each device's optional access link: ``access_latency_ms`` adds to the latency and
``access_mbps`` caps the bandwidth (a home GPU behind its own uplink). Among entries of equal rank the later wins.
A device with no ``site`` is its own site, named by its id.
"""
from __future__ import annotations

import tomllib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from p2ptrain.config import AVERAGING_CODECS, OPTIMIZERS
from p2ptrain.planner.cost import Network
from p2ptrain.planner.presets import OFFLOADS, PRECISIONS, PRESETS, ModelSpec, model_spec

MS = 1e-3
MBPS = 1e6 / 8
TFLOPS = 1e12
GIB = 2.0**30

_KEYS: dict[str, tuple[str, ...]] = {
    "defaults": ("latency_ms", "bandwidth_mbps", "wan_latency_ms", "wan_bandwidth_mbps"),
    "site": ("name", "latency_ms", "bandwidth_mbps"),
    "link": ("sites", "devices", "from", "to", "latency_ms", "bandwidth_mbps"),
    "device": ("id", "count", "site", "reliable", "tflops", "memory_gb", "access_latency_ms", "access_mbps"),
    "model": ("preset", "precision", "optimizer", "offload", "averaging_codec", "layers", "flops_per_token_per_layer",
              "activation_bytes_per_token", "param_bytes_per_layer", "memory_bytes_per_layer"),
    "batch": ("tokens", "microbatches"),
    "planner": ("stages",),
}
_SPEC_FIELDS = ("layers", "flops_per_token_per_layer", "activation_bytes_per_token", "param_bytes_per_layer",
                "memory_bytes_per_layer")


class SwarmFileError(ValueError):
    """A swarm file that cannot be used; the message names the file, the entry and the fix."""

    def __init__(self, source: str, entry: str, problem: str, fix: str):
        super().__init__(f"{source}: {entry}: {problem}; fix: {fix}")
        self.source, self.entry, self.problem, self.fix = source, entry, problem, fix


@dataclass(frozen=True, kw_only=True)
class Device:
    id: str
    site: str
    reliable: bool
    flops: float
    memory_bytes: float


@dataclass(frozen=True, kw_only=True)
class Swarm:
    """Devices and their links; ``latency_s[i, j]``/``bandwidth_bytes_s[i, j]`` describe the link i -> j."""

    devices: tuple[Device, ...]
    latency_s: np.ndarray
    bandwidth_bytes_s: np.ndarray
    source: str = "<memory>"
    model: ModelSpec | None = None
    precision: str = "fp32"
    optimizer: str = "adamw"
    offload: str = "none"
    averaging_codec: str | None = None  # how the run's stages average (`--averaging-codec`); None: at the precision
    batch_tokens: int | None = None
    microbatches: int | None = None
    stages: int | None = None
    _index: dict[str, int] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "_index", {d.id: i for i, d in enumerate(self.devices)})
        n = len(self.devices)
        if len(self._index) != n:
            raise ValueError("device ids must be unique")
        if self.latency_s.shape != (n, n) or self.bandwidth_bytes_s.shape != (n, n):
            raise ValueError(f"link matrices must be {n}x{n}")

    @property
    def ids(self) -> list[str]:
        return [d.id for d in self.devices]

    def index(self, device: str | int) -> int:
        return device if isinstance(device, int) else self._index[device]

    def latency(self, i: str | int, j: str | int) -> float:
        return float(self.latency_s[self.index(i), self.index(j)])

    def bandwidth(self, i: str | int, j: str | int) -> float:
        return float(self.bandwidth_bytes_s[self.index(i), self.index(j)])

    @property
    def reliable(self) -> np.ndarray:
        return np.array([d.reliable for d in self.devices], dtype=bool)

    def network(self) -> Network:
        return Network.from_matrices(
            flops=np.array([d.flops for d in self.devices]), memory=np.array([d.memory_bytes for d in self.devices]),
            latency_s=self.latency_s, bandwidth_bytes_s=self.bandwidth_bytes_s)


def load_swarm(path: str | Path) -> Swarm:
    """Read and check a swarm file; raises ``SwarmFileError`` naming the file, the entry and the fix."""
    source = str(path)
    try:
        data = tomllib.loads(Path(path).read_text())
    except FileNotFoundError:
        raise SwarmFileError(source, "file", "no such file", "check the path") from None
    except tomllib.TOMLDecodeError as error:
        raise SwarmFileError(source, "TOML syntax", str(error), "correct the TOML at that line") from None
    return parse_swarm(data, source=source)


def parse_swarm(data: dict[str, Any], *, source: str = "<memory>") -> Swarm:
    return _Parser(data, source).swarm()


class _Parser:
    def __init__(self, data: dict[str, Any], source: str):
        self.data, self.source = data, source

    def fail(self, entry: str, problem: str, fix: str) -> SwarmFileError:
        return SwarmFileError(self.source, entry, problem, fix)

    def table(self, name: str, value: Any, entry: str) -> dict[str, Any]:
        if not isinstance(value, dict):
            raise self.fail(entry, "is not a table", f"write it as [{name}] or [[{name}]] with key = value lines")
        unknown = sorted(set(value) - set(_KEYS[name]))
        if unknown:
            raise self.fail(entry, f"unknown field {unknown[0]!r}", f"use only {', '.join(_KEYS[name])}")
        return value

    def tables(self, name: str) -> list[tuple[str, dict[str, Any]]]:
        raw = self.data.get(name, [])
        if not isinstance(raw, list):
            raise self.fail(f"[{name}]", "must be an array of tables", f"write each entry as [[{name}]]")
        out = []
        for number, value in enumerate(raw, start=1):
            label = value.get("id", value.get("name")) if isinstance(value, dict) else None
            entry = f"[[{name}]] #{number}" + (f" ({label})" if label is not None else "")
            out.append((entry, self.table(name, value, entry)))
        return out

    def number(self, table: dict[str, Any], key: str, entry: str, *, required: bool, minimum: float = 0.0,
               strict: bool = True, hint: str = "") -> float | None:
        if key not in table:
            if required:
                raise self.fail(entry, f"field {key!r} is missing", f"add {key} = {hint or '<number>'}")
            return None
        value = table[key]
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not np.isfinite(value):
            raise self.fail(entry, f"{key} = {value!r} is not a number", f"write {key} as a number")
        if value < minimum or (strict and value == minimum):
            bound = f"> {minimum:g}" if strict else f">= {minimum:g}"
            raise self.fail(entry, f"{key} = {value} is out of range", f"make {key} {bound}")
        return float(value)

    def swarm(self) -> Swarm:
        unknown = sorted(set(self.data) - set(_KEYS))
        if unknown:
            raise self.fail(f"[{unknown[0]}]", "unknown section", f"use only {', '.join(_KEYS)}")
        defaults = self.table("defaults", self.data.get("defaults", {}), "[defaults]")
        sites = self.sites()
        devices, access = self.devices(sites)
        if not devices:
            raise self.fail("[[device]]", "the file lists no device", "add [[device]] entries")
        reliable = sum(d.reliable for d in devices)
        if reliable < 2:
            raise self.fail("[[device]]", f"{reliable} reliable device(s); every stage needs one FS and one BS",
                            "mark at least two devices reliable = true")
        latency, bandwidth = self.links(defaults, sites, devices, access)
        swarm_fields: dict[str, Any] = self.model()
        swarm_fields.update(self.batch())
        stages = self.stages(reliable)
        return Swarm(devices=tuple(devices), latency_s=latency, bandwidth_bytes_s=bandwidth, source=self.source,
                     stages=stages, **swarm_fields)

    def sites(self) -> dict[str, dict[str, float | None]]:
        sites: dict[str, dict[str, float | None]] = {}
        for entry, table in self.tables("site"):
            name = table.get("name")
            if not isinstance(name, str) or not name:
                raise self.fail(entry, "field 'name' is missing", 'add name = "<site name>"')
            if name in sites:
                raise self.fail(entry, f"site {name!r} is defined twice", "merge the two entries or rename one")
            sites[name] = {"latency": self.number(table, "latency_ms", entry, required=False, strict=False),
                           "bandwidth": self.number(table, "bandwidth_mbps", entry, required=False)}
        return sites

    def devices(self, sites: dict[str, Any]) -> tuple[list[Device], list[tuple[float, float]]]:
        devices: list[Device] = []
        access: list[tuple[float, float]] = []
        seen: dict[str, str] = {}
        for entry, table in self.tables("device"):
            base = table.get("id")
            if not isinstance(base, str) or not base:
                raise self.fail(entry, "field 'id' is missing", 'add id = "<device name>"')
            count = table.get("count", 1)
            if isinstance(count, bool) or not isinstance(count, int) or count < 1:
                raise self.fail(entry, f"count = {count!r} is not a positive integer", "make count an integer >= 1")
            if "reliable" not in table:
                raise self.fail(entry, "field 'reliable' is missing",
                                "add reliable = true (a server) or reliable = false (a client)")
            if not isinstance(table["reliable"], bool):
                raise self.fail(entry, f"reliable = {table['reliable']!r} is not a boolean", "write true or false")
            flops = self.number(table, "tflops", entry, required=True, hint="<effective TFLOP/s>")
            memory = self.number(table, "memory_gb", entry, required=True, hint="<GiB of device memory>")
            extra_latency = self.number(table, "access_latency_ms", entry, required=False, strict=False) or 0.0
            uplink = self.number(table, "access_mbps", entry, required=False) or float("inf")
            site = table.get("site")
            if site is not None and site not in sites:
                known = ", ".join(sorted(sites)) or "none defined"
                raise self.fail(entry, f"unknown site {site!r} (sites: {known})",
                                f'add a [[site]] with name = "{site}", or correct or remove the site field')
            ids = [base] if count == 1 and "count" not in table else [f"{base}-{i}" for i in range(count)]
            for device_id in ids:
                if device_id in seen:
                    raise self.fail(entry, f"device id {device_id!r} is already used by {seen[device_id]}",
                                    "give every device a unique id")
                if site is None and device_id in sites:
                    raise self.fail(entry, f"device {device_id!r} has no site and its id names a [[site]]",
                                    "set its site or rename it")
                seen[device_id] = entry
                devices.append(Device(id=device_id, site=site if site is not None else device_id,
                                      reliable=table["reliable"], flops=flops * TFLOPS, memory_bytes=memory * GIB))
                access.append((extra_latency * MS, uplink * MBPS))
        return devices, access

    def links(self, defaults: dict[str, Any], sites: dict[str, dict[str, float | None]], devices: list[Device],
              access: list[tuple[float, float]]) -> tuple[np.ndarray, np.ndarray]:
        names = sorted({d.site for d in devices})
        where = {name: i for i, name in enumerate(names)}
        ids = {d.id: i for i, d in enumerate(devices)}
        self._site_index = [where[d.site] for d in devices]
        s = len(names)
        site_lat = np.full((s, s), np.nan)
        site_bw = np.full((s, s), np.nan)
        rank = np.zeros((s, s))  # 1: undirected [[link]], 2: directed
        pairs: list[tuple[int, int, float, float]] = []
        for entry, table in self.tables("link"):
            ends = self.link_ends(entry, table, sites, where, ids)
            lat = self.number(table, "latency_ms", entry, required=True, strict=False) * MS
            bw = self.number(table, "bandwidth_mbps", entry, required=True) * MBPS
            for (kind, a), (_, b), directed in ends:
                if kind == "device":
                    pairs.append((a, b, lat, bw))
                elif rank[a, b] <= (2 if directed else 1):
                    site_lat[a, b], site_bw[a, b], rank[a, b] = lat, bw, (2 if directed else 1)
        for name, i in where.items():
            if np.isnan(site_lat[i, i]):
                own = sites.get(name, {})
                site_lat[i, i] = self.fallback(own.get("latency"), defaults, "latency_ms", name, name)
                site_bw[i, i] = self.fallback(own.get("bandwidth"), defaults, "bandwidth_mbps", name, name)
        # the pairs of sites no [[link]] sets take the WAN default, which is the same for every pair: looked up once
        # (each home device is a site of its own, so there are ~300,000 pairs at 1,024 devices); the first such pair
        # names the link in the error where there is none
        unset = np.isnan(site_lat)
        if unset.any():
            i, j = (int(k) for k in np.argwhere(unset)[0])
            site_lat[unset] = self.fallback(None, defaults, "latency_ms", names[i], names[j])
            site_bw[unset] = self.fallback(None, defaults, "bandwidth_mbps", names[i], names[j])
        at = np.array(self._site_index)
        extra = np.array([a for a, _ in access])
        uplink = np.array([b for _, b in access])
        latency = site_lat[np.ix_(at, at)] + extra[:, None] + extra[None, :]
        bandwidth = np.minimum(site_bw[np.ix_(at, at)], np.minimum(uplink[:, None], uplink[None, :]))
        for a, b, lat, bw in pairs:
            latency[a, b], bandwidth[a, b] = lat, bw
        np.fill_diagonal(latency, 0.0)
        np.fill_diagonal(bandwidth, np.inf)
        return latency, bandwidth

    def fallback(self, own: float | None, defaults: dict[str, Any], key: str, a: str, b: str) -> float:
        """A site's own value, else the WAN default between sites, else [defaults]; values in SI units."""
        scale = MS if key == "latency_ms" else MBPS
        if own is not None:
            return own * scale
        wan = "wan_" + key
        if a != b and wan in defaults:
            return self.number(defaults, wan, "[defaults]", required=True, strict=key != "latency_ms") * scale
        if key in defaults:
            return self.number(defaults, key, "[defaults]", required=True, strict=key != "latency_ms") * scale
        where = f"links inside site {a!r}" if a == b else f"the link between sites {a!r} and {b!r}"
        fix = (f'add {key} to the [[site]] named "{a}" or to [defaults]' if a == b
               else f'add a [[link]] with sites = ["{a}", "{b}"], or {key} (or wan_{key}) to [defaults]')
        raise self.fail("[defaults]", f"no {key} for {where}", fix)

    def link_ends(self, entry: str, table: dict[str, Any], sites: dict[str, Any], where: dict[str, int],
                  ids: dict[str, int]) -> list[tuple[tuple[str, int], tuple[str, int], bool]]:
        """(end, end, directed) triples of site or device indices that the [[link]] entry sets."""
        forms = [key for key in ("sites", "devices", "from") if key in table]
        if len(forms) != 1 or (("from" in table) != ("to" in table)):
            raise self.fail(entry, "must name its ends one way", "use exactly one of sites = [a, b], "
                                                                 "devices = [a, b], or from = a with to = b")

        def resolve(name: Any, kinds: tuple[str, ...]) -> list[tuple[str, int]]:
            if isinstance(name, str) and "device" in kinds and name in ids:
                return [("device", ids[name])]
            if isinstance(name, str) and "site" in kinds and name in where:
                return [("site", where[name])]
            if isinstance(name, str) and "site" in kinds and name in sites:
                return []  # a declared site with no devices: nothing to link
            what = " or ".join(kinds)
            raise self.fail(entry, f"unknown {what} {name!r}", f"name a defined {what}, or add it")

        if "from" in table:
            kinds, ends, directed = ("device", "site"), [table["from"], table["to"]], True
        else:
            key = forms[0]
            kinds, ends, directed = (("site",) if key == "sites" else ("device",)), table[key], False
            if not isinstance(ends, list) or len(ends) != 2:
                raise self.fail(entry, f"{key} must list two names", f'write {key} = ["a", "b"]')
        first, second = resolve(ends[0], kinds), resolve(ends[1], kinds)
        if not first or not second:
            return []
        a, b = first[0], second[0]
        if a[0] != b[0]:
            # a device at one end and a site at the other: the link from/to every device of that site
            device, site = (a, b) if a[0] == "device" else (b, a)
            members = [("device", i) for name, i in ids.items() if self.site_of(name, ids) == site[1]]
            return [((device, m) if a[0] == "device" else (m, device)) + (True,) for m in members]
        triples = [(a, b, directed)]
        if not directed:
            triples.append((b, a, False))
        return triples

    def site_of(self, device_id: str, ids: dict[str, int]) -> int:
        return self._site_index[ids[device_id]]

    def model(self) -> dict[str, Any]:
        if "model" not in self.data:
            return {}
        table = self.table("model", self.data["model"], "[model]")
        precision = table.get("precision", "fp32")
        offload = table.get("offload", "none")
        optimizer = table.get("optimizer", "adamw")
        if precision not in PRECISIONS:
            raise self.fail("[model]", f"unknown precision {precision!r}", f"use one of {', '.join(PRECISIONS)}")
        if optimizer not in OPTIMIZERS:
            raise self.fail("[model]", f"unknown optimizer {optimizer!r}", f"use one of {', '.join(OPTIMIZERS)}")
        if offload not in OFFLOADS:
            raise self.fail("[model]", f"unknown offload {offload!r}", f"use one of {', '.join(OFFLOADS)}")
        codec = table.get("averaging_codec")
        if codec is not None and codec not in AVERAGING_CODECS:
            raise self.fail("[model]", f"unknown averaging_codec {codec!r}",
                            f"use one of {', '.join(AVERAGING_CODECS)}")
        explicit = [key for key in _SPEC_FIELDS if key in table]
        if "preset" in table:
            if explicit:
                raise self.fail("[model]", f"sets both preset and {explicit[0]}",
                                "give either preset or all of " + ", ".join(_SPEC_FIELDS))
            if table["preset"] not in PRESETS:
                raise self.fail("[model]", f"unknown preset {table['preset']!r}", f"use one of {', '.join(PRESETS)}")
            return {"model": model_spec(table["preset"], precision=precision, optimizer=optimizer, offload=offload,
                                        averaging_codec=codec),
                    "precision": precision, "optimizer": optimizer, "offload": offload, "averaging_codec": codec}
        if codec is not None:
            raise self.fail("[model]", "sets averaging_codec for a model given by its numbers",
                            "fold the codec into param_bytes_per_layer, or name a preset")
        if "optimizer" in table:
            raise self.fail("[model]", "sets optimizer for a model given by its numbers",
                            "fold its state into memory_bytes_per_layer, or name a preset")
        values = {key: self.number(table, key, "[model]", required=True) for key in _SPEC_FIELDS}
        if not float(values["layers"]).is_integer():
            raise self.fail("[model]", f"layers = {values['layers']} is not an integer", "write layers as an integer")
        values["layers"] = int(values["layers"])
        return {"model": ModelSpec(name="custom", **values), "precision": precision, "offload": offload}

    def batch(self) -> dict[str, int]:
        if "batch" not in self.data:
            return {}
        table = self.table("batch", self.data["batch"], "[batch]")
        out = {}
        for key, name in (("tokens", "batch_tokens"), ("microbatches", "microbatches")):
            value = table.get(key)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise self.fail("[batch]", f"{key} = {value!r} is missing or not a positive integer",
                                f"add {key} = <integer >= 1>")
            out[name] = value
        if out["microbatches"] > out["batch_tokens"]:
            raise self.fail("[batch]", "more microbatches than tokens", "make microbatches <= tokens")
        return out

    def stages(self, reliable: int) -> int | None:
        if "planner" not in self.data:
            return None
        table = self.table("planner", self.data["planner"], "[planner]")
        stages = table.get("stages")
        if isinstance(stages, bool) or not isinstance(stages, int) or stages < 1:
            raise self.fail("[planner]", f"stages = {stages!r} is not a positive integer", "make stages >= 1")
        if 2 * stages > reliable:
            raise self.fail("[planner]", f"stages = {stages} needs {2 * stages} reliable devices (one FS and one BS "
                                         f"per stage) but the file has {reliable}",
                            f"lower stages to at most {reliable // 2} or mark more devices reliable = true")
        return stages
