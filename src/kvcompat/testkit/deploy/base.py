"""What every shape builder offers, with the dense attention model's answers (see the package docstring).

A family module does ``from kvcompat.testkit.deploy.base import *`` and redefines what its shape
changes.  Every function takes the shape; the side (``"prefill"`` or ``"decode"``) where P and D differ.

Three more hooks exist only where a family needs them (``make_engine`` / ``make_pd`` look them up):

* ``step(engine)``: one engine step in the shape's own order (async scheduling: EngineCore's batch
  queue), from ``engine.schedule()``, ``engine.execute(so)`` and ``engine.update(so, out)``; returns the
  step's SchedulerOutput;
* ``runner_output(scheduler_output, kv_connector_output)``: what a rank's model runner returns for a step
  (drafts: several sampled tokens a request);
* ``make_pd(prefill, make_engine, shape, decode_kwargs, kwargs)``: the P/D pair when it is more than two
  engines built side by side (a replaced prefill); ``prefill(**kwargs)`` builds a prefill engine serving
  its handshake, ``make_engine(side="decode", ...)`` the decode engine, ``side_channel_port=`` reuses an
  address.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from kvcompat.shapes import Shape
from kvcompat.testkit.adapter import config as _config
from kvcompat.testkit.adapter import planner as _planner

__all__ = [
    "allocate",
    "configure",
    "config_kwargs",
    "kinds",
    "layer_specs",
    "missing",
    "model_config",
    "tp_size",
    "write_model",
]


def missing(shape: Shape) -> str | None:
    """Why the installed release cannot have this shape at all (explicit probe), else None."""
    return None


def tp_size(shape: Shape, side: str) -> int:
    """The TP size of ``side``'s engine."""
    return shape.prefill_tp if side == "prefill" else shape.decode_tp


def model_config(shape: Shape) -> dict[str, Any]:
    """The tiny model's ``config.json`` (no weights, no hub)."""
    return dict(_config.TINY_MODEL_CONFIG)


def write_model(shape: Shape, directory: Path) -> Path:
    """The tiny model for ``shape`` in ``directory`` (its config.json).  A family whose model differs
    redefines ``model_config`` and this, as ``write_config(directory, model_config(shape))``."""
    return write_config(directory, model_config(shape))


def write_config(directory: Path, config: dict[str, Any]) -> Path:
    """``config`` as ``directory``'s config.json (a model without weights); returns the directory."""
    import json

    directory.mkdir(parents=True, exist_ok=True)
    (directory / "config.json").write_text(json.dumps(config, indent=1))
    return directory


def config_kwargs(shape: Shape, side: str) -> dict[str, Any]:
    """Keyword arguments of :func:`kvcompat.testkit.adapter.make_vllm_config` the shape sets (what a user
    passes to ``vllm serve``)."""
    return {}


def configure(vllm_config: Any, shape: Shape, side: str) -> None:
    """The VllmConfig as EngineCore runs it, once built (what the platform decided and the shape overrides)."""


def layer_specs(vllm_config: Any, shape: Shape, block_size: int, tp: int) -> list[dict[str, Any]]:
    """Each rank's ``{layer: KVCacheSpec}``, as its layers report them to EngineCore."""
    return _planner.attention_layer_specs(vllm_config, block_size, tp)


def kinds(vllm_config: Any, kv_cache_config: Any) -> dict[str, Any]:
    """How each layer's cache looks to the suite (``kvcompat.testkit.adapter.forward``); attention when absent."""
    return {}


def allocate(vllm_config: Any, kv_cache_config: Any) -> dict[str, Any]:
    """A rank's KV caches, as the release's model runner allocates them."""
    return _planner.allocate(vllm_config, kv_cache_config)
