"""The benchmarks: the reconciler against raw publish (command), every figure beside a same-run
baseline (suite), VM lifecycle against a bare QEMU (vm)."""
