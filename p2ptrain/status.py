"""`python -m p2ptrain.status --initial-peers ADDR [--json]`: what a swarm is doing, read from the DHT.

JSON fields (stable; later tools and outside checks read them):
  run_id                 the swarm's DHT prefix
  recipe                 the run's recipe as its data source publishes it (`p2ptrain.recipe.Recipe.to_value`:
                           config: the RunConfig fields, model: the model's whole config with its family, data and
                           tokenizer: sha256 fingerprints or null), with publisher: its peer id; null while none
  peers                  [{peer_id, role, stage, server_role}] every peer with a live record
  stages                 [{stage, fs: [peer ids], bs: [peer ids], workers: [peer ids], client_mode_workers,
                           state, rounds_failed, steps_unclipped, steps_skipped, digests_agree, digests_disagreed,
                           unauthorized}];
                           client_mode_workers: how many
                           of its workers dial out only (`--client-mode`, behind NAT: they reduce nothing, the
                           stage's servers do); state is what the
                           stage does now: "waiting for FS" or "waiting for BS" (it has none: the swarm waits
                           for one to come back), else its FS's view: "training", "waiting for workers" (none
                           polled lately) or "workers banned" (every recent one is banned for refused results);
                           rounds_failed: all-reduce rounds of the epochs below that failed or averaged nothing
                           (one per worker that says so); steps_unclipped: steps of the epochs below that were not
                           clipped (--clip-norm) because no global norm came in time; steps_skipped: steps of the epochs
                           below skipped for an fp16 overflow; digests_agree: whether the workers' parameter digests
                           of the newest epoch that two or more published agree (null: none such yet);
                           digests_disagreed: epochs below whose digests did not agree; unauthorized: with
                           --owner-key, the peers that announce themselves as its servers without the owner's
                           certificate for that place (left out of fs and bs, and their metrics ignored)
  epoch                  the last global batch that closed at every stage (-1: none yet)
  epochs_planned         global batches the data source will feed (null if no source is up)
  finished               the data source fed and closed all its epochs
  loss                   mean token loss (nats) of the last closed epoch, from the last stage
  tokens_per_s           training tokens per second over the last closed epoch, at the data source (fresh data
                           only: microbatches fed again under fault policy swarm do not count)
  eval_loss              the newest held-out loss (the data source's --eval-data, through every stage's servers,
                           forward only), of the parameters after the epoch it is listed with in `epochs`; null
                           if none yet
  epochs                 [{epoch, loss, tokens_per_s, seconds, abandoned, microbatches_retrained, lr, eval_loss,
                           loss_scale,
                           stages: [{stage, reported, rows_in_batch, rows_averaged, tasks_redone, rows_recomputed,
                                     rows_dropped, workers_lost, workers_joined, rounds_failed, steps_unclipped,
                                     steps_skipped, digests, digests_agree, averaging_bytes}]}] oldest first (lr: the
                           learning rate of its step; loss_scale: with --precision fp16, the loss scale its
                           gradients were computed at, else null),
                           of the epochs the peers' records carry whole: each keeps its newest epochs that fit in a
                           small DHT value (20 or more; a reader that polls keeps the rest, `History`), and an epoch
                           older than what any record still holds is left out, not shown with some peers' counts:
                           reported: whether the stage's FS has published its counts of the epoch yet (records
                             are refreshed every few seconds, and a stage may close an epoch after the last stage
                             did): until then the stage's counts below are 0, and the table shows "-";
                           rows_in_batch: rows of the global batch that entered the stage;
                           rows_averaged: rows whose gradients reached the stage's averaged optimizer step: the
                             rows the FS handed to the epoch's averaging group, less those of any worker that
                             reports its round failed (a worker's own record may be gone, a server's stays) and
                             those of groupmates that died in the round (its survivors averaged without them);
                             with --average-every H > 1 a worker steps on its own rows between rounds, and the
                             stage averages how far each moved after epochs H-1, 2H-1, ...: a row counts at its
                             own epoch, and a worker that dies between rounds takes its part of the interval with
                             it (not counted here);
                           tasks_redone: tasks handed out again (refused results, timed-out or vanished workers,
                             rows redone);
                           rows_recomputed: rows whose forward and backward were done again because the worker
                             that held their parameter gradients vanished before the stage averaged;
                           rows_dropped: fault policy swarm: rows whose parameter gradients went with a vanished
                             worker and were not redone at the stage (their microbatch's data is fed again);
                           workers_lost: workers that vanished holding parameter gradients of the epoch;
                           workers_joined: workers the stage's FS first saw while the epoch was open;
                           rounds_failed: workers whose all-reduce round of the epoch failed or averaged nothing;
                           steps_unclipped: workers (and server replicas) that stepped unclipped: with --clip-norm,
                             the global norm of the epoch did not come within the averaging timeout;
                           steps_skipped: workers (and server replicas) that skipped the epoch's step because its
                             fp16 gradients overflowed somewhere in the swarm (every holder of every stage skips
                             alike, and the loss scale halves);
                           digests: workers that published a digest of the parameters they stepped to (with
                             --average-every H > 1: of the anchor, the parameters of the last round, which the
                             stage's holders share between rounds);
                           digests_agree: whether those digests are of the same parameters up to the rounding an
                             all-reduce leaves (`protocol.optimization.digests_agree`; null: no digest);
                           averaging_bytes: what the stage's workers and server replicas sent for the epoch's
                             averaging (deposits, all-reduce parts and averages; message bytes, `p2ptrain.traffic`),
                             as of their last records;
                         abandoned: the data source ended the epoch without a step because a stage server of its
                           layout restarted or was lost before all its rows were back: no stage stepped on it (its
                           rows_averaged are 0 and it never counts as closed), and its batch of data was fed again
                           as the next epoch;
                         microbatches_retrained: fault policy swarm: microbatches of the epoch that carried data
                           fed before, whose rows a stage dropped
  bytes_sent             {kind: bytes} what the peers with a live record have sent since they started, by kind
                           (activations, averaging, state, probes, control: `p2ptrain.traffic`), as of their last
                           record: message bytes, without the DHT's traffic, libp2p framing or TCP/IP headers
  bytes_sent_by_peer     {peer_id: {kind: bytes}} the same per peer
  calls_served_by_peer   {peer_id: {method: count}} the requests each peer's process has served since it started,
                           by RPC method (rpc_take_task, ...), as of its last record
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from collections import defaultdict
from typing import TYPE_CHECKING

from p2ptrain.cli import check_maddrs, existing_file, fail, run_id
from p2ptrain.config import RunConfig
from p2ptrain.protocol.optimization import Digest, digests_agree
from p2ptrain.recipe import Recipe

if TYPE_CHECKING:
    import hivemind

    from p2ptrain.dht.records import Metrics
    from p2ptrain.live.authority import Owner


class History:
    """The epochs a reader has seen in each peer's metrics record, so that its reports keep the epochs that records
    no longer carry (a record holds its peer's newest epochs only: `node.metrics.fit`), and those of peers gone
    since. What a peer's record says of an epoch now wins over what it said before. The joined record is whole from
    where the first one read was, unless the reads left a gap (its epochs moved on past a record's depth between
    two reads)."""

    def __init__(self) -> None:
        self._seen: dict[tuple[str, str, int | None], Metrics] = {}

    def merge(self, metrics: list[Metrics]) -> list[Metrics]:
        """`metrics` with their lists of epochs joined to what was seen of them before, and the records of the peers
        seen before and not now, for their epochs."""
        from p2ptrain.dht.records import EPOCH_LISTS, join_epochs  # hivemind: not for --help

        for record in metrics:
            key = (record.peer_id, record.role, record.stage)
            before = self._seen.get(key)
            if before is not None:
                seen_to = min((getattr(before, name)[-1].epoch for name in EPOCH_LISTS if getattr(before, name)),
                              default=-1)
                gap = record.complete_from is not None and record.complete_from > seen_to + 1
                record = dataclasses.replace(
                    record, complete_from=record.complete_from if gap else before.complete_from,
                    **{name: join_epochs(getattr(before, name), getattr(record, name)) for name in EPOCH_LISTS})
            self._seen[key] = record
        return list(self._seen.values())


def collect(dht: hivemind.DHT, run_id: str, *, history: History | None = None, owner: Owner | None = None) -> dict:
    """The report (see the module docstring) of run `run_id`, read through `dht`; its `epochs` are those the peers'
    records carry, and with `history`, every epoch its earlier reads saw too; with the run's `owner`, of the servers
    it authorized only."""
    from p2ptrain.dht import get_metrics, get_peers  # hivemind: not for --help
    from p2ptrain.dht.readers import frontal_order, get_authorized_members, read_recipe

    peers = get_peers(dht, run_id)
    metrics = get_metrics(dht, run_id)
    stages_seen = [p.stage for p in peers if p.stage is not None] + [m.stage for m in metrics if m.stage is not None]
    num_stages = 1 + max(stages_seen, default=-1)
    memberships = [get_authorized_members(dht, run_id, stage, owner=owner) for stage in range(num_stages)]
    if owner is not None:  # a server's figures count only if the owner authorized it in that place
        servers = {(m.peer_id, stage, m.role) for stage, (members, _) in enumerate(memberships) for m in members}
        metrics = [m for m in metrics if m.role == "worker" or (m.peer_id, m.stage, m.role) in servers]
    stages = []
    for stage, (members, unauthorized) in enumerate(memberships):
        fs = sorted(m.peer_id for m in members if m.role == "fs")
        bs = sorted(m.peer_id for m in members if m.role == "bs")
        views = [m.condition for m in metrics if m.stage == stage and m.role == "fs" and m.condition]
        workers = [m for m in metrics
                   if m.stage == stage and (m.role == "worker" or (m.worker_epochs and not m.holds_state))]
        stages.append({
            "stage": stage, "fs": fs, "bs": bs, "workers": sorted(m.peer_id for m in workers),
            "client_mode_workers": sum(m.client_mode for m in workers), "unauthorized": sorted(unauthorized),
            "state": "waiting for FS" if not fs else "waiting for BS" if not bs else _worst(views),
        })
    epochs = _epochs(history.merge(metrics) if history is not None else metrics, num_stages)
    for entry in stages:
        summaries = [e["stages"][entry["stage"]] for e in epochs]
        checked = [s for s in summaries if s["digests"] >= 2]
        entry["rounds_failed"] = sum(s["rounds_failed"] for s in summaries)
        entry["steps_unclipped"] = sum(s["steps_unclipped"] for s in summaries)
        entry["steps_skipped"] = sum(s["steps_skipped"] for s in summaries)
        entry["digests_agree"] = checked[-1]["digests_agree"] if checked else None
        entry["digests_disagreed"] = sum(not s["digests_agree"] for s in checked)
    source = next((m for m in metrics if m.epochs_planned is not None), None)
    closed = [e for e in epochs if e["closed"]]
    last = closed[-1] if closed else None
    frontal = frontal_order(memberships[0][0], owner=owner) if memberships else ()  # stage 0's FS, read above
    recipe = read_recipe(dht, run_id, frontal[0]) if frontal else None
    return {
        "run_id": run_id,
        "recipe": {"publisher": recipe[0], **recipe[1].to_value()} if recipe else None,
        "peers": sorted(({"peer_id": p.peer_id, "role": p.role, "stage": p.stage, "server_role": p.server_role}
                         for p in peers), key=lambda p: (p["stage"] is None, p["stage"] or 0, p["peer_id"])),
        "stages": stages,
        "epoch": last["epoch"] if last else -1,
        "epochs_planned": source.epochs_planned if source else None,
        "finished": bool(source and source.finished),
        "loss": last["loss"] if last else None,
        "tokens_per_s": last["tokens_per_s"] if last else None,
        "eval_loss": next((e["eval_loss"] for e in reversed(epochs) if e["eval_loss"] is not None), None),
        "epochs": [{k: v for k, v in e.items() if k != "closed"} for e in epochs],
        "bytes_sent": {kind: sum(m.bytes_sent.get(kind, 0) for m in metrics)
                       for kind in sorted({kind for m in metrics for kind in m.bytes_sent})},
        "bytes_sent_by_peer": {m.peer_id: m.bytes_sent for m in sorted(metrics, key=lambda m: m.peer_id)},
        "calls_served_by_peer": {m.peer_id: m.calls_served for m in sorted(metrics, key=lambda m: m.peer_id)},
    }


def _worst(views: list[str]) -> str:
    """The stage's state from its FS' views: any FS that lacks workers holds the stage up."""
    for state in ("workers banned", "waiting for workers"):
        if state in views:
            return state
    return "training" if views else "starting"


def _epochs(metrics: list, num_stages: int) -> list[dict]:
    """Per epoch and stage: rows in (FS), rows averaged (workers), tasks redone (FS and BS); loss; speed."""
    rows_in, averaged, redone = defaultdict(int), defaultdict(int), defaultdict(int)
    recomputed, lost, joined, dropped = defaultdict(int), defaultdict(int), defaultdict(int), defaultdict(int)
    failed: dict[tuple[int, int], int] = defaultdict(int)
    unclipped: dict[tuple[int, int], int] = defaultdict(int)
    skipped: dict[tuple[int, int], int] = defaultdict(int)
    scales: dict[int, float] = {}
    died: dict[tuple[int, int], int] = defaultdict(int)
    averaging_bytes: dict[tuple[int, int], int] = defaultdict(int)
    digests: dict[tuple[int, int], list[Digest]] = defaultdict(list)
    rates: dict[int, float] = {}
    evals: dict[int, float] = {}
    closed_at: dict[int, set[int]] = defaultdict(set)
    # abandoned by the data source: some server dropped the epoch, and no stage stepped on it. A stage whose servers
    # stand further back than the swarm's, or whose FS restarted empty after the epoch was committed, drops epochs
    # that other stages stepped on; those count as trained, without that stage's rows
    abandoned: set[int] = set()
    stepped: set[int] = set()
    loss, speed, seconds, retrained = {}, {}, {}, {}
    for record in metrics:
        servers = record.per_epoch if record.role in ("fs", "bs") else []
        workers = record.per_epoch if record.role == "worker" else record.worker_epochs
        for entry in servers:
            key = (entry.epoch, record.stage)
            redone[key] += entry.tasks_redone
            if record.role == "fs":
                rows_in[key] += entry.rows_in_batch
                averaged[key] += entry.rows_averaged
                recomputed[key] += entry.rows_recomputed
                dropped[key] += entry.rows_dropped
                lost[key] += entry.workers_lost
                joined[key] += entry.workers_joined
                closed_at[entry.epoch].add(record.stage)
            if entry.loss is not None:
                loss[entry.epoch] = entry.loss
            if entry.abandoned:
                abandoned.add(entry.epoch)
            elif record.role == "fs":
                stepped.add(entry.epoch)
        for entry in workers:  # a worker whose round failed stepped on its own gradients
            key = (entry.epoch, record.stage)
            averaged[key] -= entry.rows_in_batch - entry.rows_averaged
            failed[key] += entry.round_failed
            unclipped[key] += entry.unclipped
            skipped[key] += entry.overflow
            died[key] = max(died[key], entry.rows_lost)  # every survivor of the round reports the same rows
            averaging_bytes[key] += entry.averaging_bytes
            if entry.digest is not None:
                digests[key].append(tuple(entry.digest))
            if entry.lr is not None:
                rates[entry.epoch] = entry.lr
            if entry.loss_scale is not None:
                scales[entry.epoch] = entry.loss_scale
        for entry in record.source_epochs:
            seconds[entry.epoch] = entry.seconds
            if entry.eval_loss is not None:
                evals[entry.epoch] = entry.eval_loss
            retrained[entry.epoch] = entry.microbatches_retrained
            speed[entry.epoch] = entry.tokens / entry.seconds if entry.seconds else None
    abandoned -= stepped
    # before the newest cut of any record, some peers' counts of an epoch may be gone while others' remain
    whole_from = max((record.complete_from for record in metrics if record.complete_from is not None), default=0)
    all_epochs = sorted(e for e in {key[0] for key in rows_in} | set(loss) | set(speed) if e >= whole_from)
    return [
        {
            "epoch": epoch, "loss": loss.get(epoch), "tokens_per_s": speed.get(epoch), "seconds": seconds.get(epoch),
            "abandoned": epoch in abandoned, "microbatches_retrained": retrained.get(epoch, 0), "lr": rates.get(epoch),
            "eval_loss": evals.get(epoch), "loss_scale": scales.get(epoch),
            "closed": len(closed_at[epoch]) == num_stages and epoch in loss and epoch not in abandoned,
            "stages": [{"stage": stage, "reported": stage in closed_at[epoch], "rows_in_batch": rows_in[(epoch, stage)],
                        # a round's rows lost are of its interval with --average-every: never below 0
                        "rows_averaged": max(averaged[(epoch, stage)] - died[(epoch, stage)], 0),
                        "tasks_redone": redone[(epoch, stage)],
                        "rows_recomputed": recomputed[(epoch, stage)], "rows_dropped": dropped[(epoch, stage)],
                        "workers_lost": lost[(epoch, stage)],
                        "workers_joined": joined[(epoch, stage)], "rounds_failed": failed[(epoch, stage)],
                        "steps_unclipped": unclipped[(epoch, stage)], "steps_skipped": skipped[(epoch, stage)],
                        "digests": len(digests[(epoch, stage)]),
                        "digests_agree": digests_agree(digests[(epoch, stage)]) if digests[(epoch, stage)] else None,
                        "averaging_bytes": averaging_bytes[(epoch, stage)]}
                       for stage in range(num_stages)],
        }
        for epoch in all_epochs
    ]


def render(report: dict) -> str:
    lines = [f"swarm {report['run_id']}: epoch {report['epoch']}"
             + (f" of {report['epochs_planned']}" if report["epochs_planned"] else "")
             + (f", loss {report['loss']:.4f}" if report["loss"] is not None else "")
             + (f", held-out {report['eval_loss']:.4f}" if report.get("eval_loss") is not None else "")
             + (f", {report['tokens_per_s']:.0f} tokens/s" if report["tokens_per_s"] else "")
             + (" (finished)" if report["finished"] else "")]
    if report.get("recipe"):
        carried = Recipe.from_value({k: v for k, v in report["recipe"].items() if k != "publisher"})
        lines.append(f"  recipe: {carried.describe()}")
    for stage in report["stages"]:
        lines.append(f"  stage {stage['stage']}: FS {', '.join(p[-8:] for p in stage['fs']) or '-'}"
                     f" | BS {', '.join(p[-8:] for p in stage['bs']) or '-'}"
                     f" | workers {', '.join(p[-8:] for p in stage['workers']) or '-'}"
                     + (f" ({stage['client_mode_workers']} in client mode)" if stage["client_mode_workers"] else "")
                     + f" | {stage['state']}"
                     + {True: " | parameters agree", False: " | PARAMETERS DIFFER", None: ""}[stage["digests_agree"]]
                     + (f" | {stage['rounds_failed']} rounds failed" if stage["rounds_failed"] else "")
                     + (f" | {stage['steps_unclipped']} steps unclipped" if stage["steps_unclipped"] else "")
                     + (f" | {stage['steps_skipped']} steps skipped (fp16 overflow)" if stage.get("steps_skipped")
                        else "")
                     + (f" | unauthorized, ignored: {', '.join(p[-8:] for p in stage['unauthorized'])}"
                        if stage.get("unauthorized") else ""))
    lines.append("  epoch    loss  tokens/s  " + "  ".join(f"s{s['stage']} rows/avg/redo" for s in report["stages"]))
    for epoch in report["epochs"][-10:]:
        cells = "  ".join(f"{s['rows_in_batch']:>6}/{s['rows_averaged']:<4}/{s['tasks_redone']:<3}" if s["reported"]
                          else f"{'-':>6} {'':<4} {'':<3}" for s in epoch["stages"])
        loss = f"{epoch['loss']:.4f}" if epoch["loss"] is not None else "-"
        speed = f"{epoch['tokens_per_s']:.0f}" if epoch["tokens_per_s"] else "-"
        lines.append(f"  {epoch['epoch']:>5}  {loss:>6}  {speed:>8}  {cells}"
                     + ("  abandoned: its batch came again" if epoch["abandoned"] else ""))
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m p2ptrain.status", description="Show a swarm's progress.")
    parser.add_argument("--initial-peers", nargs="+", required=True, help="multiaddrs of any peers of the swarm")
    parser.add_argument("--run-id", type=run_id, default=RunConfig.run_id)
    parser.add_argument("--json", action="store_true", help="print the report as JSON (fields: see module doc)")
    parser.add_argument("--owner-key", type=existing_file,
                        help="the run owner's public key: report only the servers it authorized, and list the others")
    args = parser.parse_args(argv)
    check_maddrs(parser, "--initial-peers", args.initial_peers)
    from p2ptrain.dht import start_dht, stop_dht
    from p2ptrain.live.authority import CertificateError, Owner

    owner = None
    if args.owner_key is not None:
        try:
            owner = Owner.from_file(args.owner_key)
        except CertificateError as e:
            fail(parser, "--owner-key", args.owner_key, str(e))

    try:
        dht = start_dht(args.run_id, initial_peers=args.initial_peers, client_mode=True)
    except Exception as e:
        print(f"error: could not join the swarm at {' '.join(args.initial_peers)}: {e}", file=sys.stderr)
        sys.exit(2)
    try:
        report = collect(dht, args.run_id, owner=owner)
    finally:
        stop_dht(dht)
    print(json.dumps(report, indent=2) if args.json else render(report))


if __name__ == "__main__":
    main()
