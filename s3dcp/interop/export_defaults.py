"""The defaults of ``s3dcp export`` (:func:`s3dcp.interop.export.export_safetensors`), in a module of
their own that imports nothing, so the command line can show them without importing torch."""

__all__ = ["DEFAULT_SHARD_SIZE_BYTES", "DEFAULT_WINDOW_BYTES"]

DEFAULT_SHARD_SIZE_BYTES = 5 * 1000**3  # Hugging Face's default max_shard_size, "5GB"
DEFAULT_WINDOW_BYTES = 256 * 1024 * 1024
