"""The model folder's tokenizer, and an error that names the file when it cannot be loaded.

transformers reports a damaged tokenizer.json or tokenizer_config.json with the bare JSON
decoder's message ("Expecting value: line 1 column 1"), and a folder without tokenizer files
with a paragraph about converting slow tokenizers; the user has to guess which file is meant."""

from __future__ import annotations

from pathlib import Path

from engine.config import EngineConfig
from engine.model_files import ModelFileError, json_problem

# Files a tokenizer loads as JSON, in the order transformers reads them
JSON_FILES = ("tokenizer_config.json", "tokenizer.json", "special_tokens_map.json",
              "added_tokens.json", "vocab.json")
# A tokenizer needs at least one of these (fast, SentencePiece, or BPE/WordPiece vocabularies)
VOCABULARY_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json", "vocab.txt")
MAX_DETAIL = 300  # characters of transformers' own message kept


class TokenizerLoadError(ModelFileError):
    """The model folder's tokenizer cannot be loaded; the message names the file and why."""


def load_tokenizer(config: EngineConfig):
    """The model folder's tokenizer (no code from the folder unless trust_remote_code)."""
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(config.model,
                                             trust_remote_code=config.trust_remote_code,
                                             local_files_only=True)
    except Exception as err:
        raise TokenizerLoadError(f"cannot load the tokenizer of model {config.model}: "
                                 f"{tokenizer_problem(Path(config.model), err)}") from err


def tokenizer_problem(folder: Path, err: Exception) -> str:
    """Why the tokenizer in `folder` failed to load with `err`, naming a file where one is
    to blame."""
    for name in JSON_FILES:
        path = folder / name
        problem = json_problem(path) if path.is_file() else None
        if problem is not None:
            return problem
    if folder.is_dir() and not any((folder / name).is_file() for name in VOCABULARY_FILES):
        return f"the folder has none of {', '.join(VOCABULARY_FILES)}"
    detail = " ".join(str(err).split())  # transformers' messages run over several lines
    if len(detail) > MAX_DETAIL:
        detail = detail[:MAX_DETAIL] + " …"
    return f"{type(err).__name__}: {detail}" if detail else type(err).__name__
