"""What one node is, beside the run's recipe: its role and place, its network, how it finds its place by the plan,
and how long it feeds data. `python -m p2ptrain.peer` fills these from its flags; Python code builds them directly.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from p2ptrain.config import ConfigError, check_device
from p2ptrain.planner.join import STAGE_CHOICES
from p2ptrain.protocol.layout import PeerRole, Placement

if TYPE_CHECKING:
    from hivemind.dht.crypto import RSASignatureValidator

    from p2ptrain.live.authority import Owner, ServerCertificate

# how a worker misbehaves on purpose, for tests: corrupts its results, averages slowly ("slow-averaging": each
# round takes SLOW_AVERAGING_S longer, as over a slow link), or fails one round ("failed-averaging": its round of
# epoch FAILED_AVERAGING_EPOCH raises before it starts)
FAULTS = ("none", "wrong-shape", "wrong-dtype", "nan", "slow-averaging", "failed-averaging", "overflow")


@dataclass(frozen=True, kw_only=True)
class RecipeOptions:
    """How a peer takes the swarm's recipe (`p2ptrain.recipe`): the recipe's values it was given (RunConfig field ->
    value) are checked against the carried recipe and the rest taken from it. A peer given none but the run id (or
    not even that: it takes the run the swarm has) waits for the recipe, unless it may be the data source that
    publishes it (a stage-0 FS, or a server the plan places)."""

    given: dict[str, object] = field(default_factory=dict)
    layers_given: bool = False  # --layers: the stage's layers stay as given, not the carried recipe's even split

    @property
    def discovers_run(self) -> bool:
        return "run_id" not in self.given

    @property
    def given_nothing(self) -> bool:
        return not set(self.given) - {"run_id"}


@dataclass(frozen=True, kw_only=True)
class NetworkOptions:
    """How the node joins the DHT, as hivemind's flags say it."""

    initial_peers: tuple[str, ...] = ()
    host_maddrs: tuple[str, ...] = ("/ip4/0.0.0.0/tcp/0",)
    announce_maddrs: tuple[str, ...] | None = None
    identity_path: Path | None = None  # this peer's private key, created if missing
    client_mode: bool = False  # dial out only (behind NAT); in averaging it sends and receives but reduces nothing
    maddrs_file: Path | None = None  # where to write this peer's visible multiaddrs once it is up


@dataclass(frozen=True, kw_only=True)
class PlanningOptions:
    """A node started without a placement takes it from the plan signed by `planner_key`."""

    planner_key: bytes  # the planner's RSASignatureValidator.local_public_key


@dataclass(frozen=True, kw_only=True)
class PlannerOptions:
    """A server that is also the live planner: it plans the announced peers, publishes the plan signed, and takes
    its own place from it (its `PlanningOptions` trust its own key)."""

    signer: RSASignatureValidator  # holds the planner's private key
    planner: str = "refined"  # one of p2ptrain.planner.PLANNERS
    stages: int | None = None  # force this many stages
    expect: int | None = None  # servers to wait for, this one included (default: 2 per stage, at least 2)


@dataclass(frozen=True, kw_only=True)
class NodeOptions:
    role: PeerRole
    # None: a server takes its place from the plan (`planning`); a client takes the plan's place if a plan is up,
    # else joins by probing the servers of every stage (`stage_choice`)
    placement: Placement | None = None
    computes: bool = False  # a server that also computes its stage's layers (clients always do)
    # a BS that holds its stage's parameters and optimizer state as an FS always does (`holds_state`); a BS that
    # computes holds them anyway
    keep_state: bool = False
    network: NetworkOptions = field(default_factory=NetworkOptions)
    planning: PlanningOptions | None = None
    planner: PlannerOptions | None = None
    epochs: int = 20  # global batches the data source feeds
    max_in_flight: int = 4  # microbatches the data source keeps in the pipeline at once
    compute_power: float | None = None  # this worker's FLOP/s; None: measured
    threads: int = 1  # torch threads of this process
    keep_freed_memory: bool = True  # glibc keeps freed buffers of up to 64 MiB for reuse (`node.malloc`)
    device: str = "auto"  # where a worker computes: auto (CUDA when there is one), cpu, cuda or cuda:N
    recompute: bool = False  # activation checkpointing: a worker keeps each block's input only (`StageModel`)
    dump_grads: Path | None = None  # where workers save the averaged gradients of each epoch (tests)
    fault: str = "none"  # one of FAULTS (tests)
    stage_choice: str = "cost"  # how a client without a placement picks its stage: one of STAGE_CHOICES
    probe_delay_s: float = 0.0  # tests: this peer answers link probes as over a slow link (live.probe.LinkProbe)
    checkpoint_dir: Path | None = None  # a server: where it saves its stage's state, and restores it from at start
    checkpoint_every: int = 10  # ...every this many epochs, and when it stops
    export_to: Path | None = None  # a server that is the data source: where it writes the trained model at the end
    eval_data: Path | None = None  # the data source: a held-out text file to evaluate the swarm's parameters on...
    eval_every: int = 10  # ...after every this many global batches...
    eval_rows: int = 64  # ...on this many windows of it
    owner: Owner | None = None  # the run's owner: only the servers it authorized are trusted (`live.authority`)
    certificate: ServerCertificate | None = None  # a server of an owned run: the owner's word for its place
    recipe: RecipeOptions | None = None  # None: the config is the whole recipe, carried or not (Python callers)

    def __post_init__(self) -> None:
        if self.role not in ("bootstrap", "server", "client"):
            raise ConfigError("role", self.role, "unknown role; choose bootstrap, server or client")
        if self.role == "server" and (self.placement is None) == (self.planning is None):
            raise ConfigError("placement", self.placement, "a server needs either a placement or planning options to "
                                                           "take its place from the plan")
        if self.role == "client" and self.placement is not None and self.planning is not None:
            raise ConfigError("placement", self.placement, "a client with a placement takes no place from a plan")
        if self.planner is not None:
            if self.role != "server" or self.planning is None:
                raise ConfigError("planner", self.planner, "only a server placed by the plan can be the planner")
            if self.planning.planner_key != self.planner.signer.local_public_key:
                raise ConfigError("planner", self.planner, "the planning server trusts the plans of its own key only")
        if self.placement is not None:
            if (self.role == "server") != (self.placement.server_role is not None):
                raise ConfigError("server_role", self.placement.server_role, "a server is an FS or a BS, and only a "
                                                                             "server is")
            start, end = self.placement.layers
            if not 0 <= self.placement.stage < self.placement.num_stages or not 0 <= start < end:
                raise ConfigError("stage", self.placement, "not a stage with layers")
        if self.certificate is not None and (self.role != "server" or self.owner is None):
            raise ConfigError("certificate", self.certificate, "a certificate is a server's, checked against the "
                                                               "run's owner key")
        if self.owner is not None and self.role == "server" and self.certificate is None:
            raise ConfigError("certificate", None, "a server of a run with an owner needs the owner's certificate "
                                                   "for its place (python -m p2ptrain.owner authorize)")
        if self.certificate is not None and self.placement is not None and (
                self.certificate.stage, self.certificate.role) != (self.placement.stage, self.placement.server_role):
            raise ConfigError("certificate", self.certificate, f"it authorizes the {self.certificate.role.upper()} of "
                                                               f"stage {self.certificate.stage}, not this server's place")
        check_device(self.device)
        if self.computes and self.role != "server":
            raise ConfigError("computes", self.computes, "only a server is told to compute; a client always does")
        if self.checkpoint_dir is not None and self.role != "server":
            raise ConfigError("checkpoint_dir", self.checkpoint_dir, "servers hold the stage's state; a "
                                                                     f"{self.role} saves none")
        if self.export_to is not None and self.role != "server":
            raise ConfigError("export_to", self.export_to, "the data source (the stage-0 FS) exports the model; a "
                                                           f"{self.role} does not")
        if self.keep_state and self.role != "server":
            raise ConfigError("keep_state", self.keep_state, "a BS is told to hold the stage's state; a "
                                                             f"{self.role} does not")
        if self.checkpoint_dir is not None and self.placement is not None and not self.holds_state(
                self.placement.server_role):
            raise ConfigError("checkpoint_dir", self.checkpoint_dir, "a BS holds no state to save unless started "
                                                                     "with --keep-state")
        for name in ("epochs", "max_in_flight", "threads", "checkpoint_every", "eval_every", "eval_rows"):
            if getattr(self, name) < 1:
                raise ConfigError(name, getattr(self, name), "must be at least 1")
        if self.compute_power is not None and not (math.isfinite(self.compute_power) and self.compute_power > 0):
            raise ConfigError("compute_power", self.compute_power, "must be a positive number of FLOP/s")
        if self.fault not in FAULTS:
            raise ConfigError("fault", self.fault, f"unknown fault; choose one of {', '.join(FAULTS)}")
        if self.stage_choice not in STAGE_CHOICES:
            raise ConfigError("stage_choice", self.stage_choice,
                              f"unknown stage choice; choose one of {', '.join(STAGE_CHOICES)}")
        if not (math.isfinite(self.probe_delay_s) and self.probe_delay_s >= 0):
            raise ConfigError("probe_delay_s", self.probe_delay_s, "must be 0 or more seconds")

    @property
    def does_compute(self) -> bool:
        return self.role == "client" or self.computes

    @property
    def waits_for_recipe(self) -> bool:
        """Whether this peer waits for the swarm's recipe: one given no recipe values that cannot publish one."""
        may_publish = self.role == "server" and (self.placement is None or (
            self.placement.stage == 0 and self.placement.server_role == "fs"))
        return self.recipe is not None and self.recipe.given_nothing and not may_publish

    def holds_state(self, server_role: str | None) -> bool:
        """Whether this peer holds its stage's parameters and optimizer state in the role it took: a worker, an FS,
        or a BS that computes or was told to keep the state."""
        return self.does_compute or server_role == "fs" or (server_role == "bs" and self.keep_state)
