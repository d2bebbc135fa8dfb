"""The model families, their loader (Hugging Face folders, GGUF), the tokenizer and its chat
templates, the incremental detokenizer. Below the chapters that serve them.
"""
