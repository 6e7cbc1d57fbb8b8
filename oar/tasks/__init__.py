"""The built-in task: arithmetic problems (`arith`), the flawed teacher tiny-arith imitates
(`teacher`), the tiny-arith model (`tiny_arith`, built once and cached by `tiny_arith_cache`), the
study's testbeds (`testbeds`) and the record every loader returns (`problem`). It uses torch,
transformers and its own types, never the training machinery (pyproject.toml's contracts)."""
