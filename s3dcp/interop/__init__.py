"""Other formats and tools: the TorchSnapshot storage plugin, loading from Hugging Face
safetensors in S3, exporting a checkpoint to safetensors (and trainer integrations). Each
module imports its foreign package lazily, so the core install does not need it.
"""
