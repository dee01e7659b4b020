"""FlexibleArgumentParser (vLLM's name, for scripts that build their own command line from EngineArgs.add_cli_args):
an ArgumentParser that also reads `--config FILE`, `--flag_name` spelled with underscores, and the older
`--enable-prefix-caching=false` form of a boolean engine flag."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from typing import Any


def _dashes(arg: str) -> str:
    """`--max_model_len=8` -> `--max-model-len=8` (only the flag's name; values are kept)."""
    if not arg.startswith("--"):
        return arg
    name, eq, value = arg[2:].partition("=")
    return "--" + name.replace("_", "-") + eq + value


class FlexibleArgumentParser(argparse.ArgumentParser):
    def parse_known_args(self, args: Sequence[str] | None = None, namespace: Any = None):  # type: ignore[override]
        from pagedllm.entrypoints.cli_config import expand_config

        argv = list(sys.argv[1:] if args is None else args)
        argv = expand_config([_dashes(a) for a in argv])
        return super().parse_known_args(argv, namespace)
