"""Helpers under vLLM's module names (`from pagedllm.utils import FlexibleArgumentParser`)."""

from pagedllm.utils.argparse_utils import FlexibleArgumentParser

__all__ = ["FlexibleArgumentParser"]
