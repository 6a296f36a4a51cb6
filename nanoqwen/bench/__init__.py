"""Benchmarks: kernels.py times each decoder GEMV against the device's copy bandwidth measured in the
same run (`nanoqwen bench --kernels`)."""
