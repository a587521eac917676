"""DHT key names, owner subkeys and the validators every DHT of a run must be created with.

hivemind's SchemaValidator names a key `{prefix}_{field}`, so the records of run R live under `R_peers`,
`R_stage0` .. `R_stage{MAX_STAGES-1}`, `R_metrics`, `R_plan` and `R_recipe`. Every record sits under a subkey that holds
its owner's public key in hivemind's `[owner:...]` form, so RSASignatureValidator accepts it only when
signed by that owner: nobody can overwrite another peer's entry, and only the planner's key can write
the plan entry its readers trust.
"""
from __future__ import annotations

from typing import Dict, Optional

import pydantic.v1 as pydantic
from hivemind.dht.crypto import RSASignatureValidator
from hivemind.dht.schema import BytesWithPublicKey, SchemaValidator
from hivemind.dht.validation import DHTRecord, RecordValidatorBase

from p2ptrain.dht.records import MembershipModel, MetricsModel, PeerInfoModel, PlanModel, RecipeModel

# The schema needs one field per key; stages beyond this would go unchecked, so they are refused.
MAX_STAGES = 256

_OWNER_MARK = b"[owner:"


def peers_key(run_id: str) -> str:
    return f"{run_id}_peers"


def stage_key(run_id: str, stage: int) -> str:
    if not 0 <= stage < MAX_STAGES:
        raise ValueError(f"stage {stage} outside 0..{MAX_STAGES - 1}")
    return f"{run_id}_stage{stage}"


def metrics_key(run_id: str) -> str:
    return f"{run_id}_metrics"


def plan_key(run_id: str) -> str:
    return f"{run_id}_plan"


def recipe_key(run_id: str) -> str:
    return f"{run_id}_recipe"


# the runs a DHT carries, each entry under its publisher's owned subkey: {"run_id": ...}. A run id starts with a
# letter or digit, so no run's key can be this one
RUNS_KEY = "_p2ptrain_runs"


def owned_subkey(peer_id: str, owner_key: bytes) -> bytes:
    """Subkey of a per-peer record: the peer id followed by the owner's `local_public_key`."""
    if not owner_key.startswith(_OWNER_MARK):
        raise ValueError("owner_key must be an RSASignatureValidator.local_public_key ([owner:...] form)")
    return peer_id.encode() + owner_key


def split_subkey(subkey: bytes) -> tuple[str, bytes]:
    """(peer id, owner key) of a subkey made by `owned_subkey`; the peer id is "" for the plan's subkey."""
    at = subkey.find(_OWNER_MARK)
    if at < 0:
        raise ValueError(f"subkey {subkey[:60]!r} holds no owner key")
    return subkey[:at].decode(errors="replace"), subkey[at:]


def _schema() -> type[pydantic.BaseModel]:
    # a fresh class per call: SchemaValidator patches the model it is given
    fields = {
        "peers": (Dict[BytesWithPublicKey, Optional[PeerInfoModel]], None),
        "metrics": (Dict[BytesWithPublicKey, Optional[MetricsModel]], None),
        "plan": (Dict[BytesWithPublicKey, Optional[PlanModel]], None),
        "recipe": (Dict[BytesWithPublicKey, Optional[RecipeModel]], None),
        **{f"stage{k}": (Dict[BytesWithPublicKey, Optional[MembershipModel]], None) for k in range(MAX_STAGES)},
    }
    return pydantic.create_model("P2PTrainRecords", **fields)


class CachedSchemaValidator(SchemaValidator):
    """hivemind's SchemaValidator that remembers its verdict on each (key, subkey, value).

    A DHT lookup answers with every subkey of a dictionary key, and a store first looks its key up at several nodes,
    so the same records come back many times, most unchanged since the last lookup; pydantic takes milliseconds on a
    metrics record of a few dozen epochs. Validating each distinct record once took the DHT processes of a 7-peer
    training swarm from most of their CPU to little (benchmarks/results/dataplane.md). The verdict depends on the
    record's bytes and the schemas only, so the memory is cleared when another schema is merged in.
    """

    def __init__(self, *args, cache_size: int = 256, **kwargs):
        super().__init__(*args, **kwargs)
        self.cache_size = cache_size
        self._verdicts: dict[tuple[bytes, bytes, bytes], bool] = {}

    def validate(self, record: DHTRecord) -> bool:
        slot = (record.key, record.subkey, record.value)
        verdict = self._verdicts.get(slot)
        if verdict is None:
            if len(self._verdicts) >= self.cache_size:  # bounded: the records live now are few and come back often
                self._verdicts.clear()
            verdict = self._verdicts[slot] = super().validate(record)
        return verdict

    def merge_with(self, other: RecordValidatorBase) -> bool:
        merged = super().merge_with(other)
        if merged:
            self._verdicts.clear()
        return merged


def make_validators(run_id: str, *, signer: RSASignatureValidator | None = None) -> list[RecordValidatorBase]:
    """Validators for `hivemind.DHT(record_validators=...)`: owner signatures and the run's record schema.

    `signer` holds this peer's private key; by default hivemind's process-wide key, which is also what
    hivemind.Optimizer signs its progress records with (a DHT keeps only its first RSASignatureValidator,
    so a different key here would leave those records unsigned). Pass `signer.local_public_key` to
    `Announcer(owner_key=...)`. Keys outside this run's schema (the averagers' own) stay allowed.
    """
    return [signer or RSASignatureValidator(), CachedSchemaValidator(_schema(), allow_extra_keys=True, prefix=run_id)]
