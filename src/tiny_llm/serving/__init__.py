"""The OpenAI-compatible server, split by job, calling the engine's public API.
"""
