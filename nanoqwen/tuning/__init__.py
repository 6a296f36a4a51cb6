"""Per-shape autotuning of template parameters: search spaces (tune/spaces.yaml), the tuned-results
store the codegen reads (tune/tuned.json), and the GPU sweep behind `nanoqwen-tune`."""
