"""Tensor parallel's ranks at work: how they meet (``ring``), and rank 0's workers and a
worker's loop (``workers``). The chapter's idea (shards, the all-reduce, the step sent) is
``tiny_llm.tensor_parallel``.
"""
