"""XLA flags the test session and the processes it starts share."""

# The suite's time is mostly XLA:CPU compiling tiny programs. Skipping LLVM's expensive
# passes compiles them faster and leaves the HLO passes as they are. Measured on 2 cores:
# test_update.py's master-weights test takes 31 s instead of 39 s, and the run-bound
# quickstart-learning test is unchanged at 37 s against 35 s. --xla_backend_optimization_level=0
# also halves compile time, but slows those runs by half (54 s).
CPU_FAST_COMPILE = "--xla_llvm_disable_expensive_passes=true"
