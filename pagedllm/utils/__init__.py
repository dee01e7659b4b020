"""Helpers under vLLM's module names (`from pagedllm.utils import FlexibleArgumentParser`)."""

from pagedllm.utils.argparse_utils import FlexibleArgumentParser
from pagedllm.utils.torch_utils import set_random_seed

__all__ = ["FlexibleArgumentParser", "set_random_seed"]
