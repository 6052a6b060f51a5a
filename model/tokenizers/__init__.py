"""Implementations of model.tokenizer.Tokenizer (bytes, SentencePiece, Hugging Face `tokenizers`), the
incremental decoder they share, and the artifact's tokenizer files (files.py)."""
