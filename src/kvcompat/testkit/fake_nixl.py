"""A fake NIXL agent (``nixl._api.nixl_agent``) for connector tests without NIXL.

It mimics the observable behaviour of real NIXL 1.5.x as measured on CPU
(nixl 1.5.1, UCX backend over loopback; tests/connectors/test_real_nixl.py runs
the real library and is the reference for these behaviours):

* ``add_remote_agent(metadata)`` returns the remote agent name as ``bytes``;
* ``get_new_notifs()`` returns ``{str agent name: [bytes, ...]}`` and drains;
* ``transfer(handle)`` returns ``"PROC"``; the transfer is ``"DONE"`` the next
  time ``check_xfer_state(handle)`` polls it (``"PROC"`` is never final);
* ``nixl_agent(name, config)`` creates the backends its config names (``None``:
  ``nixl_agent_config()``'s defaults, one UCX backend), each with ``num_threads``
  when it is > 0, as nixl 1.5.1's ``nixl_agent.__init__`` does (src/api/python/
  _api.py); :class:`FakeNixlAgentConfig` has ``nixl_agent_config``'s signature and
  defaults; ``create_backend`` of a type the agent already has raises, as
  ``nixlAgent::createBackend`` returns NIXL_ERR_INVALID_PARAM ("backend already
  created for type", src/core/nixl_agent.cpp); ``backend_params`` holds each
  backend's init parameters;
* ``prep_xfer_dlist`` / ``make_prepped_xfer`` / ``get_reg_descs`` /
  ``get_xfer_descs`` return opaque handles; releasing an unknown handle raises;
* ``prep_xfer_dlist`` raises ``NIXL_ERR_NOT_FOUND`` unless every descriptor lies inside memory registered
  with the same memory type and device id: the agent's own for ``"NIXL_INIT_AGENT"``, the remote agent's as
  its metadata carried it when it was added (memory the peer registers later is unknown until the peer is
  added again), as ``nixlAgent::prepXferDlist`` populates the list from the registered sections
  (src/core/nixl_agent.cpp; measured on nixl 1.5.1: ``VRAM`` over ``DRAM`` memory, an unregistered
  buffer, a range past a region's end, another device id, a region registered after the add);
* a remote agent whose metadata this agent dropped (``remove_remote_agent``, or a
  transfer that ended in a remote disconnect) is *invalidated* until it is added
  again: posting a transfer towards it raises (NIXL_ERR_NOT_FOUND) and a transfer
  to it still in progress ends in ``"ERR"``, as NIXL's ``nixlAgent::postXferReq``
  and ``getXferStatus`` check ``remoteSections`` for the remote agent
  (src/core/nixl_agent.cpp); a transfer whose backend reports
  NIXL_ERR_REMOTE_DISCONNECT makes ``getXferStatus`` call
  ``invalidateRemoteData(remoteAgent)`` (same file; "AGENT: cleanup metadata on
  failure", ai-dynamo/nixl#509), so ``check_remote_metadata`` answers False after it.

Agents of one process reach each other by name, as agents on one host do over
UCX: a prepped READ (WRITE) copies the bytes of the remote (local) descriptors
to the local (remote) ones when it completes, and then delivers its notification
message to the remote agent; ``send_notif`` delivers to the named agent.  An
agent that no instance in this process answers to gets nothing delivered and no
bytes moved.  Every call is recorded in ``calls`` (name, args, kwargs) so tests
can assert on what vLLM asked the agent to do.  All instances created in the
process are kept in ``FakeNixlWrapper.instances``.

``FakeNixlWrapper`` is composed of one mixin per role, so each reads on its own:
``_AgentsAndMemory`` (backends, memory registration, descriptor lists, remote
agents), ``_Transfers`` (prepped lists, transfer handles and states, the byte
copies) and ``_Notifications`` (queueing, delivery by name, draining); the
class itself holds the process-wide state (``instances``, ``polls_until_done``, ``failing_transfers``).

:class:`Peers` adds what NIXL does with peers that go away or register their memory again (a restarted or
woken prefill): transfers towards a gone peer end as a remote disconnect, a read made with a stale
registration fails; a test that replaces a peer installs it with its monkeypatch.
"""

from __future__ import annotations

import ctypes
import itertools
import threading
from dataclasses import dataclass, field
from typing import Any, ClassVar


@dataclass
class FakeXferTelemetry:
    """Shape of ``nixl._bindings.nixlXferTelemetry`` as read by vLLM's stats."""

    startTime: int = 0
    postDuration: int = 1
    xferDuration: int = 2
    totalBytes: int = 0
    descCount: int = 0


class FakeNixlAgentConfig:
    """Stand-in for ``nixl._api.nixl_agent_config`` (nixl 1.5.1): the same signature and defaults, and the
    same attributes (what ``nixl_agent`` reads of it)."""

    def __init__(
        self,
        enable_prog_thread: bool = True,
        enable_listen_thread: bool = False,
        listen_port: int = 8888,  # nixl._bindings.DEFAULT_COMM_PORT (nixl 1.5.1)
        capture_telemetry: bool = False,
        num_threads: int = 0,
        backends: list[str] | None = None,
        sync_mode: Any = None,
    ):
        self.backends = ["UCX"] if backends is None else backends
        self.enable_pthread = enable_prog_thread
        self.enable_listen = enable_listen_thread
        self.port = listen_port
        self.capture_telemetry = capture_telemetry
        self.num_threads = num_threads
        self.sync_mode = sync_mode


@dataclass
class FakeDescList:
    mem_type: str | None
    descs: list[Any]

    def __len__(self) -> int:
        return len(self.descs)


@dataclass
class _Xfer:
    op: str
    local: int
    local_indices: list[int]
    remote: int
    remote_indices: list[int]
    notif_msg: bytes
    state: str = "INIT"  # INIT -> PROC (transfer) -> DONE (first poll after)
    polls: int = 0
    moved: int = 0  # bytes the completed transfer moved (its telemetry's totalBytes)


def _agent_key(name: str | bytes) -> str:
    return name.decode() if isinstance(name, bytes) else name


def _expand(descs: Any) -> list[tuple[int, int]]:
    """(address, length) of every descriptor of a list: rows are (addr, len, dev) or, as NIXL >= 1.5
    prepares them, strided (addr, len, dev, stride, count) rows standing for ``count`` descriptors."""
    out: list[tuple[int, int]] = []
    for row in descs:
        values = [int(v) for v in row]
        if len(values) == 5:
            addr, length, _, stride, count = values
            out += [(addr + k * stride, length) for k in range(count)]
        else:
            out.append((values[0], values[1]))
    return out


def _rows(descs: Any) -> list[tuple[int, int, int]]:
    """(address, length, device id) of every descriptor of a list, strided rows expanded (:func:`_expand`);
    registration rows carry a fourth, name field, which is left out."""
    out: list[tuple[int, int, int]] = []
    for row in descs:
        if len(row) == 5:
            addr, length, dev, stride, count = (int(v) for v in row)
            out += [(addr + k * stride, length, dev) for k in range(count)]
        else:
            out.append((int(row[0]), int(row[1]), int(row[2]) if len(row) > 2 else 0))
    return out


def _mem(mem_type: str | None) -> str | None:
    return None if mem_type is None else str(mem_type).upper().removesuffix("_SEG")


@dataclass(frozen=True)
class _Region:
    mem_type: str | None
    addr: int
    length: int
    dev: int


def _regions(lists: list[FakeDescList]) -> list[_Region]:
    return [_Region(_mem(dl.mem_type), a, n, d) for dl in lists for a, n, d in _rows(dl.descs)]


def _uncovered(descs: FakeDescList, regions: list[_Region]) -> tuple[int, int, int] | None:
    """The first descriptor of ``descs`` that no region of its memory type and device holds whole."""
    mem = _mem(descs.mem_type)
    spans: dict[tuple[str | None, int], list[tuple[int, int]]] = {}
    for r in regions:
        spans.setdefault((r.mem_type, r.dev), []).append((r.addr, r.addr + r.length))
    for addr, length, dev in _rows(descs.descs):
        candidates = [
            s for (m, d), ss in spans.items() if d == dev and (m == mem or m is None or mem is None) for s in ss
        ]
        if not any(lo <= addr and addr + length <= hi for lo, hi in candidates):
            return addr, length, dev
    return None


def _as_bytes(msg: str | bytes) -> bytes:
    return msg.encode() if isinstance(msg, str) else bytes(msg)


@dataclass
class RecordedCall:
    name: str
    args: tuple[Any, ...]
    kwargs: dict[str, Any] = field(default_factory=dict)


class _Recorder:
    """The call record every role writes to: each call as (name, args, kwargs), in order."""

    name: str
    calls: list[RecordedCall]

    def _record(self, name: str, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        self.calls.append(RecordedCall(name, tuple(args), dict(kwargs)))

    def calls_named(self, name: str) -> list[RecordedCall]:
        return [c for c in self.calls if c.name == name]


class _AgentsAndMemory(_Recorder):
    """Backends, memory registration and descriptor lists, remote agents and their metadata."""

    registered: list[FakeDescList]
    remote_agents: dict[str, bytes]
    remote_regions: dict[str, list[_Region]]
    invalidated: set[str]
    backends: list[str]
    backend_params: dict[str, dict[str, str]]

    # -- backends / plugins -------------------------------------------------
    def get_plugin_list(self) -> list[str]:
        self._record("get_plugin_list", (), {})
        return self._plugins()

    def get_backend_mem_types(self, backend: str) -> list[str]:
        self._record("get_backend_mem_types", (backend,), {})
        return ["DRAM_SEG", "VRAM_SEG"]

    def create_backend(self, backend: str, params: Any = None, *args: Any, **kwargs: Any) -> Any:
        self._record("create_backend", (backend, params) + args, kwargs)
        return self._create_backend(backend, dict(params or {}))

    def _create_backend(self, backend: str, params: dict[str, str]) -> str:
        if backend in self.backends:  # nixlAgent::createBackend: NIXL_ERR_INVALID_PARAM
            raise RuntimeError(f"NIXL_ERR_INVALID_PARAM: backend already created for type '{backend}'")
        self.backends.append(backend)
        self.backend_params[backend] = params
        return backend

    def _create_configured_backends(self, config: Any) -> None:
        """What ``nixl_agent.__init__`` does with its config (``None``: the defaults): create each backend
        it names that a plugin exists for, with ``num_threads`` for the multi-threaded ones when > 0."""
        config = config or FakeNixlAgentConfig()
        for backend in config.backends:
            if backend not in self._plugins():
                continue  # nixl_agent skips it with a warning ("missing plugin")
            init: dict[str, str] = {}
            if config.num_threads > 0 and backend in ("UCX", "OBJ", "LIBFABRIC"):
                init["num_threads"] = str(config.num_threads)
            self._create_backend(backend, init)

    @staticmethod
    def _plugins() -> list[str]:
        return ["UCX"]

    # -- memory registration ------------------------------------------------
    def get_reg_descs(self, descs: Any, mem_type: str | None = None, *args: Any, **kwargs: Any) -> FakeDescList:
        self._record("get_reg_descs", (descs, mem_type) + args, kwargs)
        return FakeDescList(mem_type, list(descs))

    def register_memory(self, descs: Any, mem_type: str | None = None, *args: Any, **kwargs: Any) -> Any:
        self._record("register_memory", (descs, mem_type) + args, kwargs)
        if not isinstance(descs, FakeDescList):
            descs = FakeDescList(mem_type, list(descs))
        self.registered.append(descs)
        return descs

    def deregister_memory(self, descs: Any, *args: Any, **kwargs: Any) -> None:
        self._record("deregister_memory", (descs,) + args, kwargs)
        if descs in self.registered:
            self.registered.remove(descs)

    def get_xfer_descs(self, descs: Any, mem_type: str | None = None, *args: Any, **kwargs: Any) -> FakeDescList:
        self._record("get_xfer_descs", (descs, mem_type) + args, kwargs)
        return FakeDescList(mem_type, list(descs))

    # -- agents / metadata --------------------------------------------------
    def get_agent_metadata(self) -> bytes:
        self._record("get_agent_metadata", (), {})
        return b"fake-nixl-md:" + self.name.encode()

    def add_remote_agent(self, metadata: bytes) -> bytes:
        self._record("add_remote_agent", (metadata,), {})
        md = bytes(metadata)
        name = md.split(b":", 1)[1] if md.startswith(b"fake-nixl-md:") else md
        self.remote_agents[name.decode(errors="replace")] = md
        # real metadata carries the peer's registered sections as they are now (nixlAgent::getLocalMD)
        peer = FakeNixlWrapper.named(name)
        if peer is not None:
            self.remote_regions[name.decode(errors="replace")] = _regions(peer.registered)
        self.invalidated.discard(name.decode(errors="replace"))
        return name  # bytes, like real NIXL

    def remove_remote_agent(self, agent: str | bytes) -> None:
        self._record("remove_remote_agent", (agent,), {})
        self._invalidate(agent)

    def _invalidate(self, agent: str | bytes) -> None:
        """Drop a remote agent's metadata (NIXL's invalidateRemoteData): transfers towards it now fail."""
        self.remote_agents.pop(_agent_key(agent), None)
        self.invalidated.add(_agent_key(agent))

    def check_remote_metadata(self, agent: str | bytes, *args: Any, **kwargs: Any) -> bool:
        self._record("check_remote_metadata", (agent,) + args, kwargs)
        return _agent_key(agent) in self.remote_agents


class _Transfers(_Recorder):
    """Prepped descriptor lists and transfers: their handles, their states, the bytes they copy."""

    polls_until_done: ClassVar[int]
    invalidated: set[str]
    registered: list[FakeDescList]
    remote_regions: dict[str, list[_Region]]
    _handles: itertools.count[int]
    _dlists: dict[int, tuple[str, FakeDescList]]
    _xfers: dict[int, _Xfer]

    def prep_xfer_dlist(
        self, agent_name: str | bytes, xfer_list: Any, mem_type: str | None = None, *args: Any, **kwargs: Any
    ) -> int:
        self._record("prep_xfer_dlist", (agent_name, xfer_list, mem_type) + args, kwargs)
        dl = xfer_list if isinstance(xfer_list, FakeDescList) else FakeDescList(mem_type, list(xfer_list))
        key = _agent_key(agent_name)
        if key in ("", "NIXL_INIT_AGENT"):
            regions: list[_Region] | None = _regions(self.registered)
        else:
            regions = self.remote_regions.get(key)  # None: a peer outside this process, nothing to check
        checked = FakeDescList(mem_type if mem_type is not None else dl.mem_type, dl.descs)
        outside = None if regions is None else _uncovered(checked, regions)
        if outside is not None:  # nixlAgent::prepXferDlist finds no registered section holding it
            addr, length, dev = outside
            raise RuntimeError(
                f"NIXL_ERR_NOT_FOUND: prep_xfer_dlist({key!r}): descriptor ({addr:#x}, {length}, dev {dev}) "
                f"of mem type {mem_type!r} lies in no memory registered with that type and device"
            )
        h = next(self._handles)
        self._dlists[h] = (_agent_key(agent_name), dl)
        return h

    def release_dlist_handle(self, handle: int) -> None:
        self._record("release_dlist_handle", (handle,), {})
        if handle not in self._dlists:
            raise ValueError(f"unknown dlist handle {handle}")
        del self._dlists[handle]

    def make_prepped_xfer(
        self,
        operation: str,
        local_xfer_side: int,
        local_indices: Any,
        remote_xfer_side: int,
        remote_indices: Any,
        notif_msg: bytes = b"",
        *args: Any,
        **kwargs: Any,
    ) -> int:
        self._record(
            "make_prepped_xfer",
            (operation, local_xfer_side, local_indices, remote_xfer_side, remote_indices, notif_msg) + args,
            kwargs,
        )
        if local_xfer_side not in self._dlists or remote_xfer_side not in self._dlists:
            raise ValueError("make_prepped_xfer on an unknown dlist handle")
        h = next(self._handles)
        self._xfers[h] = _Xfer(
            operation,
            local_xfer_side,
            [int(i) for i in local_indices],
            remote_xfer_side,
            [int(i) for i in remote_indices],
            _as_bytes(notif_msg) if notif_msg else b"",
        )
        return h

    def initialize_xfer(
        self,
        operation: str,
        local_descs: Any,
        remote_descs: Any,
        remote_agent: str,
        notif_msg: bytes = b"",
        *args: Any,
        **kwargs: Any,
    ) -> int:
        self._record("initialize_xfer", (operation, local_descs, remote_descs, remote_agent, notif_msg) + args, kwargs)
        h = next(self._handles)
        self._xfers[h] = _Xfer(operation, 0, [], 0, [], _as_bytes(notif_msg) if notif_msg else b"")
        return h

    def transfer(self, handle: int, notif_msg: bytes = b"") -> str:
        self._record("transfer", (handle, notif_msg), {})
        x = self._xfers[handle]
        if self._remote_name(x) in self.invalidated:  # nixlAgent::postXferReq checks remoteSections first
            raise RuntimeError(f"NIXL_ERR_NOT_FOUND: remote agent {self._remote_name(x)!r} was invalidated")
        x.state = "PROC"
        return "PROC"

    def _remote_name(self, x: _Xfer) -> str:
        return self._dlists.get(x.remote, ("", None))[0]

    def check_xfer_state(self, handle: int) -> str:
        self._record("check_xfer_state", (handle,), {})
        x = self._xfers[handle]
        if x.state == "PROC" and self._remote_name(x) in self.invalidated:
            x.state = "ERR"  # nixlAgent::getXferStatus: the remote was invalidated during the transfer
        if x.state == "PROC":
            # Completes when polled, never inside transfer(); with
            # polls_until_done > 1 the first polls still see "PROC".
            x.polls += 1
            if x.polls >= self.polls_until_done:
                with FakeNixlWrapper._lock:
                    failing = FakeNixlWrapper.failing_transfers > 0
                    FakeNixlWrapper.failing_transfers -= failing
                    cut = not failing and FakeNixlWrapper.disconnecting_transfers > 0
                    FakeNixlWrapper.disconnecting_transfers -= cut
                    FakeNixlWrapper.failed += failing or cut
                if cut:  # NIXL_ERR_REMOTE_DISCONNECT: getXferStatus invalidates the remote agent's metadata
                    self._invalidate(self._remote_name(x))
                if failing or cut:  # what a backend reports for a transfer that broke: no bytes, no notification
                    x.state = "ERR"
                else:
                    x.state = "DONE"
                    self._complete(x)
        return x.state

    def get_xfer_telemetry(self, handle: int) -> FakeXferTelemetry:
        self._record("get_xfer_telemetry", (handle,), {})
        x = self._xfers[handle]
        # what NIXL's telemetry reports: the bytes the transfer moved, and its descriptors' count
        return FakeXferTelemetry(totalBytes=x.moved, descCount=len(x.local_indices))

    def release_xfer_handle(self, handle: int) -> None:
        self._record("release_xfer_handle", (handle,), {})
        if handle not in self._xfers:
            raise ValueError(f"unknown xfer handle {handle}")
        del self._xfers[handle]

    def _complete(self, x: _Xfer) -> None:
        """What the NIXL backend does when a prepped transfer finishes: move the bytes, notify the peer."""
        remote_agent, remote = self._dlists.get(x.remote, ("", FakeDescList(None, [])))
        _, local = self._dlists.get(x.local, ("", FakeDescList(None, [])))
        peer = FakeNixlWrapper.named(remote_agent) if remote_agent else None
        if peer is None:
            return
        local_descs, remote_descs = _expand(local.descs), _expand(remote.descs)
        for li, ri in zip(x.local_indices, x.remote_indices, strict=True):
            laddr, llen = local_descs[li]
            raddr, rlen = remote_descs[ri]
            if llen != rlen:
                raise ValueError(f"transfer of {llen} bytes into a {rlen}-byte remote descriptor")
            x.moved += llen
            if x.op == "READ":
                ctypes.memmove(laddr, raddr, llen)
            elif x.op == "WRITE":
                ctypes.memmove(raddr, laddr, llen)
        if x.notif_msg:
            peer.inject_notif(self.name, x.notif_msg)


class _Notifications(_Recorder):
    """Notifications: queued per sending agent, delivered to agents of this process by name, drained."""

    _notifs: dict[str, list[bytes]]

    def inject_notif(self, remote_agent_name: str, msg: bytes) -> None:
        """Queue a notification as if ``remote_agent_name`` had sent ``msg``."""
        with FakeNixlWrapper._lock:
            self._notifs.setdefault(remote_agent_name, []).append(_as_bytes(msg))

    def get_new_notifs(self) -> dict[str, list[bytes]]:
        self._record("get_new_notifs", (), {})
        with FakeNixlWrapper._lock:
            out, self._notifs = self._notifs, {}
        return out

    def send_notif(self, remote_agent_name: str | bytes, notif_msg: bytes = b"", *args: Any, **kwargs: Any) -> None:
        self._record("send_notif", (remote_agent_name, notif_msg) + args, kwargs)
        peer = FakeNixlWrapper.named(remote_agent_name)
        if peer is not None:
            peer.inject_notif(self.name, _as_bytes(notif_msg))

    def check_remote_xfer_done(self, remote_agent: str, lookup_msg: bytes) -> bool:
        self._record("check_remote_xfer_done", (remote_agent, lookup_msg), {})
        msgs = self._notifs.get(remote_agent, [])
        return any(lookup_msg in m for m in msgs)


class FakeNixlWrapper(_AgentsAndMemory, _Transfers, _Notifications):
    """Drop-in stand-in for ``nixl_agent(name, config)``."""

    instances: ClassVar[list[FakeNixlWrapper]] = []
    polls_until_done: ClassVar[int] = 1
    failing_transfers: ClassVar[int] = 0  # the next N transfers to complete end in "ERR" instead
    # the next N transfers to complete end in "ERR" as a remote disconnect (NIXL_ERR_REMOTE_DISCONNECT):
    # the initiating agent also drops the target agent's metadata (nixlAgent::getXferStatus)
    disconnecting_transfers: ClassVar[int] = 0
    failed: ClassVar[int] = 0  # transfers that ended in "ERR"
    _lock: ClassVar[threading.Lock] = threading.Lock()

    def __init__(self, agent_name: str, config: Any = None, *args: Any, **kwargs: Any):
        self.name = agent_name
        self.config = config
        self.calls: list[RecordedCall] = []
        self.registered: list[FakeDescList] = []
        self.remote_agents: dict[str, bytes] = {}
        self.remote_regions: dict[str, list[_Region]] = {}  # each remote agent's registrations when added
        self.invalidated: set[str] = set()  # remote agents whose metadata was dropped, until added again
        self.backends: list[str] = []
        self.backend_params: dict[str, dict[str, str]] = {}
        self._handles = itertools.count(1)
        self._dlists: dict[int, tuple[str, FakeDescList]] = {}
        self._xfers: dict[int, _Xfer] = {}
        self._notifs: dict[str, list[bytes]] = {}
        self._record("__init__", (agent_name, config) + args, kwargs)
        self._create_configured_backends(config)
        with FakeNixlWrapper._lock:
            FakeNixlWrapper.instances.append(self)

    @classmethod
    def reset(cls) -> None:
        with cls._lock:
            cls.instances.clear()
            cls.failing_transfers = cls.disconnecting_transfers = cls.failed = 0

    @classmethod
    def named(cls, name: str | bytes) -> FakeNixlWrapper | None:
        """The agent of this process that answers to ``name`` (None: no such agent here)."""
        key = _agent_key(name)
        with cls._lock:
            return next((a for a in reversed(cls.instances) if a.name == key), None)


class Peers:
    """What NIXL does with peers that a test replaces or restarts, which the fake leaves out otherwise, modelled on the fake's own state
    (class-wide, undone with the test's monkeypatch), and every read's remote agent and end.

    * A peer whose process is gone (``gone``): a transfer towards it ends in ``"ERR"`` as a remote
      disconnect, and the reading agent drops the peer's metadata (NIXL_ERR_REMOTE_DISCONNECT makes
      nixlAgent::getXferStatus invalidate the remote agent; fake_nixl's ``disconnecting_transfers``, aimed
      at that peer).  The fake would otherwise still find the peer's agent object in this process and copy
      from the memory it had registered.
    * ``registrations``: an agent's metadata carries its memory registration (real NIXL metadata holds the
      registered sections and their remote keys); a read made with a peer's registration from before the
      peer registered its memory again (a sleep and wake-up) ends in ``"ERR"`` with no bytes moved: its
      remote keys are stale.  The fake's metadata is only the agent's name, the same before and after.
    """

    def __init__(self, monkeypatch, cls, *, registrations: bool = False):
        self.gone: set[str] = set()
        self.reads: list[tuple[str, str, int]] = []  # (reading agent, remote agent, index in its calls)
        self.ends: list[tuple[str, str, str]] = []  # (reading agent, remote agent, "DONE" | "ERR")
        self.stale_reads = 0
        self.loaded: dict[tuple[str, str], int] = {}  # (agent, remote agent) -> the registration it loaded
        peers = self
        real_make, real_check = cls.make_prepped_xfer, cls.check_xfer_state

        def make_prepped_xfer(agent, *args, **kwargs):
            handle = real_make(agent, *args, **kwargs)
            remote = args[3] if len(args) > 3 else kwargs["remote_xfer_side"]
            peers.reads.append((agent.name, agent._dlists[remote][0], len(agent.calls) - 1))
            return handle

        def check_xfer_state(agent, handle):
            x = agent._xfers.get(handle)
            proc = x is not None and x.state == "PROC"
            if proc:
                remote = agent._remote_name(x)
                if remote in peers.gone:
                    agent._invalidate(remote)  # the disconnect: the transfer ends in ERR, the metadata is dropped
                elif peers._stale(agent, remote):
                    peers.stale_reads += 1
                    x.state = "ERR"
            state = real_check(agent, handle)
            if proc and state != "PROC":
                peers.ends.append((agent.name, agent._remote_name(x), state))
            return state

        monkeypatch.setattr(cls, "make_prepped_xfer", make_prepped_xfer)
        monkeypatch.setattr(cls, "check_xfer_state", check_xfer_state)
        if not registrations:
            return
        real_md, real_add = cls.get_agent_metadata, cls.add_remote_agent

        def get_agent_metadata(agent):
            return real_md(agent) + b"@reg" + str(len(agent.calls_named("register_memory"))).encode()

        def add_remote_agent(agent, metadata):
            md, _, reg = bytes(metadata).rpartition(b"@reg")
            name = real_add(agent, md)
            peers.loaded[(agent.name, _agent_key(name))] = int(reg)
            return name

        monkeypatch.setattr(cls, "get_agent_metadata", get_agent_metadata)
        monkeypatch.setattr(cls, "add_remote_agent", add_remote_agent)

    def _stale(self, agent, remote: str) -> bool:
        loaded = self.loaded.get((agent.name, remote))
        peer = type(agent).named(remote)
        return loaded is not None and peer is not None and len(peer.calls_named("register_memory")) != loaded

    def reads_towards(self, names: set[str], since: int = 0) -> list[tuple[str, str, int]]:
        return [r for r in self.reads[since:] if r[1] in names]

    def done_towards(self, names: set[str], since: int = 0) -> int:
        return sum(1 for _, remote, state in self.ends[since:] if remote in names and state == "DONE")
