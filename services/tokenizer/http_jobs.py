"""One HTTP generation request at the engine: its prompts' requests, merged.

A completions request may carry several prompts; each becomes its own
``RunningRequest`` at the scheduler. A ``Job`` pumps each one's outputs (one task per
prompt) into a single queue, so the HTTP side reads one ordered stream of
``(prompt_index, GenerateOutput)`` whether it streams or collects. ``close`` is the one
way out: it stops the pumps and aborts at the scheduler whatever has not finished
(a client that went away, a failed sibling prompt), exactly once.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Sequence

from services.tokenizer.request_runner import RequestFailed, RequestRunner, RunningRequest
from shared.protocol import GenerateOutput

log = logging.getLogger("pagoda.frontend.http")

# (prompt index, an output | the run failed | None: the run ended)
_Item = tuple[int, GenerateOutput | RequestFailed | None]


class Job:
    """The running prompts of one HTTP request; read with ``next`` or ``collect``."""

    def __init__(self, job_id: str, runs: Sequence[RunningRequest]) -> None:
        self.job_id = job_id
        self.runs = list(runs)
        self._queue: asyncio.Queue[_Item] = asyncio.Queue()
        self._open = len(self.runs)  # runs whose end marker has not been read
        self._closed = False
        self.failed = False  # a prompt failed at the scheduler (its siblings get aborted)
        loop = asyncio.get_running_loop()
        self._pumps = [loop.create_task(self._pump(i, run), name=f"http-{job_id}-{i}")
                       for i, run in enumerate(self.runs)]

    @property
    def finished(self) -> bool:
        return all(run.finished for run in self.runs)

    async def _pump(self, index: int, run: RunningRequest) -> None:
        try:
            async for out in run.outputs():
                self._queue.put_nowait((index, out))
            self._queue.put_nowait((index, None))
        except RequestFailed as e:
            self._queue.put_nowait((index, e))
        except Exception:  # a frontend bug: fail this request, never the process
            log.exception("HTTP request %s: prompt %d failed in the frontend", self.job_id, index)
            self._queue.put_nowait((index, RequestFailed(
                "engine_error", "the frontend failed while processing this request")))

    async def next(self) -> tuple[int, GenerateOutput] | None:
        """The next output of any prompt; None once all ended; raises ``RequestFailed``."""
        while self._open:
            index, item = await self._queue.get()
            if item is None:
                self._open -= 1
            elif isinstance(item, RequestFailed):
                self._open = 0
                self.failed = True
                raise item
            else:
                return index, item
        return None

    async def collect(self) -> list[tuple[int, GenerateOutput]]:
        outputs = []
        while (item := await self.next()) is not None:
            outputs.append(item)
        return outputs

    def end_early(self, index: int, outputs: list[GenerateOutput]) -> None:
        """Shutdown: prompt ``index`` was aborted upstream; deliver its final outputs."""
        pump = self._pumps[index]
        if pump.done():
            return  # it ended (and said so) already
        pump.cancel()
        for out in outputs:
            self._queue.put_nowait((index, out))
        self._queue.put_nowait((index, None))

    def unended(self) -> list[tuple[int, RunningRequest]]:
        return [(i, run) for i, run in enumerate(self.runs) if not self._pumps[i].done()]

    async def close(self, runner: RequestRunner, why: str | None = None) -> None:
        """Stop the pumps; abort what is unfinished at the scheduler (logged with ``why``)."""
        if self._closed:
            return
        self._closed = True
        for pump in self._pumps:
            pump.cancel()
        unfinished = [run for run in self.runs if not run.finished]
        if unfinished:
            await runner.abort_many(unfinished)
            if why is not None and not self.failed:
                log.warning("HTTP request %s: %s; aborted %d request(s) at the scheduler",
                            self.job_id, why, len(unfinished))
