"""The run's owner and the servers it authorizes.

A run may have an owner: a key pair (the planner's kind, `live.identity`) whose public half every peer is given
(`--owner-key`). The owner authorizes each server for one place, a stage and a role, by signing a certificate
over (run id, peer id, stage, role, whether it is the data source); the server publishes the signature in its
stage record. Readers that know the owner key keep only the servers whose certificate verifies for the place they
announce, so a peer the owner did not authorize cannot become a server of any layout, nor the data source, and a
certificate copied into another peer's record names the peer it was issued to, in the place it was issued for.
Volunteers (clients) need no certificate, as in any open swarm.

The data source is fixed by the owner too: the stage-0 FS whose certificate says so (the smallest peer id of those,
if the owner named several), else, if the owner named none, the authorized stage-0 FS with the smallest peer id.

Signing and checking use hivemind's RSA keys; nothing here touches the network.
"""
from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from hivemind.p2p import PeerID
from hivemind.utils.crypto import RSAPublicKey

from p2ptrain.protocol.layout import ServerRole

if TYPE_CHECKING:
    from hivemind.utils.crypto import RSAPrivateKey

_OWNER_MARK, _END = b"[owner:", b"]"


class CertificateError(ValueError):
    """A certificate that is malformed, or not for this peer and place, or not signed by the owner."""


def peer_id_of(identity: Path) -> str:
    """The peer id of the libp2p identity file `identity` (as `--identity-path` takes it)."""
    try:
        return PeerID.from_identity(identity.read_bytes()).to_base58()
    except Exception as e:  # a protobuf or key that does not parse
        raise CertificateError(f"{identity} holds no libp2p identity: {e!r}") from None


def _payload(*, run_id: str, peer_id: str, stage: int, role: ServerRole, data_source: bool) -> bytes:
    return json.dumps(["p2ptrain server certificate", run_id, peer_id, stage, role, data_source]).encode()


@dataclass(frozen=True, kw_only=True)
class ServerCertificate:
    """The owner's word that `peer_id` may serve run `run_id` as `role` of `stage` (and feed its data)."""

    run_id: str
    peer_id: str
    stage: int
    role: ServerRole
    data_source: bool
    signature: str  # base64, by the owner's private key over `_payload`

    @classmethod
    def issue(cls, owner: RSAPrivateKey, *, run_id: str, peer_id: str, stage: int, role: ServerRole,
              data_source: bool = False) -> ServerCertificate:
        if role not in ("fs", "bs") or stage < 0:
            raise CertificateError(f"a server is the FS or BS of a stage >= 0, not the {role} of stage {stage}")
        if data_source and (stage, role) != (0, "fs"):
            raise CertificateError("the data source is a stage-0 FS")
        payload = _payload(run_id=run_id, peer_id=peer_id, stage=stage, role=role, data_source=data_source)
        signature = owner.sign(payload).decode()
        return cls(run_id=run_id, peer_id=peer_id, stage=stage, role=role, data_source=data_source,
                   signature=signature)

    def save(self, path: Path) -> None:
        path.write_text(json.dumps(asdict(self), indent=1) + "\n")

    @classmethod
    def load(cls, path: Path) -> ServerCertificate:
        try:
            fields = json.loads(path.read_text())
            certificate = cls(**fields)
        except (OSError, ValueError, TypeError) as e:
            raise CertificateError(f"{path} holds no server certificate ({e}); write one with python -m "
                                   f"p2ptrain.owner authorize") from None
        if not (isinstance(certificate.stage, int) and isinstance(certificate.data_source, bool)
                and all(isinstance(getattr(certificate, name), str)
                        for name in ("run_id", "peer_id", "role", "signature"))):
            raise CertificateError(f"{path}: a field has the wrong type")
        return certificate


class Owner:
    """Checks certificates against the owner's public key (`[owner:ssh-rsa ...]`, as `live.identity` writes it)."""

    def __init__(self, *, public_key: bytes):
        key = public_key.strip()
        if not (key.startswith(_OWNER_MARK) and key.endswith(_END)):
            raise CertificateError("not an owner public key: expected the [owner:ssh-rsa ...] line that "
                                   "python -m p2ptrain.owner writes to KEY.pub")
        try:
            self._key = RSAPublicKey.from_bytes(key[len(_OWNER_MARK):-len(_END)])
        except ValueError as e:
            raise CertificateError(f"not an owner public key: {e}") from None
        self.public_key = key
        self._checked: dict[tuple, bool] = {}  # readers check the same records every few seconds

    @classmethod
    def from_file(cls, path: Path) -> Owner:
        try:
            return cls(public_key=path.read_bytes())
        except OSError as e:
            raise CertificateError(f"cannot read the owner key {path}: {e}") from None

    def signed(self, *, run_id: str, peer_id: str, stage: int, role: str, data_source: bool,
               signature: str | None) -> bool:
        """Whether `signature` is the owner's over this place."""
        if signature is None or role not in ("fs", "bs"):
            return False
        key = (run_id, peer_id, stage, role, data_source, signature)
        if key not in self._checked:
            if len(self._checked) > 4096:  # records of servers long gone
                self._checked.clear()
            payload = _payload(run_id=run_id, peer_id=peer_id, stage=stage, role=role, data_source=data_source)
            self._checked[key] = self._key.verify(payload, signature.encode())
        return self._checked[key]

    def check(self, certificate: ServerCertificate, *, run_id: str, peer_id: str, stage: int,
              role: ServerRole) -> None:
        """CertificateError unless `certificate` authorizes `peer_id` as `role` of `stage` in `run_id`."""
        issued = (certificate.run_id, certificate.peer_id, certificate.stage, certificate.role)
        if issued != (run_id, peer_id, stage, role):
            raise CertificateError(f"the certificate is for peer {certificate.peer_id} as {certificate.role.upper()} "
                                   f"of stage {certificate.stage} in run {certificate.run_id!r}, not for peer "
                                   f"{peer_id} as {role.upper()} of stage {stage} in run {run_id!r}")
        if not self.signed(run_id=run_id, peer_id=peer_id, stage=stage, role=role,
                           data_source=certificate.data_source, signature=certificate.signature):
            raise CertificateError("the certificate is not signed by the owner key given (--owner-key)")
