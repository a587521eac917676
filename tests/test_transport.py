"""`Caller.exchange`, the one path of every RPC: a call whose caller is cancelled ends in CancelledError, also when
the reply is ready at that moment (Python 3.11's asyncio.wait_for returned the reply then, and the cancelled task ran
on: a round's watch kept probing, and the round never ended)."""
from __future__ import annotations

import asyncio

import pytest

from p2ptrain.transport import Caller, Envelope


def test_a_cancelled_call_is_cancelled_even_when_its_reply_lands_at_that_moment():
    async def main() -> None:
        caller = Caller(p2p=None, peer_id="me", codec="none", timeout=5.0)
        release = asyncio.Event()

        async def answer(*_: object) -> Envelope:  # stands for the transport: the reply comes when released
            await release.wait()
            return Envelope({}, [])

        caller._exchange = answer
        call = asyncio.create_task(caller.exchange("peer", "service", "rpc_method", Envelope({}, [])))
        await asyncio.sleep(0)  # the call waits for its reply
        release.set()  # the reply lands...
        call.cancel()  # ...in the same turn of the loop as the caller's cancellation
        with pytest.raises(asyncio.CancelledError):
            await call

    asyncio.run(main())
