"""A model's pooling defaults for embedding requests, and how a request's PoolingParams resolve
against them.

A sentence-transformers directory says how it pools: ``modules.json`` lists its modules; its
Pooling module's ``config.json`` (``1_Pooling``) names the mode (``pooling_mode_lasttoken``,
``_mean_tokens``, ``_cls_token``) and a Normalize module asks for unit vectors. Without one (a
GGUF file, a plain HF directory) a decoder pools its last token and normalizes. ``--pooling``
overrides the method. ``matryoshka_dimensions`` / ``is_matryoshka`` in ``config.json`` let a
request ask for fewer ``dimensions``.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass

from conveyor.core.pooling_params import POOLING_METHODS, PoolingParams

_ST_MODES = {"pooling_mode_lasttoken": "last", "pooling_mode_mean_tokens": "mean",
             "pooling_mode_cls_token": "cls"}
_ST_PASSIVE = ("sentence_transformers.models.Transformer", "sentence_transformers.models.Pooling",
               "sentence_transformers.models.Normalize")


@dataclass(frozen=True)
class PoolingConfig:
    method: str = "last"
    normalize: bool = True
    hidden_size: int = 0
    matryoshka: bool = False  # the model was trained so that leading dimensions stand alone
    source: str = "default"  # where the method came from, for messages

    def resolve(self, params: PoolingParams) -> PoolingParams:
        """``params`` with every None filled in from this config; ValueError for ``dimensions``
        the model cannot give."""
        dims = params.dimensions
        if dims is not None:
            if not self.matryoshka:
                raise ValueError("dimensions: this model was not trained for Matryoshka "
                                 "representations (no matryoshka_dimensions in its config.json), "
                                 "so shortened embeddings would be poor; leave dimensions unset")
            if dims > self.hidden_size:
                raise ValueError(f"dimensions must be <= {self.hidden_size} for this model, "
                                 f"got {dims}")
            if dims == self.hidden_size:
                dims = None
        return PoolingParams(method=params.method or self.method,
                             normalize=self.normalize if params.normalize is None
                             else params.normalize,
                             dimensions=dims)


def read_pooling_config(path: str, hidden_size: int, method: str | None = None) -> PoolingConfig:
    """The pooling defaults of the model at ``path`` (a file or a directory); ``method``
    (``--pooling``) replaces the model's own method."""
    if method is not None and method not in POOLING_METHODS:
        raise ValueError(f"pooling must be one of {', '.join(POOLING_METHODS)}, got {method!r}")
    config = PoolingConfig(hidden_size=hidden_size)
    if os.path.isdir(path):
        config = _sentence_transformers_config(path, hidden_size) or config
        hf = _read_json(os.path.join(path, "config.json")) or {}
        if hf.get("matryoshka_dimensions") or hf.get("is_matryoshka"):
            config = PoolingConfig(config.method, config.normalize, hidden_size, True, config.source)
    if method is not None:
        config = PoolingConfig(method, config.normalize, hidden_size, config.matryoshka,
                               "--pooling")
    return config


def _sentence_transformers_config(path: str, hidden_size: int) -> PoolingConfig | None:
    modules = _read_json(os.path.join(path, "modules.json"))
    if modules is None:
        return None
    where = os.path.join(path, "modules.json")
    if not isinstance(modules, list):
        raise ValueError(f"{where}: expected a list of modules")
    pooling_dir = None
    normalize = False
    for module in modules:
        kind = module.get("type", "") if isinstance(module, dict) else ""
        if kind not in _ST_PASSIVE:
            raise ValueError(f"{where}: module {kind or module!r} is not supported (Conveyor "
                             "runs Transformer, Pooling and Normalize modules)")
        if kind.endswith(".Pooling"):
            pooling_dir = os.path.join(path, module.get("path", ""))
        normalize |= kind.endswith(".Normalize")
    if pooling_dir is None:
        return PoolingConfig("last", normalize, hidden_size, source=where)
    where = os.path.join(pooling_dir, "config.json")
    cfg = _read_json(where)
    if not isinstance(cfg, dict):
        raise ValueError(f"{where}: missing or not a JSON object")
    modes = [name for name, on in cfg.items() if name.startswith("pooling_mode_") and on is True]
    if len(modes) != 1 or modes[0] not in _ST_MODES:
        raise ValueError(f"{where}: pooling modes {modes} are not supported (one of "
                         f"{', '.join(_ST_MODES)})")
    if cfg.get("include_prompt") is False:
        raise ValueError(f"{where}: include_prompt=false is not supported")
    return PoolingConfig(_ST_MODES[modes[0]], normalize, hidden_size, source=where)


def _read_json(path: str) -> object | None:
    if not os.path.exists(path):
        return None
    try:
        with open(path) as f:
            return json.load(f)
    except (OSError, json.JSONDecodeError) as e:
        raise ValueError(f"{path}: cannot be read as JSON ({e})") from e
