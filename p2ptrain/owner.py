"""`python -m p2ptrain.owner authorize`: the run's owner authorizes a server for its place.

    python -m p2ptrain.owner authorize --owner-identity owner.key --run-id demo \\
        --identity-path fs0.id --stage 0 --server-role fs --data-source

writes `fs0.id.cert`, the owner's signature over (run id, the peer id of `fs0.id`, stage, role, data source),
creating the owner's key (`owner.key`, public half `owner.key.pub`) and the server's libp2p identity (`fs0.id`) if
they are missing. The server is then started with `--identity-path fs0.id --owner-key owner.key.pub` and the same
place; every other peer gets `--owner-key owner.key.pub` and trusts only the servers so authorized
(`p2ptrain/live/authority.py`). Keep `owner.key` to yourself: whoever holds it decides who serves the run.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

from p2ptrain.cli import fail, run_id
from p2ptrain.config import RunConfig


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m p2ptrain.owner", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    commands = parser.add_subparsers(dest="command", required=True)
    authorize = commands.add_parser("authorize", help="write a server's certificate for its place")
    authorize.add_argument("--owner-identity", type=Path, required=True,
                           help="the owner's private key (created if missing; its public key goes to PATH.pub)")
    authorize.add_argument("--run-id", type=run_id, default=RunConfig.run_id)
    authorize.add_argument("--identity-path", type=Path, required=True,
                           help="the server's libp2p identity, as its --identity-path (created if missing)")
    authorize.add_argument("--stage", type=int, required=True, help="the server's stage, from 0")
    authorize.add_argument("--server-role", choices=("fs", "bs"), required=True)
    authorize.add_argument("--data-source", action="store_true",
                           help="this stage-0 FS feeds the swarm's data (default: the authorized stage-0 FS with "
                                "the smallest peer id)")
    authorize.add_argument("--out", type=Path, help="where to write the certificate (default: IDENTITY.cert)")
    return parser


def main(argv: list[str] | None = None) -> None:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.stage < 0:
        fail(parser, "--stage", args.stage, "stages count from 0")
    if args.data_source and (args.stage, args.server_role) != (0, "fs"):
        parser.error("--data-source is for a stage-0 FS (--stage 0 --server-role fs)")
    for flag, path in (("--owner-identity", args.owner_identity), ("--identity-path", args.identity_path)):
        if path.exists() and not path.is_file():
            fail(parser, flag, path, "is not a file")
    from hivemind.p2p import P2P  # hivemind: only once the command line holds

    from p2ptrain.live.authority import CertificateError, ServerCertificate, peer_id_of
    from p2ptrain.live.identity import load_or_create_identity, load_or_create_key, public_key_path

    try:
        owner = load_or_create_key(args.owner_identity)
        load_or_create_identity(args.owner_identity)  # (re)writes the public key file peers are given
    except (OSError, ValueError) as e:
        fail(parser, "--owner-identity", args.owner_identity, str(e))
    if not args.identity_path.exists():
        args.identity_path.parent.mkdir(parents=True, exist_ok=True)
        P2P.generate_identity(str(args.identity_path))
    try:
        peer_id = peer_id_of(args.identity_path)
        certificate = ServerCertificate.issue(owner, run_id=args.run_id, peer_id=peer_id, stage=args.stage,
                                              role=args.server_role, data_source=args.data_source)
    except CertificateError as e:
        fail(parser, "--identity-path", args.identity_path, str(e))
    out = args.out or args.identity_path.with_name(args.identity_path.name + ".cert")
    certificate.save(out)
    print(f"{out}: peer {peer_id} may serve run {args.run_id!r} as {args.server_role.upper()} of stage {args.stage}"
          + (", and feed its data" if args.data_source else "")
          + f"; give every peer --owner-key {public_key_path(args.owner_identity)}", file=sys.stderr)


if __name__ == "__main__":
    main()
