"""The two configs of a peer, both torch-free:

- `RunConfig`, the run's recipe as every peer sees it (model, stages, batch, data, optimizer, wire codec): every
  peer of a run must be given the same one, and it is read once and shared, never carried on messages.
- `RuntimeConfig`, every timeout, retry, backoff, lease and poll period of the runtime in one place with its
  default, as Petals keeps its client's in one config.
"""
from __future__ import annotations

import dataclasses
import functools
import math
import re
from dataclasses import dataclass
from pathlib import Path

from p2ptrain.models import TRAINABLE, ModelConfig, model_config
from p2ptrain.models.configs import even_split
from p2ptrain.models.hf_config import CheckpointError, read_config
from p2ptrain.models.registry import trainable

CODECS: tuple[str, ...] = ("none", "fp16", "int8")  # codecs of activations and gradients on the wire
INT8_BLOCKSIZE = 256  # values that share one float32 absmax in the int8 codec (`p2ptrain.compression` says why)
# bytes a float32 value takes on the wire in each codec, headers aside (int8: a code plus its block's absmax share)
WIRE_BYTES: dict[str, float] = {"none": 4.0, "fp16": 2.0, "int8": 1.0 + 4.0 / INT8_BLOCKSIZE}
# how a stage's all-reduce sends its gradients (`--averaging-codec`), and the wire codec of CODECS that does it
AVERAGING_CODECS: dict[str, str] = {"fp32": "none", "fp16": "fp16", "int8": "int8"}
# what the servers do with the rows whose parameter gradients a vanished worker took: "taskpool" redoes them at their
# stage from the inputs the FS keeps (the paper's task pool); "swarm" drops them, and the data source feeds their
# microbatches again from stage 0 in a later epoch (what SWARM does), so the two compare on one runtime
FAULT_POLICIES: tuple[str, ...] = ("taskpool", "swarm")
OPTIMIZERS: tuple[str, ...] = ("adamw", "adamw8bit", "lamb")
# what a stage computes in (`client.device`): fp32, or bf16 or fp16 under autocast, with fp32 master weights and
# optimizer state either way; fp16 with a dynamic loss scale (`protocol.optimization.LossScaleRule`)
PRECISIONS: tuple[str, ...] = ("fp32", "bf16", "fp16")

RUN_ID_PATTERN = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,63}")
DEVICE_PATTERN = re.compile(r"auto|cpu|cuda(:\d+)?")  # what --device takes (`client.device.resolve_device`)


def check_run_id(run_id: str) -> None:
    """A run id prefixes DHT keys: letters, digits and a few marks only."""
    if not RUN_ID_PATTERN.fullmatch(run_id):
        raise ConfigError("run_id", run_id, "use 1 to 64 letters, digits, '.', '_' or '-'")


def check_device(device: str) -> None:
    """A device name as `--device` takes it; whether this machine has it is checked where the peer computes."""
    if not DEVICE_PATTERN.fullmatch(device):
        raise ConfigError("device", device, "unknown device; use auto, cpu, cuda or cuda:N")


class ConfigError(ValueError):
    """A config value that cannot work: `field` names it (so a command line can name its flag), `problem` says
    what to fix."""

    def __init__(self, field: str, value: object, problem: str):
        super().__init__(f"{field} = {value!r}: {problem}")
        self.field, self.value, self.problem = field, value, problem


@dataclass(frozen=True, kw_only=True)
class RunConfig:
    run_id: str = "p2ptrain"  # prefix of the swarm's DHT keys
    model: str = "llama-tiny"  # a preset of p2ptrain.models.TRAINABLE
    num_stages: int = 2
    rows_per_microbatch: int = 8
    microbatches: int = 4  # per global batch (epoch)
    seq_len: int = 64
    seed: int = 0
    optimizer: str = "adamw"  # one of OPTIMIZERS
    lr: float = 3e-3  # the peak learning rate, reached after the warm-up
    warmup_epochs: int = 0  # the learning rate rises linearly to `lr` over this many epochs...
    decay_epochs: int = 0  # ...then falls along a cosine to `min_lr` at this epoch (0: no decay), and stays there
    min_lr: float = 0.0
    weight_decay: float = 0.01  # on matrices and embeddings only (StageModel.optimizer_groups)
    clip_norm: float = 0.0  # clip the gradient by its global norm across all stages to this (0: no clipping)
    # delayed parameter updates: an epoch computes on the parameters before the last step; None (the default) turns
    # them on where they apply (not with fp16's loss scale, nor with average_every > 1), and a config holds the bool
    dpu: bool | None = None
    # with dpu (nothing without): an epoch computes where a step on the stage's mean gradient of the epoch before (from
    # its deposits) takes the stage's parameters, not on the parameters before the step in flight (which steps on the
    # round's average); off, delayed updates cost 1.22x one process's held-out loss on the convergence benchmark
    dpu_lookahead: bool = True
    # with dpu: no drain at the epoch boundary. The data source feeds the next epoch while the current one's last
    # microbatches are still in backward, and a worker with no task of its epoch takes the next one's, on the parameters
    # delayed updates give that epoch (its stage's step before last, one epoch stale, as dpu allows), or with the
    # look-ahead where a step on its own gradient so far takes them, until the look-ahead on the stage's mean lands
    overlap_epochs: bool = False
    precision: str = "fp32"  # what the stages compute in: one of PRECISIONS
    loss_scale: float = 2.0**16  # fp16: the loss scale the run starts at (torch's GradScaler's)
    loss_scale_growth: int = 100  # fp16: the loss scale doubles after this many epochs in a row without overflow
    # the master copy, accumulated gradients and optimizer state in host memory (ZeRO-Offload), only the weights
    # computed with on the device
    offload_optimizer: bool = False
    averaging_codec: str = "int8"  # how the stage's all-reduce and its deposits send gradients: one of AVERAGING_CODECS
    # (int8: a quarter of fp32's bytes, held-out loss within 2% of one process's; fp32: exact)
    # DiLoCo: each worker steps on its own gradients, and the stage averages once every `average_every` epochs, the
    # difference its parameters moved since the last round, on which an outer SGD with Nesterov momentum steps
    average_every: int = 1  # 1: average the gradients at every epoch
    outer_lr: float = 0.7
    outer_momentum: float = 0.9
    compression: str = "none"  # codec of activations and gradients: one of CODECS
    data: str | None = None  # a local UTF-8 text file; None: the embedded corpus
    tokenizer: str | None = None  # a local Hugging Face tokenizer.json; None: byte-level tokens (`data.ByteTokenizer`)
    fault_policy: str = "taskpool"  # one of FAULT_POLICIES
    # a local Hugging Face checkpoint directory the run starts from (`models.hf`): its config.json is the model's
    # config, and `model` only names it
    init_from: str | None = None
    # the model's whole config, when it is no preset's (a swarm's carried recipe, a Hugging Face checkpoint); `model`
    # then only names it
    architecture: ModelConfig | None = None

    def __post_init__(self) -> None:
        check_run_id(self.run_id)
        if self.dpu is None:
            object.__setattr__(self, "dpu", self.precision != "fp16" and self.average_every == 1)
        if self.init_from is not None:
            pretrained = checkpoint_config(self.init_from)  # a ConfigError if it is no checkpoint
            if self.architecture is not None and self.architecture != pretrained:
                raise ConfigError("init_from", self.init_from, "its config.json is another model than the run's")
        elif self.architecture is None and self.model not in TRAINABLE:
            raise ConfigError("model", self.model, f"unknown model; choose one of {', '.join(TRAINABLE)}")
        if not trainable(self.model_config):
            raise ConfigError("model", self.model, f"a {self.model_config.family} model cannot be trained by a swarm "
                                                   "yet")
        layers = self.model_config.num_layers
        if not 1 <= self.num_stages <= layers:
            raise ConfigError("num_stages", self.num_stages, f"must be between 1 and the model's {layers} layers")
        for name in ("rows_per_microbatch", "microbatches", "seq_len"):
            if getattr(self, name) < 1:
                raise ConfigError(name, getattr(self, name), "must be at least 1")
        if self.seq_len > self.model_config.max_seq_len:
            raise ConfigError("seq_len", self.seq_len,
                              f"exceeds the model's max_seq_len {self.model_config.max_seq_len}")
        if self.seed < 0:
            raise ConfigError("seed", self.seed, "must be 0 or more")
        if not (math.isfinite(self.lr) and self.lr > 0):
            raise ConfigError("lr", self.lr, "must be a positive number")
        if self.optimizer not in OPTIMIZERS:
            raise ConfigError("optimizer", self.optimizer, f"unknown optimizer; choose one of {', '.join(OPTIMIZERS)}")
        for name in ("weight_decay", "min_lr", "clip_norm"):
            if not (math.isfinite(getattr(self, name)) and getattr(self, name) >= 0):
                raise ConfigError(name, getattr(self, name), "must be 0 or more")
        if self.min_lr > self.lr:
            raise ConfigError("min_lr", self.min_lr, f"exceeds the peak learning rate {self.lr}")
        if self.warmup_epochs < 0:
            raise ConfigError("warmup_epochs", self.warmup_epochs, "must be 0 or more")
        if self.decay_epochs and self.decay_epochs <= self.warmup_epochs:
            raise ConfigError("decay_epochs", self.decay_epochs,
                              f"must be 0 (no decay) or past the warm-up's {self.warmup_epochs} epochs")
        if self.precision not in PRECISIONS:
            raise ConfigError("precision", self.precision, f"unknown precision; choose one of {', '.join(PRECISIONS)}")
        if not (math.isfinite(self.loss_scale) and self.loss_scale > 0):
            raise ConfigError("loss_scale", self.loss_scale, "must be a positive number")
        if self.loss_scale_growth < 1:
            raise ConfigError("loss_scale_growth", self.loss_scale_growth, "must be at least 1")
        if self.precision == "fp16" and self.dpu:
            # the next epoch would compute at a loss scale the step in flight may still halve
            raise ConfigError("dpu", self.dpu, "fp16's loss scale is decided by each step, before the next epoch "
                                               "computes; turn delayed updates off, or use bf16")
        if self.precision == "fp16" and self.average_every > 1:
            # an overflow in a worker's own step between rounds would be its own decision, not the stage's
            raise ConfigError("average_every", self.average_every, "fp16 skips overflowing steps alike on every "
                                                                   "worker, which needs a round at every epoch; use 1, "
                                                                   "or bf16")
        if self.compression not in CODECS:
            raise ConfigError("compression", self.compression, f"unknown codec; choose one of {', '.join(CODECS)}")
        if self.averaging_codec not in AVERAGING_CODECS:
            raise ConfigError("averaging_codec", self.averaging_codec,
                              f"unknown codec; choose one of {', '.join(AVERAGING_CODECS)}")
        if self.average_every < 1:
            raise ConfigError("average_every", self.average_every, "must be at least 1 (1: average at every epoch)")
        if not (math.isfinite(self.outer_lr) and self.outer_lr > 0):
            raise ConfigError("outer_lr", self.outer_lr, "must be a positive number")
        if not (math.isfinite(self.outer_momentum) and 0 <= self.outer_momentum < 1):
            raise ConfigError("outer_momentum", self.outer_momentum, "must be in [0, 1)")
        if self.average_every > 1 and self.clip_norm:
            # a worker's own gradients between rounds have no global norm that all stages share
            raise ConfigError("clip_norm", self.clip_norm, "cannot clip with average_every > 1; set it to 0")
        if self.average_every > 1 and self.shares_across_stages:
            # between rounds each stage would step its copy of a shared tensor on its own gradients alone
            raise ConfigError("average_every", self.average_every, "the model's stages share tensors (tied "
                                                                   "embeddings, shared blocks), which stay equal only "
                                                                   "when averaged at every epoch; use 1")
        if self.average_every > 1 and self.dpu:
            raise ConfigError("dpu", self.dpu, "delayed updates are for average_every = 1; turn one of them off")
        if self.overlap_epochs and not self.dpu:
            # without delayed updates the next epoch computes on the step of this one, which is not taken yet
            raise ConfigError("overlap_epochs", self.overlap_epochs, "the next epoch may start before this one steps "
                                                                     "only with delayed updates; turn dpu on")
        if self.fault_policy not in FAULT_POLICIES:
            raise ConfigError("fault_policy", self.fault_policy,
                              f"unknown policy; choose one of {', '.join(FAULT_POLICIES)}")
        if self.overlap_epochs and self.fault_policy != "taskpool":
            raise ConfigError("overlap_epochs", self.overlap_epochs, "fault policy swarm feeds lost rows again in a "
                                                                     "later epoch, one epoch at a time; use taskpool")
        if self.tokenizer is not None:
            tokens = vocab_size(self.tokenizer)  # a ConfigError if it is no tokenizer
            if tokens > self.model_config.vocab_size:
                raise ConfigError("tokenizer", self.tokenizer, f"has {tokens} tokens, more than the model's "
                                                               f"vocabulary of {self.model_config.vocab_size}")
        if not self.model_config.causal:
            self._check_masking()
        if self.data is not None:
            self._check_data(Path(self.data))

    def _check_masking(self) -> None:
        """A masked-LM model (`data.Masking`) needs a mask token: id 256 past the byte-level tokens, or the
        tokenizer's."""
        if self.tokenizer is None:
            if self.model_config.vocab_size <= 256:
                raise ConfigError("model", self.model, "a masked-LM model on byte-level tokens takes id 256 for its "
                                                       "mask token: it needs a vocabulary of 257 or more")
            return
        from p2ptrain.tokenizer import mask_token_id

        if mask_token_id(self.tokenizer) is None:
            raise ConfigError("tokenizer", self.tokenizer, "has no mask token ([MASK] or <mask>), which a masked-LM "
                                                           "model needs")

    def _check_data(self, path: Path) -> None:
        if path.is_dir():
            return  # a folder's documents are read and checked where they are trained on (`data.load_documents`)
        if not path.is_file():
            raise ConfigError("data", self.data, "no such file or folder; give a local UTF-8 text file, a folder of "
                                                 ".txt files or a datasets folder (save_to_disk)")
        try:
            with path.open("rb") as f:
                size = len(f.read(self.seq_len + 1))
        except OSError as e:
            raise ConfigError("data", self.data, f"cannot be read ({e.strerror})") from None
        if size < self.seq_len + 1 and self.tokenizer is None:  # byte-level tokens: one per byte
            raise ConfigError("data", self.data, f"{size} bytes, too short for one sequence of {self.seq_len} + 1 "
                                                 "tokens")

    @property
    def model_config(self) -> ModelConfig:
        """The model's config: `architecture` as it is, else the checkpoint's it starts from, else the preset's, with
        a tokenizer's size for vocabulary."""
        if self.architecture is not None:
            return self.architecture
        if self.init_from is not None:
            return checkpoint_config(self.init_from)
        preset = model_config(self.model)
        if self.tokenizer is None:
            return preset
        return dataclasses.replace(preset, vocab_size=vocab_size(self.tokenizer))

    @property
    def shares_across_stages(self) -> bool:
        """Whether stages hold copies of one tensor, whose gradients are summed across them at every epoch
        (`protocol.sharing`): tied embeddings in several stages, or ALBERT's blocks."""
        model = self.model_config
        return self.num_stages > 1 and (model.tie_embeddings or model.family == "albert")

    @property
    def averaging_wire(self) -> str:
        """The wire codec (of CODECS) that `averaging_codec` sends with."""
        return AVERAGING_CODECS[self.averaging_codec]

    def averages_at(self, epoch: int) -> bool:
        """Whether the stage averages when `epoch` closes: every epoch, or the last of every `average_every`."""
        return (epoch + 1) % self.average_every == 0

    @property
    def rows_per_epoch(self) -> int:
        return self.rows_per_microbatch * self.microbatches

    @property
    def tokens_per_epoch(self) -> int:
        return self.rows_per_epoch * self.seq_len

    def stage_layers(self, stage: int) -> tuple[int, int]:
        """Layers [start, end) of a stage when the layers are split evenly (a plan may set them instead)."""
        if not 0 <= stage < self.num_stages:
            raise ConfigError("stage", stage, f"not in 0..{self.num_stages - 1} (the run has {self.num_stages} stages)")
        return even_split(self.model_config.num_layers, self.num_stages)[stage]


@functools.lru_cache(maxsize=8)
def vocab_size(tokenizer: str) -> int:
    """The number of token ids of a local Hugging Face tokenizer (a tokenizer.json, or a transformers tokenizer
    folder; added tokens included); a ConfigError says what is wrong with it. Nothing is downloaded: a name that is
    no local file or folder is refused."""
    from p2ptrain.tokenizer import load_tokenizer

    try:
        return load_tokenizer(tokenizer)[1]
    except (OSError, ValueError) as e:
        raise ConfigError("tokenizer", tokenizer, str(e)) from None


@functools.lru_cache(maxsize=8)
def checkpoint_config(path: str) -> ModelConfig:
    """The model config of a local Hugging Face checkpoint directory; a ConfigError says what is wrong with it."""
    try:
        return read_config(path)
    except CheckpointError as e:
        raise ConfigError("init_from", path, str(e)) from None


@dataclass(frozen=True, kw_only=True)
class RuntimeConfig:
    """Timeouts, retries, backoffs, leases and poll periods, in seconds unless named otherwise. The defaults suit a
    loopback swarm and a slow WAN alike; `python -m p2ptrain.peer` sets the lease and averaging timeouts."""

    # deadlines that follow the link (`protocol.deadlines`, docs/design.md §5): a wait for bytes is its floor plus
    # deadline_slack times their time at the rate measured on the link, or at slowest_uplink_mbit until one was
    deadline_slack: float = 3.0
    slowest_uplink_mbit: float = 1.0
    # transport
    rpc_timeout_s: float = 60.0  # longest one RPC may go with nothing of it moving (no chunk sent or received)
    keep_streams: bool = True  # calls reuse streams kept open by earlier calls to the same peer (`transport`)
    push_attempts: int = 3  # a worker pushes a result this many times when its reply is lost in transport
    push_backoff_s: float = 0.2  # every retried call backs off exponentially from this...
    delivery_backoff_max_s: float = 5.0  # ...up to this; a server retries a push to another server until it lands
    # workers
    push_behind: bool = False  # a worker pushes a task's result while it polls for and computes its next task, the
    # result's acknowledgement (the server confirms it with its issuer first) off its critical path (`client.worker`)
    unreachable_backoff_s: float = 0.2  # after a server did not answer a task poll
    leave_timeout_s: float = 5.0  # a stopping worker tells its servers it leaves for at most this long
    no_servers_wait_s: float = 0.5  # a worker that knows no FS of its stage looks again after this
    fs_poll_wait_s: float = 0.1  # how long an FS holds a worker's task poll open when it has no work...
    fs_poll_wait_backward_s: float = 0.02  # ...and while the worker awaits backward tasks from the BS (it holds
    # forward states): the FS's poll wakes on the FS's news only, so this is the longest a backward task waits
    bs_poll_wait_s: float = 0.0  # the same for a BS (workers ask BS first and must not sit there)...
    bs_poll_wait_backward_s: float = 0.1  # ...but the first stage's only BS holds it up to this while the worker holds
    # forward states and its FS had no work for it: the data source feeds rows only as backward passes complete, so
    # its next task is a backward one, which answers the hold at once (a loop of short polls cost ~20 calls a second)
    idle_poll_wait_s: float = 4.0  # how long the only FS of a stage holds a poll while nothing of the stage is out;
    # its news (rows, the rows all back, a closure) answer the poll at once, so this only spaces an idle swarm's polls
    # (at most half the FS's worker_lost_s: a worker in a held poll is heard only when it polls again)
    averaging_timeout_s: float = 30.0  # the floor of an all-reduce round's deadlines (`StageAllReduce`) and of a
    # worker's wait for the global gradient norm after it (clip_norm), asking the data source again every norm_poll_s;
    # an FS counts a worker gone whose gradients have not come after its last result, nor bytes of them for this long
    norm_poll_s: float = 0.05
    # servers
    lease_timeout_s: float = 30.0  # the longest a worker may take on a task before it goes back to the pool; a
    # worker this server has timed gets lease_slack times its measured time for the task's rows, at least lease_min_s
    lease_slack: float = 4.0
    lease_min_s: float = 2.0
    worker_lost_s: float = 10.0  # a worker silent this long is gone: its leases go back to the pool, and the rows
    # whose parameter gradients it held in an epoch not yet closed are redone by others
    probe_silent_s: float = 1.0  # a worker silent this long while it holds a lease or gradients is probed (and
    # during an all-reduce each groupmate this often): a process that cannot be reached is gone at once (the round
    liveness_timeout_s: float = 2.0  # fails); an answer, or none in this long, leaves it to worker_lost_s (the
    # round to averaging_timeout_s)
    active_worker_s: float = 30.0  # an FS sizes tasks for the workers that polled within this long
    refusals_before_ban: int = 3  # a worker whose results were refused this many times gets no tasks for ban_s,
    ban_s: float = 30.0  # ...doubled at each ban after the first
    closures_kept: int = 4  # epochs an FS remembers the averaging group of, for workers still finishing one
    feeder_poll_s: float = 0.25  # how often the data source, waiting on its FS's progress (which wakes it at once),
    # looks whether it was stopped
    server_check_s: float = 1.0  # the data source pings every stage server this often...
    server_lost_s: float = 10.0  # ...and holds one lost that has not answered for this long (until it answers);
    # a worker stops waiting for an FS that has not answered it for this long to close an epoch
    # DHT
    record_period_s: float = 30.0  # a peer re-stores its records this often...
    record_ttl_s: float = 90.0  # ...and they expire this long after the last store
    membership_period_s: float = 5.0  # a peer re-reads who serves each stage this often while that changes or a
    # server stopped answering (`MembershipCache.suspect`)...
    membership_idle_period_s: float = 30.0  # ...backing off to this while its reads find it unchanged...
    membership_retry_s: float = 0.5  # ...and this often while a stage lacks an FS or a BS
    metrics_period_s: float = 3.0  # a peer publishes its training metrics this often when they changed
    # the carried recipe (`p2ptrain.recipe`)
    recipe_timeout_s: float = 300.0  # a peer given no recipe waits this long for the swarm's (and for its run)
    recipe_poll_s: float = 1.0  # ...reading the DHT this often
    # live planning
    plan_timeout_s: float = 600.0  # a peer waits this long for a plan that places it, a planner for the servers
    plan_poll_s: float = 2.0  # a peer waiting for a plan reads the DHT this often
    probe_timeout_s: float = 10.0  # longest one link measurement may take
    progress_every_s: float = 15.0  # waiting peers and planners log their progress this often

    @property
    def slowest_uplink(self) -> float:
        """`slowest_uplink_mbit` in bytes/s."""
        return self.slowest_uplink_mbit * 1e6 / 8

    def __post_init__(self) -> None:
        for name, value in vars(self).items():
            minimum = 1 if name in ("push_attempts", "refusals_before_ban", "closures_kept") else 0
            if not (math.isfinite(value) and value >= minimum):
                raise ConfigError(name, value, f"must be at least {minimum}")
        if not 0 < self.record_period_s < self.record_ttl_s:
            raise ConfigError("record_period_s", self.record_period_s, "need 0 < record_period_s < record_ttl_s, or "
                                                                       "records lapse")
        for name in ("rpc_timeout_s", "lease_timeout_s", "averaging_timeout_s", "plan_timeout_s", "probe_timeout_s",
                     "liveness_timeout_s", "slowest_uplink_mbit"):
            if getattr(self, name) <= 0:
                raise ConfigError(name, getattr(self, name), "must be positive")
