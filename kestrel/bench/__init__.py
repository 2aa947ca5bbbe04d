"""Benchmarks run from the command line (`kestrel bench ...`), each writing a JSON result.

- `agent`: a multi-turn agentic workload against any OpenAI-compatible server, swept over concurrency.
"""
