"""``restarted-prefill``: D's prefill peer replaced by a new engine at the same address (kvcompat.shapes).

The dense model at TP 1 on both sides (the base's answers); what the shape changes is the pair's history,
so all it adds is :func:`make_pd`, the pair as a fleet leaves it after a prefill pod was replaced:

1. P1 comes up and serves its Nixl handshake on its side-channel port (``VLLM_NIXL_SIDE_CHANNEL_PORT``);
2. D reads one request from P1 over NIXL, so D's Nixl worker holds P1's agent, its KV base addresses and
   the descriptor-list handles prepared for it;
3. P1 shuts down as EngineCore shuts an engine down (``EngineCore.shutdown``, v1/engine/core.py 0.34.0
   L883-889: the executor's workers first, then the Scheduler, whose connector joins its handshake
   listener), and its listener is gone: the port is free again;
4. P2, a new engine (a new engine id, its own fresh NIXL agents) takes P1's address and serves its
   handshake there.

``make_pd`` returns (P2, D).  A contract that needs more of that history passes ``restart=Restart(...)``
to ``make_pd``: P2 with P1's engine id (a pod restart that keeps its id), a step run while P1 is still up
(reads left in flight when it goes away); make_pd fills in P1 and its port.  P1's engine stays built (its
caches alive, the NIXL agent object in this process) and is shut down again at the end of the test, as
every engine is; only its handshake listener and its workers' NIXL registrations are gone.  What the
transport does with a peer whose process died is the test's to model (kvcompat.testkit.fake_nixl).

A user can restart a prefill wherever NixlConnector exists, so this shape is never not applicable.
"""

from __future__ import annotations

import dataclasses
import os
import socket
import time
from collections.abc import Callable
from typing import Any

from kvcompat.shapes import Shape
from kvcompat.testkit import adapter as va
from kvcompat.testkit import setup_owned_by
from kvcompat.testkit.deploy.base import *  # noqa: F403

OLD_ENGINE = "kvcompat-prefill"  # P1
NEW_ENGINE = "kvcompat-prefill-restarted"  # P2
DECODE_ENGINE = "kvcompat-decode"  # conftest.D_ENGINE
# The contracts that own the setup steps below (tests/connectors/conftest.py PREFILLED, PD_READ).
PREFILLED = "test_prefill_finish_returns_nixl_transfer_params"
PD_READ = "test_decode_reads_exactly_the_kv_the_prefill_side_computed"
FIRST_READ = "restart-read-from-p1"
# The release's handshake listener sees its stop event when a one-second receive times out
# (nixl/base_scheduler.py 0.34.0 L358-366); the Scheduler's shutdown joins it.  A port still bound after
# this long is a listener that never stopped.
LISTENER_GONE_S = 10.0
# How long P1 may take to learn that D read its blocks (the notification runs over the transport).
NOTIFIED_S = 15.0


def missing(shape: Shape) -> str | None:
    """Never: a prefill engine can be restarted or replaced wherever NixlConnector exists."""
    return None


@dataclasses.dataclass
class Restart:
    """How :func:`make_pd` replaces D's prefill peer, and what it did (``old``, ``port``: filled in).

    ``same_engine_id``: P2 comes back with P1's engine id (a pod restart that keeps its id).
    ``before_shutdown(p1, d)``: run once D has read from P1 and before P1 goes away (requests left in flight).
    """

    same_engine_id: bool = False
    before_shutdown: Callable[[Any, Any], None] | None = None
    old: Any = None  # P1, shut down
    port: int | None = None  # the side-channel port P1 listened on and P2 listens on
    first_read: str = FIRST_READ  # the request D read from P1


def make_pd(prefill: Any, make_engine: Any, shape: Shape, decode_kwargs: dict[str, Any], kwargs: dict[str, Any]):
    """P2 and D: D has read from P1, P1 has shut down, P2 serves its handshake at P1's address (see the
    module docstring).  ``kwargs`` go to every engine (``restart``: a :class:`Restart`), ``decode_kwargs``
    to D only."""
    kwargs = dict(kwargs)
    restart = kwargs.pop("restart", None) or Restart()
    old_id = kwargs.pop("engine_id", OLD_ENGINE)
    p1 = prefill(engine_id=old_id, **kwargs)
    port = _listening_port(p1)
    d = make_engine(engine_id=DECODE_ENGINE, **{**kwargs, "side": "decode", **decode_kwargs})
    _read_once(p1, d, restart.first_read)
    if restart.before_shutdown is not None:
        restart.before_shutdown(p1, d)
    shut_down(p1, port)
    p2 = prefill(engine_id=old_id if restart.same_engine_id else NEW_ENGINE, side_channel_port=port, **kwargs)
    restart.old, restart.port = p1, port
    return p2, d


def _listening_port(p: Any) -> int:
    """The side-channel port ``p``'s Nixl handshake listener serves on: what ``VLLM_NIXL_SIDE_CHANNEL_PORT``
    said when it was built (make_engine sets it per engine), as its Nixl scheduler read it."""
    port = int(os.environ["VLLM_NIXL_SIDE_CHANNEL_PORT"])
    nixl_scheduler = getattr(p.nixl, "connector_scheduler", None)
    read = getattr(nixl_scheduler, "side_channel_port", port)
    if read != port:  # a data-parallel offset, which these engines do not have
        raise RuntimeError(f"P1's Nixl scheduler listens on port {read}, not VLLM_NIXL_SIDE_CHANNEL_PORT={port}")
    return port


def _read_once(p: Any, d: Any, rid: str) -> None:
    """D reads one request from P over NIXL (vLLM's P/D proxy protocol), to its end, and P frees its blocks."""
    prompt = [5100 + (i % 400) for i in range(2 * va.BLOCK_SIZE + 3)]
    with setup_owned_by(PREFILLED):
        params = p.prefill(rid, prompt)
    with setup_owned_by(PD_READ):
        d.scheduler.add_request(va.make_request(rid, prompt, max_tokens=2, kv_transfer_params=params))
        d.run([rid])
        received = any(rid in (o.finished_recving or ()) for o in d.kv_outputs if o)
        assert received, f"D never received {rid}'s KV from {p.kv_transfer_name()} over NIXL"
        deadline = time.monotonic() + NOTIFIED_S
        while rid in p.scheduler.requests and time.monotonic() < deadline:
            p.step()
            time.sleep(0.001)
        assert rid not in p.scheduler.requests, f"{p.kv_transfer_name()} kept {rid}'s blocks after D read them"


def shut_down(p: Any, port: int) -> None:
    """``p`` shut down as EngineCore shuts an engine down: the workers' connectors, then the Scheduler's
    (which stops Nixl's handshake listener); returns once nothing listens on ``port`` any more."""
    p.shutdown_workers()
    p.scheduler.shutdown()
    host = os.environ.get("VLLM_NIXL_SIDE_CHANNEL_HOST", "127.0.0.1")
    deadline = time.monotonic() + LISTENER_GONE_S
    while not _free(host, port):
        if time.monotonic() > deadline:
            raise RuntimeError(
                f"{p.kv_transfer_name()}'s handshake listener still holds {host}:{port} "
                f"{LISTENER_GONE_S:.0f}s after its shutdown"
            )
        time.sleep(0.05)


def _free(host: str, port: int) -> bool:
    """Whether a new listener can bind ``host:port`` (as ZMQ binds: SO_REUSEADDR, refused while one listens)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
        except OSError:
            return False
    return True
