"""`kvcli serve`: the engine behind an OpenAI-compatible HTTP API with Prometheus metrics.

  protocol.py   request bodies (pydantic, unknown fields refused) and response shapes
  worker.py     the one thread that owns the engine; asyncio handlers talk to it through queues
  metrics.py    /metrics: vLLM's metric names where one exists, kvcli: ones for the breakdown
  app.py        the FastAPI routes
"""
