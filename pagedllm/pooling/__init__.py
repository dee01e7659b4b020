"""Pooling models (embeddings, classifiers, cross-encoders): their configuration and output types."""
