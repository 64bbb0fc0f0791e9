"""XLA flags the test session and the processes it starts share."""

# The suite's time is mostly XLA:CPU compiling tiny programs. LLVM's cheap pipeline
# compiles them much faster and leaves the HLO passes as they are. The few run-bound tests
# get slower: the quickstart-learning test takes 54 s instead of 35 s.
# Whole suite on 2 cores: 952 s with no flag, 910 s with only
# --xla_llvm_disable_expensive_passes, 828 s with both flags.
CPU_FAST_COMPILE = "--xla_backend_optimization_level=0 --xla_llvm_disable_expensive_passes=true"
