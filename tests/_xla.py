"""XLA flags the test session and the processes it starts share."""

# The suite's time is XLA:CPU compiles of tiny programs, not running them: LLVM's cheap
# pipeline compiles them much faster (tests/test_update.py: 105 s -> 65 s) and changes no
# HLO pass, so results keep XLA's semantics.
CPU_FAST_COMPILE = "--xla_backend_optimization_level=0 --xla_llvm_disable_expensive_passes=true"
