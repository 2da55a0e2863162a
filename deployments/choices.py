"""Several choices (OpenAI's ``n``) of one request: their sampling parameters and one stream.

A request with ``n > 1`` becomes ``n`` engine requests on the same replica (they share the
prompt, so the prefix cache computes it once). Choice ``k`` of a seeded request draws with seed
``seed + k``: the choices differ, and each is reproducible.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import TypeVar

from engine.sampling_params import SamplingParams

T = TypeVar("T")
_END = object()


def choice_params(params: SamplingParams, index: int) -> SamplingParams:
    """Choice ``index``'s parameters: ``params`` itself, or a shallow copy with its own seed;
    either way the stop strings and the other per-request tables are shared, not rebuilt."""
    if index == 0 or params.seed is None:
        return params
    return params.with_seed(params.seed + index)


async def merge_streams(streams: list[AsyncIterator[T]]) -> AsyncIterator[tuple[int, T]]:
    """``(stream index, item)`` as items arrive on any stream, until every stream ends.

    The first exception from any stream is raised here. However the iteration ends, every
    stream is closed (an engine stream aborts its request when closed early); a merge never
    started has started no stream.
    """
    tasks: list[asyncio.Task[None]] = []
    try:
        if len(streams) == 1:
            async for item in streams[0]:
                yield 0, item
            return
        queue: asyncio.Queue[tuple[int, object, BaseException | None]] = asyncio.Queue()

        async def pump(index: int, stream: AsyncIterator[T]) -> None:
            try:
                async for item in stream:
                    queue.put_nowait((index, item, None))
            except Exception as e:  # noqa: BLE001 - handed to the consumer
                queue.put_nowait((index, None, e))
            else:
                queue.put_nowait((index, _END, None))

        tasks = [asyncio.create_task(pump(i, s)) for i, s in enumerate(streams)]
        running = len(streams)
        while running:
            index, item, error = await queue.get()
            if error is not None:
                raise error
            if item is _END:
                running -= 1
                continue
            yield index, item  # type: ignore[misc]
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        for stream in streams:
            aclose = getattr(stream, "aclose", None)
            if aclose is not None:
                await aclose()
