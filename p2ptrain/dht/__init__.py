"""Signed, schema-checked soft-state records of a run in hivemind's DHT (docs/design.md §4)."""
from p2ptrain.dht.announcer import Announcer
from p2ptrain.dht.keys import (
    MAX_STAGES,
    CachedSchemaValidator,
    make_validators,
    metrics_key,
    owned_subkey,
    peers_key,
    plan_key,
    recipe_key,
    split_subkey,
    stage_key,
)
from p2ptrain.dht.node import start_dht, stop_dht
from p2ptrain.dht.readers import get_metrics, get_peers, get_plan, get_recipe, get_runs, get_stage_members
from p2ptrain.dht.records import (
    MAX_EPOCHS_KEPT,
    EpochMetrics,
    Link,
    Membership,
    Metrics,
    PeerInfo,
    PlanRecord,
    RecipeRecord,
)

__all__ = [
    "MAX_EPOCHS_KEPT",
    "MAX_STAGES",
    "Announcer",
    "CachedSchemaValidator",
    "EpochMetrics",
    "Link",
    "Membership",
    "Metrics",
    "PeerInfo",
    "PlanRecord",
    "RecipeRecord",
    "get_metrics",
    "get_peers",
    "get_plan",
    "get_recipe",
    "get_runs",
    "get_stage_members",
    "make_validators",
    "metrics_key",
    "owned_subkey",
    "peers_key",
    "plan_key",
    "recipe_key",
    "split_subkey",
    "stage_key",
    "start_dht",
    "stop_dht",
]
