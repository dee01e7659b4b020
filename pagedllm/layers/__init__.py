"""Building blocks shared by the model files: linear layers, norms, activations, rotary, embeddings, attention."""
