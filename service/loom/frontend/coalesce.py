"""Coalesce chunks that are ready together into one stream message per completion.

A stream message costs the server about as much CPU as a whole decode row on a small model, so a
slow reader or a busy event loop must not mean one message per token. A pump task consumes the
chunks as they are produced while the writer waits on the network; each time the writer is
ready it takes everything pending, merged per completion.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncGenerator

from .completion import Chunk


class _End:
    pass


_END = _End()


async def coalesced(source: AsyncGenerator[Chunk, None]) -> AsyncGenerator[list[Chunk], None]:
    """Batches of chunks, at most one per completion index per batch, in order of first arrival.

    Closing this generator (a client cancel reaching the handler) cancels the pump, which closes
    ``source`` and so aborts the engine request.
    """
    queue: asyncio.Queue[Chunk | _End | BaseException] = asyncio.Queue()

    async def pump() -> None:
        try:
            async with contextlib.aclosing(source):
                async for chunk in source:
                    queue.put_nowait(chunk)
            queue.put_nowait(_END)
        except Exception as exc:
            queue.put_nowait(exc)

    task = asyncio.create_task(pump(), name="loom-stream-pump")
    try:
        done = False
        while not done:
            items = [await queue.get()]
            while not queue.empty():
                items.append(queue.get_nowait())
            batch: dict[int, Chunk] = {}
            error: BaseException | None = None
            for item in items:
                if isinstance(item, _End):
                    done = True
                elif isinstance(item, BaseException):
                    error = item
                    break
                elif item.index in batch:
                    batch[item.index].merge(item)
                else:
                    batch[item.index] = item
            if batch:
                yield list(batch.values())
            if error is not None:
                raise error
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
