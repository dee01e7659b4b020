"""The worker side: executor, model runner and its persistent batch."""
