"""Model files: the catalog and where models come from (`catalog`), GGUF header facts, slim
verifiers cut from a target's blocks, derived weight formats and their quality, and the files
via-edge derives."""
