"""Starting this process's DHT node for a run (with the run's record validators, and safe from Ctrl-C meanwhile), and
stopping it for sure."""
from __future__ import annotations

import logging
import os
import signal
import threading
from typing import Any

import hivemind
from hivemind.dht.crypto import RSASignatureValidator
from hivemind.utils.mpfuture import MPFuture

from p2ptrain.dht.keys import make_validators
from p2ptrain.dht.readers import READ_TIMEOUT_S, wait_for_reads

logger = logging.getLogger(__name__)

# torch's shared-memory manager, which hivemind starts on a process's first MPFuture (the DHT's), hangs the process
# for good when a signal interrupts its start: seen with py-spy in a launcher that got Ctrl-C at that moment, its
# main thread spinning in libshm's start_manager beside a defunct torch_shm_manager
_HELD = {signal.SIGINT, signal.SIGTERM}
_holding = 0  # threads holding the signals back now
_lock = threading.Lock()

# A DHT process sends each answer to its parent under hivemind's update lock (`MPFuture._update_lock`), one lock
# shared by every DHT process forked from the same parent; a node killed while it holds it leaves it held, and every
# DHT this process starts later hangs at its start (seen in CI: a test's node SIGKILLed just as it reported itself
# ready, then every later test's node stuck in `MPFuture._send_update`). A send under the lock is one pipe write: a
# lock not free for this long is the dead node's.
UPDATE_LOCK_WAIT_S = 10.0


def _release_in_child() -> None:
    """A process forked while the signals were held back (the DHT's own) must still take them."""
    if _holding:
        signal.pthread_sigmask(signal.SIG_UNBLOCK, _HELD)


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


def stop_dht(dht: hivemind.DHT, *, kill_wait_s: float = 10.0) -> None:
    """`dht.shutdown()`, and SIGKILL to a node that outlasts its grace period there; every DHT this package starts
    (a peer's, the launcher's, `p2ptrain.status`'s and `p2ptrain.plan`'s readers) is stopped here. hivemind's own
    fallback is SIGTERM, which a peer's node ignores: forked after the peer's event loop took SIGTERM
    (`loop.add_signal_handler`), it inherits that handler, a no-op without the loop. That keeps a SIGTERM sent to the
    whole process group (pkill -f, systemd) from killing the node under its parent, which then shuts it down in
    order; but a node that did not end in time would stay alive, and the process's exit would join it for good.

    Reads of the node under way end first (`readers.wait_for_reads`): shut down under a read, it would never answer.
    A node that ended by a signal (either fallback) and left hivemind's update lock held gets it released for it."""
    if not wait_for_reads(dht, READ_TIMEOUT_S):
        logger.warning(f"reads of the DHT node still under way after {READ_TIMEOUT_S:g} s: stopping it")
    dht.shutdown()
    if dht.is_alive():
        logger.warning(f"the DHT node (pid {dht.pid}) did not shut down in {dht.shutdown_timeout:g} s: killing it")
        dht.kill()
        dht.join(kill_wait_s)
    if not dht.is_alive() and dht.exitcode is not None and dht.exitcode < 0:
        _free_update_lock(dht)


def _free_update_lock(dead: hivemind.DHT) -> None:
    """Release hivemind's update lock if `dead`, killed, left it held (any process may release a multiprocessing
    Lock); a lock taken by a live DHT process is free again well within UPDATE_LOCK_WAIT_S."""
    lock = MPFuture._update_lock
    if lock.acquire(timeout=UPDATE_LOCK_WAIT_S):
        lock.release()
        return
    logger.warning(f"the DHT node (pid {dead.pid}) died holding hivemind's update lock: releasing it, or every DHT "
                   f"started later in this process would hang at its start")
    lock.release()
