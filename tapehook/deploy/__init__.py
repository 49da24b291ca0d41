"""Deploy a trained model: a SavedModel of stock TF ops, or a .tflite file for
LiteRT or Larq Compute Engine (docs/deploy.md)."""

from tapehook.deploy.targets import export_savedmodel, export_tflite, run_tflite

__all__ = ["export_savedmodel", "export_tflite", "run_tflite"]
