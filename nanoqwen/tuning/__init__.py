"""Per-shape autotuning of template parameters: search spaces (tune/spaces.yaml) and the GPU sweep behind
`nanoqwen-tune`, which writes the tuned results (tune/tuned.json) that codegen/tuned.py reads. The top
layer beside the CLI: it drives bench and runtime; nothing below imports it."""
