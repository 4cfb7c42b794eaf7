"""Executors: the only code that builds tensors (packed or padded batches) and runs the model."""

from minibatch.runner.model_runner import ModelRunner

__all__ = ["ModelRunner"]
