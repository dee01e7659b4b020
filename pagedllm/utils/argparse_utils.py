"""FlexibleArgumentParser (vLLM's name, for scripts that build their own command line from EngineArgs.add_cli_args):
an ArgumentParser that also reads `--config FILE`, `--flag_name` spelled with underscores, and the older
`--enable-prefix-caching=false` form of a boolean engine flag."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from typing import Any


class FlexibleArgumentParser(argparse.ArgumentParser):
    def parse_known_args(self, args: Sequence[str] | None = None, namespace: Any = None):  # type: ignore[override]
        from pagedllm.entrypoints.cli_config import expand_config

        argv = list(sys.argv[1:] if args is None else args)
        argv = expand_config(argv)  # --config FILE, --flag_name, --flag=false
        return super().parse_known_args(argv, namespace)
