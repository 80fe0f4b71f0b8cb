"""kvcli: run and profile long-context generation through a paged KV cache."""

__version__ = "0.1.0"
