"""The text side of generation: tokenizer, incremental detokenizer, stop strings, chunks."""
