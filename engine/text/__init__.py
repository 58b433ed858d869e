"""Text in and out of token ids, no device: tokenizer_files.py (the model folder's tokenizer),
tokenizer_pool.py (copies for the HTTP threads), detokenizer.py (whole characters, stop
strings), output_processor.py (a step's token ids → text events)."""
