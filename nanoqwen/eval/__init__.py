"""Evaluation suites: humaneval.py (problems, prompts, stops, scoring), sandbox.py (runs generated code),
clients.py (completions from a model in-process or from an OpenAI-compatible server)."""
