"""Configuration: serving.properties and env vars → settings with sources (properties.py),
settings → a frozen ServingConfig with the strategy chosen (serving_config.py)."""
