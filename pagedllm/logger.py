"""pagedllm's log, set up as vLLM sets up its own: at import, a handler on the `pagedllm` logger writing
`LEVEL MM-DD HH:MM:SS [file.py:line] message` to stderr at VLLM_LOGGING_LEVEL (INFO). With
VLLM_CONFIGURE_LOGGING=0 nothing is set up and the application's logging configuration decides; with
VLLM_LOGGING_CONFIG_PATH a JSON `logging.config.dictConfig` file sets it up instead."""

from __future__ import annotations

import json
import logging
import logging.config
import sys

from pagedllm import envs

LOG_FORMAT = "%(levelname)s %(asctime)s [%(filename)s:%(lineno)d] %(message)s"
DATE_FORMAT = "%m-%d %H:%M:%S"
_HANDLER_NAME = "pagedllm-default"


def configure_logging() -> None:
    """Idempotent; a bad VLLM_LOGGING_LEVEL or VLLM_CONFIGURE_LOGGING is a ValueError naming it.
    VLLM_LOGGING_CONFIG_PATH: that JSON dictConfig configures logging instead (as vLLM's)."""
    config_path = envs.logging_config_path()
    if not envs.configure_logging():
        if config_path is not None:
            raise ValueError("VLLM_LOGGING_CONFIG_PATH is set but VLLM_CONFIGURE_LOGGING=0: unset one of them")
        return
    if config_path is not None:
        apply_config_file(config_path)
        return
    logger = logging.getLogger("pagedllm")
    if any(h.get_name() == _HANDLER_NAME for h in logger.handlers):
        return
    handler = logging.StreamHandler(sys.stderr)
    handler.set_name(_HANDLER_NAME)
    handler.setFormatter(logging.Formatter(LOG_FORMAT, DATE_FORMAT))
    logger.addHandler(handler)
    logger.setLevel(envs.logging_level())
    logger.propagate = False  # as vLLM's: one line per record, whatever the root logger has


def apply_config_file(path: str) -> None:
    try:
        with open(path, encoding="utf-8") as f:
            config = json.load(f)
    except (OSError, json.JSONDecodeError) as e:
        raise ValueError(f"VLLM_LOGGING_CONFIG_PATH={path!r}: not a readable JSON file: {e}") from None
    if not isinstance(config, dict):
        raise ValueError(f"VLLM_LOGGING_CONFIG_PATH={path!r}: a logging dictConfig is a JSON object")
    try:
        logging.config.dictConfig(config)
    except (ValueError, TypeError, AttributeError, ImportError) as e:
        raise ValueError(f"VLLM_LOGGING_CONFIG_PATH={path!r}: not a valid logging dictConfig: {e}") from None
