"""Text formats shared by training and serving: the byte-level BPE tokenizer and the chat format."""
