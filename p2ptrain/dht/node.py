"""Starting this process's DHT node for a run: with the run's record validators, and safe from Ctrl-C meanwhile."""
from __future__ import annotations

import os
import signal
import threading
from typing import Any

import hivemind
from hivemind.dht.crypto import RSASignatureValidator

from p2ptrain.dht.keys import make_validators

# torch's shared-memory manager, which hivemind starts on a process's first MPFuture (the DHT's), hangs the process
# for good when a signal interrupts its start: seen with py-spy in a launcher that got Ctrl-C at that moment, its
# main thread spinning in libshm's start_manager beside a defunct torch_shm_manager
_HELD = {signal.SIGINT, signal.SIGTERM}
_holding = 0  # threads holding the signals back now
_lock = threading.Lock()


def _release_in_child() -> None:
    """A process forked while the signals were held back (the DHT's own) must still take them, and SIGTERM must end
    it: it inherits the handler of the parent's event loop (`loop.add_signal_handler`), a no-op without that loop, and
    `hivemind.DHT.shutdown` ends a node that outlasts its grace period with SIGTERM. Ignored, that left the node alive
    and the parent's exit joining it for good (a peer that refused its checkpoint never exited)."""
    if _holding:
        signal.pthread_sigmask(signal.SIG_UNBLOCK, _HELD)
        signal.signal(signal.SIGTERM, signal.SIG_DFL)


os.register_at_fork(after_in_child=_release_in_child)


def start_dht(run_id: str, *, signer: RSASignatureValidator | None = None, **options: Any) -> hivemind.DHT:
    """`hivemind.DHT(start=True, **options)` with the run's validators (`make_validators(run_id, signer=signer)`).

    SIGINT and SIGTERM are held back from this thread until the node is up, and then delivered: a Ctrl-C while it
    starts takes effect a moment later instead of hanging the process (another thread may take them meanwhile).
    """
    global _holding
    with _lock:
        _holding += 1
    held = signal.pthread_sigmask(signal.SIG_BLOCK, _HELD)
    try:
        return hivemind.DHT(start=True, record_validators=make_validators(run_id, signer=signer), **options)
    finally:
        with _lock:
            _holding -= 1
        signal.pthread_sigmask(signal.SIG_SETMASK, held)
