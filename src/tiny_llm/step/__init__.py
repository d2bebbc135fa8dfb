"""The step's data that the days operate on: requests, scheduled chunks, the typed step batch
and its layouts, the attention backends' protocol, and Day 1's dense KV cache.
"""
