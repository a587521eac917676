"""The planner's key pair: the private key signs the plan, peers trust plans stored under its public key. The
run's owner has a key pair of the same kind (`live.authority`), and may be the planner.

The private key file holds hivemind's RSAPrivateKey as DER; `PATH.pub` holds the public key in the
`[owner:ssh-rsa ...]` form that is both the plan's DHT subkey and what `get_plan` compares against.
"""
from __future__ import annotations

import os
from pathlib import Path

from hivemind.dht.crypto import RSASignatureValidator
from hivemind.utils.crypto import RSAPrivateKey


def public_key_path(identity: Path) -> Path:
    return identity.with_name(identity.name + ".pub")


def load_or_create_key(identity: Path) -> RSAPrivateKey:
    """The private key in `identity`, creating the file (owner-only) with a new key if it is missing."""
    if identity.exists():
        key = RSAPrivateKey.__new__(RSAPrivateKey)
        # hivemind offers no loader; its pickling hook restores a key from exactly the DER that to_bytes() writes
        key.__setstate__({"_private_key": identity.read_bytes()})
        return key
    key = RSAPrivateKey()
    identity.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(identity, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)  # a private key: owner-only
    with os.fdopen(fd, "wb") as f:
        f.write(key.to_bytes())
    return key


def load_or_create_identity(identity: Path) -> RSASignatureValidator:
    """The planner's (or owner's) signer from `identity`, creating the key if the file is missing; (re)writes
    `identity.pub`."""
    signer = RSASignatureValidator(load_or_create_key(identity))
    public_key_path(identity).write_bytes(signer.local_public_key + b"\n")
    return signer


def read_planner_key(path: Path) -> bytes:
    """The planner's public key as written by `load_or_create_identity`; ValueError if the file holds none."""
    key = path.read_bytes().strip()
    if not (key.startswith(b"[owner:") and key.endswith(b"]")):
        raise ValueError(f"{path} does not hold a planner public key (write it with "
                         f"python -m p2ptrain.plan --planner-identity KEY, which creates KEY.pub)")
    return key
