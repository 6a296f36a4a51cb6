"""`nanoqwen serve`: the OpenAI-compatible HTTP layer (routes, schemas, errors, metrics), the engine thread
that runs requests one at a time, incremental text with stop strings, and the FIM / chat prompt layouts."""
