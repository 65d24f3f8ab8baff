"""The engine's side of LoRA: adapter names -> device slots, loads off the step loop, unloads.

A load reads and checks the PEFT directory and lays it out as slot-table entries on a worker
thread (``read_peft_adapter`` + ``adapter_tables``: file reads and tensor copies, which release
the interpreter lock); the step loop only copies the finished tables into the slot between two
steps (:meth:`AdapterManager.finished`). The slot is reserved when the load starts, so a load
that would not fit is refused at once.

Unloading an adapter that a request still uses (queued, held or running) is refused with
FAILED_PRECONDITION: the caller retries once those requests end; nothing waits inside the
engine. Each load gets a new key (name and load number): the prefix cache hashes blocks with it,
so an adapter loaded again under the same name never reuses the old one's KV.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

import structlog
import torch

from loom.engine.types import AdapterInfo, AdapterReply

from .layers import LayerTarget, adapter_tables
from .peft_adapter import AdapterError, PeftAdapter, read_peft_adapter

log = structlog.get_logger(__name__)

Tables = dict[str, tuple[torch.Tensor, torch.Tensor]]


@dataclass
class LoadedAdapter:
    info: AdapterInfo
    slot: int
    key: str  # "name#load number": what the prefix cache hashes


@dataclass
class _Loading:
    op_id: int
    name: str
    path: str
    slot: int
    future: Future[tuple[PeftAdapter, Tables]]


class AdapterManager:
    """Adapters loaded in the worker's slot tables (slots 1..max_loras; 0 is the base model)."""

    def __init__(self, targets: dict[str, LayerTarget], max_loras: int, max_rank: int, dtype: torch.dtype,
                 install: Callable[[int, Tables], None], clear: Callable[[int], None]) -> None:
        self.targets, self.max_loras, self.max_rank, self.dtype = targets, max_loras, max_rank, dtype
        self._install, self._clear = install, clear
        self.loaded: dict[str, LoadedAdapter] = {}
        self._loading: dict[str, _Loading] = {}
        self._serial = itertools.count(1)
        self._pool: ThreadPoolExecutor | None = None

    # -- what requests see -------------------------------------------------------------------------
    def lookup(self, name: str) -> LoadedAdapter | None:
        return self.loaded.get(name)

    def infos(self) -> tuple[AdapterInfo, ...]:
        return tuple(a.info for a in sorted(self.loaded.values(), key=lambda a: a.info.name))

    @property
    def num_loading(self) -> int:
        return len(self._loading)

    # -- loading -----------------------------------------------------------------------------------
    def read(self, path: str) -> tuple[PeftAdapter, Tables]:
        """Read, check and lay out an adapter (any thread); raises :class:`AdapterError`."""
        try:
            adapter = read_peft_adapter(path, self.max_rank)
        except OSError as exc:
            raise AdapterError("path", f"cannot read {path!r}: {exc}") from exc
        return adapter, adapter_tables(adapter, self.targets, self.max_rank, self.dtype)

    def load_now(self, name: str, path: str) -> AdapterInfo:
        """Load on this thread (start-up); raises :class:`AdapterError` or ``ValueError``."""
        refused = self._refusal(0, name)
        if refused is not None:
            raise ValueError(refused.message)
        adapter, tables = self.read(path)
        return self._put(name, self._free_slot(), adapter, tables).info

    def start_load(self, op_id: int, name: str, path: str) -> AdapterReply | None:
        """Start loading on a worker thread: None, or the reply refusing it at once."""
        refused = self._refusal(op_id, name)
        if refused is not None:
            return refused
        if self._pool is None:
            self._pool = ThreadPoolExecutor(1, thread_name_prefix="lora-load")
        slot = self._free_slot()
        self._loading[name] = _Loading(op_id, name, path, slot, self._pool.submit(self.read, path))
        return None

    def finished(self) -> list[AdapterReply]:
        """Install the loads whose files are read (between steps) and answer them."""
        replies: list[AdapterReply] = []
        for name, job in list(self._loading.items()):
            if not job.future.done():
                continue
            del self._loading[name]
            try:
                adapter, tables = job.future.result()
            except AdapterError as exc:
                log.info("adapter refused", adapter=name, path=job.path, error=str(exc))
                replies.append(AdapterReply(job.op_id, "INVALID_ARGUMENT", f"adapter {name!r}: {exc}", exc.field,
                                            adapters=self.infos()))
                continue
            except Exception as exc:  # a bug, not the adapter's fault: say so, keep serving
                log.error("adapter load failed", adapter=name, error=repr(exc))
                replies.append(AdapterReply(job.op_id, "INTERNAL", f"adapter {name!r}: {type(exc).__name__}: {exc}",
                                            adapters=self.infos()))
                continue
            loaded = self._put(name, job.slot, adapter, tables)
            replies.append(AdapterReply(job.op_id, "OK", adapter=loaded.info, adapters=self.infos()))
        return replies

    def _refusal(self, op_id: int, name: str) -> AdapterReply | None:
        if not self.max_loras:
            return AdapterReply(op_id, "FAILED_PRECONDITION",
                                "LoRA adapters are off: start the server with --max-loras N (or --lora-adapters)",
                                adapters=self.infos())
        if name in self.loaded or name in self._loading:
            return AdapterReply(op_id, "ALREADY_EXISTS", f"adapter {name!r} is already loaded; unload it first",
                                "adapter_id", adapters=self.infos())
        if len(self.loaded) + len(self._loading) >= self.max_loras:
            return AdapterReply(op_id, "RESOURCE_EXHAUSTED",
                                f"{self.max_loras} adapters are loaded already (--max-loras); unload one first",
                                adapters=self.infos())
        return None

    def _free_slot(self) -> int:
        used = {a.slot for a in self.loaded.values()} | {j.slot for j in self._loading.values()}
        return next(s for s in range(1, self.max_loras + 1) if s not in used)

    def _put(self, name: str, slot: int, adapter: PeftAdapter, tables: Tables) -> LoadedAdapter:
        self._install(slot, tables)
        info = AdapterInfo(name, adapter.path, adapter.rank, adapter.alpha, adapter.use_rslora, adapter.target_modules)
        loaded = LoadedAdapter(info, slot, f"{name}#{next(self._serial)}")
        self.loaded[name] = loaded
        log.info("adapter loaded", adapter=name, path=adapter.path, rank=adapter.rank, slot=slot,
                 target_modules=list(adapter.target_modules))
        return loaded

    # -- unloading ---------------------------------------------------------------------------------
    def unload(self, op_id: int, name: str, users: int) -> AdapterReply:
        """Unload ``name`` unless ``users`` requests still use it (FAILED_PRECONDITION)."""
        loaded = self.loaded.get(name)
        if loaded is None:
            return AdapterReply(op_id, "NOT_FOUND", f"adapter {name!r} is not loaded", "adapter_id",
                                adapters=self.infos())
        if users:
            return AdapterReply(op_id, "FAILED_PRECONDITION",
                                f"adapter {name!r} is in use by {users} request(s); unload it once they end",
                                "adapter_id", adapters=self.infos())
        del self.loaded[name]
        self._clear(loaded.slot)
        log.info("adapter unloaded", adapter=name, slot=loaded.slot)
        return AdapterReply(op_id, "OK", adapter=loaded.info, adapters=self.infos())
