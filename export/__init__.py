"""Training checkpoint -> served artifact (safetensors, config, tokenizer, manifest, ONNX); artifact
loading with integrity checks; import of transformers Reformer checkpoints."""

from .artifact import Artifact, ArtifactError, load_artifact, save_artifact

__all__ = ["Artifact", "ArtifactError", "load_artifact", "save_artifact"]
