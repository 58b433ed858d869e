"""Where the weights come from: a local folder (checks.py), s3:// (s3.py), the embedded
default model (default_model.py); store.py resolves option.model_id to a folder."""
