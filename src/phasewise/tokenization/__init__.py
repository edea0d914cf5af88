"""Text to token ids and back: `Tokenizer` (tokenizer.py, a `tokenizers` tokenizer with the model's
chat template), the tokenizer saved beside a GGUF (saved_tokenizer.py) and the chat template's
rendering (chat_template.py)."""
