"""Sampling: the parameters of a request and their checks, the sampler (penalties, filters,
logprobs) and tool calls. Grammars come from the Serving chapter (``tiny_llm.structured``).
"""
