"""The engine core in its own process, and the asyncio client the front end talks to.

The engine process runs :class:`LLMEngine`'s step loop; it blocks on its input pipe only when it
has nothing to do, otherwise it drains new requests and aborts between steps. Each step's
outputs go back as one message. The front end's :class:`AsyncEngineClient` reads that pipe from
the event loop (``add_reader``, no thread) and routes outputs to per-request queues.

Messages are the typed dataclasses of :mod:`loom.engine.types`: front end -> engine
:data:`~loom.engine.types.ToEngine` (AddRequest, AbortRequest, AbortCompletion, StatsQuery,
Shutdown); engine -> front end :data:`~loom.engine.types.FromEngine` (EngineReady, EngineFailed,
StepOutputs, StatsReply).
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import multiprocessing as mp
import os
import signal
import threading
import traceback
from collections.abc import AsyncIterator
from multiprocessing.connection import Connection
from typing import TYPE_CHECKING, Any

import structlog

from loom.config import EngineConfig
from loom.distributed.errors import ShardLostError
from loom.process_tuning import freeze_startup_objects

from .types import (
    AbortCompletion,
    AbortRequest,
    AdapterCommand,
    AdapterInfo,
    AdapterReply,
    AddRequest,
    EngineFailed,
    EngineInfo,
    EngineOutput,
    EngineReady,
    EngineRequest,
    EngineStats,
    FinishReason,
    FromEngine,
    Shutdown,
    StatsQuery,
    StatsReply,
    StepOutputs,
    ToEngine,
)

if TYPE_CHECKING:
    from .llm_engine import LLMEngine

log = structlog.get_logger(__name__)

_GRAMMAR_POLL_S = 0.002


class EngineDeadError(RuntimeError):
    """The engine process exited; no request can be served until the server restarts."""


class RequestEndedError(RuntimeError):
    """The server ended the request itself (its shutdown's grace period ran out); the engine
    freed its KV blocks. The message says why."""


def run_engine_core(config: EngineConfig, conn: Connection, log_json: bool = False, log_level: str = "INFO") -> None:
    """Entry point of the engine process.

    The front end decides when the engine stops (a "shutdown" message, or its pipe closing when
    the front end dies): supervisors often signal every process of a service at once (systemd's
    KillMode=control-group, ``timeout``, ``kill -- -PGID``, a shell's ``kill %1``, Ctrl-C in a
    terminal), and an engine that died on that signal would fail every stream the front end is
    draining. SIGKILL still ends it, and the front end's shutdown escalates to it.
    """
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, signal.SIG_IGN)
    from loom.logging_setup import configure_logging

    configure_logging(json_output=log_json, level=log_level, process="engine")
    send_lock = threading.Lock()

    def shard_lost(reason: str) -> None:
        """A tensor-parallel rank died or hung (the sharded worker's watchdog thread; the other
        ranks are already killed): tell the front end why, then exit at once (the step loop may
        be stuck in a collective that will never return)."""
        log.error("tensor-parallel rank lost; the engine exits", reason=reason)
        with contextlib.suppress(Exception), send_lock:
            conn.send(EngineFailed(reason))
        os._exit(1)

    try:
        from .llm_engine import LLMEngine

        engine = LLMEngine(config, on_shard_failure=shard_lost)
    except Exception as exc:
        from loom.config import ConfigError
        from loom.model_loader.errors import ModelLoadError
        from loom.plugin_api import PluginError

        if isinstance(exc, (ConfigError, ModelLoadError, PluginError)):
            # A problem with the configuration or the model's files: the message says it all.
            conn.send(EngineFailed(str(exc)))
            log.error("engine failed to start", error=str(exc))
        else:
            conn.send(EngineFailed(f"{type(exc).__name__}: {exc}"))
            log.error("engine failed to start", error=traceback.format_exc())
        return
    frozen = freeze_startup_objects()
    log.debug("start-up objects frozen for the garbage collector", objects=frozen)
    try:
        conn.send(EngineReady(engine.info))
        _serve_pipe(engine, conn, send_lock)
    except (EOFError, BrokenPipeError, ConnectionResetError):
        # The front end is gone (killed, or crashed) without a shutdown message: so is our work.
        log.warning("the front end's pipe closed; engine exiting")
    except ShardLostError as exc:
        engine.close()
        shard_lost(str(exc))
    finally:
        engine.close()  # the other tensor-parallel ranks stop (drained: the front end waited)


def _serve_pipe(engine: LLMEngine, conn: Connection, send_lock: threading.Lock) -> None:
    """The step loop: requests and aborts in between steps, outputs after each, until "shutdown"."""
    from .llm_engine import RequestRejected

    while True:
        # Block only when idle; otherwise pick up whatever arrived during the last step. While the
        # only requests wait for their grammars to compile, look again every few milliseconds.
        if not engine.has_unfinished() and not engine.adapters_loading:
            conn.poll(None)
        elif not engine.has_schedulable():
            conn.poll(_GRAMMAR_POLL_S)
        for reply in engine.adapter_replies():  # adapters whose files are read: installed between steps
            with send_lock:
                conn.send(reply)
        while conn.poll(0):
            msg: ToEngine = conn.recv()
            if isinstance(msg, AddRequest):
                try:
                    engine.add_request(msg.request)
                except RequestRejected as exc:
                    with send_lock:
                        conn.send(StepOutputs([EngineOutput(msg.request.request_id, 0, [], [],
                                                            finish_reason=FinishReason.ERROR, error=str(exc),
                                                            rejection=exc.rejection)]))
                except ValueError as exc:
                    with send_lock:
                        conn.send(StepOutputs([EngineOutput(msg.request.request_id, 0, [], [],
                                                            finish_reason=FinishReason.ERROR, error=str(exc))]))
            elif isinstance(msg, AbortRequest):
                engine.abort(msg.request_id)
            elif isinstance(msg, AbortCompletion):
                engine.abort_completion(msg.request_id, msg.index)
            elif isinstance(msg, StatsQuery):
                with send_lock:
                    conn.send(StatsReply(engine.stats()))
            elif isinstance(msg, AdapterCommand):
                answer = engine.adapter_command(msg)
                if answer is not None:
                    with send_lock:
                        conn.send(answer)
            elif isinstance(msg, Shutdown):
                return
            else:
                raise TypeError(f"unknown message to the engine: {msg!r}")
        if engine.has_unfinished():
            outputs = engine.step()
            if outputs:
                with send_lock:
                    conn.send(StepOutputs(outputs))


class AsyncEngineClient:
    """Starts the engine process and multiplexes requests over its pipe (asyncio side)."""

    def __init__(self, config: EngineConfig, log_json: bool = False, log_level: str = "INFO") -> None:
        self.config = config
        self._log_json = log_json
        self._log_level = log_level  # the engine process logs at the server's --log-level
        self._conn: Connection | None = None
        self._proc: Any = None
        self._queues: dict[str, asyncio.Queue[EngineOutput | Exception]] = {}
        self._stats_waiters: list[asyncio.Future[EngineStats]] = []
        self._adapter_waiters: dict[int, asyncio.Future[AdapterReply]] = {}
        self._adapter_ops = itertools.count(1)
        self.adapters: tuple[AdapterInfo, ...] = ()  # the LoRA adapters loaded now (updated by each reply)
        self.info: EngineInfo | None = None
        self.dead: str | None = None
        self.died = asyncio.Event()  # set the moment the engine is found dead (not on shutdown)

    async def start(self) -> EngineInfo:
        """Spawn the engine process and wait until it has loaded the model."""
        ctx = mp.get_context("spawn")
        parent, child = ctx.Pipe(duplex=True)
        self._proc = ctx.Process(target=run_engine_core, args=(self.config, child, self._log_json, self._log_level),
                                 name="loom-engine", daemon=True)
        self._proc.start()
        child.close()
        self._conn = parent
        loop = asyncio.get_running_loop()
        while not await loop.run_in_executor(None, parent.poll, 0.5):
            if not self._proc.is_alive():
                raise EngineDeadError(f"engine process exited with code {self._proc.exitcode} during start-up")
        msg: FromEngine = parent.recv()
        if isinstance(msg, EngineFailed):
            self._proc.join(5)
            raise EngineDeadError(f"engine failed to start: {msg.reason}")
        assert isinstance(msg, EngineReady), msg
        self.info = msg.info
        self.adapters = msg.info.adapters
        loop.add_reader(parent.fileno(), self._on_readable)
        return msg.info

    def _on_readable(self) -> None:
        assert self._conn is not None
        try:
            while self._conn.poll(0):
                msg: FromEngine = self._conn.recv()
                if isinstance(msg, StepOutputs):
                    for out in msg.outputs:
                        q = self._queues.get(out.request_id)
                        if q is not None:
                            q.put_nowait(out)
                elif isinstance(msg, StatsReply) and self._stats_waiters:
                    fut = self._stats_waiters.pop(0)
                    if not fut.done():  # its caller may have given up (wait_for timeout)
                        fut.set_result(msg.stats)
                elif isinstance(msg, EngineFailed):  # after start: a tensor-parallel rank was lost
                    self._fail_all(msg.reason)
                    return
                elif isinstance(msg, AdapterReply):
                    self.adapters = msg.adapters
                    waiter = self._adapter_waiters.pop(msg.op_id, None)
                    if waiter is not None and not waiter.done():
                        waiter.set_result(msg)
        except (EOFError, OSError) as exc:
            self._fail_all(f"engine process died: {exc!r}")

    def _fail_all(self, reason: str) -> None:
        self.dead = reason
        self.died.set()
        log.error("engine process lost", reason=reason)
        with contextlib.suppress(Exception):
            asyncio.get_running_loop().remove_reader(self._conn.fileno())  # type: ignore[union-attr]
        for q in self._queues.values():
            q.put_nowait(EngineDeadError(reason))
        for fut in self._stats_waiters:
            fut.set_exception(EngineDeadError(reason))
        self._stats_waiters.clear()
        for waiter in self._adapter_waiters.values():
            if not waiter.done():
                waiter.set_exception(EngineDeadError(reason))
        self._adapter_waiters.clear()

    def _send(self, msg: ToEngine) -> None:
        if self.dead:
            raise EngineDeadError(self.dead)
        assert self._conn is not None, "engine not started"
        try:
            self._conn.send(msg)
        except (BrokenPipeError, OSError) as exc:
            self._fail_all(f"engine pipe broken: {exc!r}")
            raise EngineDeadError(self.dead or "engine died") from exc

    async def generate(self, request: EngineRequest) -> AsyncIterator[EngineOutput]:
        """Stream the outputs of ``request`` until all its completions finished.

        Leaving the iteration early (client cancel, deadline, stop string found) aborts the
        request in the engine, which frees its KV blocks at once.
        """
        if request.request_id in self._queues:
            raise ValueError(f"duplicate request id {request.request_id!r}")
        q: asyncio.Queue[EngineOutput | Exception] = asyncio.Queue()
        self._queues[request.request_id] = q
        remaining = max(1, request.n)
        try:
            self._send(AddRequest(request))
            while remaining:
                item = await q.get()
                if isinstance(item, Exception):
                    raise item
                if item.finished:
                    remaining -= 1
                    if item.finish_reason is FinishReason.ERROR and item.index == 0 and not item.token_ids:
                        remaining = 0  # rejected by the engine as a whole
                yield item
        finally:
            del self._queues[request.request_id]
            if remaining and not self.dead:
                with contextlib.suppress(EngineDeadError):
                    self._send(AbortRequest(request.request_id))

    def abort(self, request_id: str) -> None:
        self._send(AbortRequest(request_id))

    def end_all(self, reason: str) -> int:
        """End every request in flight with :class:`RequestEndedError` (``reason``): their streams
        raise it, and leaving them aborts each request in the engine. Returns how many."""
        for q in self._queues.values():
            q.put_nowait(RequestEndedError(reason))
        return len(self._queues)

    def abort_completion(self, request_id: str, index: int) -> None:
        """Stop completion ``index`` of a running request; its stream simply ends for it."""
        if not self.dead:
            with contextlib.suppress(EngineDeadError):
                self._send(AbortCompletion(request_id, index))

    async def stats(self) -> EngineStats:
        fut: asyncio.Future[EngineStats] = asyncio.get_running_loop().create_future()
        self._stats_waiters.append(fut)
        self._send(StatsQuery())
        return await fut

    async def adapter_command(self, name: str, path: str | None) -> AdapterReply:
        """Load (``path`` given) or unload the LoRA adapter ``name``; the engine's reply (a load
        returns once its files are read, checked and installed)."""
        op_id = next(self._adapter_ops)
        fut: asyncio.Future[AdapterReply] = asyncio.get_running_loop().create_future()
        self._adapter_waiters[op_id] = fut
        try:
            self._send(AdapterCommand(op_id, name, path))
            return await fut
        finally:
            self._adapter_waiters.pop(op_id, None)

    @property
    def num_in_flight(self) -> int:
        return len(self._queues)

    def is_alive(self) -> bool:
        return self.dead is None and self._proc is not None and self._proc.is_alive()

    async def shutdown(self, timeout: float = 10.0) -> None:
        if self._conn is not None:
            with contextlib.suppress(Exception):
                asyncio.get_running_loop().remove_reader(self._conn.fileno())
            with contextlib.suppress(Exception):
                self._conn.send(Shutdown())
        if self._proc is not None:
            # An engine still loading reads no messages: no point waiting for it.
            await asyncio.get_running_loop().run_in_executor(
                None, self._proc.join, timeout if self.info is not None else 0.0)
            if self._proc.is_alive():
                os.kill(self._proc.pid, signal.SIGKILL)  # SIGTERM is ignored there (see run_engine_core)
                await asyncio.get_running_loop().run_in_executor(None, self._proc.join, 5.0)
        self.dead = self.dead or "engine shut down"
