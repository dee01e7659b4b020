"""Finding a model and loading its weights: safetensors, PyTorch .bin, GGUF, or dummy random weights."""
