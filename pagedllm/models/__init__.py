"""Model architectures, one file each, registered by their HF `architectures` name."""
