"""pagedllm's log, set up as vLLM sets up its own: at import, a handler on the `pagedllm` logger writing
`LEVEL MM-DD HH:MM:SS [file.py:line] message` to stderr at VLLM_LOGGING_LEVEL (INFO). With
VLLM_CONFIGURE_LOGGING=0 nothing is set up and the application's logging configuration decides."""

from __future__ import annotations

import logging
import sys

from pagedllm import envs

LOG_FORMAT = "%(levelname)s %(asctime)s [%(filename)s:%(lineno)d] %(message)s"
DATE_FORMAT = "%m-%d %H:%M:%S"
_HANDLER_NAME = "pagedllm-default"


def configure_logging() -> None:
    """Idempotent; a bad VLLM_LOGGING_LEVEL or VLLM_CONFIGURE_LOGGING is a ValueError naming it."""
    if not envs.configure_logging():
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
