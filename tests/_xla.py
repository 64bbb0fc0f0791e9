"""XLA flags the test session and the processes it starts share."""

# The suite's time is mostly XLA:CPU compiling tiny programs. LLVM's cheap pipeline
# compiles them much faster and leaves the HLO passes as they are. The few run-bound tests
# get slower: the quickstart-learning test takes 54 s instead of 35 s.
# Whole suite on 2 cores: 952 s with no flag, 910 s with only
# --xla_llvm_disable_expensive_passes, 828 s with both flags.
# XLA:CPU's older fusion emitters (--xla_cpu_use_fusion_emitters=false) compile a further
# third faster: a 3-step tiny `grpo run` on 8 devices took 12.0 s of CPU instead of 18.4 s,
# with the same losses to the bit (round 8). libtpu's XLA does not know that flag and aborts
# on it ("Unknown flag in XLA_FLAGS") when a test compiles for a TPU topology in the same
# process, so the session keeps it only for its own CPU client (parsed when the backend
# starts; see conftest) and for the `grpo run` processes the multi-process tests start.
LIBTPU_UNKNOWN = "--xla_cpu_use_fusion_emitters=false"
CPU_FAST_COMPILE = f"--xla_backend_optimization_level=0 --xla_llvm_disable_expensive_passes=true {LIBTPU_UNKNOWN}"


def without_libtpu_unknown(flags: str) -> str:
    """``flags`` less the ones libtpu would abort on."""
    return " ".join(f for f in flags.split() if f != LIBTPU_UNKNOWN)
